"""Cutting wanted offsets into sequential runs, so originals are read by range, not by seek;
and a read that finds the cluster silent gives the loop back at once."""

from __future__ import annotations

import itertools

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kdelay.state.originals import OriginalReader, flat, runs


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
