"""Lanes on the real broker: one deployment, two environments, no request crossing over."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
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
    delivered = [metrics.lane_delivered.labels(lane=lane) for lane in ("dev1", "dev2")]
    refusals = metrics.dead_lettered.labels(reason="wrong-lane")

    def by_lane() -> dict[tuple[str, str], float]:
        return {(s.labels["lane"], s.labels["reason"]): s.value
                for family in metrics.lane_refused.collect() for s in family.samples
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
