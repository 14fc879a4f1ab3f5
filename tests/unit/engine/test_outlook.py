"""The outlook gauges, on real index stores in a temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from kdelay.engine.metrics import Metrics
from kdelay.engine.outlook import Outlook
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import Layout
from kdelay.state.changes import Changes
from kdelay.state.index import PartitionIndex
from tests.unit.state.test_index import entry

NOW = 1_700_000_000_000
TOPIC = "requests"
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
SETTINGS = Settings(requests_topic=TOPIC, retention_margin_ms=HOUR_MS)
LAYOUT = Layout(partitions=2, retention_ms=DAY_MS)


class FakeWatermarks:
    """A consumer's cached high watermarks, by partition (-1001 when never fetched)."""

    def __init__(self, high: dict[int, int]) -> None:
        self.high = high
        self.cached: list[bool] = []

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        self.cached.append(cached)
        return 0, self.high.get(partition.partition, -1001)


@pytest.fixture
def indexes(tmp_path: Path) -> Iterator[dict[int, PartitionIndex]]:
    """Two empty indexes, of partitions 0 and 1."""
    made = {p: PartitionIndex(tmp_path / f"p{p}", p) for p in (0, 1)}
    yield made
    for index in made.values():
        index.close()


def value(metrics: Metrics, name: str, partition: int) -> float | None:
    return metrics.registry.get_sample_value(name, {"partition": str(partition)})


def test_due_times_overdue_count_and_age(indexes: dict[int, PartitionIndex]) -> None:
    indexes[0].apply(Changes(puts=[entry(NOW - 4_000, offset=1), entry(NOW - 1_000, offset=2),
                                   entry(NOW, offset=3), entry(NOW + 60_000, offset=4)]))
    metrics = Metrics()
    Outlook(metrics, SETTINGS, LAYOUT).refresh(NOW, indexes, {}, None)
    assert value(metrics, "kdelay_pending_earliest_due_timestamp_seconds", 0) == (
        (NOW - 4_000) / 1000)
    assert value(metrics, "kdelay_pending_latest_due_timestamp_seconds", 0) == (
        (NOW + 60_000) / 1000)
    assert value(metrics, "kdelay_overdue_oldest_age_seconds", 0) == 4.0
    assert value(metrics, "kdelay_overdue_entries", 0) == 3
    assert metrics.registry.get_sample_value("kdelay_owned_partitions") == 2
    # Partition 1 holds nothing: no due times, nothing overdue.
    assert value(metrics, "kdelay_pending_earliest_due_timestamp_seconds", 1) is None
    assert value(metrics, "kdelay_pending_latest_due_timestamp_seconds", 1) is None
    assert value(metrics, "kdelay_overdue_entries", 1) == 0
    assert value(metrics, "kdelay_overdue_oldest_age_seconds", 1) == 0


def test_nothing_due_yet_is_not_overdue(indexes: dict[int, PartitionIndex]) -> None:
    indexes[0].apply(Changes(puts=[entry(NOW + 1)]))
    metrics = Metrics()
    Outlook(metrics, SETTINGS, LAYOUT).refresh(NOW, indexes, {}, None)
    assert value(metrics, "kdelay_overdue_entries", 0) == 0
    assert value(metrics, "kdelay_overdue_oldest_age_seconds", 0) == 0


def test_overdue_count_stops_at_its_cap(indexes: dict[int, PartitionIndex]) -> None:
    indexes[0].apply(Changes(puts=[entry(NOW - 10, offset=o) for o in range(7)]))
    metrics = Metrics()
    Outlook(metrics, SETTINGS, LAYOUT, overdue_cap=5).refresh(NOW, indexes, {}, None)
    assert value(metrics, "kdelay_overdue_entries", 0) == 5


def test_delivered_entries_leave_the_outlook(indexes: dict[int, PartitionIndex]) -> None:
    first, second = entry(NOW - 2_000, offset=1), entry(NOW + 5_000, offset=2)
    indexes[0].apply(Changes(puts=[first, second]))
    metrics = Metrics()
    outlook = Outlook(metrics, SETTINGS, LAYOUT)
    outlook.refresh(NOW, indexes, {}, None)
    indexes[0].apply(Changes(deletes=[first.key]))
    outlook.refresh(NOW, indexes, {}, None)
    assert value(metrics, "kdelay_overdue_entries", 0) == 0
    assert value(metrics, "kdelay_pending_earliest_due_timestamp_seconds", 0) == (
        (NOW + 5_000) / 1000)


def test_intake_lag_from_cached_watermarks(indexes: dict[int, PartitionIndex]) -> None:
    metrics, consumer = Metrics(), FakeWatermarks({0: 120})
    Outlook(metrics, SETTINGS, LAYOUT).refresh(NOW, indexes, {0: 100, 1: 7}, consumer)
    assert value(metrics, "kdelay_intake_lag_records", 0) == 20
    # Partition 1's high watermark was never fetched: no lag series rather than a guess.
    assert value(metrics, "kdelay_intake_lag_records", 1) is None
    assert consumer.cached == [True, True]


def test_series_of_a_partition_no_longer_owned_go(indexes: dict[int, PartitionIndex]) -> None:
    indexes[1].apply(Changes(puts=[entry(NOW - 1, partition=1)]))
    metrics = Metrics()
    outlook = Outlook(metrics, SETTINGS, LAYOUT)
    outlook.refresh(NOW, indexes, {1: 3}, FakeWatermarks({1: 5}))
    assert value(metrics, "kdelay_overdue_entries", 1) == 1
    outlook.refresh(NOW, {0: indexes[0]}, {}, None)
    for name in ("kdelay_overdue_entries", "kdelay_overdue_oldest_age_seconds",
                 "kdelay_pending_earliest_due_timestamp_seconds", "kdelay_intake_lag_records"):
        assert value(metrics, name, 1) is None, name
    assert metrics.registry.get_sample_value("kdelay_owned_partitions") == 1


def test_retention_headroom_of_overdue_entries_is_exact(
        indexes: dict[int, PartitionIndex]) -> None:
    # entry(due) stamps its request 1 ms before it is due.
    indexes[0].apply(Changes(puts=[entry(NOW - 5_000, offset=1), entry(NOW - 9_000, offset=2),
                                   entry(NOW + 23 * HOUR_MS - 1_000, offset=3)]))
    metrics = Metrics()
    Outlook(metrics, SETTINGS, LAYOUT).refresh(NOW, indexes, {}, None)
    # The entry not yet due has at least 23 h - 1 s + the 1 h margin: more.
    oldest_request = NOW - 9_000 - 1
    assert value(metrics, "kdelay_retention_headroom_seconds", 0) == (
        oldest_request + DAY_MS - NOW) / 1000
    assert value(metrics, "kdelay_retention_headroom_seconds", 1) is None  # nothing pending


def test_retention_headroom_of_entries_not_yet_due_is_a_lower_bound(
        indexes: dict[int, PartitionIndex]) -> None:
    indexes[0].apply(Changes(puts=[entry(NOW + 2_000, offset=1)]))
    metrics = Metrics()
    Outlook(metrics, SETTINGS, LAYOUT).refresh(NOW, indexes, {}, None)
    # Due in 2 s and accepted only if due by its timestamp + retention - margin.
    assert value(metrics, "kdelay_retention_headroom_seconds", 0) == (2_000 + HOUR_MS) / 1000


def test_no_headroom_under_unlimited_retention(indexes: dict[int, PartitionIndex]) -> None:
    indexes[0].apply(Changes(puts=[entry(NOW - 1)]))
    metrics = Metrics()
    Outlook(metrics, SETTINGS, Layout(partitions=2, retention_ms=None)).refresh(
        NOW, indexes, {}, None)
    assert value(metrics, "kdelay_retention_headroom_seconds", 0) is None
