"""The service in-process against the real broker, on a manual clock."""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from kdelay.errors import ServiceError
from kdelay.plumbing import callbacks
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Guarantee
from kdelay.protocol import envelope
from kdelay.state.changes import Changes
from kdelay.state.index import PartitionIndex
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, header, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]


def request(target: str, index: int, timestamp: int, delay_ms: int,
            target_partition: int | None = None, **extra: Any) -> dict[str, Any]:
    headers: list[tuple[str, bytes | None]] = [
        (envelope.TARGET, target.encode()), (envelope.DELAY_MS, str(delay_ms).encode()),
        ("trace", f"t{index}".encode()), ("trace", b"second"), ("empty", None),
    ]
    if target_partition is not None:
        headers.append((envelope.PARTITION, str(target_partition).encode()))
    return {"key": f"k{index}".encode(), "value": f"value-{index}".encode() * 3,
            "headers": headers, "timestamp": timestamp, **extra}


def test_thousand_requests_delivered_once_intact_and_never_early(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=3)
    targets = [topic_factory("target-a", 2), topic_factory("target-b", 3)]
    clock = ManualClock(int(time.time() * 1000))
    start = clock.now_ms()
    rng = random.Random(7)
    records = []
    for i in range(1000):
        explicit = 1 if i % 10 == 0 else None
        records.append(request(targets[i % 2], i, start, rng.randint(0, 5_000), explicit,
                               partition=i % 3))
    reports = produce(bootstrap, deployment.requests, records)
    due_of = {f"k{i}".encode(): start + int(dict(r["headers"])[envelope.DELAY_MS] or 0)
              for i, r in enumerate(records)}
    origin_of = {m.key(): f"{deployment.requests}/{m.partition()}/{m.offset()}" for m in reports}
    out = collector(targets)
    service = running(deployment, clock)
    service.add()

    def delivered() -> bool:
        out.poll()
        return len(out.messages) >= 1000

    service.until(delivered, timeout_s=120, advance_ms=25)
    out.poll(1.0)
    keys = Counter(m.key() for m in out.messages)
    assert len(out.messages) == 1000
    assert set(keys.values()) == {1}
    for message in out.messages:
        key = message.key()
        assert key is not None
        i = int(key[1:])
        due = due_of[key]
        assert message.timestamp()[1] >= due, "delivered before its due time"
        assert message.topic() == targets[i % 2]
        assert message.value() == f"value-{i}".encode() * 3
        assert message.headers() == [
            ("trace", f"t{i}".encode()), ("trace", b"second"), ("empty", None),
            (envelope.ORIGIN, origin_of[key].encode()), (envelope.DUE_MS, str(due).encode()),
        ]
        if i % 10 == 0:
            assert message.partition() == 1


def test_malformed_requests_are_dead_lettered_and_the_partition_keeps_flowing(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=1, retention_ms=86_400_000,
                                    retention_margin_ms=3_600_000)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()

    def hdrs(*pairs: tuple[str, str]) -> list[tuple[str, bytes | None]]:
        return [(k, v.encode()) for k, v in pairs]

    bad = {
        "missing-target": hdrs((envelope.DELAY_MS, "10")),
        "missing-time": hdrs((envelope.TARGET, target)),
        "conflicting-time": hdrs((envelope.TARGET, target), (envelope.DELAY_MS, "1"),
                                 (envelope.LEVEL, "1")),
        "bad-time": hdrs((envelope.TARGET, target), (envelope.DUE_MS, "soon")),
        "unknown-level": hdrs((envelope.TARGET, target), (envelope.LEVEL, "0")),
        "delay-too-long": hdrs((envelope.TARGET, target), (envelope.DELAY_MS, str(86_400_000))),
        "bad-cancel": hdrs((envelope.CANCEL, "")),
        "bad-partition": hdrs((envelope.TARGET, target), (envelope.DELAY_MS, "1"),
                              (envelope.PARTITION, "-3")),
    }
    records: list[dict[str, Any]] = [
        {"key": code.encode(), "value": b"payload", "headers": h, "timestamp": now}
        for code, h in bad.items()
    ]
    records.append({"key": b"good", "value": b"ok", "timestamp": now,
                    "headers": hdrs((envelope.TARGET, target), (envelope.DELAY_MS, "100"))})
    produce(bootstrap, deployment.requests, records)
    out = collector([target, deployment.settings.dlq_topic])
    service = running(deployment, clock)
    service.add()

    def settled() -> bool:
        out.poll()
        return len(out.messages) >= len(records)

    service.until(settled, advance_ms=50)
    dead = {m.key(): m for m in out.on(deployment.settings.dlq_topic)}
    assert set(dead) == {code.encode() for code in bad}
    for code, message in dead.items():
        assert header(message, envelope.ERROR) == code
        assert header(message, envelope.ERROR_DETAIL)
        assert message.value() == b"payload"
        assert header(message, envelope.ORIGIN) is not None
    assert [m.key() for m in out.on(target)] == [b"good"]


def test_cancel_and_dedup_by_schedule_id(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=1)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()

    def scheduled(key: bytes, sid: str, delay: int) -> dict[str, Any]:
        return {"key": key, "value": key, "timestamp": now, "headers": [
            (envelope.TARGET, target.encode()), (envelope.DELAY_MS, str(delay).encode()),
            (envelope.SCHEDULE_ID, sid.encode())]}

    def cancel(sid: str) -> dict[str, Any]:
        return {"value": sid.encode(), "timestamp": now,
                "headers": [(envelope.CANCEL, sid.encode())]}

    produce(bootstrap, deployment.requests, [
        scheduled(b"a1", "a", 1_000), scheduled(b"a2", "a", 2_000),  # duplicate id
        scheduled(b"b", "b", 1_000), cancel("b"),  # cancelled before due
        cancel("nobody"),  # unknown
        scheduled(b"c", "c", 500),
    ])
    out = collector([target])
    running_ = running(deployment, clock)
    service = running_.add()
    running_.until(lambda: _count(service, "scheduled") >= 3)
    running_.until(lambda: out.poll() >= 2, advance_ms=50)
    produce(bootstrap, deployment.requests, [cancel("c")])  # after delivery
    running_.until(lambda: _count(service, "already-delivered") >= 1)
    clock.advance(5_000)
    running_.step(20)
    out.poll(1.0)
    assert sorted(m.key() or b"" for m in out.messages) == [b"a1", b"c"]
    assert _count(service, "duplicate") == 1
    assert _count(service, "cancelled") == 1
    assert _count(service, "unknown") == 1


def _count(service: Any, outcome: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": outcome})
    return float(value or 0)


def test_deleted_records_are_dead_lettered_as_expired(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, admin: AdminClient,
) -> None:
    deployment = deployment_factory(partitions=1)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    records = [request(target, i, now, 60_000) for i in range(3)]
    records[0]["headers"].append((envelope.SCHEDULE_ID, b"gone-0"))
    reports = produce(bootstrap, deployment.requests, records)
    out = collector([target, deployment.settings.dlq_topic])
    running_ = running(deployment, clock)
    service = running_.add()
    running_.until(lambda: _count(service, "scheduled") >= 3)
    cut = TopicPartition(deployment.requests, 0, reports[2].offset() or 0)
    admin.delete_records([cut])[cut].result(timeout=30)
    clock.advance(61_000)
    running_.until(lambda: out.poll() >= 3, advance_ms=10)
    dead = out.on(deployment.settings.dlq_topic)
    assert sorted(header(m, envelope.ORIGIN) or b"" for m in dead) == sorted(
        f"{deployment.requests}/0/{r.offset()}".encode() for r in reports[:2])
    assert {header(m, envelope.ERROR) for m in dead} == {b"expired"}
    # No original is left to copy: the DLQ record carries the id the index knows.
    assert {header(m, envelope.ORIGIN): header(m, envelope.SCHEDULE_ID) for m in dead} == {
        f"{deployment.requests}/0/{reports[0].offset()}".encode(): b"gone-0",
        f"{deployment.requests}/0/{reports[1].offset()}".encode(): None}
    # ... and the target each was scheduled for, under a name that is no request's.
    assert [header(m, envelope.SCHEDULED_TARGET) for m in dead] == [target.encode()] * 2
    assert [header(m, envelope.TARGET) for m in dead] == [None] * 2
    assert [m.key() for m in out.on(target)] == [b"k2"]


def test_recreated_requests_topic_gives_mismatch_not_a_wrong_record(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, admin: AdminClient,
) -> None:
    deployment = deployment_factory(partitions=1)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    produce(bootstrap, deployment.requests, [request(target, i, now, 60_000) for i in range(2)])
    running_ = running(deployment, clock)
    service = running_.add()
    running_.until(lambda: _count(service, "scheduled") >= 2)
    running_.close(service)
    _recreate(admin, deployment.requests)
    produce(bootstrap, deployment.requests, [
        {"key": b"other", "value": b"not the original", "timestamp": now,
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"999999")]}])
    out = collector([target, deployment.settings.dlq_topic])
    running_.add()
    clock.advance(61_000)
    running_.until(lambda: out.poll() >= 2,
                   advance_ms=10)
    dead = out.on(deployment.settings.dlq_topic)
    assert {header(m, envelope.ERROR) for m in dead} == {b"mismatch"}
    assert out.on(target) == []


def _recreate(admin: AdminClient, topic: str) -> None:
    admin.delete_topics([topic])[topic].result(timeout=30)
    deadline = time.monotonic() + 60
    while True:
        futures = admin.create_topics([NewTopic(topic, 1, 1)])
        try:
            futures[topic].result(timeout=30)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_record_the_broker_refuses_backs_off_alone_and_ends_in_the_dlq(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    """The broker refuses a record too large for its target topic: its delivery report
    fails (and carries no headers). Sent together with records to another target, that
    record alone backs off, then goes to the DLQ as undeliverable; the others are
    delivered once."""
    deployment = deployment_factory(partitions=1, delivery_attempts=2)
    small = topic_factory("small", 1, {"max.message.bytes": "1024"})
    wide = topic_factory("wide", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    records = [{"key": f"k{i}".encode(), "value": b"x" * (4_000 if i == 1 else 10),
                "timestamp": now, "headers": [
                    (envelope.TARGET, (small if i == 1 else wide).encode()),
                    (envelope.DELAY_MS, b"100")]}
               for i in range(3)]
    produce(bootstrap, deployment.requests, records)
    out = collector([small, wide, deployment.settings.dlq_topic])
    service = running(deployment, clock)
    service.add()

    def settled() -> bool:
        out.poll()
        return len(out.messages) >= 3

    service.until(settled, advance_ms=200)
    assert sorted(m.key() or b"" for m in out.on(wide)) == [b"k0", b"k2"]
    assert out.on(small) == []
    [dead] = out.on(deployment.settings.dlq_topic)
    assert dead.key() == b"k1"
    assert header(dead, envelope.ERROR) == b"undeliverable"
    assert b"2 attempts" in (header(dead, envelope.ERROR_DETAIL) or b"")


@pytest.mark.parametrize("guarantee", [Guarantee.AT_LEAST_ONCE])
def test_a_changelog_batch_the_broker_refuses_stops_the_service_with_its_code(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
) -> None:
    """At-least-once asks for the report of a plan's last changelog put only; its
    changelog producer is gapless, so a batch of puts the broker refuses for good
    (larger than the changelog's ``max.message.bytes``) ends the service with
    ``changelog-write-failed`` and the broker's reason."""
    deployment = deployment_factory(partitions=1, changelog_config={"max.message.bytes": "1000"})
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    produce(bootstrap, deployment.requests,
            [request(target, i, clock.now_ms(), 60_000) for i in range(200)])
    instances = running(deployment, clock)
    service = instances.add()
    with pytest.raises(ServiceError) as raised:
        instances.until(lambda: False, timeout_s=60, advance_ms=10)
    assert raised.value.code == "changelog-write-failed"
    assert deployment.settings.changelog_topic in str(raised.value)
    assert "too large" in str(raised.value)
    # The close's drain meets the reports of the plans written after the refused one,
    # if any were: whether it does depends on how the 200 requests fell into steps.
    raised_again: list[str] = []
    try:
        service.close()
    except ServiceError as again:
        raised_again.append(again.code)
    assert raised_again in ([], ["changelog-write-failed"])
    callbacks.drain_errors()  # raised in the revoke callback of that close: seen above


@pytest.mark.parametrize("guarantee", [Guarantee.EXACTLY_ONCE])
def test_a_crash_between_a_seal_and_the_plan_of_its_transaction_loses_no_request(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transaction carries intake's puts and, after them, delivery's seal of the same
    partition; the seal is applied to the index first. The instance dies before the puts
    are: its successor must restore them from the changelog (the index's position may not
    pass them), though the transaction already committed the requests' offsets."""
    deployment = deployment_factory(partitions=1)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    out = collector([target])
    instances = running(deployment, clock)
    first = instances.add()
    crash = {"armed": False, "sealed": False, "crashed": False}
    apply = PartitionIndex.apply

    def dying(index: PartitionIndex, changes: Changes) -> bytes | None:
        if changes.watermark is not None or changes.deletes:
            crash["sealed"] = True
        elif changes.entries() and crash["armed"] and crash["sealed"]:
            crash["crashed"] = True
            raise RuntimeError("killed between the seal and the plan")
        return apply(index, changes)

    monkeypatch.setattr(PartitionIndex, "apply", dying)
    sent = 0
    while not crash["crashed"]:  # requests keep coming due while new ones arrive
        assert sent < 2_000, "no step both sealed deliveries and applied a plan"
        produce(bootstrap, deployment.requests,
                [request(target, sent + i, clock.now_ms(), 300) for i in range(10)])
        sent += 10
        crash["armed"] = sent > 100
        crash["sealed"] = False
        clock.advance(50)
        try:
            instances.step()
        except RuntimeError:
            assert crash["crashed"]
    monkeypatch.setattr(PartitionIndex, "apply", apply)
    with contextlib.suppress(Exception):  # the dead instance: only its locks must go
        instances.close(first)
    if first in instances.services:
        instances.services.remove(first)
    callbacks.drain_errors()
    instances.add()

    def delivered() -> bool:
        out.poll()
        return len({m.key() for m in out.messages}) >= sent

    instances.until(delivered, timeout_s=90, advance_ms=50)
    assert {m.key() for m in out.messages} == {f"k{i}".encode() for i in range(sent)}
    assert len(out.messages) == sent, "exactly once"
