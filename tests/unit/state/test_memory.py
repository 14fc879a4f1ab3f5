"""RocksDB's memory: one budget shared by every store, measured where it goes; a
restore into an empty store counts its tally exactly without looking up new keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdelay.protocol.codec import (
    Fingerprint,
    IndexValue,
    encode_due_key,
    encode_index_value,
)
from kdelay.state.changes import Changes
from kdelay.state.index import CHANGELOG, PartitionIndex
from kdelay.state.memory import MB, StoreMemory
from kdelay.state.tally import MINUTE_MS, Tally

NOW = 1_700_000_000_000


def puts(count: int, start: int = 0) -> dict[bytes, bytes]:
    """``count`` entries due a minute apart in threes, with a target and no id."""
    return {encode_due_key(NOW + (i // 3) * MINUTE_MS, 0, i): encode_index_value(
        IndexValue(Fingerprint(NOW - i, i), None, "orders")) for i in range(start, start + count)}


def test_a_budget_below_a_megabyte_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 MB"):
        StoreMemory(MB // 2, MB)


def test_stores_share_the_budget_and_report_where_memory_goes(tmp_path: Path) -> None:
    memory = StoreMemory(8 * MB, 4 * MB)
    first = PartitionIndex(tmp_path / "p0", 0, memory)
    second = PartitionIndex(tmp_path / "p1", 1, memory)
    try:
        first.apply(Changes(raw_puts=puts(1_000)))
        second.apply(Changes(raw_puts=puts(500)))
        usage = memory.usage([*first.families(), *second.families()])
        assert usage.memtables > 0
        assert usage.cache_capacity == 8 * MB
        assert usage.write_buffer_budget == 4 * MB
        assert usage.total == usage.block_cache + usage.memtables + usage.table_readers
        assert first.memory is second.memory is memory
    finally:
        first.close()
        second.close()


def test_a_fresh_store_counts_its_tally_exactly_as_it_goes(tmp_path: Path) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    lookups: list[int] = []
    looked_up = index.raw_values

    def counted(keys: list[bytes]) -> list[bytes | None]:
        lookups.append(len(keys))
        return looked_up(keys)

    index.raw_values = counted  # type: ignore[method-assign]
    try:
        index.fresh(True)
        index.bulk(True)
        index.apply(Changes(raw_puts=puts(300)))
        assert lookups == []  # every key above any put before: new without a lookup
        index.apply(Changes(raw_puts=puts(300, 100)))  # 200 of them again: not twice
        assert lookups == [200]  # only those at or below the highest offset seen
        index.apply(Changes(deletes=[encode_due_key(NOW, 0, 0)]))
        index.apply(Changes(raw_puts=puts(1, 0)))  # put again after its delete: counted
        forwarded = {encode_due_key(NOW, 2, 5): encode_index_value(
            IndexValue(Fingerprint(NOW, 5), None, "orders"))}
        index.apply(Changes(raw_puts={**puts(2, 400), **forwarded}))  # two partitions
        assert index.tally.total == 403
        index.bulk(False)
        index.fresh(False)
        expected = Tally.of(index.raw_items())
        assert (index.tally.due, index.tally.slack, index.tally.origin) == (
            expected.due, expected.slack, expected.origin)
    finally:
        index.close()
    reopened = PartitionIndex(tmp_path / "p0", 0)
    try:
        assert reopened.tally.total == 403  # stored with every batch
    finally:
        reopened.close()


@pytest.mark.parametrize("bulk", [True, False])
def test_a_restore_fills_smaller_memtables_that_flush_as_it_goes(
        tmp_path: Path, bulk: bool) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    active = "rocksdb.num-entries-active-mem-table"
    try:
        index.bulk(bulk)
        for start in range(0, 120_000, 10_000):  # about 6 MB of memtable
            index.apply(Changes(raw_puts=puts(10_000, start)))
        held = index.families()[0].property_int_value(active)
        assert held is not None
        if not bulk:
            assert held == 120_000, "all in the one memtable of the store's usual size"
            return
        assert held < 120_000, "a memtable filled and was switched for flushing"
        index.bulk(False)
        assert index.families()[0].property_int_value(active) == 0, "flushed at the end"
    finally:
        index.close()
    reopened = PartitionIndex(tmp_path / "p0", 0)
    try:
        assert reopened.tally.total == 120_000
        assert sum(1 for _ in reopened.raw_items()) == 120_000
    finally:
        reopened.close()


def test_a_fresh_store_cut_short_is_counted(tmp_path: Path) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    index.fresh(True)
    index.bulk(True)
    index.apply(Changes(raw_puts=puts(50)))
    index.close()  # closed mid-restore: flushed as it is
    reopened = PartitionIndex(tmp_path / "p0", 0)
    try:
        assert reopened.tally.total == 50
        assert reopened.tally.due == Tally.of(reopened.raw_items()).due
    finally:
        reopened.close()


def test_a_store_with_entries_is_not_fresh(tmp_path: Path) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        index.apply(Changes(raw_puts=puts(5)))
        with pytest.raises(ValueError, match="not fresh"):
            index.fresh(True)
    finally:
        index.close()


def test_counting_in_chunks_matches_counting_one_by_one() -> None:
    entries = sorted(puts(70_000).items())
    whole = Tally.of(entries, ordered=True)
    assert whole.total == 70_000
    assert whole.due == Tally.of(entries[:10]).due + Tally.of(entries[10:]).due


_RESTORE_THEN_KILL = """
import os, sys
import os
import subprocess
import sys
from pathlib import Path
from kdelay.protocol.codec import IndexValue, encode_due_key, encode_index_value, fingerprint
from kdelay.state.changes import Changes
from kdelay.state.index import CHANGELOG, PartitionIndex
index = PartitionIndex(Path(sys.argv[1]), 0)
index.bulk(True)
value = encode_index_value(IndexValue(fingerprint(b"k", b"v", 1), None))
index.apply(Changes(raw_puts={encode_due_key(1_000 + n, 0, n): value for n in range(10)},
                    changelog=123))
index.bulk(False)
os._exit(0)  # killed: nothing closed
"""


def test_a_restore_ended_survives_a_kill_with_its_offsets(tmp_path: Path) -> None:
    """Ending bulk mode makes every column family durable, not the due index alone: a
    store killed right after its restore keeps its changelog offset and tally."""
    path = tmp_path / "p0"
    subprocess.run([sys.executable, "-c", _RESTORE_THEN_KILL, str(path)], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    reopened = PartitionIndex(path, 0)
    try:
        assert reopened.first_key_any() is not None
        assert reopened.offset(CHANGELOG) == 123
        assert reopened.tally.total == 10
    finally:
        reopened.close()
