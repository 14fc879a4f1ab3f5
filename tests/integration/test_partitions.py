"""Partitions that move: a second instance, a lost state directory, a failing target."""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.cimpl import NewPartitions

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from tests.conftest import TopicFactory, wait_visible
from tests.integration.conftest import Collector, Deployment, Running, header, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]


def requests_for(target: str, count: int, now: int, spread_ms: int) -> list[dict[str, Any]]:
    return [{"key": f"k{i}".encode(), "value": f"v{i}".encode(), "timestamp": now,
             "partition": i % 3,
             "headers": [(envelope.TARGET, target.encode()),
                         (envelope.DUE_MS, str(now + (i * 37) % spread_ms).encode())]}
            for i in range(count)]


def assert_each_once_never_early(out: Collector, count: int) -> None:
    keys = Counter(m.key() for m in out.messages)
    assert sorted(k or b"" for k in keys) == sorted(f"k{i}".encode() for i in range(count))
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]
    for message in out.messages:
        due = int(header(message, envelope.DUE_MS) or b"0")
        assert message.timestamp()[1] >= due


def test_two_instances_split_partitions_and_a_rebalance_loses_nothing(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, tmp_path: Path,
) -> None:
    deployment = deployment_factory(partitions=3)
    target = topic_factory("target", 3)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    produce(bootstrap, deployment.requests, requests_for(target, 300, now + 1_000, 20_000))
    out = collector([target])
    group = running(deployment, clock)
    first = group.add(state_dir=tmp_path / "a")
    group.until(lambda: len(first.owned()) == 3)
    second = group.add(state_dir=tmp_path / "b")
    group.until(lambda: len(first.owned()) + len(second.owned()) == 3
                and bool(first.owned()) and bool(second.owned()))
    assert set(first.owned()).isdisjoint(second.owned())
    group.until(lambda: out.poll() >= 100, advance_ms=20)
    group.close(second)
    group.until(lambda: len(first.owned()) == 3)
    group.until(lambda: out.poll() >= 300, advance_ms=50)
    out.poll(1.0)
    assert_each_once_never_early(out, 300)


def test_lost_state_directory_is_rebuilt_from_the_changelog(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=3)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    produce(bootstrap, deployment.requests, requests_for(target, 200, now + 1_000, 10_000))
    out = collector([target])
    group = running(deployment, clock)
    service = group.add()
    group.until(lambda: out.poll() >= 50, advance_ms=20)
    group.close(service)
    shutil.rmtree(deployment.settings.state_dir)
    restarted = group.add()
    group.until(lambda: out.poll() >= 200, advance_ms=50)
    out.poll(1.0)
    assert_each_once_never_early(out, 200)
    restored = restarted.metrics.registry.get_sample_value(
        "kdelay_restored_changelog_records_total")
    assert restored is not None
    assert restored > 0


def test_failing_target_is_retried_then_dead_lettered_without_blocking_others(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=1, delivery_attempts=2, delivery_timeout_ms=1_500)
    good = topic_factory("good", 1)
    missing = f"missing-{good}"
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()

    def to(target: str, key: bytes, due: int) -> dict[str, Any]:
        return {"key": key, "value": key + b"-payload", "timestamp": now, "headers": [
            (envelope.TARGET, target.encode()), (envelope.DUE_MS, str(due).encode()),
            ("user", b"kept")]}

    produce(bootstrap, deployment.requests, [
        to(missing, b"lost-target", now), to(good, b"early", now + 10), to(good, b"late", now + 20),
    ])
    out = collector([good, deployment.settings.dlq_topic])
    group = running(deployment, clock)
    group.add()
    group.until(lambda: len(out.on(good)) >= 2 or out.poll() < 0, advance_ms=5)
    assert out.on(deployment.settings.dlq_topic) == []
    group.until(lambda: out.poll() >= 3, advance_ms=200)
    [dead] = out.on(deployment.settings.dlq_topic)
    assert header(dead, envelope.ERROR) == b"undeliverable"
    assert b"2 attempts" in (header(dead, envelope.ERROR_DETAIL) or b"")
    assert dead.key() == b"lost-target"
    assert dead.value() == b"lost-target-payload"
    assert header(dead, "user") == b"kept"


def test_partitions_added_to_the_requests_topic_are_reported_not_served(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, caplog: pytest.LogCaptureFixture,
) -> None:
    # A fast metadata refresh makes the group notice the new partition (and
    # rebalance) within the test; the service's own check runs on its clock.
    deployment = deployment_factory(
        partitions=1, kafka_config={"topic.metadata.refresh.interval.ms": "1000"})
    settings = deployment.settings
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    run = running(deployment, clock)
    service = run.add()
    run.until(lambda: service.owned() == [0])
    deployment.admin.create_partitions(
        [NewPartitions(settings.requests_topic, 2)])[settings.requests_topic].result(timeout=30)
    wait_visible(deployment.admin, settings.requests_topic, 2)
    now = clock.now_ms()
    headers = [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"100")]
    produce(bootstrap, settings.requests_topic, [
        {"key": b"p0", "value": b"v", "headers": headers, "timestamp": now, "partition": 0},
        {"key": b"p1", "value": b"v", "headers": headers, "timestamp": now, "partition": 1}])
    out = collector([target, settings.dlq_topic])
    gauges = service.metrics.registry

    def reported() -> bool:
        out.poll()
        return (gauges.get_sample_value("kdelay_unserved_request_partitions") == 1
                and bool(out.on(target)))

    with caplog.at_level(logging.ERROR):
        run.until(reported, advance_ms=1_000, timeout_s=60)
        run.step(20)
    out.poll(1.0)
    assert [m.key() for m in out.messages] == [b"p0"], "partition 1 is not served, not DLQed"
    assert service.owned() == [0]
    assert gauges.get_sample_value("kdelay_request_partitions") == 2
    errors = [r.getMessage() for r in caplog.records
              if "error[requests-partitions-added]" in r.getMessage()]
    assert len(errors) == 1, errors
    assert settings.changelog_topic in errors[0]
    assert "--partitions 2" in errors[0]
