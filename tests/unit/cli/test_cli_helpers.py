"""The helper commands on the command line: ``worker`` and ``send --every/--cron``; no broker.

Only arguments rejected before any network are exercised here; the commands
against a broker are in ``tests/e2e/test_helpers.py``.
"""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner, Result

from kdelay.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KDELAY_"):
            monkeypatch.delenv(name)


def error_line(result: Result) -> str:
    """The one ``error[...]`` line of a command that exited 2."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    [line] = result.stderr.strip().splitlines()
    return line


def test_worker_help_names_the_registry_option() -> None:
    result = runner.invoke(app, ["worker", "--help"])
    assert result.exit_code == 0, result.output
    assert "--registry" in result.output
    assert "KDELAY_REGISTRY" in result.output


@pytest.mark.parametrize(("reference", "message"), [
    ("no_such_module_q:tasks", "error[bad-registry]: cannot import module 'no_such_module_q'"),
    ("tests.unit.helpers.test_tasks",
     "error[bad-registry]: --registry 'tests.unit.helpers.test_tasks' must"),
    ("tests.unit.helpers.test_tasks:RUNS",
     "error[bad-registry]: tests.unit.helpers.test_tasks:RUNS is a list"),
])
def test_worker_refuses_a_bad_registry(reference: str, message: str) -> None:
    assert error_line(runner.invoke(app, ["worker", "--registry", reference])).startswith(
        message)


@pytest.mark.parametrize(("args", "message"), [
    (["--every", "1s", "--delay", "5s"], "error[invalid-argument]: --every and --cron exclude"),
    (["--every", "1s", "--cron", "0 9 * * *"], "error[invalid-argument]: give exactly one"),
    (["--cron", "0 9 * *"], "error[invalid-argument]: cron expression '0 9 * *' must have"),
    (["--cron", "0 9 * * *", "--tz", "Mars/Olympus"], "error[invalid-argument]: unknown time"),
    (["--every", "0s"], "error[invalid-argument]: an interval must be at least 1 ms"),
])
def test_send_refuses_a_bad_series(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["send", "orders", "--value", "x", *args])
    assert error_line(result).startswith(message)
