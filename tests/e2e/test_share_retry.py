"""The share-group form of the retry helper, end to end, on a broker with share groups.

Share groups (KIP-932) are production-ready from Kafka 4.2; the session's
default broker may be older, so this module uses a broker of its own: the one
``KDELAY_SHARE_BOOTSTRAP_SERVERS`` names, else one ``tools/kafka`` starts with
``KDELAY_KAFKA_VERSION`` = :data:`SHARE_KAFKA_VERSION` (and stops afterwards).
One ``kdelay run`` serves the module on that broker. A failed record must come
back through kdelay after its backoff step, never straight from the share
group: every call of the handler sees a record delivered once by the group.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from confluent_kafka import Message, Producer
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from kdelay.plumbing.settings import Settings
from kdelay.retry import RetryingShareConsumer, RetryPolicy, attempts_of
from tests.conftest import ROOT, _unavailable, produce_all, wait_visible
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, run_cli
from tests.integration.conftest import header

pytestmark = pytest.mark.kafka
SHARE_KAFKA_VERSION = "4.4.0"  # the newest tools/test also runs its compatibility subset on
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def share_bootstrap() -> Iterator[str]:
    """A broker with share groups: given, or started from Kafka's jars for this module."""
    given = os.environ.get("KDELAY_SHARE_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    env = {**os.environ, "KDELAY_KAFKA_VERSION": SHARE_KAFKA_VERSION, "KDELAY_BROKER_PORT": "0"}
    env.pop("KDELAY_BOOTSTRAP_SERVERS", None)
    tool = str(ROOT / "tools" / "kafka")
    started = subprocess.run([tool, "start"], capture_output=True, text=True, env=env,
                             check=False, timeout=600)
    lines = [ln for ln in started.stdout.splitlines() if ln.startswith("bootstrap=")]
    if started.returncode != 0 or not lines:
        _unavailable(f"no Kafka {SHARE_KAFKA_VERSION} broker: {started.stderr[-1500:]}")
    try:
        yield lines[0].removeprefix("bootstrap=")
    finally:
        subprocess.run([tool, "stop"], capture_output=True, env=env, check=False, timeout=120)


@pytest.fixture(scope="module")
def share_admin(share_bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": share_bootstrap})


@pytest.fixture(scope="module")
def service(share_bootstrap: str, share_admin: AdminClient,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """kdelay's topics and one ``kdelay run`` on the share-group broker."""
    suffix = uuid.uuid4().hex[:12]
    tmp = tmp_path_factory.mktemp("share")
    deployment = Deployment(share_bootstrap, f"s-req-{suffix}", f"s-chg-{suffix}",
                            f"s-dlq-{suffix}", f"s-g-{suffix}", tmp / "state", 3)
    created = run_cli(deployment.env(), "topics", "create", "--partitions", "3")
    assert created.returncode == 0, created.stderr
    process = KdelayProcess("kdelay-run", deployment.env(), tmp / "run.log")
    try:
        process.wait_ready()
        yield deployment
    finally:
        process.kill()
        share_admin.delete_topics([deployment.requests, deployment.changelog, deployment.dlq])


def topic(admin: AdminClient, prefix: str) -> str:
    """A one-partition topic with a random name."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(30)
    wait_visible(admin, name, 1)
    return name


def share_group(admin: AdminClient) -> str:
    """A new share group that starts at the earliest offset (records sent before it joins)."""
    group = f"share-{uuid.uuid4().hex[:12]}"
    entry = ConfigEntry("share.auto.offset.reset", "earliest",
                        incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=[entry])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)
    return group


@dataclass
class Call:
    """One call of the handler: the helper's attempt count, the group's delivery count."""

    attempts: int
    delivery_count: int | None
    key: bytes | None
    value: bytes | None
    trace: bytes | None
    at: float


def recorder(calls: list[Call], fail: Callable[[Message], Exception | None]
             ) -> Callable[[Message], None]:
    """A handler that records each call and raises what ``fail`` returns for it."""

    def handle(message: Message) -> None:
        calls.append(Call(attempts_of(message.headers()), message.delivery_count(),
                          message.key(), message.value(), header(message, "trace"),
                          time.monotonic()))
        error = fail(message)
        if error is not None:
            raise error

    return handle


def consumer_of(deployment: Deployment, orders: str, handler: Callable[[Message], None],
                policy: RetryPolicy, group: str) -> RetryingShareConsumer:
    settings = Settings(bootstrap_servers=deployment.bootstrap,
                        requests_topic=deployment.requests, changelog_topic=deployment.changelog,
                        dlq_topic=deployment.dlq)
    return RetryingShareConsumer(settings, [orders], handler, policy, group_id=group)


def step_until(condition: Callable[[], bool], what: str, consumer: RetryingShareConsumer) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S}s"
        consumer.step(0.2)


def send(bootstrap: str, orders: str, key: bytes) -> None:
    produce_all(Producer({"bootstrap.servers": bootstrap}), orders,
                [{"key": key, "value": b"order " + key, "headers": [("trace", b"t-" + key)]}])


def test_a_failed_record_comes_back_through_kdelay_not_the_share_group(
        service: Deployment, share_admin: AdminClient) -> None:
    orders, dlq = topic(share_admin, "orders"), topic(share_admin, "orders-dlq")
    calls: list[Call] = []
    policy = RetryPolicy(dlq, backoff=(300, 600, 900))
    consumer = consumer_of(service, orders, recorder(
        calls, lambda m: RuntimeError("flaky") if attempts_of(m.headers()) < 2 else None),
        policy, share_group(share_admin))
    try:
        send(service.bootstrap, orders, b"o1")
        step_until(lambda: len(calls) == 3, "three calls", consumer)
        consumer.step(1.0)  # the group hands out nothing more: every record was settled
    finally:
        consumer.close()
    assert [c.attempts for c in calls] == [0, 1, 2]
    assert [c.delivery_count for c in calls] == [1, 1, 1]
    assert {(c.key, c.value, c.trace) for c in calls} == {(b"o1", b"order o1", b"t-o1")}
    gaps = [b.at - a.at for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.3
    assert gaps[1] >= 0.6


def test_always_failing_ends_in_the_dead_letters_with_its_attempts(
        service: Deployment, share_admin: AdminClient) -> None:
    orders, dlq = topic(share_admin, "orders"), topic(share_admin, "orders-dlq")
    calls: list[Call] = []
    policy = RetryPolicy(dlq, backoff=(100, 200), non_retryable=(KeyError,))
    consumer = consumer_of(service, orders, recorder(
        calls, lambda m: KeyError("no such sku") if m.key() == b"fatal" else ValueError("bad")),
        policy, share_group(share_admin))
    dead = Receiver(service.bootstrap, share_admin, [dlq])
    try:
        send(service.bootstrap, orders, b"o2")
        send(service.bootstrap, orders, b"fatal")
        step_until(lambda: dead.poll(0.01) == 2, "two dead letters", consumer)
    finally:
        consumer.close()
        dead.close()
    by_key = {r.message.key(): r.message for r in dead.received}
    retried, fatal = by_key[b"o2"], by_key[b"fatal"]
    assert (retried.value(), header(retried, "trace")) == (b"order o2", b"t-o2")
    assert [header(retried, n) for n in ("kdelay.error-type", "kdelay.attempts")] == [
        b"ValueError", b"3"]
    assert [header(fatal, n) for n in ("kdelay.error-type", "kdelay.attempts")] == [
        b"KeyError", b"1"]
    assert sorted(c.attempts for c in calls if c.key == b"o2") == [0, 1, 2]
    assert {c.delivery_count for c in calls} == {1}
