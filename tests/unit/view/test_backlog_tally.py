"""``kdelay backlog`` from the stores' tallies agrees with a count of every key."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdelay.plumbing.settings import Settings
from kdelay.protocol.codec import Fingerprint, IndexValue, encode_due_key
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import PartitionIndex
from kdelay.state.tally import MINUTE_MS
from kdelay.view.backlog import backlog, scanned_backlog, tallied_backlog
from kdelay.view.pending import PendingView

NOW = 1_700_000_000_000 // MINUTE_MS * MINUTE_MS + 37_123  # inside a minute
PARTITIONS = 3
HOUR = 3_600_000

# (store partition, due time relative to NOW, request partition, deleted afterwards)
entries = st.lists(st.tuples(st.integers(0, PARTITIONS - 1),
                             st.integers(-3 * HOUR, 3 * HOUR) | st.integers(-40_000, 30_000),
                             st.integers(0, PARTITIONS - 1), st.booleans()),
                   max_size=60)


@contextmanager
def view_of(tmp: Path, rows: list[tuple[int, int, int, bool]]) -> Iterator[PendingView]:
    """A view whose stores hold ``rows`` (each a put, some deleted again afterwards)."""
    view = PendingView(Settings(), tmp / "view", NOW)
    stores = {p: PartitionIndex(tmp / f"p{p}", p) for p in range(PARTITIONS)}
    view._indexes = stores  # a view of local stores, without a changelog to sync from
    try:
        for offset, (store, ahead, origin, deleted) in enumerate(rows):
            key = encode_due_key(NOW + ahead, origin, offset)
            value = IndexValue(Fingerprint(NOW - 5_000, offset), None, "orders")
            stores[store].apply(Changes(puts=[Entry(key, value)]))
            if deleted:
                stores[store].apply(Changes(deletes=[key]))
        yield view
    finally:
        view.close()


@settings(max_examples=40, deadline=None)
@given(entries, st.sampled_from([MINUTE_MS, HOUR, 24 * HOUR]))
def test_the_tally_counts_as_every_key_does(rows: list[tuple[int, int, int, bool]],
                                            bucket_ms: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, view_of(Path(tmp), rows) as view:
        tallied = tallied_backlog(view, NOW, bucket_ms)
        assert tallied == scanned_backlog(view, NOW, bucket_ms)
        assert backlog(view, NOW, bucket_ms) == tallied


def test_forwarded_entries_count_under_the_partition_of_their_request(tmp_path: Path) -> None:
    rows = [(0, 1_000, 0, False), (0, 2_000, 2, False), (1, -1, 2, False), (2, 0, 2, True)]
    with view_of(tmp_path, rows) as view:
        counted = tallied_backlog(view, NOW, HOUR)
    assert counted.by_partition == {0: 1, 1: 0, 2: 2}
    assert counted.overdue == 1  # due 1 ms before now; the one due at now was deleted
    assert (counted.earliest_due_ms, counted.latest_due_ms) == (NOW - 1, NOW + 2_000)


def test_buckets_of_part_of_a_minute_are_counted_from_the_keys(tmp_path: Path) -> None:
    rows = [(0, 1_000, 0, False), (0, 11_000, 0, False)]
    with view_of(tmp_path, rows) as view:
        counted = backlog(view, NOW, 10_000)
        with pytest.raises(ValueError, match="whole minutes"):
            tallied_backlog(view, NOW, 10_000)
    assert [count for _, count in counted.buckets] == [1, 1]
