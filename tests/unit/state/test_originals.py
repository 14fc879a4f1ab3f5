"""Cutting wanted offsets into sequential runs, so originals are read by range, not by seek;
a read that finds the cluster silent gives the loop back at once; and a partition read
ahead while another lags keeps a bounded number of records."""

from __future__ import annotations

import itertools

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kdelay.state.originals import KEPT_RECORDS, OriginalReader, flat, runs


def shape(partition: int, offsets: list[int], max_gap: int) -> list[list[int]]:
    """The offsets of each run ``runs`` makes, checking the run's bookkeeping on the way."""
    result = runs(partition, offsets, max_gap)
    for run in result:
        assert run.partition == partition
        assert run.pending == run.offsets
        assert run.start == run.offsets[0]
        assert run.end == run.offsets[-1]
    return [run.offsets for run in result]


def test_no_offsets_make_no_runs() -> None:
    assert runs(0, [], 10) == []


def test_a_single_offset_is_a_run() -> None:
    assert shape(3, [42], 10) == [[42]]


def test_offsets_within_the_gap_share_a_run() -> None:
    assert shape(0, [10, 11, 15, 20], 5) == [[10, 11, 15, 20]]


def test_a_gap_larger_than_max_gap_starts_a_new_run() -> None:
    assert shape(0, [10, 11, 17, 18, 100], 5) == [[10, 11], [17, 18], [100]]


def test_a_gap_of_exactly_max_gap_does_not_split() -> None:
    assert shape(0, [0, 5, 11], 5) == [[0, 5], [11]]


def test_zero_max_gap_gives_one_run_per_offset() -> None:
    assert shape(1, [4, 5, 6], 0) == [[4], [5], [6]]


def test_duplicates_are_read_once() -> None:
    assert shape(0, [7, 7, 8, 8, 8, 50, 50], 2) == [[7, 8], [50]]


def test_unsorted_input_is_sorted_first() -> None:
    assert shape(2, [30, 3, 1, 31, 2, 12], 3) == [[1, 2, 3], [12], [30, 31]]


def test_any_iterable_is_accepted() -> None:
    assert shape(0, list(range(9, -1, -3)), 3) == [[0, 3, 6, 9]]
    assert [r.offsets for r in runs(0, iter({5, 1}), 10)] == [[1, 5]]


@pytest.mark.parametrize("max_gap", [0, 1, 2, 10, 1_000])
def test_runs_cover_every_distinct_offset_exactly_once(max_gap: int) -> None:
    offsets = [97, 3, 3, 14, 1_500, 15, 16, 2_600, 2_601, 98]
    cut = shape(0, offsets, max_gap)
    flat = [o for run in cut for o in run]
    assert flat == sorted(set(offsets))
    for left, right in itertools.pairwise(cut):
        assert right[0] - left[-1] > max_gap
    for run in cut:
        assert all(b - a <= max_gap for a, b in itertools.pairwise(run))


class SilentCluster:
    """A reader's consumer whose watermark queries find no broker."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        self.asked.append(partition.partition)
        raise KafkaException(KafkaError(KafkaError._ALL_BROKERS_DOWN, "all brokers down"))

    def unassign(self) -> None:
        pass


def test_a_read_that_finds_the_cluster_silent_says_so_and_leaves_everything_for_later() -> None:
    told: list[str] = []
    reader = OriginalReader({}, "requests", away=told.append)
    cluster = SilentCluster()
    reader._consumer = cluster  # type: ignore[assignment]
    assert flat(reader.read({0: [5, 6], 1: [7], 2: [9]})) == {}
    assert cluster.asked == [0], "one silent answer stops the read: no wait per partition"
    assert len(told) == 1
    assert "originals" in told[0]


class Record:
    """A fetched record of ``partition`` at ``offset``."""

    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def error(self) -> None:
        return None


class RacingCluster:
    """Partition 0 streams records from offset 0 on, fast; partition 1's one record
    comes only after ``lag`` of partition 0's batches. A partition let go still hands
    out the records it had queued, then nothing."""

    def __init__(self, lag: int) -> None:
        self.assigned: set[int] = set()
        self.let_go: list[int] = []
        self._next = 0
        self._lag = lag
        self._queued = 0

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        return 0, 1_000_000

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned |= {p.partition for p in partitions}

    def incremental_unassign(self, partitions: list[TopicPartition]) -> None:
        gone = {p.partition for p in partitions}
        if not gone <= self.assigned:
            raise KafkaException(KafkaError(KafkaError._INVALID_ARG, "not assigned"))
        self.assigned -= gone
        self.let_go += [p.partition for p in partitions]
        self._queued = 2_000  # records of partition 0 fetched before it was let go

    def consume(self, limit: int, timeout: float = -1) -> list[Record]:
        self._lag -= 1
        if self._lag <= 0 and 1 in self.assigned:
            return [Record(1, 5)]
        if 0 not in self.assigned:
            if not self._queued:
                return []
            self._queued -= 1
        batch = [Record(0, self._next + at) for at in range(min(limit, 500))]
        self._next += len(batch)
        return batch


def test_a_partition_done_early_keeps_a_bounded_number_of_records_while_another_lags() -> None:
    reader = OriginalReader({}, "requests", timeout_s=30.0)
    cluster = RacingCluster(lag=5 * KEPT_RECORDS)  # partition 0 races far ahead of partition 1
    reader._consumer = cluster  # type: ignore[assignment]
    found = reader.read({0: [0], 1: [5]})
    assert set(found[0]) == {0}
    assert set(found[1]) == {5}
    assert cluster.let_go == [0], "the partition that raced ahead is let go at the bound"
    assert len(reader._kept.get(0, [])) <= KEPT_RECORDS
    assert 0 not in reader._positions, "its next read assigns it anew, at its start"
