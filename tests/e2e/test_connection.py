"""A broker that cannot be reached: every command says so in one line, within seconds.

No broker is needed: the commands are pointed at a closed port on 127.0.0.1.
Before the connection check, ``kdelay send`` waited out a 10 s metadata
timeout while librdkafka wrote a line per reconnect attempt to stderr. One
command runs as a process (everything written to its stderr counts); the
others run in-process, which is quicker and checks the same code path.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kdelay.cli import app
from tests.e2e.conftest import clean_environment, run_cli

COMMANDS = [
    ["send", "orders", "--value", "v", "--delay", "5s"],
    ["cancel", "order-42"],
    ["topics", "create"],
    ["run", "--check"],
    ["restore"],
    ["tail", "orders"],
    ["worker"],
    ["retention", "set", "7d"],
    ["due"],
]


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def assert_one_line(exit_code: int, stdout: str, stderr: str, port: int) -> None:
    """Exit 1, nothing on stdout, and exactly the one error line on stderr."""
    assert exit_code == 1, stderr
    assert stdout == ""
    [line] = stderr.splitlines()
    assert line.startswith(f"error[broker-unreachable]: no Kafka broker answers at "
                           f"127.0.0.1:{port} ("), line
    assert "Connection refused" in line


def test_send_as_a_process_prints_only_the_error_line(closed_port: int) -> None:
    env = clean_environment(KDELAY_BOOTSTRAP_SERVERS=f"127.0.0.1:{closed_port}")
    started = time.monotonic()
    result = run_cli(env, *COMMANDS[0], timeout_s=30)
    seconds = time.monotonic() - started
    assert_one_line(result.returncode, result.stdout, result.stderr, closed_port)
    # librdkafka retries forever; the check gives up as soon as every broker is down.
    assert seconds < 10, f"send took {seconds:.1f}s to fail"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_fails_fast_in_one_line(
    command: list[str], closed_port: int, tmp_path: Path
) -> None:
    env = {"KDELAY_BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port}",
           "KDELAY_STATE_DIR": str(tmp_path / "state")}
    result = CliRunner().invoke(app, command, env=env)
    assert_one_line(result.exit_code, result.stdout, result.stderr, closed_port)
