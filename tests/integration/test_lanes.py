"""Lanes on the real broker: one deployment, two environments, no request crossing over."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kdelay.client import DelayProducer
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope, idkeys
from kdelay.protocol.forward import id_partition
from kdelay.protocol.targets import Lanes
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, header, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]


def _request(target: str, key: bytes, now: int, lane: bytes | None = None,
             delay_ms: int = 100) -> dict[str, Any]:
    headers = [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, str(delay_ms).encode())]
    if lane is not None:
        headers.append((envelope.LANE, lane))
    return {"key": key, "value": b"v-" + key, "timestamp": now, "headers": headers}


def _lanes() -> tuple[Lanes, str, str]:
    """Two lanes whose prefixes no other test's topics share."""
    run = uuid.uuid4().hex[:8]
    first, second = f"dev1-{run}.", f"dev2-{run}."
    return Lanes({"dev1": first, "dev2": second}), first, second


def test_each_lanes_requests_reach_only_its_own_targets(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    lanes, first, second = _lanes()
    deployment = deployment_factory(partitions=1, lanes=lanes)
    settings = deployment.settings
    one, two = topic_factory(f"{first}orders", 1), topic_factory(f"{second}orders", 1)
    shared = topic_factory("shared", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    records = [
        _request(one, b"dev1-own", now, b"dev1"),
        _request(two, b"dev2-own", now, b"dev2"),
        _request(two, b"dev1-to-dev2", now, b"dev1"),
        _request(one, b"dev2-to-dev1", now, b"dev2"),
        _request(shared, b"dev1-to-shared", now, b"dev1"),
        _request(one, b"none-to-dev1", now),
        _request(one, b"prod-to-dev1", now, b"prod"),
        _request(shared, b"none-to-shared", now),
    ]
    produce(bootstrap, settings.requests_topic, records)
    out = collector([one, two, shared, settings.dlq_topic])
    service = running(deployment, clock)
    service.add()
    service.until(lambda: out.poll() >= len(records), advance_ms=50)
    out.poll(0.5)

    assert [m.key() for m in out.on(one)] == [b"dev1-own"]
    assert [m.key() for m in out.on(two)] == [b"dev2-own"]
    assert [m.key() for m in out.on(shared)] == [b"none-to-shared"]
    dead = {m.key(): header(m, envelope.ERROR) for m in out.on(settings.dlq_topic)}
    assert dead == {b"dev1-to-dev2": b"wrong-lane", b"dev2-to-dev1": b"wrong-lane",
                    b"dev1-to-shared": b"wrong-lane", b"none-to-dev1": b"missing-lane",
                    b"prod-to-dev1": b"unknown-lane"}
    for message in out.on(settings.dlq_topic):  # intact, lane included, so it can be re-sent
        assert message.value() == b"v-" + (message.key() or b"")
    metrics = service.services[0].metrics
    delivered = [metrics.delivery.lane_delivered.labels(lane=lane) for lane in ("dev1", "dev2")]
    refusals = metrics.dead_lettered.labels(reason="wrong-lane")

    def by_lane() -> dict[tuple[str, str], float]:
        return {(s.labels["lane"], s.labels["reason"]): s.value
                for family in metrics.intake.lane_refused.collect() for s in family.samples
                if s.name.endswith("_total")}

    # Counted once reports are settled and batches applied, which may follow the arrivals.
    service.until(lambda: sum(by_lane().values()) >= 5
                  and all(count._value.get() >= 1 for count in delivered))
    assert [count._value.get() for count in delivered] == [1, 1]
    assert refusals._value.get() == 3
    assert by_lane() == {("dev1", "wrong-lane"): 2, ("dev2", "wrong-lane"): 1,
                         ("(none)", "missing-lane"): 1, ("(unknown)", "unknown-lane"): 1}

def test_an_entry_indexed_before_lanes_were_configured_is_refused_when_due(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    lanes, first, _ = _lanes()
    deployment = deployment_factory(partitions=1)
    settings = deployment.settings
    target = topic_factory(f"{first}orders", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    produce(bootstrap, settings.requests_topic, [
        _request(target, b"lane-less", now, delay_ms=60_000),
        _request(target, b"dev1", now, b"dev2", delay_ms=60_000)])
    before = running(deployment, clock)
    service = before.add()
    # Without lanes, the lane-less request is indexed and the laned one refused.
    out = collector([target, settings.dlq_topic])
    before.until(lambda: out.poll() >= 1 and service.indexes[0].first_key() is not None)
    before.close()
    after = running(deployment, clock)
    after.add(lanes=lanes)
    clock.advance(60_000)
    after.until(lambda: out.poll() >= 2)
    out.poll(0.5)
    assert not out.on(target)
    dead = {m.key(): header(m, envelope.ERROR) for m in out.on(settings.dlq_topic)}
    assert dead == {b"dev1": b"unknown-lane", b"lane-less": b"missing-lane"}
    [refused] = [m for m in out.on(settings.dlq_topic) if m.key() == b"lane-less"]
    assert refused.value() == b"v-lane-less"
    assert header(refused, envelope.TARGET) == target.encode()


def test_an_id_is_unique_within_its_lane_forwarded_answered_and_restored(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, tmp_path: Path,
) -> None:
    lanes, first, second = _lanes()
    deployment = deployment_factory(partitions=3, lanes=lanes)
    settings = deployment.settings
    one, two = topic_factory(f"{first}orders", 1), topic_factory(f"{second}orders", 1)
    shared = topic_factory("shared", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    sid = f"order-{uuid.uuid4().hex[:8]}"
    home = id_partition(sid, 3)
    away = (home + 1) % 3

    def scheduled(target: str, key: bytes, lane: bytes | None, partition: int) -> dict[str, Any]:
        record = _request(target, key, now, lane, delay_ms=60_000)
        record["headers"].append((envelope.SCHEDULE_ID, sid.encode()))
        return {**record, "partition": partition}

    # The same id in dev1 (written off its home: forwarded), dev2 and no lane: three
    # schedules; dev1's again is its duplicate only.
    produce(bootstrap, settings.requests_topic, [
        scheduled(one, b"dev1", b"dev1", away), scheduled(two, b"dev2", b"dev2", home),
        scheduled(shared, b"none", None, away), scheduled(one, b"dev1-again", b"dev1", home)])
    out = collector([one, two, shared, settings.outcomes_topic])
    group = running(deployment, clock)
    group.add()
    group.until(lambda: out.poll() >= 0 and len(out.on(settings.outcomes_topic)) >= 4)

    # dev1's cancel, forwarded, reaches dev1's schedule only; dev2's reschedule, by
    # the client library on the id's home, moves dev2's; the lane-less stands.
    produce(bootstrap, settings.requests_topic, [{
        "value": sid.encode(), "partition": away, "timestamp": now,
        "headers": [(envelope.CANCEL, sid.encode()), (envelope.LANE, b"dev1")]}])
    with DelayProducer(settings, lane="dev2", clock=clock) as producer:
        ticket = producer.reschedule(sid, due=now + 1_000)
        group.until(lambda: out.poll() >= 0 and len(out.on(settings.outcomes_topic)) >= 6)
        assert ticket.outcome(timeout=10).outcome == "rescheduled"
    clock.advance(2_000)
    group.until(lambda: out.poll() >= 0 and bool(out.on(two)))
    out.poll(0.5)
    assert [m.key() for m in out.on(two)] == [b"dev2"]
    assert not out.on(one)
    assert not out.on(shared)

    answers = [(m.key(), idkeys.decode_answer(m.value() or b""))
               for m in out.on(settings.outcomes_topic)]
    by_request = {(a.lane, a.outcome) for _, a in answers}
    assert by_request == {("dev1", "scheduled"), ("dev2", "scheduled"), (None, "scheduled"),
                          ("dev1", "duplicate"), ("dev1", "cancelled"), ("dev2", "rescheduled")}
    for key, answer in answers:
        assert key == idkeys.outcome_key(sid, answer.lane)
        assert answer.schedule_id == sid
    assert {m.partition() for m in out.on(settings.outcomes_topic)} == {
        id_partition(sid, deployment.partitions)}

    # A rebuilt index (another state dir, restored from the changelog) keeps the three
    # apart: each lane's ended id answers its own duplicate, the lane-less one is pending.
    group.close()
    rebuilt = running(deployment, clock)
    service = rebuilt.add(state_dir=tmp_path / "rebuilt")
    produce(bootstrap, settings.requests_topic, [
        scheduled(one, b"dev1-late", b"dev1", home), scheduled(two, b"dev2-late", b"dev2", home),
        scheduled(shared, b"none-late", None, home)])
    rebuilt.until(lambda: out.poll() >= 0 and len(out.on(settings.outcomes_topic)) >= 9)
    late = [idkeys.decode_answer(m.value() or b"") for m in out.on(settings.outcomes_topic)][6:]
    assert sorted((a.lane or "", a.outcome, a.first or "") for a in late) == [
        ("", "duplicate", "pending"), ("dev1", "duplicate", "cancelled"),
        ("dev2", "duplicate", "delivered")]
    index = service.indexes[home]
    assert index.id_state(sid) is not None
    assert index.id_state(idkeys.id_key(sid, "dev1")) is not None
    clock.advance(60_000)
    rebuilt.until(lambda: out.poll() >= 0 and bool(out.on(shared)))
    out.poll(0.5)
    assert [m.key() for m in out.on(shared)] == [b"none"]
    assert not out.on(one)
