"""The RocksDB index of one request partition, on a real store in a temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rocksdict import AccessType, Options, Rdict

from kdelay.protocol import codec
from kdelay.protocol.codec import (
    DueKey,
    Fingerprint,
    IdState,
    IndexValue,
    encode_due_key,
    encode_index_value,
)
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import (
    CHANGELOG,
    CONSUMED,
    EXPIRY_CF,
    IDS_CF,
    META_CF,
    PUT_SPANS,
    SWEEP_CF,
    DueSummary,
    IndexCorrupt,
    PartitionIndex,
)
from kdelay.state.statedir import IndexLocked, StateDirFull, StateDirLock, free_bytes


def entry(due_ms: int, partition: int = 0, offset: int = 0, sid: str | None = None) -> Entry:
    """An index entry whose fingerprint is derived from its coordinates."""
    value = IndexValue(Fingerprint(due_ms - 1, (partition * 1_000 + offset) % 2**32), sid)
    return Entry(encode_due_key(due_ms, partition, offset), value)


def dues(entries: list[Entry]) -> list[DueKey]:
    """The (due, partition, offset) of each entry, in the order given."""
    return [e.due for e in entries]


@pytest.fixture
def index(tmp_path: Path) -> Iterator[PartitionIndex]:
    """An empty index of partition 0 on a fresh store."""
    store = PartitionIndex(tmp_path / "p0", 0)
    yield store
    store.close()


def put(index: PartitionIndex, *entries: Entry) -> None:
    index.apply(Changes(puts=list(entries)))


# -- apply ---------------------------------------------------------------------


def test_apply_writes_entries_ids_and_offsets_together(index: PartitionIndex) -> None:
    a, b = entry(100, offset=1, sid="a"), entry(200, offset=2)
    index.apply(Changes(puts=[a, b], ids={"a": IdState(a.key, None)}, consumed=3, changelog=7))
    assert index.get(a.key) == a.value
    assert index.get(b.key) == b.value
    assert index.id_state("a") == IdState(a.key, None)
    assert index.offset(CONSUMED) == 3
    assert index.offset(CHANGELOG) == 7


def test_apply_deletes_entries_and_ids_and_moves_offsets(index: PartitionIndex) -> None:
    a, b = entry(100, offset=1, sid="a"), entry(200, offset=2)
    index.apply(Changes(puts=[a, b], ids={"a": IdState(a.key, None)}, consumed=3, changelog=7))
    index.apply(Changes(deletes=[a.key], ids={"a": None, "b": IdState(None, 200)}, consumed=4))
    assert index.get(a.key) is None
    assert index.get(b.key) == b.value
    assert index.id_state("a") is None
    assert index.id_state("b") == IdState(None, 200)
    assert index.offset(CONSUMED) == 4
    assert index.offset(CHANGELOG) == 7, "an offset not in the changes keeps its value"


def test_apply_writes_nothing_when_any_part_is_invalid(index: PartitionIndex) -> None:
    good = entry(100, offset=1)
    index.apply(Changes(consumed=1))
    bad_state = IdState(None, None)
    with pytest.raises(ValueError, match="exactly one"):
        index.apply(Changes(puts=[good], ids={"x": bad_state}, consumed=2, changelog=5))
    assert index.get(good.key) is None
    assert index.offset(CONSUMED) == 1
    assert index.offset(CHANGELOG) is None
    assert list(index.entries()) == []


def test_a_put_and_a_delete_of_one_key_in_one_batch_leave_it_deleted(
    index: PartitionIndex,
) -> None:
    a = entry(100)
    index.apply(Changes(puts=[a], deletes=[a.key]))
    assert index.get(a.key) is None


def test_changes_are_truthy_only_when_they_change_something() -> None:
    assert not Changes()
    assert Changes(consumed=0)
    assert Changes(changelog=0)
    assert Changes(deletes=[b"k"])
    assert Changes(ids={"x": None})
    assert Changes(puts=[entry(1)])


def test_get_and_id_state_of_unknown_keys_are_none(index: PartitionIndex) -> None:
    assert index.get(encode_due_key(1, 0, 0)) is None
    assert index.id_state("nope") is None


def test_schedule_ids_may_be_any_utf8(index: PartitionIndex) -> None:
    a = entry(5)
    index.apply(Changes(ids={"zählung/ü-1": IdState(a.key, None)}))
    assert index.id_state("zählung/ü-1") == IdState(a.key, None)
    assert index.id_state("zahlung/u-1") is None


# -- offsets -------------------------------------------------------------------


def test_offsets_are_none_until_set(index: PartitionIndex) -> None:
    assert index.offset(CONSUMED) is None
    assert index.offset(CHANGELOG) is None


@pytest.mark.parametrize("value", [-1, 0, 1, 2**40 + 3, 2**63 - 1])
def test_offsets_round_trip(index: PartitionIndex, value: int) -> None:
    index.apply(Changes(consumed=value, changelog=value))
    assert index.offset(CONSUMED) == value
    assert index.offset(CHANGELOG) == value


# -- scan ----------------------------------------------------------------------


def test_scan_returns_due_entries_in_key_order(index: PartitionIndex) -> None:
    put(index, entry(300, offset=3), entry(100, offset=1), entry(500, offset=5),
        entry(200, offset=2))
    assert dues(index.scan(300, 10)) == [(100, 0, 1), (200, 0, 2), (300, 0, 3)]


def test_scan_bound_is_inclusive_of_upper_ms(index: PartitionIndex) -> None:
    put(index, entry(1_000), entry(1_001, offset=1))
    assert dues(index.scan(999, 10)) == []
    assert dues(index.scan(1_000, 10)) == [(1_000, 0, 0)]
    assert dues(index.scan(1_001, 10)) == [(1_000, 0, 0), (1_001, 0, 1)]


def test_scan_returns_the_stored_values(index: PartitionIndex) -> None:
    a = entry(100, offset=4, sid="order-4")
    put(index, a)
    assert index.scan(100, 10) == [a]


def test_scan_respects_limit(index: PartitionIndex) -> None:
    put(index, *(entry(100 + i, offset=i) for i in range(10)))
    assert dues(index.scan(1_000, 3)) == [(100, 0, 0), (101, 0, 1), (102, 0, 2)]
    assert len(index.scan(1_000, 10)) == 10
    assert len(index.scan(1_000, 50)) == 10


def test_scan_skips_keys_without_counting_them(index: PartitionIndex) -> None:
    entries = [entry(100 + i, offset=i) for i in range(6)]
    put(index, *entries)
    skip = {entries[0].key, entries[1].key, entries[3].key}
    assert dues(index.scan(1_000, 2, skip=skip)) == [(102, 0, 2), (104, 0, 4)]
    assert dues(index.scan(1_000, 10, skip=skip)) == [(102, 0, 2), (104, 0, 4), (105, 0, 5)]


def test_scan_skipping_everything_returns_nothing_and_loses_nothing(
    index: PartitionIndex,
) -> None:
    entries = [entry(100 + i, offset=i) for i in range(3)]
    put(index, *entries)
    assert index.scan(1_000, 10, skip={e.key for e in entries}) == []
    assert index.scan(1_000, 10) == entries


def test_same_millisecond_entries_come_in_partition_then_offset_order(
    index: PartitionIndex,
) -> None:
    put(index, entry(1_000, 2, 1), entry(1_000, 0, 9), entry(1_000, 1, 0), entry(1_000, 0, 3),
        entry(999, 7, 0), entry(1_000, 0, 2**40))
    assert dues(index.scan(1_000, 10)) == [
        (999, 7, 0), (1_000, 0, 3), (1_000, 0, 9), (1_000, 0, 2**40), (1_000, 1, 0),
        (1_000, 2, 1),
    ]


def test_an_entry_put_below_the_head_after_an_empty_scan_is_found(
    index: PartitionIndex,
) -> None:
    put(index, entry(5_000, offset=1))
    assert index.scan(4_000, 10) == []
    put(index, entry(100, offset=2))
    assert dues(index.scan(4_000, 10)) == [(100, 0, 2)]


def test_a_past_due_entry_put_after_later_ones_were_scanned_is_found(
    index: PartitionIndex,
) -> None:
    later = [entry(1_000 + i, offset=10 + i) for i in range(3)]
    put(index, *later)
    assert index.scan(2_000, 10) == later
    index.apply(Changes(deletes=[later[0].key, later[1].key]))
    assert index.scan(2_000, 10) == [later[2]]
    past = entry(10, offset=20)
    put(index, past)
    assert index.scan(2_000, 10) == [past, later[2]]


def test_an_entry_put_below_the_head_after_a_limited_scan_is_found(
    index: PartitionIndex,
) -> None:
    put(index, entry(500, offset=1), entry(600, offset=2))
    assert dues(index.scan(1_000, 1)) == [(500, 0, 1)]
    index.apply(Changes(deletes=[entry(500, offset=1).key]))
    assert dues(index.scan(1_000, 1)) == [(600, 0, 2)]
    put(index, entry(50, offset=3))
    assert dues(index.scan(1_000, 1)) == [(50, 0, 3)]


def test_an_entry_put_between_head_and_bound_is_found(index: PartitionIndex) -> None:
    assert index.scan(1_000, 10) == []
    put(index, entry(1_500, offset=1))
    assert index.scan(1_000, 10) == []
    assert dues(index.scan(2_000, 10)) == [(1_500, 0, 1)]


def test_a_wider_scan_after_a_narrower_one_sees_everything(index: PartitionIndex) -> None:
    put(index, entry(100, offset=1), entry(3_000, offset=2))
    assert dues(index.scan(200, 10)) == [(100, 0, 1)]
    assert dues(index.scan(50, 10)) == []
    assert dues(index.scan(5_000, 10)) == [(100, 0, 1), (3_000, 0, 2)]


def test_scans_after_deleting_scanned_entries_continue_past_them(
    index: PartitionIndex,
) -> None:
    entries = [entry(1_000 + i // 3, partition=i % 2, offset=i) for i in range(600)]
    put(index, *entries)
    expected = sorted(entries, key=lambda e: e.key)
    taken: list[Entry] = []
    while True:
        batch = index.scan(10_000, 25)
        if not batch:
            break
        assert batch == expected[len(taken):len(taken) + 25]
        taken.extend(batch)
        index.apply(Changes(deletes=[e.key for e in batch]))
    assert taken == expected
    assert list(index.entries()) == []
    assert index.first_key() is None


def test_scan_with_limit_zero_returns_nothing(index: PartitionIndex) -> None:
    put(index, entry(100))
    assert index.scan(1_000, 0) == []


# -- entries, first_key, the lowest put ------------------------------------------


def test_entries_iterates_everything_in_key_order(index: PartitionIndex) -> None:
    put(index, entry(300, 1, 0), entry(100, 0, 5), entry(2**50, 0, 1), entry(100, 0, 4))
    assert dues(list(index.entries())) == [
        (100, 0, 4), (100, 0, 5), (300, 1, 0), (2**50, 0, 1),
    ]
    assert dues(list(index.entries(300))) == [(100, 0, 4), (100, 0, 5), (300, 1, 0)]
    assert dues(list(index.entries(99))) == []


def test_entries_ignores_the_scan_head(index: PartitionIndex) -> None:
    put(index, entry(100, offset=1), entry(200, offset=2), entry(300, offset=3))
    index.scan(250, 1)
    index.scan(5_000, 10, skip={entry(100, offset=1).key})
    assert dues(list(index.entries())) == [(100, 0, 1), (200, 0, 2), (300, 0, 3)]


def test_first_key_is_the_smallest_pending_key(index: PartitionIndex) -> None:
    assert index.first_key() is None
    put(index, entry(300, offset=1), entry(200, offset=2))
    assert index.first_key() == encode_due_key(200, 0, 2)
    index.apply(Changes(deletes=[encode_due_key(200, 0, 2)]))
    assert index.first_key() == encode_due_key(300, 0, 1)


MINUTE = 60_000


def test_first_and_last_key_step_over_delivered_entries_at_both_ends(
    index: PartitionIndex,
) -> None:
    early = [entry(m * MINUTE + 5, offset=m) for m in range(3)]
    late = [entry(m * MINUTE + 5, offset=m) for m in range(7, 10)]
    first, last = entry(4 * MINUTE + 1, offset=40), entry(5 * MINUTE + 10, offset=50)
    gone_in_last_minute = entry(5 * MINUTE + 50, offset=51)
    put(index, *early, first, last, gone_in_last_minute, *late)
    index.apply(Changes(deletes=[e.key for e in [*early, *late, gone_in_last_minute]]))
    assert index.first_key() == first.key
    assert index.last_key() == last.key
    assert index.first_key_after(0) == first.key
    assert index.first_key_after(4 * MINUTE + 1) == last.key


class _NoIterators:
    """Stands in for the store: any iterator over it fails the test."""

    def iter(self, *_: object) -> None:
        raise AssertionError("the store was read")


def test_a_drained_index_answers_from_its_tally_without_reading_tombstones(
    index: PartitionIndex, monkeypatch: pytest.MonkeyPatch,
) -> None:
    entries = [entry(1_000 + i, offset=i) for i in range(100)]
    put(index, *entries)
    index.apply(Changes(deletes=[e.key for e in entries]))
    monkeypatch.setattr(index, "_db", _NoIterators())
    assert index.first_key() is None
    assert index.last_key() is None
    assert index.first_key_after(0) is None


def test_apply_returns_the_smallest_key_it_put(index: PartitionIndex) -> None:
    assert index.apply(Changes(puts=[entry(500, offset=1), entry(700, offset=2)])) == (
        encode_due_key(500, 0, 1))
    assert index.apply(Changes(puts=[entry(300, offset=3)])) == encode_due_key(300, 0, 3)
    assert index.apply(Changes(deletes=[encode_due_key(300, 0, 3)], consumed=9)) is None, (
        "deletes and offsets are not puts")
    assert index.apply(Changes(puts=[entry(800, offset=5)])) == encode_due_key(800, 0, 5)


def test_one_batch_of_unordered_puts_and_raw_puts_notes_its_lowest_key(
    index: PartitionIndex,
) -> None:
    put(index, entry(1_000, offset=1))
    index.scan(1_000, 10)
    raw = entry(400, offset=7)
    lowest = index.apply(Changes(puts=[entry(900, offset=2), entry(600, offset=3)],
                                 raw_puts={raw.key: b"\x00" * 12}))
    assert lowest == raw.key
    assert dues(index.scan(1_000, 10)) == [(400, 0, 7), (600, 0, 3), (900, 0, 2), (1_000, 0, 1)]


def test_raw_puts_move_the_lowest_put_and_the_scan_head_back(index: PartitionIndex) -> None:
    assert index.apply(Changes(puts=[entry(500, offset=1)])) is not None
    assert index.scan(1_000, 10) == [entry(500, offset=1)]
    raw = {e.key: encode_index_value(e.value) for e in (entry(900, offset=2), entry(200, offset=3))}
    assert index.apply(Changes(raw_puts=raw)) == encode_due_key(200, 0, 3)
    assert dues(index.scan(1_000, 10)) == [(200, 0, 3), (500, 0, 1), (900, 0, 2)]


def test_raw_values_reads_many_keys_at_once(index: PartitionIndex) -> None:
    a, b = entry(100, offset=1, sid="a"), entry(200, offset=2)
    put(index, a, b)
    missing = encode_due_key(150, 0, 9)
    assert index.raw_values([b.key, missing, a.key]) == [
        encode_index_value(b.value), None, encode_index_value(a.value)]
    assert index.raw_values([]) == []


# -- the store on disk -----------------------------------------------------------
#
# A closed PartitionIndex is dropped (``del``) before its path is opened again: see
# test_close_releases_the_store_lock for why that is needed today.


def test_reopening_the_store_keeps_entries_ids_and_offsets(tmp_path: Path) -> None:
    path = tmp_path / "state" / "p3"
    a, b = entry(100, 3, 1, sid="a"), entry(200, 3, 2)
    first = PartitionIndex(path, 3)
    first.apply(Changes(puts=[a, b], ids={"a": IdState(a.key, None)}, consumed=3, changelog=2))
    first.scan(10_000, 10)
    first.apply(Changes(deletes=[b.key]))
    first.close()
    del first

    again = PartitionIndex(path, 3)
    try:
        assert again.partition == 3
        assert list(again.entries()) == [a]
        assert again.scan(10_000, 10) == [a]
        assert again.id_state("a") == IdState(a.key, None)
        assert again.offset(CONSUMED) == 3
        assert again.offset(CHANGELOG) == 2
    finally:
        again.close()


def test_close_releases_the_store_lock(tmp_path: Path) -> None:
    path = tmp_path / "p0"
    first = PartitionIndex(path, 0)
    first.apply(Changes(puts=[entry(100)], consumed=1))
    first.close()
    again = PartitionIndex(path, 0)
    try:
        assert again.offset(CONSUMED) == 1
        assert list(again.entries()) == [entry(100)]
    finally:
        again.close()


def test_destroy_removes_the_store(tmp_path: Path) -> None:
    path = tmp_path / "p0"
    store = PartitionIndex(path, 0)
    store.apply(Changes(puts=[entry(100)], consumed=1))
    store.close()
    del store
    PartitionIndex.destroy(path)
    assert not path.exists()

    fresh = PartitionIndex(path, 0)
    try:
        assert list(fresh.entries()) == []
        assert fresh.offset(CONSUMED) is None
    finally:
        fresh.close()


def test_destroy_of_a_missing_store_is_harmless(tmp_path: Path) -> None:
    PartitionIndex.destroy(tmp_path / "never-created")
    assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_is_index_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "p0"
    path.write_bytes(b"not a rocksdb")
    with pytest.raises(IndexCorrupt, match="cannot open index"):
        PartitionIndex(path, 0)
    PartitionIndex.destroy(path)
    assert not path.exists(), "destroy clears a file in the store's place too"


def test_a_damaged_store_is_index_corrupt_and_destroy_clears_it(tmp_path: Path) -> None:
    path = tmp_path / "p0"
    store = PartitionIndex(path, 0)
    store.apply(Changes(puts=[entry(100)]))
    store.close()
    del store
    (path / "CURRENT").write_bytes(b"garbage\n")
    with pytest.raises(IndexCorrupt, match="cannot open index"):
        PartitionIndex(path, 0)
    PartitionIndex.destroy(path)
    rebuilt = PartitionIndex(path, 0)
    try:
        assert list(rebuilt.entries()) == []
    finally:
        rebuilt.close()


def test_a_store_held_open_elsewhere_is_locked_not_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "p0"
    holder = PartitionIndex(path, 0)
    try:
        holder.apply(Changes(puts=[entry(100)], consumed=1))
        with pytest.raises(IndexLocked):
            PartitionIndex(path, 0)
        assert list(holder.entries()) == [entry(100)], "the held store is untouched"
    finally:
        holder.close()


# -- ended-id markers expire -----------------------------------------------------


def delivered(index: PartitionIndex, **ids: int) -> None:
    index.apply(Changes(ids={sid: IdState(None, ms) for sid, ms in ids.items()}))


def prune(index: PartitionIndex, before_ms: int, limit: int) -> int:
    """Drop what :meth:`expired_ids` finds, as intake's planner does; return how many."""
    found = index.expired_ids(before_ms, limit)
    index.apply(Changes(ids={sid: None for sid, _ in found if sid},
                        expired=[key for _, key in found]))
    return len(found)


def test_expired_ids_name_only_ids_still_in_the_state_that_expired(
        index: PartitionIndex) -> None:
    delivered(index, stale=100, current=200)
    delivered(index, stale=900)
    found = index.expired_ids(before_ms=500, limit=10)
    assert [sid for sid, _ in found] == ["", "current"], "stale ended again later: key only"


def test_prune_drops_markers_delivered_before_the_cutoff(index: PartitionIndex) -> None:
    delivered(index, old=100, older=50, recent=1_000)
    assert index.id_count() == 3
    assert prune(index, before_ms=500, limit=100) == 2
    assert index.id_state("old") is None
    assert index.id_state("older") is None
    assert index.id_state("recent") == IdState(None, 1_000)
    assert index.id_count() == 1
    assert prune(index, before_ms=500, limit=100) == 0, "expiry entries go with the ids"


def test_prune_keeps_an_id_scheduled_again_after_its_delivery(index: PartitionIndex) -> None:
    delivered(index, reused=100)
    again = entry(5_000, offset=9, sid="reused")
    index.apply(Changes(puts=[again], ids={"reused": IdState(again.key, None)}))
    prune(index, before_ms=500, limit=100)
    assert index.id_state("reused") == IdState(again.key, None)


def test_prune_keeps_an_id_delivered_again_later(index: PartitionIndex) -> None:
    delivered(index, twice=100)
    delivered(index, twice=900)
    prune(index, before_ms=500, limit=100)
    assert index.id_state("twice") == IdState(None, 900)
    prune(index, before_ms=1_000, limit=100)
    assert index.id_state("twice") is None


def test_prune_stops_at_its_limit(index: PartitionIndex) -> None:
    delivered(index, **{f"id{i}": i for i in range(10)})
    assert prune(index, before_ms=100, limit=4) == 4
    assert index.id_count() == 6
    assert index.id_state("id3") is None
    assert index.id_state("id4") == IdState(None, 4)


def test_markers_and_their_expiry_survive_a_reopen(tmp_path: Path) -> None:
    store = PartitionIndex(tmp_path / "p", 0)
    delivered(store, kept=100)
    store.close()
    reopened = PartitionIndex(tmp_path / "p", 0)
    try:
        assert prune(reopened, before_ms=500, limit=10) == 1
        assert reopened.id_count() == 0
    finally:
        reopened.close()


def test_last_key_and_a_capped_summary_of_due_entries(index: PartitionIndex) -> None:
    assert index.last_key() is None
    assert index.due_summary(10_000, 100) == DueSummary(0, None, False)
    put(index, *(entry(1_000 * d, offset=d) for d in range(1, 6)))
    assert index.last_key() == encode_due_key(5_000, 0, 5)
    # entry() stamps each request 1 ms before its due time.
    assert index.due_summary(3_000, 100) == DueSummary(3, 999, False)
    assert index.due_summary(3_000, 3) == DueSummary(3, 999, False)
    assert index.due_summary(3_000, 2) == DueSummary(2, 999, True)
    index.apply(Changes(deletes=[encode_due_key(1_000, 0, 1)]))
    assert index.due_summary(3_000, 100) == DueSummary(2, 1_999, False)
    assert index.first_key_after(3_000) == encode_due_key(4_000, 0, 4)
    assert index.first_key_after(5_000) is None


# -- the exact tally of pending entries ------------------------------------------


def test_the_tally_counts_new_keys_once_and_only_deletes_of_present_keys(
    index: PartitionIndex,
) -> None:
    a, b, c = entry(100_000, offset=1), entry(200_000, offset=2), entry(300_000, offset=3)
    put(index, a, b)
    put(index, a)  # a request read again writes the same key: not a new entry
    assert index.tally.total == 2
    index.apply(Changes(deletes=[a.key, c.key]))  # c was never there
    assert index.tally.total == 1
    index.apply(Changes(puts=[c], deletes=[c.key]))  # put and deleted in one batch
    assert index.tally.total == 1
    assert sum(1 for _ in index.entries()) == index.tally.total


def test_replayed_changelog_records_are_counted_once(index: PartitionIndex) -> None:
    a, b = entry(100_000, offset=1), entry(160_000, offset=2)
    raw = {a.key: encode_index_value(a.value), b.key: encode_index_value(b.value)}
    index.apply(Changes(raw_puts=dict(raw)))
    index.apply(Changes(raw_puts=dict(raw)))
    assert index.tally.total == 2
    assert dict(index.tally.due) == {1: 1, 2: 1}


def test_the_tally_is_stored_with_the_entries_and_loaded_on_open(tmp_path: Path) -> None:
    store = PartitionIndex(tmp_path / "p", 0)
    put(store, *(entry(60_000 * i, offset=i) for i in range(1, 40)))
    store.apply(Changes(deletes=[entry(60_000 * 5, offset=5).key]))
    expected = (store.tally.total, dict(store.tally.due), dict(store.tally.slack))
    store.close()
    reopened = PartitionIndex(tmp_path / "p", 0)
    try:
        assert (reopened.tally.total, dict(reopened.tally.due),
                dict(reopened.tally.slack)) == expected
        assert expected[0] == 38
    finally:
        reopened.close()


def test_a_store_written_before_the_tally_existed_is_counted_when_opened(
    tmp_path: Path,
) -> None:
    from rocksdict import Options, Rdict

    path = tmp_path / "old"
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    old = Rdict(str(path), options)
    for i in range(25):
        e = entry(60_000 * i, offset=i)
        old[e.key] = encode_index_value(e.value)
    old.close()
    store = PartitionIndex(path, 0)
    try:
        assert store.tally.total == 25
        put(store, entry(10 ** 9, offset=99))
        assert store.tally.total == 26
    finally:
        store.close()


def test_a_tally_stored_without_request_partitions_is_counted_again_when_opened(
    tmp_path: Path,
) -> None:
    store = PartitionIndex(tmp_path / "p", 2)
    put(store, *(entry(60_000 * i, partition=2, offset=i) for i in range(1, 11)),
        entry(60_000, partition=1, offset=50))
    assert dict(store.tally.origin) == {2: 10, 1: 1}
    # As an earlier version stored it: due and slack rows, an empty completeness marker.
    store._meta[codec.TALLY_COMPLETE] = b""
    for partition in (1, 2):
        del store._meta[codec.encode_tally_key(b"o", partition)]
    store._meta[codec.encode_tally_key(b"d", 10**6)] = codec.encode_count(99)  # stale
    store.close()
    reopened = PartitionIndex(tmp_path / "p", 2)
    try:
        assert dict(reopened.tally.origin) == {2: 10, 1: 1}
        assert reopened.tally.total == 11
        assert 10**6 not in reopened.tally.due
    finally:
        reopened.close()
    again = PartitionIndex(tmp_path / "p", 2)  # stored whole this time: loaded
    try:
        assert dict(again.tally.origin) == {2: 10, 1: 1}
        assert again.tally.total == 11
    finally:
        again.close()


def test_free_bytes_of_a_path_not_created_yet_is_its_volumes(tmp_path: Path) -> None:
    assert free_bytes(tmp_path / "state" / "not-yet") == free_bytes(tmp_path) > 0


def test_state_dir_full_names_the_path_and_the_room_left(tmp_path: Path) -> None:
    error = StateDirFull(tmp_path / "idx", "IO error: No space left on device")
    assert str(tmp_path / "idx") in str(error)
    assert f"({error.free_bytes} bytes free)" in str(error)
    assert "nothing is lost" in str(error)
def test_a_state_dir_is_locked_once_until_released(tmp_path: Path) -> None:
    state = tmp_path / "state"
    lock = StateDirLock(state)
    with pytest.raises(IndexLocked, match="in use by another process"):
        StateDirLock(state)
    lock.release()
    lock.release()
    StateDirLock(state).release()


# -- watermarks and the sweep list ---------------------------------------------


def test_a_watermark_is_kept_with_the_changes_and_read_back_on_open(tmp_path: Path) -> None:
    from kdelay.protocol.codec import Watermark
    a, b = entry(100, offset=1), entry(200, offset=2)
    store = PartitionIndex(tmp_path / "p0", 0)
    try:
        put(store, a, b)
        mark = Watermark(b.key, frozenset({a.key}))
        store.apply(Changes(watermark=mark))
        assert store.watermark == mark
    finally:
        store.close()
    again = PartitionIndex(tmp_path / "p0", 0)
    try:
        assert again.watermark == mark
    finally:
        again.close()


def test_cover_deletes_what_the_watermark_covers_and_notes_it_for_the_sweep(
        index: PartitionIndex) -> None:
    from kdelay.protocol.codec import Watermark
    done, kept, later = entry(100, offset=1, sid="x"), entry(150, offset=2), entry(300, offset=3)
    index.apply(Changes(puts=[done, kept, later], ids={"x": IdState(done.key, None)}))
    changes = index.cover(Watermark(later.key, frozenset({kept.key})))
    assert (changes.deletes, changes.swept) == ([done.key], [done.key])
    assert changes.ids == {"x": None}, "its pending id is released"
    index.apply(changes)
    assert [e.key for e in index.entries()] == [kept.key, later.key]
    assert [keys for _, keys in index.unswept(10)] == [[done.key]]
    assert index.tally.total == 2


def test_the_sweep_list_is_kept_in_chunks_read_from_a_head(index: PartitionIndex) -> None:
    from kdelay.state.index import SWEEP_CHUNK
    keys = [encode_due_key(100, 0, offset) for offset in range(SWEEP_CHUNK + 5)]
    index.apply(Changes(swept=keys[:2]))
    index.apply(Changes(swept=keys[2:]))
    chunks = index.unswept(1)
    assert [chunk for _, chunk in chunks] == [keys[:2]], "whole chunks, at least one"
    rest = index.unswept(10 * SWEEP_CHUNK)
    assert [chunk for _, chunk in rest] == [keys[2:SWEEP_CHUNK + 2], keys[SWEEP_CHUNK + 2:]], \
        "from where the last read stopped; one write's keys cut into chunks"
    assert index.sweep_backlog == SWEEP_CHUNK + 5
    index.apply(Changes(unswept=[chunk_id for chunk_id, _ in chunks + rest[:1]]))
    assert index.sweep_backlog == 3, "the chunks handed out and swept are counted out"
    assert index.unswept(10) == []
    index.rewind_sweep()
    assert [chunk for _, chunk in index.unswept(10)] == [keys[SWEEP_CHUNK + 2:]]
    index.apply(Changes(swept=keys[:1]))
    assert [chunk for _, chunk in index.unswept(10)] == [keys[:1], keys[SWEEP_CHUNK + 2:]], (
        "a chunk below the head moves it back")


def test_a_store_written_without_bloom_filters_opens_and_reads_with_them(
        tmp_path: Path) -> None:
    """Stores made before the due index and the ids had bloom filters keep working."""
    def plain() -> Options:
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.create_missing_column_families(True)
        return options

    old = entry(100, offset=1)
    store = Rdict(str(tmp_path / "p0"), plain(), access_type=AccessType.read_write(),
                  column_families={cf: plain() for cf in (IDS_CF, META_CF, EXPIRY_CF,
                                                          SWEEP_CF)})
    store[old.key] = encode_index_value(old.value)
    store.close()
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        new = entry(200, offset=2)
        put(index, new)
        assert index.raw_values([old.key, new.key, entry(300, offset=3).key]) == [
            encode_index_value(old.value), encode_index_value(new.value), None]
        assert index.tally.total == 2
    finally:
        index.close()


def test_scan_raw_returns_the_columns_scan_does(index: PartitionIndex) -> None:
    entries = [entry(100 + i, offset=i) for i in range(6)]
    put(index, *entries)
    skip = {entries[1].key}
    keys, values, gapless, seen, _, _ = index.scan_raw(103, 3, skip=skip)
    assert keys == [entries[0].key, entries[2].key, entries[3].key]
    assert [e.key for e in index.scan(103, 3, skip=skip)] == keys
    assert values == [encode_index_value(e.value) for e in (entries[0], entries[2], entries[3])]
    assert (gapless, seen) == (False, 1)  # entries[1] lies between the keys read
    assert index.scan_raw(103, 10, start=entries[3].key) == (
        [entries[3].key], [encode_index_value(entries[3].value)], True, 1, b"", b"")


def test_a_key_passed_over_outside_the_keys_read_leaves_the_scan_gapless(
        index: PartitionIndex) -> None:
    entries = [entry(100 + i, offset=i) for i in range(5)]
    put(index, *entries)
    scan = index.scan_raw(104, 2, skip={entries[0].key, entries[3].key})
    assert (scan.keys, scan.gapless) == ([entries[1].key, entries[2].key], True)
    scan = index.scan_raw(104, 10, skip={entries[4].key})
    assert (len(scan.keys), scan.gapless) == (4, True)


def delete_read(index: PartitionIndex, keys: list[bytes], seen: int) -> None:
    """Delete keys a gapless scan read (at ``seen``), as delivery's settle does."""
    values = [value for value in index.raw_values(keys) if value is not None]
    index.apply(Changes(deletes=keys, known=dict(zip(keys, values, strict=True)),
                        ranges=[(0, len(keys), seen)]))


def test_a_gapless_range_leaves_as_a_range_and_the_tally_counts_it(
        index: PartitionIndex) -> None:
    entries = [entry(100 + i, offset=i) for i in range(10)]
    after = entry(200, offset=99)
    put(index, *entries, after)
    scan = index.scan_raw(150, 100)
    assert scan.gapless
    delete_read(index, scan.keys[2:8], scan.puts_seen)
    left = [*entries[:2], *entries[8:], after]
    assert [e.key for e in index.entries()] == [e.key for e in left]
    assert index.tally.total == len(left)


def test_a_put_inside_a_range_since_it_was_read_keeps_the_range_to_its_keys(
        index: PartitionIndex) -> None:
    entries = [entry(100 + 2 * i, offset=i) for i in range(10)]
    put(index, *entries)
    scan = index.scan_raw(150, 100)
    inside, outside = entry(105, offset=50), entry(300, offset=51)
    put(index, outside)  # after the range: the range may go as one
    put(index, inside)  # between the keys read: only they may go
    delete_read(index, scan.keys, scan.puts_seen)
    assert [e.key for e in index.entries()] == [inside.key, outside.key]
    assert index.tally.total == 2


def test_a_range_read_before_the_puts_remembered_goes_key_by_key(
        index: PartitionIndex) -> None:
    entries = [entry(100 + 2 * i, offset=i) for i in range(10)]
    put(index, *entries)
    scan = index.scan_raw(150, 100)
    inside = entry(105, offset=50)
    put(index, inside)  # inside the range, then more puts than are remembered
    for i in range(PUT_SPANS):
        put(index, entry(10_000 + i, offset=100 + i))
    delete_read(index, scan.keys, scan.puts_seen)
    assert index.get(inside.key) == inside.value
    assert index.tally.total == PUT_SPANS + 1


def test_the_sweep_backlog_is_counted_again_on_open(tmp_path: Path) -> None:
    store = PartitionIndex(tmp_path / "p0", 0)
    try:
        store.apply(Changes(swept=[encode_due_key(1, 0, offset) for offset in range(7)]))
    finally:
        store.close()
    again = PartitionIndex(tmp_path / "p0", 0)
    try:
        assert again.sweep_backlog == 7
    finally:
        again.close()


def test_an_entry_made_from_its_encoded_value_decodes_it_when_asked() -> None:
    value = IndexValue(Fingerprint(1_000, 7), None, "orders")
    key = encode_due_key(5_000, 0, 1)
    lazy = Entry(key, None, encode_index_value(value))
    assert lazy.value == value
    assert lazy == Entry(key, value)
    with pytest.raises(ValueError, match="needs its value"):
        Entry(key, None)
