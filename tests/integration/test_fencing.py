"""Zombies: an instance that lost its partitions must not deliver or commit for them."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Guarantee
from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]


def _joined(bootstrap: str, group: str, topic: str) -> Consumer:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    return consumer


def test_a_transaction_with_a_stale_group_generation_cannot_commit(
    topic_factory: TopicFactory, bootstrap: str,
) -> None:
    source, sink = topic_factory("src", 2), topic_factory("sink", 1)
    produce(bootstrap, source, [{"value": b"x", "partition": p} for p in (0, 1)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    zombie = _joined(bootstrap, group, source)
    deadline = time.monotonic() + 30
    while not zombie.assignment() and time.monotonic() < deadline:
        zombie.consume(10, timeout=0.2)
    stale = zombie.consumer_group_metadata()
    newcomer = _joined(bootstrap, group, source)
    while not newcomer.assignment() and time.monotonic() < deadline:
        zombie.consume(10, timeout=0.1)
        newcomer.consume(10, timeout=0.1)
    assert newcomer.assignment(), "the group never rebalanced"
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{group}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(sink, value=b"zombie write")

    def commit_as_zombie() -> None:
        producer.send_offsets_to_transaction([TopicPartition(source, 0, 1)], stale, 30)
        producer.commit_transaction(30)

    with pytest.raises(KafkaException):
        commit_as_zombie()
    producer.abort_transaction(30)
    seen = Collector(bootstrap, [sink])
    try:
        seen.poll(3.0)
        assert seen.messages == [], "a fenced transaction must not become visible"
    finally:
        seen.close()
        zombie.close()
        newcomer.close()


@pytest.mark.parametrize("guarantee", [Guarantee.EXACTLY_ONCE])  # fencing is an EOS property
def test_an_instance_frozen_past_its_poll_interval_delivers_nothing_twice(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, tmp_path: Path, guarantee: Guarantee,
) -> None:
    config = {"session.timeout.ms": "6000", "max.poll.interval.ms": "6000",
              "heartbeat.interval.ms": "500"}
    deployment = deployment_factory(partitions=2, kafka_config=config)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    now = clock.now_ms()
    records: list[dict[str, Any]] = [
        {"key": f"k{i}".encode(), "value": b"v", "timestamp": now, "partition": i % 2,
         "headers": [(envelope.TARGET, target.encode()),
                     (envelope.DUE_MS, str(now + 200 * i).encode())]}
        for i in range(100)]
    produce(bootstrap, deployment.requests, records)
    out = collector([target])
    group = running(deployment, clock)
    zombie = group.add(state_dir=tmp_path / "zombie")
    group.until(lambda: len(zombie.owned()) == 2)
    group.until(lambda: out.poll() >= 10, advance_ms=50)
    survivor = group.add(state_dir=tmp_path / "survivor")
    group.services.remove(zombie)  # frozen: not stepped past its poll interval
    group.until(lambda: len(survivor.owned()) == 2, timeout_s=60)
    group.until(lambda: out.poll() >= 60, advance_ms=50)
    group.services.append(zombie)  # thaws: must learn it lost its partitions, not deliver
    group.until(lambda: out.poll() >= 100, advance_ms=50)
    out.poll(2.0)
    keys = Counter(m.key() for m in out.messages)
    assert len(keys) == 100
    assert max(keys.values()) == 1
