"""``--log-format``: text or JSON lines, chosen by option or ``KDELAY_LOG_FORMAT``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from kdelay.cli import app, options
from kdelay.engine import runner as engine_runner
from kdelay.plumbing import identity
from kdelay.plumbing.logs import JsonFormatter
from kdelay.plumbing.settings import Settings

runner = CliRunner()


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Give the root logger back as it was; no ``KDELAY_*`` variable leaks in."""
    for name in list(os.environ):
        if name.startswith("KDELAY_"):
            monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _no_connection_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """No broker here: the connection check ``run`` makes first passes."""
    monkeypatch.setattr(options, "check_connection", lambda config: None)


def logging_service(settings: Settings, *, check: bool) -> int:
    """Stands in for ``run_service``: logs one line, and one with a traceback."""
    log = logging.getLogger("kdelay.engine.service")
    log.info("assigned %s", [0, 1])
    logging.getLogger("kdelay.kafka.targets").warning("FAIL [rdkafka#producer-1] broker down")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("step failed")
    return 0


def test_json_formatter_writes_one_object_per_record() -> None:
    record = logging.LogRecord("kdelay.engine.delivery", logging.WARNING, __file__, 1,
                               'retry "%s"', ("k1",), None)
    record.created = 1_700_000_000.25
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert json.loads(line) == {"time": "2023-11-14T22:13:20.250+00:00", "level": "WARNING",
                                "logger": "kdelay.engine.delivery", "message": 'retry "k1"'}


@pytest.mark.parametrize("how", ["option", "env"])
def test_run_logs_json_lines(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(engine_runner, "run_service", logging_service)
    args, env = (["run", "--log-format", "json"], {}) if how == "option" else (
        ["run"], {"KDELAY_LOG_FORMAT": "json"})
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [(x["level"], x["logger"], x["message"]) for x in lines] == [
        ("INFO", "kdelay.engine.service", "assigned [0, 1]"),
        ("WARNING", "kdelay.kafka.targets", "FAIL [rdkafka#producer-1] broker down"),
        ("ERROR", "kdelay.engine.service", "step failed")]
    assert "RuntimeError: boom" in lines[2]["exception"]
    # Every line names the instance (and librdkafka's its client, in the logger).
    assert {x["instance"] for x in lines} == {identity.of(Settings()).member_id}


def test_run_logs_text_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_runner, "run_service", logging_service)
    result = runner.invoke(app, ["run"])
    assert result.exit_code == 0, result.output
    first = result.stderr.splitlines()[0]
    assert first.endswith(" INFO kdelay.engine.service: assigned [0, 1]")
    assert f" [{identity.of(Settings()).member_id}] INFO " in first, "text lines name the instance"
    with pytest.raises(json.JSONDecodeError):
        json.loads(first)


def test_an_unknown_log_format_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_runner, "run_service", logging_service)
    result = runner.invoke(app, ["run", "--log-format", "yaml"])
    assert result.exit_code == 2
    assert "yaml" in result.stderr
