"""Keyed records land where a Java producer would put them, so per-key order holds.

The expected partition comes from a port of the Java client's
``Utils.murmur2`` kept here, checked against the vectors of Kafka's own
``UtilsTest.testMurmur2``: an oracle independent of librdkafka.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]

M = 0x5BD1E995
MASK = 0xFFFFFFFF


def java_murmur2(data: bytes) -> int:
    """``org.apache.kafka.common.utils.Utils.murmur2``: a signed 32-bit hash."""
    h = (0x9747B28C ^ len(data)) & MASK
    whole = len(data) - len(data) % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * M) & MASK
        k ^= k >> 24
        k = (k * M) & MASK
        h = ((h * M) & MASK) ^ k
    tail = data[whole:]
    if tail:
        for i in reversed(range(len(tail))):
            h ^= tail[i] << (8 * i)
        h = (h * M) & MASK
    h ^= h >> 13
    h = (h * M) & MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def java_partition(key: bytes, partitions: int) -> int:
    """The partition the Java default partitioner picks for a keyed record."""
    return (java_murmur2(key) & 0x7FFFFFFF) % partitions


@pytest.mark.parametrize(("data", "expected"), [
    (b"21", -973932308), (b"foobar", -790332482), (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829), (b"abc", 479470107),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
])
def test_the_oracle_matches_kafkas_own_vectors(data: bytes, expected: int) -> None:
    assert java_murmur2(data) == expected


@pytest.mark.kafka
def test_a_keyed_record_without_a_target_partition_lands_where_java_puts_it(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=3)
    target = topic_factory("target", 7)
    clock = ManualClock(int(time.time() * 1000))
    keys = [f"customer-{i}".encode() for i in range(80)]
    produce(bootstrap, deployment.requests, [
        {"key": key, "value": b"v", "partition": i % 3, "timestamp": clock.now_ms(),
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"0")]}
        for i, key in enumerate(keys)])
    out = collector([target])
    service = running(deployment, clock)
    service.add()
    service.until(lambda: out.poll() >= len(keys), advance_ms=10)
    placed = {m.key(): m.partition() for m in out.messages}
    assert placed == {key: java_partition(key, 7) for key in keys}
