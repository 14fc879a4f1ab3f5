"""Which topics kdelay delivers to: never its own, and only allowed ones when told so."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka.cimpl import NewTopic

from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import WORKER_RESERVED_TOPICS, Settings
from kdelay.protocol import codec, envelope
from tests.conftest import TopicFactory, wait_visible
from tests.integration.conftest import Collector, Deployment, Running, header, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]


def _request(target: str, key: bytes, value: bytes, now: int) -> dict[str, Any]:
    return {"key": key, "value": value, "timestamp": now,
            "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"100")]}


def test_kdelay_never_delivers_to_its_own_topics(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=1)
    settings = deployment.settings
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    # A consumed marker forged into the changelog would make a rebuilt index skip
    # (or re-read) requests; a request looping into the requests topic would
    # schedule itself again.
    own = [settings.changelog_topic, settings.requests_topic, settings.dlq_topic,
           *WORKER_RESERVED_TOPICS, "__consumer_offsets"]
    records = [_request(topic, codec.CONSUMED_MARKER, codec.encode_offset(10**6), now)
               for topic in own]
    records.append(_request(target, b"good", b"ok", now))
    produce(bootstrap, settings.requests_topic, records)
    out = collector([target, settings.dlq_topic, settings.changelog_topic,
                     settings.requests_topic])
    service = running(deployment, clock)
    service.add()

    def settled() -> bool:
        out.poll()
        return (len(out.on(settings.dlq_topic)) >= len(own) and bool(out.on(target))
                and len(out.on(settings.requests_topic)) >= len(records))

    service.until(settled, advance_ms=50)
    out.poll(0.5)
    assert sorted(header(m, envelope.TARGET) or b"" for m in out.on(settings.dlq_topic)) == \
        sorted(t.encode() for t in own)
    assert {header(m, envelope.ERROR) for m in out.on(settings.dlq_topic)} == {
        b"forbidden-target"}
    assert not [m for m in out.on(settings.changelog_topic)
                if header(m, envelope.ORIGIN) is not None]
    assert len(out.on(settings.requests_topic)) == len(records)
    assert [m.key() for m in out.on(target)] == [b"good"]
    refusals = service.services[0].metrics.dead_lettered.labels(reason="forbidden-target")
    # Counted once the batch is applied, which may follow the DLQ record's arrival.
    service.until(lambda: refusals._value.get() >= len(own))
    assert refusals._value.get() == len(own)


def test_kdelays_own_topics_are_refused_under_the_names_in_force(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    # The worker runs under other names than the defaults: the service, given the same
    # settings, refuses those names (and its renamed outcomes topic, made by the factory).
    run = uuid.uuid4().hex[:8]
    deployment = deployment_factory(partitions=1, series_cancels_topic=f"acme-{run}.stops",
                                    worker_dlq_topic=f"acme-{run}.failed")
    settings = deployment.settings
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    own = [settings.outcomes_topic, settings.series_cancels_topic, settings.worker_dlq_topic]
    records = [_request(topic, b"forged", b"x", now) for topic in own]
    records.append(_request(target, b"good", b"ok", now))
    produce(bootstrap, settings.requests_topic, records)
    out = collector([target, settings.dlq_topic, settings.outcomes_topic])
    service = running(deployment, clock)
    service.add()
    service.until(lambda: out.poll() >= 0 and len(out.on(settings.dlq_topic)) >= len(own)
                  and bool(out.on(target)), advance_ms=50)
    out.poll(0.5)
    dead = out.on(settings.dlq_topic)
    assert sorted(header(m, envelope.TARGET) or b"" for m in dead) == \
        sorted(t.encode() for t in own)
    assert {header(m, envelope.ERROR) for m in dead} == {b"forbidden-target"}
    assert not out.on(settings.outcomes_topic)
    assert [m.key() for m in out.on(target)] == [b"good"]


def test_allowed_targets_restrict_where_requests_go(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    allowed = topic_factory("orders", 1)
    by_regex = topic_factory("billing", 1)
    other = topic_factory("payroll", 1)
    deployment = deployment_factory(partitions=1,
                                    allowed_targets=("orders-*", r"re:billing-[0-9a-f]+"))
    settings = deployment.settings
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    records = [_request(allowed, b"a", b"1", now), _request(by_regex, b"b", b"2", now),
               _request(other, b"c", b"3", now)]
    produce(bootstrap, settings.requests_topic, records)
    out = collector([allowed, by_regex, other, settings.dlq_topic])
    service = running(deployment, clock)
    service.add()

    def settled() -> bool:
        return out.poll() >= len(records)

    service.until(settled, advance_ms=50)
    out.poll(0.5)
    assert [m.key() for m in out.on(allowed)] == [b"a"]
    assert [m.key() for m in out.on(by_regex)] == [b"b"]
    assert not out.on(other)
    dead = out.on(settings.dlq_topic)
    assert [m.key() for m in dead] == [b"c"]
    assert header(dead[0], envelope.ERROR) == b"target-not-allowed"
    assert other.encode() in (header(dead[0], envelope.ERROR_DETAIL) or b"")


def test_an_entry_indexed_before_the_allow_list_narrowed_is_refused_when_due(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    target = topic_factory("payroll", 1)
    deployment = deployment_factory(partitions=1)
    settings = deployment.settings
    clock = ManualClock(int(time.time() * 1000))
    record = _request(target, b"k", b"payload", clock.now_ms())
    record["headers"] = [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"60000")]
    produce(bootstrap, settings.requests_topic, [record])
    first = running(deployment, clock)
    service = first.add()
    first.until(lambda: bool(service.indexes) and service.indexes[0].first_key() is not None)
    first.close()
    out = collector([target, settings.dlq_topic])
    second = running(deployment, clock)
    second.add(allowed_targets=("orders.*",))
    clock.advance(60_000)
    second.until(lambda: out.poll() >= 1)
    out.poll(0.5)
    assert not out.on(target)
    [dead] = out.on(settings.dlq_topic)
    assert header(dead, envelope.ERROR) == b"target-not-allowed"
    assert (dead.key(), dead.value()) == (b"k", b"payload")


def test_a_target_created_after_its_due_time_still_gets_the_record(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    defaults = Settings()
    # The retry settings are the defaults users run with.
    deployment = deployment_factory(partitions=1, retry_backoff_ms=defaults.retry_backoff_ms,
                                    retry_backoff_max_ms=defaults.retry_backoff_max_ms)
    settings = deployment.settings
    late = f"late-{uuid.uuid4().hex[:12]}"
    clock = ManualClock(int(time.time() * 1000))
    produce(bootstrap, settings.requests_topic, [_request(late, b"k", b"v", clock.now_ms())])
    out = collector([settings.dlq_topic])
    service = running(deployment, clock)
    service.add()
    # Due 100 ms after its timestamp; the target appears a minute after that.
    for _ in range(120):
        clock.advance(500)
        service.step()
    assert out.poll(0.2) == 0, "dead-lettered while the target may still appear"
    assert service.services[0].metrics.delivery.retries._value.get() > 0
    deployment.admin.create_topics([NewTopic(late, 1, 1)])[late].result(timeout=30)
    try:
        wait_visible(deployment.admin, late, 1)
        target = collector([late])
        service.until(lambda: target.poll() >= 1, advance_ms=1_000)
        out.poll(0.5)
        assert [m.key() for m in target.messages] == [b"k"]
        assert out.messages == []
    finally:
        deployment.admin.delete_topics([late])[late].result(timeout=30)
