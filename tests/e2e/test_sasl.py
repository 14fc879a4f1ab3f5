"""``--kafka-config`` with a Java client.properties against a real SASL/SCRAM listener.

The jar broker of ``tools/kafka`` listens with SASL_PLAINTEXT (SCRAM-SHA-256
and PLAIN, user ``kdelay``); ``tools/test`` exports its address as
``KDELAY_SASL_BOOTSTRAP_SERVERS``. Every command runs as a user runs it: the
``kdelay`` console script, its stdout and stderr captured whole.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tests.conftest import ROOT, _unavailable
from tests.e2e.conftest import clean_environment, run_cli

pytestmark = pytest.mark.kafka

USER = "kdelay"
PASSWORD = "kdelay-dev-secret"  # noqa: S105 - the development broker's fixed user (tools/kafka)
WRONG = "not-the-kdelay-password"
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"


@pytest.fixture(scope="module")
def sasl_bootstrap(bootstrap: str) -> str:
    """The SASL_PLAINTEXT address: KDELAY_SASL_BOOTSTRAP_SERVERS, else ``tools/kafka sasl``.

    Depends on ``bootstrap`` so that the session's broker has been started first.
    """
    external = os.environ.get("KDELAY_SASL_BOOTSTRAP_SERVERS")
    if external:
        return external
    if os.environ.get("KDELAY_BOOTSTRAP_SERVERS"):
        _unavailable("KDELAY_BOOTSTRAP_SERVERS is set without KDELAY_SASL_BOOTSTRAP_SERVERS")
    found = subprocess.run([str(ROOT / "tools" / "kafka"), "sasl"], capture_output=True,
                           text=True, check=False).stdout.strip()
    if not found.startswith("sasl_bootstrap="):
        _unavailable("the local broker has no SASL listener (tools/kafka sasl)")
    return found.removeprefix("sasl_bootstrap=")


def java_properties(folder: Path, bootstrap: str, password: str) -> Path:
    """A client.properties as a Java client takes it: SCRAM through ``sasl.jaas.config``."""
    path = folder / f"client-{uuid.uuid4().hex[:6]}.properties"
    path.write_text(
        f"bootstrap.servers={bootstrap}\n"
        "security.protocol=SASL_PLAINTEXT\n"
        "sasl.mechanism=SCRAM-SHA-256\n"
        f"sasl.jaas.config={SCRAM} required \\\n"
        f'    username="{USER}" \\\n'
        f'    password="{password}";\n'
        "# Java-only, translated: the OS default socket buffer\n"
        "send.buffer.bytes=-1\n")
    return path


@pytest.fixture
def topics(sasl_bootstrap: str) -> Iterator[dict[str, str]]:
    """Random names for kdelay's topics and a target; deleted at the end (over SCRAM)."""
    suffix = uuid.uuid4().hex[:10]
    names = {"KDELAY_REQUESTS_TOPIC": f"sasl-req-{suffix}",
             "KDELAY_CHANGELOG_TOPIC": f"sasl-chg-{suffix}",
             "KDELAY_DLQ_TOPIC": f"sasl-dlq-{suffix}", "target": f"sasl-target-{suffix}"}
    yield names
    admin = AdminClient({"bootstrap.servers": sasl_bootstrap, "security.protocol":
                         "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
                         "sasl.username": USER, "sasl.password": PASSWORD})
    present = set(admin.list_topics(timeout=10).topics)
    doomed = [name for name in names.values() if name in present]
    for future in admin.delete_topics(doomed).values() if doomed else ():
        future.result(timeout=30)


def test_commands_authenticate_with_a_java_scram_properties_file(
    sasl_bootstrap: str, topics: dict[str, str], tmp_path: Path
) -> None:
    config = java_properties(tmp_path, sasl_bootstrap, PASSWORD)
    target = topics.pop("target")
    env = clean_environment(KDELAY_KAFKA_CONFIG=str(config),
                            KDELAY_STATE_DIR=str(tmp_path / "state"), **topics)
    created = run_cli(env, "topics", "create", "--partitions", "1", "--target", target)
    assert created.returncode == 0, created.stderr
    assert f"created {target} (target)" in created.stdout
    sent = run_cli(env, "send", target, "--value", "over-scram", "--delay", "1h", "--id", "s1")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.startswith(f"{topics['KDELAY_REQUESTS_TOPIC']}/0/")
    checked = run_cli(env, "run", "--check")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith(f"ok: {sasl_bootstrap} reachable")
    for result in (created, sent, checked):
        assert PASSWORD not in result.stdout + result.stderr


@pytest.mark.parametrize("command", [["send", "t", "--value", "v", "--delay", "1s"],
                                     ["run", "--check"]])
def test_a_wrong_password_is_one_line_without_the_password(
    sasl_bootstrap: str, tmp_path: Path, command: list[str]
) -> None:
    config = java_properties(tmp_path, sasl_bootstrap, WRONG)
    result = run_cli(clean_environment(KDELAY_KAFKA_CONFIG=str(config)), *command,
                     timeout_s=30)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error[authentication-failed]: the brokers at "), line
    assert "SCRAM-SHA-256" in line
    assert WRONG not in line

