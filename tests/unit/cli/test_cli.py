"""The command line: help, env variables, settings building and error reporting.

No broker: ``run`` is pointed at a stand-in for ``run_service`` that records the
settings it was given, and ``send`` is only exercised on arguments it rejects
before touching the network.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from kdelay import native
from kdelay.cli import app, envvar, options
from kdelay.engine import runner as engine_runner
from kdelay.plumbing.settings import Guarantee, Settings
from kdelay.plumbing.topics import LayoutError

runner = CliRunner()
TYPER_OWN_OPTIONS = {"--install-completion", "--show-completion"}
NOT_SETTINGS = {*TYPER_OWN_OPTIONS, "--version"}  # options with no environment variable


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``KDELAY_*`` variable of the machine running the tests leaks into a command."""
    for name in list(os.environ):
        if name.startswith("KDELAY_"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _no_connection_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """No broker here: the CLI's connection check before ``run`` and ``restore`` passes.

    tests/integration/test_connection.py runs the real check against a closed port.
    """
    monkeypatch.setattr(options, "check_connection", lambda config: None)


class FakeService:
    """Stands in for ``kdelay.engine.runner.run_service``: records calls, returns or raises."""

    def __init__(self, result: int | Exception = 0) -> None:
        self.result = result
        self.calls: list[tuple[Settings, bool]] = []

    def __call__(self, settings: Settings, *, check: bool) -> int:
        self.calls.append((settings, check))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    @property
    def settings(self) -> Settings:
        assert len(self.calls) == 1, self.calls
        return self.calls[0][0]


@pytest.fixture
def fake_service(monkeypatch: pytest.MonkeyPatch) -> FakeService:
    fake = FakeService()
    monkeypatch.setattr(engine_runner, "run_service", fake)
    return fake


def invoke(args: list[str], env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, args, env=env)


def assert_error_line(result: Result, code: str, exit_code: int = 2) -> str:
    """The command failed with one ``error[code]: ...`` line on stderr and no traceback."""
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error[{code}]: "), lines[0]
    assert "Traceback" not in result.output
    return lines[0]


# --- help and env variables ------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [[], ["run"], ["topics"], ["topics", "create"], ["send"], ["cancel"]],
    ids=lambda args: " ".join(args) or "kdelay",
)
def test_help_for_every_command(args: list[str]) -> None:
    result = invoke([*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


@pytest.mark.parametrize("environ", [{}, {native.PURE_PYTHON_ENV: "1"}])
def test_version_says_how_the_hot_path_runs(environ: dict[str, str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "mode", native.mode)
    mode = native.choose(environ, finders=[])  # this process keeps its own finders
    result = invoke(["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"kdelay {metadata.version('kdelay')} (delivery hot path {mode})\n"


def _options(command: Any, path: str = "kdelay") -> Iterator[tuple[str, Any]]:
    """Every option of ``command`` and its subcommands, with the command path."""
    for param in command.params:
        if param.param_type_name == "option":
            yield path, param
    for name, sub in getattr(command, "commands", {}).items():
        yield from _options(sub, f"{path} {name}")


def test_every_option_has_its_env_variable() -> None:
    checked = 0
    for path, option in _options(typer.main.get_command(app)):
        name = max(option.opts, key=len)
        if name in NOT_SETTINGS:
            continue
        expected = "KDELAY_" + name.removeprefix("--").upper().replace("-", "_")
        assert option.envvar == expected, f"{path} {name}"
        checked += 1
    assert checked > 4 * 14


def test_envvar_names() -> None:
    assert envvar("bootstrap-servers") == "KDELAY_BOOTSTRAP_SERVERS"
    assert envvar("kafka-config") == "KDELAY_KAFKA_CONFIG"


def test_env_variable_is_honoured(fake_service: FakeService) -> None:
    result = invoke(["run", "--check"], env={"KDELAY_REQUESTS_TOPIC": "env.requests"})
    assert result.exit_code == 0, result.output
    assert fake_service.calls[0][1] is True
    assert fake_service.settings.requests_topic == "env.requests"


def test_flag_wins_over_env_variable(fake_service: FakeService) -> None:
    result = invoke(["run", "--requests-topic", "flag.requests"],
                    env={"KDELAY_REQUESTS_TOPIC": "env.requests"})
    assert result.exit_code == 0, result.output
    assert fake_service.settings.requests_topic == "flag.requests"
    assert fake_service.calls[0][1] is False


def test_common_options_build_settings(fake_service: FakeService, tmp_path: Path) -> None:
    result = invoke([
        "run", "--bootstrap-servers", "b:9092", "--changelog-topic", "c", "--dlq-topic", "d",
        "--group-id", "g", "--state-dir", str(tmp_path), "--guarantee", "exactly-once",
        "--metrics-port", "9400", "--levels", "1s 10s", "--retention-margin-ms", "60000",
        "--delivery-attempts", "3", "--retry-backoff-ms", "10", "--retry-backoff-max-ms", "20",
        "--lookahead-ms", "500", "--batch-size", "50", "--transactional-id", "tx",
    ])
    assert result.exit_code == 0, result.output
    assert fake_service.settings == Settings(
        bootstrap_servers="b:9092", changelog_topic="c", dlq_topic="d", group_id="g",
        state_dir=tmp_path, guarantee=Guarantee.EXACTLY_ONCE, metrics_port=9400,
        levels=(1_000, 10_000), retention_margin_ms=60_000, delivery_attempts=3,
        retry_backoff_ms=10, retry_backoff_max_ms=20, lookahead_ms=500, batch_size=50,
        transactional_id="tx",
    )


def test_run_takes_the_worker_topic_names_it_must_refuse(fake_service: FakeService) -> None:
    # The same variables ``kdelay worker`` reads: the service refuses the names in force.
    result = invoke(["run", "--worker-dlq-topic", "acme.failed"],
                    env={"KDELAY_SERIES_CANCELS_TOPIC": "acme.stops"})
    assert result.exit_code == 0, result.output
    reserved = fake_service.settings.reserved_topics
    assert "acme.failed" in reserved
    assert "acme.stops" in reserved


def test_defaults_come_from_settings(fake_service: FakeService) -> None:
    assert invoke(["run"]).exit_code == 0
    assert fake_service.settings == Settings()


def test_service_exit_code_is_the_command_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_runner, "run_service", FakeService(3))
    assert invoke(["run"]).exit_code == 3


# --- --kafka-config --------------------------------------------------------------------


def test_kafka_config_file_and_bootstrap_precedence(
    fake_service: FakeService, tmp_path: Path
) -> None:
    path = tmp_path / "client.properties"
    path.write_text("bootstrap.servers=file:9092\nsecurity.protocol=SSL\n", encoding="utf-8")
    assert invoke(["run"], env={"KDELAY_KAFKA_CONFIG": str(path)}).exit_code == 0
    assert invoke(["run", "--kafka-config", str(path),
                   "--bootstrap-servers", "flag:9092"]).exit_code == 0
    from_file, from_flag = (settings for settings, _ in fake_service.calls)
    assert from_file.client_config()["bootstrap.servers"] == "file:9092"
    assert from_file.client_config()["security.protocol"] == "SSL"
    assert from_flag.client_config()["bootstrap.servers"] == "flag:9092"
    assert from_flag.client_config()["security.protocol"] == "SSL"


def test_missing_kafka_config_is_one_error_line(
    fake_service: FakeService, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.properties"
    result = invoke(["run", "--kafka-config", str(missing)])
    line = assert_error_line(result, "kafka-config-missing")
    assert str(missing) in line
    assert fake_service.calls == []


def test_malformed_kafka_config_names_file_and_line(
    fake_service: FakeService, tmp_path: Path
) -> None:
    path = tmp_path / "client.properties"
    path.write_text("# settings\nsecurity.protocol=SSL\nsasl.mechanism\n", encoding="utf-8")
    line = assert_error_line(invoke(["send", "t", "--delay", "1s", "--kafka-config", str(path)]),
                             "kafka-config-malformed")
    assert f"{path}:3:" in line


# --- errors users cause ----------------------------------------------------------------


def test_invalid_setting_is_one_error_line(fake_service: FakeService) -> None:
    line = assert_error_line(invoke(["run", "--batch-size", "0"]), "invalid-setting")
    assert "batch_size" in line


def test_layout_error_from_the_service_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    error = LayoutError("changelog-missing", "changelog topic c does not exist: run ...")
    monkeypatch.setattr(engine_runner, "run_service", FakeService(error))
    line = assert_error_line(invoke(["run", "--check"]), "changelog-missing")
    assert line.endswith("does not exist: run ...")


def test_value_error_inside_the_service_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_runner, "run_service", FakeService(ValueError("a bug")))
    result = invoke(["run"])
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError)


_CRASHING_RUN = """
import sys
from kdelay import cli
from kdelay.cli import options
from kdelay.engine import runner as engine_runner

def crash(settings, *, check):
    raise RuntimeError("a bug, with the settings at hand: " + settings.bootstrap_servers)

engine_runner.run_service = crash
options.check_connection = lambda config: None
sys.argv = ["kdelay", "run", "--kafka-config", sys.argv[1]]
cli.main()
"""


def test_a_traceback_never_shows_the_password(tmp_path: Path) -> None:
    """typer's pretty traceback of a bug (locals hidden) holds no value of the config file."""
    password = "tr4ceback-s3cret"  # noqa: S105 - a test credential
    config = tmp_path / "client.properties"
    config.write_text("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-256\n"
                      "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule "
                      f'required username="u" password="{password}";\n')
    result = subprocess.run([sys.executable, "-c", _CRASHING_RUN, str(config)],
                            capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 1
    assert "RuntimeError: a bug" in result.stderr
    assert password not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--delay", "5s", "--due", "1700000000000"], "exactly one of delay, due and level"),
        (["--delay", "5s", "--level", "2"], "exactly one of delay, due and level"),
        ([], "exactly one of delay, due and level, got none"),
        (["--delay", "5 parsecs"], "not a duration"),
        (["--due", "2026-01-01T00:00:00"], "has no timezone"),
        (["--due", "tomorrow"], "not a due time"),
        (["--level", "0"], "level"),
        (["--delay", "1s", "--header", "kdelay-target=x"], "reserved"),
        (["--delay", "1s", "--header", "novalue"], "expected name=value"),
        (["--delay", "1s", "--partition", "-1"], "partition"),
    ],
)
def test_send_rejects_bad_arguments_before_any_network(args: list[str], fragment: str) -> None:
    result = invoke(["send", "target", "--bootstrap-servers", "127.0.0.1:1", *args])
    assert fragment in assert_error_line(result, "invalid-argument")


def test_topics_create_rejects_bad_counts_before_any_network() -> None:
    result = invoke(["topics", "create", "--partitions", "0",
                     "--bootstrap-servers", "127.0.0.1:1"])
    assert "partitions must be at least 1" in assert_error_line(result, "invalid-argument")


def test_topics_create_rejects_retention_shorter_than_the_levels() -> None:
    result = invoke(["topics", "create", "--retention-ms", "60000", "--levels", "1s 2h",
                     "--bootstrap-servers", "127.0.0.1:1"])
    assert "shorter than the longest delay level" in assert_error_line(result, "invalid-argument")


# --- --workers -------------------------------------------------------------------------


class FakeWorkers:
    """Stands in for ``kdelay.engine.runner.run_workers``: records the worker count."""

    def __init__(self) -> None:
        self.calls: list[tuple[Settings, int, bool]] = []

    def __call__(self, settings: Settings, workers: int, main: object, *, check: bool) -> int:
        self.calls.append((settings, workers, check))
        return 0


@pytest.fixture
def fake_workers(monkeypatch: pytest.MonkeyPatch) -> FakeWorkers:
    fake = FakeWorkers()
    monkeypatch.setattr(engine_runner, "run_workers", fake)
    return fake


def test_one_worker_runs_the_service_in_this_process(
    fake_service: FakeService, fake_workers: FakeWorkers
) -> None:
    assert invoke(["run"]).exit_code == 0
    assert invoke(["run"], env={"KDELAY_WORKERS": "1"}).exit_code == 0
    assert len(fake_service.calls) == 2
    assert fake_workers.calls == []


def test_workers_from_the_flag_or_the_env_variable(
    fake_service: FakeService, fake_workers: FakeWorkers
) -> None:
    assert invoke(["run", "--workers", "2"]).exit_code == 0
    assert invoke(["run", "--check"], env={"KDELAY_WORKERS": "3"}).exit_code == 0
    assert [(w, check) for _, w, check in fake_workers.calls] == [(2, False), (3, True)]
    assert fake_service.calls == []


def test_zero_workers_is_one_error_line(
    fake_service: FakeService, fake_workers: FakeWorkers
) -> None:
    line = assert_error_line(invoke(["run", "--workers", "0"]), "invalid-setting")
    assert "workers must be at least 1" in line
    assert fake_service.calls == []
    assert fake_workers.calls == []
