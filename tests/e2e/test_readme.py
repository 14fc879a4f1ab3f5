"""The README's "Run it" walk, run as written: ``tools/up`` in one shell, the rest in another.

The commands are read from README.md itself, so the page cannot drift from
what works. Two substitutions keep the test isolated and short: the demo
target ``orders`` becomes a random topic (and kdelay's topics, group and state
dir are random, through ``KDELAY_*`` variables), and the 20 s delay becomes 2 s.
``tail`` is started before the ``send`` it watches for, as a reader of the
README starts it within the 20 s.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tests.conftest import ROOT
from tests.e2e.conftest import clean_environment, kdelay_command, run_cli

pytestmark = pytest.mark.kafka

KDELAY = ".venv/bin/kdelay"
UP_READY = "tools/up: kdelay runs on"
WAIT_S = 60.0


def run_it_commands() -> list[list[str]]:
    """Every command line in the code blocks of the README's "Run it" section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Run it\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(("tools/", KDELAY))]


def wait_for(path: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    """Wait until ``text`` shows in the log at ``path``; fail if ``process`` exits first."""
    deadline = time.monotonic() + WAIT_S
    while text not in path.read_text(errors="replace"):
        assert process.poll() is None, f"exited with {process.returncode}:\n{path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} within {WAIT_S}s:\n{path.read_text()}"
        time.sleep(0.1)


@pytest.fixture
def walk_env(bootstrap: str, admin: AdminClient, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Random topics, group and state dir for the walk; its topics are deleted at the end."""
    suffix = uuid.uuid4().hex[:10]
    env = clean_environment(
        KDELAY_BOOTSTRAP_SERVERS=bootstrap, KDELAY_REQUESTS_TOPIC=f"walk-req-{suffix}",
        KDELAY_CHANGELOG_TOPIC=f"walk-chg-{suffix}", KDELAY_DLQ_TOPIC=f"walk-dlq-{suffix}",
        KDELAY_OUTCOMES_TOPIC=f"walk-out-{suffix}",
        KDELAY_GROUP_ID=f"walk-{suffix}", KDELAY_STATE_DIR=str(tmp_path / "state"),
        KDELAY_TARGET=f"walk-orders-{suffix}", KDELAY_PARTITIONS="1",
        KDELAY_VENV=sys.prefix)  # tools/up runs this environment's kdelay
    yield env
    present = set(admin.list_topics(timeout=10).topics)
    doomed = [name for name in env.values() if name in present]
    for future in admin.delete_topics(doomed).values() if doomed else ():
        future.result(timeout=30)


@pytest.mark.compat
def test_the_readme_walk_works_as_written(walk_env: dict[str, str], tmp_path: Path) -> None:
    up, send, tail, send_later, cancel, web = run_it_commands()
    assert up == ["tools/up"]
    assert web == [KDELAY, "web"]  # the console, tested in tests/browser
    assert (send[:3], tail[:3], cancel[:2]) == (
        [KDELAY, "send", "orders"], [KDELAY, "tail", "orders"], [KDELAY, "cancel"])
    target = walk_env["KDELAY_TARGET"]

    def local(command: list[str]) -> list[str]:
        """The arguments after ``kdelay``, for this test's target and a 2 s delay."""
        return [target if w == "orders" else "2s" if w == "20s" else w for w in command[1:]]

    log = tmp_path / "up.log"
    with log.open("wb") as out:
        service = subprocess.Popen([str(ROOT / "tools" / "up")], env=walk_env, cwd=ROOT,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(log, UP_READY, service)
        watcher = subprocess.Popen([*kdelay_command(), *local(tail)], env=walk_env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert watcher.stderr is not None
        assert watcher.stderr.readline().startswith(f"following {target} ")
        sent = run_cli(walk_env, *local(send))
        assert sent.returncode == 0, sent.stderr
        delivered, _ = watcher.communicate(timeout=WAIT_S)
        assert watcher.returncode == 0
        assert f'value={{"id": 42}} kdelay-origin={sent.stdout.strip()} kdelay-due-ms=' \
            in delivered
        for command in (send_later, cancel):
            result = run_cli(walk_env, *local(command))
            assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[1].startswith("cancelled order-43 schedule=")
        wait_for(log, "request cancelled", service)
        service.send_signal(signal.SIGINT)
        assert service.wait(timeout=WAIT_S) == 0, log.read_text()
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(timeout=30)
