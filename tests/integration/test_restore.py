"""`kdelay restore`: rebuild local indexes from the changelog, from the command line."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.engine import service as service_module
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import Fingerprint, IdState, IndexValue
from kdelay.state import changelog
from kdelay.state.changelog import Restorer
from kdelay.state.index import CHANGELOG, CONSUMED, PartitionIndex
from kdelay.state.statedir import store_path
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]


def _args(deployment: Deployment) -> list[str]:
    s = deployment.settings
    return ["--bootstrap-servers", s.bootstrap_servers, "--requests-topic", s.requests_topic,
            "--changelog-topic", s.changelog_topic, "--dlq-topic", s.dlq_topic,
            "--state-dir", str(s.state_dir)]


def _pending_in(service: Service) -> list[bytes]:
    """The due keys of the service's index of partition 0 (none when it does not own it)."""
    index = service.indexes.get(0)
    return [] if index is None else [entry.key for entry in index.entries()]


def _pending(deployment: Deployment, partition: int) -> list[bytes]:
    s = deployment.settings
    index = PartitionIndex(store_path(s.state_dir, s.requests_topic, partition), partition)
    try:
        return [entry.key for entry in index.entries()]
    finally:
        index.close()


@pytest.mark.compat
def test_restore_fresh_rebuilds_what_the_service_indexed(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=2)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    records: list[dict[str, Any]] = [
        {"key": f"k{i}".encode(), "value": b"v", "timestamp": clock.now_ms(), "partition": i % 2,
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"3600000")]}
        for i in range(40)]
    produce(bootstrap, deployment.requests, records)
    group = running(deployment, clock)
    service = group.add()
    group.until(lambda: (service.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": "scheduled"}) or 0) >= 40)
    group.close(service)
    before = {p: _pending(deployment, p) for p in (0, 1)}
    assert sum(len(keys) for keys in before.values()) == 40

    result = CliRunner().invoke(app, ["restore", "--fresh", *_args(deployment)])

    assert result.exit_code == 0, result.output
    assert "partition 0:" in result.output
    assert "partition 1:" in result.output
    assert {p: _pending(deployment, p) for p in (0, 1)} == before


def test_restore_refuses_a_store_that_is_in_use(deployment_factory: Make) -> None:
    deployment = deployment_factory(partitions=1)
    s = deployment.settings
    holder = PartitionIndex(store_path(s.state_dir, s.requests_topic, 0), 0)
    try:
        result = CliRunner().invoke(app, ["restore", "--fresh", *_args(deployment)])
        assert result.exit_code == 2
        assert "error[state-dir-in-use]" in result.output
    finally:
        holder.close()


T0 = 1_700_000_000_000


def _put(key: bytes, crc: int, schedule_id: str | None = None) -> dict[str, Any]:
    value = codec.encode_index_value(IndexValue(Fingerprint(T0, crc), schedule_id))
    return {"key": key, "value": value, "partition": 0}


def _tombstone(key: bytes) -> dict[str, Any]:
    return {"key": key, "value": None, "partition": 0}


def test_restorer_replays_tombstones_ids_and_offsets_and_catches_up(
    topic_factory: TopicFactory, bootstrap: str, tmp_path: Path,
) -> None:
    topic = topic_factory("changelog", 1, {"cleanup.policy": "compact"})
    k1, k2, k3, k4 = (codec.encode_due_key(T0 + i, 0, i) for i in (40, 10, 30, 20))
    produce(bootstrap, topic, [
        _put(k1, 1, "a"), _put(k2, 2), _tombstone(k1), _put(k3, 3, "b"),
        {"key": codec.CONSUMED_MARKER, "value": codec.encode_offset(7), "partition": 0},
        _put(k1, 11, "a")])
    restorer = Restorer({"bootstrap.servers": bootstrap}, topic)
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        assert restorer.restore(index) == 4, "k1, k2, k3 and the marker"
        assert [e.key for e in index.entries()] == [k2, k3, k1]
        assert index.id_state("a") == IdState(k1, None)
        assert (index.offset(CONSUMED), index.offset(CHANGELOG)) == (7, 6)

        produce(bootstrap, topic, [_tombstone(k3), _put(k4, 4, "b"), _tombstone(k2),
                                   _tombstone(k4), _put(k2, 22)])
        assert restorer.restore(index) == 3, "k3, k4 and k2, from offset 6 on"
        assert [(e.key, e.value.fingerprint.crc) for e in index.entries()] == [(k2, 22), (k1, 11)]
        assert index.id_state("b") is None, "released by the tombstone of k4"
        assert index.id_state("a") == IdState(k1, None)
        assert (index.offset(CONSUMED), index.offset(CHANGELOG)) == (7, 11)
        assert restorer.restore(index) == 0
    finally:
        index.close()
        restorer.close()


# The broker compacts within seconds: a segment per 100 ms, cleaning at any dirt, and
# tombstones kept for 100 ms (the broker cleans every second, see tools/kafka).
COMPACT_AT_ONCE = {"delete.retention.ms": "100", "segment.ms": "100",
                   "min.cleanable.dirty.ratio": "0.01", "min.compaction.lag.ms": "0"}
HAND_OVER_MS = 3_000


def _changelog_keys(bootstrap: str, topic: str) -> set[bytes]:
    """The keys the changelog's partition 0 holds now (puts and tombstones).

    Read to the end of the partition, which the consumer reports: under
    exactly-once the last offset is a transaction marker, never handed out as a
    record, so the offset of the last record read cannot tell.
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         "enable.partition.eof": True})
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        keys: set[bytes] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for message in consumer.consume(1_000, timeout=0.5):
                error = message.error()
                if error is None:
                    keys.add(message.key() or b"")
                elif error.code() == KafkaError._PARTITION_EOF:
                    return keys
        raise AssertionError(f"the end of {topic} [0] not reached within 30 s")
    finally:
        consumer.close()


def _compact_away(bootstrap: str, topic: str, keys: set[bytes]) -> None:
    """Write unrelated tombstones until compaction has removed every record of ``keys``.

    The filler keeps the log dirty and rolls segments, so the cleaner passes again
    once the tombstones' retention is over (it removes a tombstone only then).
    """
    deadline = time.monotonic() + 90
    filler = 0
    while keys & _changelog_keys(bootstrap, topic):
        if time.monotonic() > deadline:
            raise AssertionError("the broker did not compact the changelog within 90 s")
        filler += 1
        produce(bootstrap, topic, [_tombstone(codec.encode_due_key(0, 0, 10**12 + filler))])
        time.sleep(0.5)  # the broker's cleaner runs on its own clock


def test_a_state_dir_older_than_the_changelogs_tombstones_is_rebuilt_not_resurrected(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    collector: Callable[[list[str]], Collector], tmp_path: Path,
) -> None:
    # Each instance stops and the next one (another state dir, so another static
    # member) joins: the group hands it the partition once the stopped one's
    # session times out, so a short session timeout shortens the hand-overs.
    deployment = deployment_factory(partitions=1, changelog_config=COMPACT_AT_ONCE,
                                    session_timeout_ms=HAND_OVER_MS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    produce(bootstrap, deployment.requests, [
        {"key": f"k{i}".encode(), "value": b"v", "timestamp": clock.now_ms(),
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"3600000")]}
        for i in range(5)])
    group = running(deployment, clock)
    first = group.add(state_dir=tmp_path / "first")
    group.until(lambda: len(_pending_in(first)) == 5)
    scheduled = set(_pending_in(first))
    group.close(first)

    # Another instance (another state dir) delivers everything an hour later ...
    clock.advance(3_600_000)
    out = collector([target])
    second = group.add(state_dir=tmp_path / "second")
    group.until(lambda: out.poll() >= 5)
    group.close(second)
    # ... and compaction removes the entries' puts and tombstones.
    _compact_away(bootstrap, deployment.settings.changelog_topic, scheduled)

    again = group.add(state_dir=tmp_path / "first")
    group.until(lambda: 0 in again.owned())
    for _ in range(20):
        clock.advance(1_000)
        group.step()
        out.poll()

    assert len(out.on(target)) == 5, "the first state dir brought delivered entries back"
    assert _pending_in(again) == []


# -- restores that serve partition by partition ---------------------------------------


def _gauge(service: Service, name: str, partition: int) -> float | None:
    return service.metrics.registry.get_sample_value(name, {"partition": str(partition)})


def test_each_partition_serves_once_its_own_restore_is_done(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    collector: Callable[[list[str]], Collector], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small slices, so that partition 1's restore takes many steps.
    monkeypatch.setattr(changelog, "APPLY_EVERY", 500)
    monkeypatch.setattr(changelog, "TAKE", 500)
    monkeypatch.setattr(service_module, "RESTORE_SLICE_S", 0.0)
    deployment = deployment_factory(partitions=2)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    produce(bootstrap, deployment.requests, [
        {"key": f"k{i}".encode(), "value": b"v", "timestamp": clock.now_ms(), "partition": 0,
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"60000")]}
        for i in range(5)])
    group = running(deployment, clock)
    service = group.add()
    group.until(lambda: (service.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": "scheduled"}) or 0) >= 5)
    group.close(service)
    # Partition 1's changelog holds 20 000 entries due in a day: a long restore.
    far = clock.now_ms() + 86_400_000
    produce(bootstrap, deployment.settings.changelog_topic, [
        {"key": codec.encode_due_key(far + i, 1, i),
         "value": codec.encode_index_value(IndexValue(Fingerprint(T0, i), None)), "partition": 1}
        for i in range(20_000)])
    shutil.rmtree(deployment.settings.state_dir)  # the state dir is lost
    clock.advance(61_000)  # partition 0's five are due
    seen = collector([target])
    service = group.add()
    group.until(lambda: seen.poll() >= 5, timeout_s=120)

    assert service.owned() == [0], "partition 1 is still restoring"
    group.until(lambda: _gauge(service, "kdelay_restore_remaining_records", 1) is not None)
    assert service.owned() == [0]
    assert (_gauge(service, "kdelay_restore_remaining_records", 1) or 0) > 0
    assert _gauge(service, "kdelay_restore_total_records", 1) == 20_000
    group.until(lambda: service.owned() == [0, 1], timeout_s=300)
    assert _gauge(service, "kdelay_restore_remaining_records", 1) is None, "gone when done"
    assert service.indexes[1].tally.total == 20_000
    assert len(list(service.indexes[1].entries())) == 20_000

