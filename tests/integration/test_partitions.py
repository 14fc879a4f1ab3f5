"""Partitions that move: a second instance, a lost state directory, a failing target."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from tests.conftest import TopicFactory
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
