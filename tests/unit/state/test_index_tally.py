"""The index's tally stays exact whatever mix of puts, deletes and scans it sees.

Deleting an entry a scan returned counts it out of the tally from the value
the scan read, with no lookup; these tests hold that to the tally counted
from the store itself after every write.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdelay.protocol.codec import Fingerprint, IndexValue, encode_due_key, encode_index_value
from kdelay.state import index as index_module
from kdelay.state.changes import Changes, Entry, FreshPuts
from kdelay.state.index import PartitionIndex
from kdelay.state.tally import MINUTE_MS, Tally

NOW = 1_700_000_000_000
KEYS = 12


def entry(slot: int) -> Entry:
    """The entry of key ``slot``: due and slack minutes differ by slot. A key always
    has one value (it names one request), as in the service."""
    value = IndexValue(Fingerprint(NOW - (slot % 3) * 7 * MINUTE_MS, slot), None)
    return Entry(encode_due_key(NOW + slot * MINUTE_MS, 0, slot), value,
                 encode_index_value(value))


slots = st.lists(st.integers(0, KEYS - 1), max_size=6)
operations = st.lists(st.one_of(
    st.tuples(st.just("put"), slots, st.just(0)),
    st.tuples(st.just("delete"), slots, st.just(0)),
    st.tuples(st.just("both"), slots, st.just(0)),
    st.tuples(st.just("scan"), st.just([]), st.integers(0, KEYS)),
    st.tuples(st.just("fresh"), slots, st.just(0)),
    st.tuples(st.just("lists"), slots, st.integers(0, 2)),
), max_size=25)


def fresh_puts(entries: list[Entry]) -> FreshPuts:
    """``entries`` as intake plans its usual requests: fresh puts, side by side."""
    fresh = FreshPuts(0)
    for e in entries:
        fresh.add(e.key, e.raw, e.due.due_ms, e.value.fingerprint.timestamp_ms)
    return fresh


def apply(index: PartitionIndex, kind: str, chosen: list[int], number: int) -> None:
    if kind == "scan":
        index.scan(NOW + KEYS * MINUTE_MS, number)
        return
    puts = [entry(s) for s in dict.fromkeys(chosen)] if kind != "delete" else []
    if kind in ("fresh", "lists"):  # requests read the first time: only keys not in the store
        puts = [e for e, raw in zip(puts, index.raw_values([e.key for e in puts]),
                                    strict=True) if raw is None]
        if kind == "fresh":
            index.apply(Changes(puts=puts, absent={e.key for e in puts}))
            return
        # As lists, with ``number`` other keys deleted (a cancel) or put again (an id's).
        others = [entry(s) for s in range(KEYS) if entry(s).key not in
                  {e.key for e in puts}][:number]
        index.apply(Changes(fresh=fresh_puts(puts), deletes=[e.key for e in others[:1]],
                            puts=others[1:]))
        return
    half = chosen[len(chosen) // 2:] if kind == "both" else chosen
    deletes = [entry(s).key for s in half] if kind != "put" else []
    index.apply(Changes(puts=puts, deletes=deletes))


def assert_exact(index: PartitionIndex) -> None:
    counted = Tally.of(index.raw_items())
    assert (index.tally.due, index.tally.slack) == (counted.due, counted.slack)
    assert index.tally.total == counted.total


@settings(max_examples=60, deadline=None)
@given(operations, st.booleans())
def test_the_tally_matches_the_store_after_any_writes_and_scans(
        ops: list[tuple[str, list[int], int]], tiny_cap: bool) -> None:
    cap = index_module.SCANNED_CAP
    index_module.SCANNED_CAP = 2 if tiny_cap else cap
    try:
        with tempfile.TemporaryDirectory() as tmp:
            index = PartitionIndex(Path(tmp) / "p0", 0)
            try:
                for kind, chosen, number in ops:
                    apply(index, kind, chosen, number)
                    assert_exact(index)
            finally:
                index.close()
    finally:
        index_module.SCANNED_CAP = cap


def recorded_lookups(index: PartitionIndex, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The keys ``index`` looks up from now on, in order."""
    looked_up: list[bytes] = []
    lookup = index.raw_values

    def recording(keys: list[bytes]) -> list[bytes | None]:
        looked_up.extend(keys)
        return lookup(keys)

    monkeypatch.setattr(index, "raw_values", recording)
    return looked_up


def test_deleting_scanned_entries_looks_nothing_up(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        index.apply(Changes(puts=[entry(s) for s in range(4)]))
        found = index.scan(NOW + KEYS * MINUTE_MS, 3)
        looked_up = recorded_lookups(index, monkeypatch)
        unscanned = entry(3).key
        index.apply(Changes(deletes=[*(e.key for e in found), unscanned]))
        assert looked_up == [unscanned]
        assert index.tally.total == 0
    finally:
        index.close()


def test_puts_of_keys_known_absent_look_nothing_up(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        index.apply(Changes(puts=[entry(0)]))
        looked_up = recorded_lookups(index, monkeypatch)
        fresh = [entry(s) for s in (1, 2, 3)]
        index.apply(Changes(puts=[entry(0), *fresh], absent={e.key for e in fresh}))
        assert looked_up == [entry(0).key], "only the put not known absent is looked up"
        assert_exact(index)
        assert index.tally.total == 4
    finally:
        index.close()


def test_a_batch_of_fresh_puts_only_is_counted_without_a_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Intake's usual batch; a key left in ``absent`` with no put (a request taken
    out of its plan) must not let a put already in the store count twice."""
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        index.apply(Changes(puts=[entry(0)]))
        looked_up = recorded_lookups(index, monkeypatch)
        fresh = [entry(s) for s in (1, 2, 3)]
        index.apply(Changes(puts=fresh, absent={e.key for e in fresh}))
        assert looked_up == []
        stale = {entry(4).key, entry(5).key}
        index.apply(Changes(puts=[entry(0), entry(5)], absent=stale))
        assert looked_up == [entry(0).key]
        assert_exact(index)
        assert index.tally.total == 5
    finally:
        index.close()


def test_fresh_puts_as_lists_are_written_and_counted_without_a_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Intake's usual batch as lists: written whole, counted from their extremes, and
    the lowest key put returned (delivery learns from it), as for entries."""
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        looked_up = recorded_lookups(index, monkeypatch)
        fresh = [entry(s) for s in (3, 1, 2)]
        assert index.apply(Changes(fresh=fresh_puts(fresh))) == entry(1).key
        assert looked_up == []
        assert list(index.entries()) == sorted(fresh, key=lambda e: e.key)
        assert_exact(index)
        assert index.tally.origin == {0: 3}
    finally:
        index.close()


def test_fresh_puts_beside_entries_and_deletes_are_not_looked_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        index.apply(Changes(puts=[entry(0), entry(1)]))
        looked_up = recorded_lookups(index, monkeypatch)
        index.apply(Changes(fresh=fresh_puts([entry(2), entry(3)]), puts=[entry(4)],
                            deletes=[entry(0).key]))
        assert sorted(looked_up) == sorted([entry(4).key, entry(0).key])
        assert [e.key for e in index.entries()] == [entry(s).key for s in (1, 2, 3, 4)]
        assert_exact(index)
    finally:
        index.close()
