"""Least privilege on the real broker: SASL_SSL, a development CA, and exactly the ACLs
docs/operations/security.md lists.

The jar broker of ``tools/kafka`` has a SASL_SSL listener whose certificate a
CA made at its first start signs, and KRaft's ``StandardAuthorizer`` with
``allow.everyone.if.no.acl.found=false`` (``tools/kafka tls`` prints both; the
PLAINTEXT listener's principal is a super user, so the other tests never meet
an ACL). Each test makes two SCRAM users of its own, grants them the ACLs of
the ``kafka-acls.sh`` lines in docs/operations/security.md (read from the page, so the
page cannot drift) and runs ``kdelay run`` as one of them, configured with a
Java ``client.properties`` that trusts the CA through PEM settings.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer

# confluent_kafka.admin re-exports these without listing them, which strict mypy rejects.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialUpsertion,
)

from kdelay.client import id_partition
from kdelay.protocol import envelope
from tests.conftest import ROOT, _unavailable, produce_all
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, clean_environment, run_cli
from tests.e2e.prometheus_server import free_port

pytestmark = pytest.mark.kafka

SUPER_USER = "kdelay"
SUPER_PASSWORD = "kdelay-dev-secret"  # noqa: S105 - the development broker's fixed user
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
OPERATIONS = {"Read": AclOperation.READ, "Write": AclOperation.WRITE,
              "Describe": AclOperation.DESCRIBE,
              "DescribeConfigs": AclOperation.DESCRIBE_CONFIGS}
RESOURCES = {"--topic": ResourceType.TOPIC, "--group": ResourceType.GROUP,
             "--transactional-id": ResourceType.TRANSACTIONAL_ID}


@pytest.fixture(scope="module")
def tls(bootstrap: str) -> tuple[str, Path]:
    """The SASL_SSL address and the CA that signs its certificate.

    ``KDELAY_TLS_BOOTSTRAP_SERVERS`` and ``KDELAY_TLS_CA`` when set, else
    ``tools/kafka tls``. Depends on ``bootstrap`` so the broker runs first.
    """
    external = os.environ.get("KDELAY_TLS_BOOTSTRAP_SERVERS")
    if external:
        return external, Path(os.environ["KDELAY_TLS_CA"])
    found = subprocess.run([str(ROOT / "tools" / "kafka"), "tls"], capture_output=True,
                           text=True, check=False).stdout.split()
    values = dict(line.split("=", 1) for line in found if "=" in line)
    if "tls_bootstrap" not in values:
        _unavailable("the local broker has no SASL_SSL listener (tools/kafka tls)")
    return values["tls_bootstrap"], Path(values["tls_ca"])


def scram_config(tls: tuple[str, Path], user: str,
                 password: str) -> dict[str, str | int | float | bool]:
    """librdkafka settings of a SCRAM user on the SASL_SSL listener."""
    return {"bootstrap.servers": tls[0], "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": user,
            "sasl.password": password, "ssl.ca.location": str(tls[1])}


def java_properties(path: Path, ca: Path, user: str, password: str) -> Path:
    """A Java client.properties: SCRAM over TLS, the CA trusted as a PEM trust store."""
    path.write_text(
        "security.protocol=SASL_SSL\n"
        "sasl.mechanism=SCRAM-SHA-256\n"
        f'sasl.jaas.config={SCRAM} required username="{user}" password="{password}";\n'
        "ssl.truststore.type=PEM\n"
        f"ssl.truststore.location={ca}\n")
    return path


def documented_acls(names: dict[str, str]) -> list[AclBinding]:
    """The ACL bindings of the ``kafka-acls.sh`` lines in docs/operations/security.md, ``$NAME``s
    replaced by ``names``."""
    page = (ROOT / "docs" / "operations" / "security.md").read_text()
    block = page.split("<!-- acls:begin -->")[1].split("<!-- acls:end -->")[0]
    lines = [line for line in block.splitlines() if line.startswith("kafka-acls.sh")]
    assert lines, "docs/operations/security.md lists no kafka-acls.sh command"
    bindings = []
    for line in lines:
        text = re.sub(r"\$([A-Z]+)", lambda m: names.get(m.group(1), m.group(0)), line)
        bindings += _bindings(shlex.split(text))
    return bindings


def _bindings(args: list[str]) -> list[AclBinding]:
    """The bindings of one ``kafka-acls.sh --add`` command line."""
    options: dict[str, list[str]] = {}
    for flag, value in itertools.pairwise(args):
        if flag.startswith("--") and not value.startswith("--"):
            options.setdefault(flag, []).append(value)
    [principal] = options["--allow-principal"]
    [(flag, [name])] = [(f, v) for f, v in options.items() if f in RESOURCES]
    pattern = (ResourcePatternType.PREFIXED
               if options.get("--resource-pattern-type") == ["prefixed"]
               else ResourcePatternType.LITERAL)
    return [AclBinding(RESOURCES[flag], name, pattern, principal, "*", OPERATIONS[op],
                       AclPermissionType.ALLOW) for op in options["--operation"]]


class Principals:
    """Two SCRAM users of one test, the ACLs granted to them, and the super user's admin."""

    def __init__(self, tls: tuple[str, Path]) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.tls = tls
        self.admin = AdminClient(scram_config(tls, SUPER_USER, SUPER_PASSWORD))
        self.service = (f"svc-{suffix}", f"svc-secret-{uuid.uuid4().hex}")
        self.producer = (f"prod-{suffix}", f"prod-secret-{uuid.uuid4().hex}")
        upserts: list[UserScramCredentialAlteration] = [UserScramCredentialUpsertion(
            user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 4096), password.encode())
            for user, password in (self.service, self.producer)]
        for future in self.admin.alter_user_scram_credentials(upserts).values():
            future.result(timeout=30)
        self.granted: list[AclBinding] = []

    def grant(self, bindings: list[AclBinding]) -> None:
        for future in self.admin.create_acls(bindings).values():
            future.result(timeout=30)
        self.granted += bindings

    def close(self) -> None:
        filters = [AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal,
                                    b.host, b.operation, b.permission_type)
                   for b in self.granted]
        if filters:
            for future in self.admin.delete_acls(filters).values():
                future.result(timeout=30)


@pytest.fixture
def principals(tls: tuple[str, Path]) -> Iterator[Principals]:
    made = Principals(tls)
    yield made
    made.close()


def send_as(principals: Principals, topic: str, records: list[dict[str, Any]]) -> list[Any]:
    """Produce as the requests producer; return the delivery reports."""
    config = {**scram_config(principals.tls, *principals.producer), "enable.idempotence": True,
              "message.timeout.ms": 10_000}
    return produce_all(Producer(config), topic, records)


def refusal(principals: Principals, topic: str) -> int | None:
    """Produce one record to ``topic`` as the requests producer; return the error code."""
    codes: list[int | None] = []
    producer = Producer({**scram_config(principals.tls, *principals.producer),
                         "message.timeout.ms": 10_000})
    producer.produce(topic, value=b"direct", on_delivery=lambda error, _: codes.append(
        None if error is None else error.code()))
    producer.flush(30)
    return codes[0] if codes else -1


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_the_service_serves_over_sasl_ssl_with_exactly_the_documented_acls(
    principals: Principals, tls: tuple[str, Path], bootstrap: str, admin: AdminClient,
    tmp_path: Path, start_kdelay: Any, guarantee: str,
) -> None:
    suffix = uuid.uuid4().hex[:10]
    deployment = Deployment(
        bootstrap=tls[0], requests=f"acl-req-{suffix}", changelog=f"acl-chg-{suffix}",
        dlq=f"acl-dlq-{suffix}", group_id=f"acl-g-{suffix}",
        state_dir=tmp_path / "state", partitions=3, outcomes=f"acl-out-{suffix}",
        controls=f"acl-ctl-{suffix}", status=f"acl-sts-{suffix}")
    target, forbidden = f"acl-target-{suffix}", f"acl-forbidden-{suffix}"
    super_properties = java_properties(tmp_path / "admin.properties", tls[1], SUPER_USER,
                                       SUPER_PASSWORD)
    created = run_cli(deployment.env(KDELAY_KAFKA_CONFIG=str(super_properties)),
                      "topics", "create", "--partitions", "3", "--target", target)
    assert created.returncode == 0, created.stderr
    for future in principals.admin.create_topics([NewTopic(forbidden, 1, 1)]).values():
        future.result(timeout=30)
    principals.grant(documented_acls({
        "KDELAY": principals.service[0], "PRODUCER": principals.producer[0],
        "GROUP": deployment.group_id, "REQUESTS": deployment.requests,
        "CHANGELOG": deployment.changelog, "DLQ": deployment.dlq,
        "OUTCOMES": deployment.outcomes, "CONTROLS": deployment.controls,
        "STATUS": deployment.status, "TARGET": target}))

    password = principals.service[1]
    properties = java_properties(tmp_path / "client.properties", tls[1], *principals.service)
    # Run as docs/operations/security.md says to when kdelay's ACLs are broader than its
    # producers': with the targets it may serve listed.
    env = {"KDELAY_KAFKA_CONFIG": str(properties), "KDELAY_GUARANTEE": guarantee,
           "KDELAY_ALLOWED_TARGETS": target}
    port = free_port()
    service: KdelayProcess = start_kdelay(deployment, KDELAY_METRICS_PORT=str(port), **env)
    service.wait_ready()

    # The producer may write the requests topic, and nothing else.
    assert refusal(principals, target) == KafkaError.TOPIC_AUTHORIZATION_FAILED
    due = str(time.time_ns() // 1_000_000).encode()
    # Ids on other partitions than their own: kdelay forwards them (Write on requests).
    assert any(id_partition(f"acl-{i}", 3) != i % 3 for i in range(6))
    reports = send_as(principals, deployment.requests, [
        *({"value": f"ok-{i}".encode(), "partition": i % 3,
           "headers": [(envelope.TARGET, target.encode()), (envelope.DUE_MS, due),
                       (envelope.SCHEDULE_ID, f"acl-{i}".encode())]}
          for i in range(6)),
        {"value": b"smuggled", "partition": 0,
         "headers": [(envelope.TARGET, forbidden.encode()), (envelope.DUE_MS, due)]}])
    assert [r.error() for r in reports] == [None] * 7

    out = Receiver(bootstrap, admin, [target, forbidden, deployment.dlq])
    try:
        out.until(lambda: len(out.on(target)) >= 6 and len(out.on(deployment.dlq)) >= 1,
                  "six deliveries and one dead letter")
        out.drain(2.0)
        assert sorted(r.message.value() or b"" for r in out.on(target)) == [
            f"ok-{i}".encode() for i in range(6)], "each delivered once"
        assert out.on(forbidden) == [], "kdelay wrote where it may not"
        [dead] = out.on(deployment.dlq)
        headers = dict(dead.message.headers() or [])
        assert headers[envelope.ERROR] == b"target-not-allowed"
        assert dead.message.value() == b"smuggled"
    finally:
        out.close()

    # A producer without Read on the outcomes topic still cancels; only --wait cannot answer.
    producer = java_properties(tmp_path / "producer.properties", tls[1], *principals.producer)
    waited = run_cli(deployment.env(KDELAY_KAFKA_CONFIG=str(producer)),
                     "cancel", "acl-0", "--wait", "--timeout", "5s")
    assert waited.returncode == 7, waited.stderr
    assert waited.stderr.startswith("error[outcomes-unreadable]: "), waited.stderr
    assert waited.stdout.startswith(f"{deployment.requests}/"), "the cancel was written"

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        metrics = page.read().decode()
    assert "kdelay_intake_records_total" in metrics
    helped = run_cli(deployment.env(**env), "run", "--help")
    assert helped.returncode == 0, helped.stderr
    assert service.terminate() == 0
    # librdkafka's own transient retries (a coordinator still loading) are not
    # refusals; a missing ACL shows as an authorization error, or as kdelay's own
    # warning or error.
    unexpected = [line for line in service.log().splitlines()
                  if " ERROR " in line or "AUTHORIZATION" in line.upper()
                  or (" WARNING " in line and " kdelay.kafka." not in line)]
    assert unexpected == [], "an ACL the service needs is missing from the documented set"
    for text in (service.log(), metrics, helped.stdout + helped.stderr):
        assert password not in text
        assert SUPER_PASSWORD not in text


def inline_pem(ca: Path) -> str:
    """The CA certificate as a Java properties value: ``\\n`` escapes, continued lines."""
    return "\\n\\\n    ".join(ca.read_text().strip().splitlines())


@pytest.mark.parametrize("trust", ["location", "inline", "none"])
def test_the_pem_trust_settings_of_a_java_client_properties_meet_the_tls_listener(
    tls: tuple[str, Path], tmp_path: Path, trust: str,
) -> None:
    settings = {"location": f"ssl.truststore.type=PEM\nssl.truststore.location={tls[1]}\n",
                "inline": f"ssl.truststore.type=PEM\n"
                          f"ssl.truststore.certificates={inline_pem(tls[1])}\n",
                "none": ""}[trust]
    properties = tmp_path / "client.properties"
    properties.write_text(
        "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-256\n"
        f'sasl.jaas.config={SCRAM} required username="{SUPER_USER}" '
        f'password="{SUPER_PASSWORD}";\n' + settings)
    changelog = f"pem-chg-{uuid.uuid4().hex[:10]}"
    env = clean_environment(KDELAY_BOOTSTRAP_SERVERS=tls[0],
                            KDELAY_KAFKA_CONFIG=str(properties),
                            KDELAY_CHANGELOG_TOPIC=changelog)

    result = run_cli(env, "retention", "check", timeout_s=30)

    assert SUPER_PASSWORD not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    [line] = lines
    if trust == "none":
        assert result.returncode == 2
        assert line.startswith("error[tls-failed]: the TLS handshake with the brokers at "), line
    else:
        # Connected and authenticated over TLS: the broker answers that the topic is missing.
        assert line.startswith("error[restore-failed]: "), line
        assert f"changelog topic {changelog} does not exist" in line, line
