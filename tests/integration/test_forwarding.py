"""Schedule ids work whatever partition a request was written to.

Producers that cannot choose a partition (Kafka Connect, an outbox router, a
framework) place a request by its business key, so a request with
``kdelay-id`` lands on another partition than the id's, where the client
library writes cancels. A cancel must still find its schedule, and a second
request with the same id written to yet another partition must still be a
duplicate. The service runs under both guarantees on a manual clock.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay.client import DelayProducer, id_partition
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from kdelay.view import retention
from kdelay.view.pending import PendingView
from tests.conftest import TopicFactory, produce_all
from tests.integration.conftest import Collector, Deployment, Running, header, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]
PARTITIONS = 3
DELAY_MS = 60_000


def outcomes(service: Service, outcome: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": outcome})
    return value or 0.0


def pending(service: Service, sid: str) -> bool:
    """Whether any index of ``service`` holds ``sid`` as pending."""
    states = [index.id_state(sid) for index in service.indexes.values()]
    return any(state is not None and state.pending_key is not None for state in states)


def business_key(sid: str) -> bytes:
    """A key that librdkafka's default partitioner places off ``sid``'s partition."""
    for n in range(100):
        key = f"customer-{n}".encode()
        if zlib.crc32(key) % PARTITIONS != id_partition(sid, PARTITIONS):
            return key
    raise AssertionError("no business key found")


def request(target: str, due_ms: int, sid: str | None, key: bytes, value: bytes
            ) -> dict[str, object]:
    headers = [(envelope.TARGET, target.encode()), (envelope.DUE_MS, str(due_ms).encode())]
    if sid is not None:
        headers.append((envelope.SCHEDULE_ID, sid.encode()))
    return {"key": key, "value": value, "headers": headers}


def keys_of(messages: list[Message]) -> list[bytes | None]:
    return [m.key() for m in messages]


@pytest.mark.kafka
def test_a_cancel_finds_a_schedule_written_by_a_business_key(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=PARTITIONS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    service = group.add()
    sid = "order-7"
    due = clock.now_ms() + DELAY_MS
    # librdkafka's default partitioner, keyed by the business key: not the id's partition.
    business = Producer({"bootstrap.servers": bootstrap})
    [written] = produce_all(business, deployment.requests,
                            [request(target, due, sid, business_key(sid), b"cancel me")])
    assert written.partition() != id_partition(sid, PARTITIONS)
    group.until(lambda: pending(service, sid))

    with DelayProducer(deployment.settings) as client:
        cancel = client.cancel(sid)
    assert cancel.coordinates.partition == id_partition(sid, PARTITIONS)
    group.until(lambda: outcomes(service, "cancelled") + outcomes(service, "unknown") >= 1)
    assert outcomes(service, "cancelled") == 1, "the cancel did not find its schedule"
    answer = cancel.outcome(timeout=30)
    assert (answer.outcome, answer.request) == ("cancelled", str(cancel))
    where = f"{deployment.requests}/{written.partition()}/{written.offset()}"
    assert answer.schedule == where, "found where it was written"

    # A control record due at the same time shows when the cancelled one would have come.
    produce(bootstrap, deployment.requests, [request(target, due, None, b"control", b"c")])
    out = collector([target])
    clock.advance(DELAY_MS + 1)
    group.until(lambda: out.poll() >= 1)
    group.step(5)
    out.poll(0.5)
    assert keys_of(out.messages) == [b"control"]


@pytest.mark.kafka
def test_a_forwarded_schedule_whose_original_expired_names_its_id_and_target_in_the_dlq(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, admin: AdminClient,
) -> None:
    deployment = deployment_factory(partitions=PARTITIONS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    service = group.add()
    sid = "order-9"
    business = Producer({"bootstrap.servers": bootstrap})
    [written] = produce_all(business, deployment.requests, [request(
        target, clock.now_ms() + DELAY_MS, sid, business_key(sid), b"lost")])
    group.until(lambda: pending(service, sid))
    # Retention (here delete-records) takes the original before it is due.
    cut = TopicPartition(deployment.requests, written.partition() or 0,
                         (written.offset() or 0) + 1)
    admin.delete_records([cut])[cut].result(timeout=30)
    out = collector([deployment.settings.dlq_topic])
    clock.advance(DELAY_MS + 1)
    group.until(lambda: out.poll() >= 1)
    [dead] = out.messages
    assert header(dead, envelope.ERROR) == b"expired"
    assert header(dead, envelope.ORIGIN) == (
        f"{deployment.requests}/{written.partition()}/{written.offset()}".encode())
    assert (header(dead, envelope.SCHEDULE_ID), header(dead, envelope.SCHEDULED_TARGET)) == (
        sid.encode(), target.encode()), "the id and the target the index knows"


@pytest.mark.kafka
def test_a_duplicate_id_on_another_partition_is_not_scheduled_twice(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=PARTITIONS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    service = group.add()
    sid = "invoice-12"
    home = id_partition(sid, PARTITIONS)
    first, second = (p for p in range(PARTITIONS) if p != home)
    due = clock.now_ms() + DELAY_MS
    produce(bootstrap, deployment.requests,
            [{**request(target, due, sid, b"first", b"1"), "partition": first}])
    group.until(lambda: pending(service, sid))
    produce(bootstrap, deployment.requests,
            [{**request(target, due + 5, sid, b"second", b"2"), "partition": second}])
    group.until(lambda: outcomes(service, "duplicate") + outcomes(service, "scheduled") >= 2)
    assert outcomes(service, "duplicate") == 1, "the second request with the id was scheduled"

    out = collector([target])
    clock.advance(DELAY_MS + 10)
    group.until(lambda: out.poll() >= 1)
    group.step(5)
    out.poll(0.5)
    assert keys_of(out.messages) == [b"first"]


@pytest.mark.kafka
def test_a_forwarded_schedule_moves_with_its_ids_partition(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, tmp_path: Path,
) -> None:
    deployment = deployment_factory(partitions=PARTITIONS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    first = group.add(state_dir=tmp_path / "first")
    sids = [f"move-{n}" for n in range(6)]
    due = clock.now_ms() + DELAY_MS
    produce(bootstrap, deployment.requests, [
        {**request(target, due, sid, sid.encode(), b"v"),
         "partition": (id_partition(sid, PARTITIONS) + 1) % PARTITIONS} for sid in sids])
    group.until(lambda: all(pending(first, sid) for sid in sids))

    # The ids' partitions move to another instance (another state dir): it restores
    # the forwarded entries from the changelog and serves their cancels and deliveries.
    group.close(first)
    second = group.add(state_dir=tmp_path / "second")
    group.until(lambda: len(second.owned()) == PARTITIONS)
    assert all(pending(second, sid) for sid in sids)
    with DelayProducer(deployment.settings) as client:
        for sid in sids[:3]:
            client.cancel(sid)
    group.until(lambda: outcomes(second, "cancelled") + outcomes(second, "unknown") >= 3)
    assert outcomes(second, "cancelled") == 3

    out = collector([target])
    clock.advance(DELAY_MS)
    group.until(lambda: out.poll() >= 3)
    group.step(5)
    out.poll(0.5)
    assert sorted(m.key() or b"" for m in out.messages) == [sid.encode() for sid in sids[3:]]
    assert all(m.timestamp()[1] >= due for m in out.messages)


@pytest.mark.kafka
def test_retention_counts_a_forwarded_schedule_where_its_original_lies(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    tmp_path: Path,
) -> None:
    deployment = deployment_factory(partitions=PARTITIONS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    service = group.add()
    sid = "retained-1"
    home = id_partition(sid, PARTITIONS)
    lies = (home + 1) % PARTITIONS
    [written] = produce(bootstrap, deployment.requests, [
        {**request(target, clock.now_ms() + DELAY_MS, sid, b"k", b"v"), "partition": lies}])
    group.until(lambda: pending(service, sid))
    assert service.indexes[home].id_state(sid) is not None, "held by the id's partition"
    offset = written.offset()
    assert offset is not None

    with PendingView(deployment.settings, tmp_path / "view", clock.now_ms()) as view:
        found = view.find(lies, offset)
        assert found is not None
        assert (found.partition, found.offset, found.schedule_id) == (lies, offset, sid)
        assert view.find(home, offset) is None
    low = TopicPartition(deployment.requests, lies, offset + 1)
    for future in deployment.admin.delete_records([low]).values():
        future.result(timeout=30)
    with PendingView(deployment.settings, tmp_path / "view", clock.now_ms()) as view:
        report = retention.check(deployment.settings, view, clock.now_ms())
    figures = {p.partition: p for p in report.partitions}
    assert (figures[lies].pending, figures[lies].expired, figures[lies].headroom_ms) == (1, 1, 0)
    assert (figures[home].pending, figures[home].expired) == (0, 0)
    assert report.expired == 1
