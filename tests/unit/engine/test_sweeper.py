"""The sweeper writes the tombstones of covered puts, a batch at a time, off the hot path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Message

from kdelay.engine import sweeper as sweeper_module
from kdelay.engine.metrics import Metrics
from kdelay.engine.sweeper import SWEEP_BATCH, SWEEP_TRICKLE, Sweeper
from kdelay.plumbing.clients import Report
from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.protocol.envelope import Headers
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import PartitionIndex

CHANGELOG = "kdelay.changelog"


class OnlyErrors:
    """A producer that reports failures only, as with ``delivery.report.only.error``."""

    def __init__(self) -> None:
        self.queued: list[tuple[int, bytes | None, Report]] = []
        self.sent: list[tuple[int, bytes | None, bytes | None]] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                partition: int = -1, callback: Report | None = None,
                on_delivery: Report | None = None, timestamp: int = 0,
                headers: Headers | None = None) -> None:
        on_delivery = on_delivery or callback
        assert topic == CHANGELOG
        assert on_delivery is not None
        self.queued.append((partition, key, on_delivery))
        self.sent.append((partition, key, value))

    def land(self, error: KafkaError | None = None) -> None:
        queued, self.queued = self.queued, []
        for partition, key, report in queued:
            if error is not None:
                report(error, Message(topic=CHANGELOG, partition=partition, key=key))

    def poll(self, timeout: float = -1) -> int:
        return 0

    def flush(self, timeout: float = -1) -> int:
        return len(self.queued)

    def __len__(self) -> int:
        return len(self.queued)

    def list_topics(self, topic: str, timeout: float = -1) -> object:
        raise NotImplementedError


@pytest.fixture
def index(tmp_path: Path) -> Iterator[PartitionIndex]:
    idx = PartitionIndex(tmp_path / "p0", 0)
    yield idx
    idx.close()


def keys(count: int) -> list[bytes]:
    return [codec.encode_due_key(1_000, 0, offset) for offset in range(count)]


def test_covered_keys_get_tombstones_and_leave_the_sweep_list_once_landed(
        index: PartitionIndex) -> None:
    covered = keys(3)
    index.apply(Changes(swept=covered))
    producer, metrics = OnlyErrors(), Metrics()
    sweeper = Sweeper(producer, CHANGELOG, metrics)
    sweeper.step({0: index}, busy=False)
    assert producer.sent == [(0, key, None) for key in covered]
    sweeper.step({0: index}, busy=False)
    assert len(producer.sent) == 3, "nothing more until the batch landed"
    producer.land()
    sweeper.step({0: index}, busy=False)
    index.rewind_sweep()
    assert index.unswept(10) == []
    assert metrics.registry.get_sample_value("kdelay_swept_records_total") == 3


def test_a_sweep_takes_whole_chunks(index: PartitionIndex,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweeper_module, "BACKLOG_LIMIT", 0)
    index.apply(Changes(swept=keys(3)))
    index.apply(Changes(swept=keys(7)[3:]))
    producer = OnlyErrors()
    Sweeper(producer, CHANGELOG, Metrics()).step({0: index}, busy=True)
    assert len(producer.sent) == 7, "the trickle is reached within the chunks"


def test_a_step_sweeps_one_batch_in_all_partitions_and_says_while_more_is_left(
        tmp_path: Path) -> None:
    """A sweep is a few milliseconds of the loop's step, whatever the partitions hold
    (after a burst, a million keys): the rest waits for the next steps."""
    indexes = {p: PartitionIndex(tmp_path / f"p{p}", p) for p in (0, 1)}
    try:
        for index in indexes.values():
            for start in range(0, SWEEP_BATCH, 100):
                index.apply(Changes(swept=keys(SWEEP_BATCH)[start : start + 100]))
        producer = OnlyErrors()
        sweeper = Sweeper(producer, CHANGELOG, Metrics())
        assert sweeper.waiting(indexes)
        sweeper.step(indexes, busy=False)
        assert len(producer.sent) == SWEEP_BATCH, "one batch, not one per partition"
        for _ in range(4):
            producer.land()
            sweeper.step(indexes, busy=False)
        assert len(producer.sent) == 2 * SWEEP_BATCH
        assert not sweeper.waiting(indexes), "all swept and landed"
    finally:
        for index in indexes.values():
            index.close()


def test_while_deliveries_are_due_nothing_is_swept_below_the_backlog_limit(
        index: PartitionIndex, monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst is not slowed down by the sweep; a load that never lets up still is,
    a little, once a partition's sweep list is past its limit."""
    for start in range(0, 3 * SWEEP_TRICKLE, 10):
        index.apply(Changes(swept=keys(3 * SWEEP_TRICKLE)[start : start + 10]))
    assert index.sweep_backlog == 3 * SWEEP_TRICKLE
    producer = OnlyErrors()
    sweeper = Sweeper(producer, CHANGELOG, Metrics())
    sweeper.step({0: index}, busy=True)
    assert producer.sent == []
    monkeypatch.setattr(sweeper_module, "BACKLOG_LIMIT", SWEEP_TRICKLE)
    sweeper.step({0: index}, busy=True)
    assert len(producer.sent) == SWEEP_TRICKLE
    producer.land()
    sweeper.step({0: index}, busy=True)
    assert index.sweep_backlog == 2 * SWEEP_TRICKLE


def test_a_failed_batch_is_swept_again(index: PartitionIndex) -> None:
    index.apply(Changes(swept=keys(2)))
    producer, metrics = OnlyErrors(), Metrics()
    sweeper = Sweeper(producer, CHANGELOG, metrics)
    sweeper.step({0: index}, busy=False)
    producer.land(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied"))
    sweeper.step({0: index}, busy=False)
    assert metrics.registry.get_sample_value("kdelay_changelog_errors_total") == 2
    sweeper.step({0: index}, busy=False)
    assert [key for _, key, _ in producer.sent] == keys(2) * 2


def test_a_key_put_again_gets_no_tombstone(index: PartitionIndex) -> None:
    again, other = keys(2)
    index.apply(Changes(swept=[again, other]))
    index.apply(Changes(puts=[Entry(again, IndexValue(Fingerprint(1, 2), None))]))
    producer = OnlyErrors()
    sweeper = Sweeper(producer, CHANGELOG, Metrics())
    sweeper.step({0: index}, busy=False)
    assert [key for _, key, _ in producer.sent] == [other]
    producer.land()
    sweeper.step({0: index}, busy=False)
    index.rewind_sweep()
    assert index.unswept(10) == [], "out of the sweep list either way"


def test_drain_sweeps_until_nothing_is_left(index: PartitionIndex) -> None:
    index.apply(Changes(swept=keys(7)))

    class Landing(OnlyErrors):
        def poll(self, timeout: float = -1) -> int:
            self.land()
            return 0

    producer = Landing()
    assert Sweeper(producer, CHANGELOG, Metrics()).drain({0: index}, 5.0)
    assert len(producer.sent) == 7
