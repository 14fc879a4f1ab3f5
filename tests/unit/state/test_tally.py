"""The pending tally: exact counts by due minute and slack, summed into horizons and risk."""

from __future__ import annotations

import struct
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.state import tally
from kdelay.state.changes import FreshPuts
from kdelay.state.tally import MINUTE_MS, Change, Tally, buckets, deleted_change, horizons

NOW = 1_700_000_000_000 // MINUTE_MS * MINUTE_MS + 30_000  # half way through a minute


def entry(due_ms: int, record_ms: int, offset: int = 0) -> tuple[bytes, bytes]:
    key = codec.encode_due_key(due_ms, 0, offset)
    return key, codec.encode_index_value(IndexValue(Fingerprint(record_ms, 7), None))


def test_buckets_are_the_due_minute_and_the_slack_minute() -> None:
    key, raw = entry(NOW, NOW - 90_000)
    assert buckets(key, raw) == (NOW // MINUTE_MS, -2)


def test_a_tally_counted_from_scratch_and_one_loaded_from_its_rows_agree() -> None:
    counted = Tally.of([entry(NOW + i * 7_000, NOW - 1_000, i) for i in range(50)])
    loaded = Tally.load((k, codec.encode_count(n)) for k, n in counted.all_rows())
    assert counted.total == loaded.total == 50
    assert (counted.due, counted.slack) == (loaded.due, loaded.slack)


def test_a_change_moves_only_the_buckets_it_touches_and_empties_go() -> None:
    tally = Tally.of([entry(NOW, NOW), entry(NOW + MINUTE_MS, NOW, 1)])
    change = Change()
    change.count(*entry(NOW, NOW), -1)
    change.count(*entry(NOW + 5 * MINUTE_MS, NOW, 2), 1)
    rows = dict(tally.rows(change))
    assert rows[codec.encode_tally_key(b"d", NOW // MINUTE_MS)] == 0
    assert rows[codec.encode_tally_key(b"d", NOW // MINUTE_MS + 5)] == 1
    tally.commit(change)
    assert tally.total == 2
    assert NOW // MINUTE_MS not in tally.due


def test_a_batch_counts_exactly_as_one_entry_at_a_time() -> None:
    added = [entry(NOW + i * 13_000, NOW - i * 29_000, i) for i in range(40)]
    removed = [entry(NOW - i * 61_000, NOW - 3 * i * MINUTE_MS, 100 + i) for i in range(25)]
    one, batch = Change(), Change()
    for key, raw in added:
        one.count(key, raw, 1)
    for key, raw in removed:
        one.count(key, raw, -1)
    batch.count_all([k for k, _ in added], [v for _, v in added], 1)
    batch.count_all([k for k, _ in removed], [v for _, v in removed], -1)
    assert (batch.due, batch.slack) == (one.due, one.slack)
    assert len(batch.due) > 5  # the entries span many minutes
    assert len(batch.slack) > 5


@pytest.mark.parametrize("spread_ms", [0, 59_000, 61_000], ids=["one-instant", "one-minute",
                                                               "two-minutes"])
def test_a_burst_batch_counts_as_one_entry_at_a_time(spread_ms: int) -> None:
    """A batch due within one minute (a burst) is counted in one step; the same result."""
    start = NOW - NOW % MINUTE_MS
    burst = [entry(start + spread_ms * i // 99, start - 5_000, i) for i in range(100)]
    one, batch = Change(), Change()
    for key, raw in burst:
        one.count(key, raw, -1)
    batch.count_all([k for k, _ in burst], [v for _, v in burst], -1)
    assert (batch.due, batch.slack) == (one.due, one.slack)
    assert sum(batch.due.values()) == -100


def test_a_batch_needs_a_value_for_every_key() -> None:
    key, raw = entry(NOW, NOW)
    change = Change()
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        change.count_all([key, key], [raw], 1)
    assert (change.due, change.slack) == ({}, {})


def test_horizons_by_due_minute() -> None:
    dues = [NOW - 3 * MINUTE_MS, NOW - MINUTE_MS, NOW - 1_000, NOW + 20_000, NOW + 45_000,
            NOW + 5 * MINUTE_MS, NOW + 30 * MINUTE_MS, NOW + 5 * 3_600_000,
            NOW + 3 * 86_400_000]
    tally = Tally.of([entry(due, NOW - 1, i) for i, due in enumerate(dues)])
    assert tally.by_horizon(NOW) == {
        "overdue": 2,  # their due minute is over
        "1m": 3,  # the current minute (one of them already due) and the next one
        "10m": 1, "1h": 1, "1d": 1, "beyond": 1}
    assert list(tally.by_horizon(NOW)) == horizons()
    assert sum(tally.by_horizon(NOW).values()) == tally.total


def test_entries_due_after_their_original_expires_are_at_risk() -> None:
    retention = 3_600_000
    tally = Tally.of([
        entry(NOW + 10 * MINUTE_MS, NOW, 0),  # slack -10 min: safe
        entry(NOW + 50 * MINUTE_MS, NOW, 1),  # -50 min: safe
        entry(NOW + 2 * 3_600_000, NOW, 2),  # -2 h: the original is gone an hour early
        entry(NOW + 3_600_000 + 30_000, NOW, 3),  # straddles the limit: counted
    ])
    assert tally.at_risk(retention) == 2
    assert tally.at_risk(None) == 0


@given(st.lists(st.tuples(st.integers(min_value=0, max_value=2**40),
                          st.integers(min_value=-(2**40), max_value=2**40)),
                min_size=1, max_size=60),
       st.integers(min_value=0, max_value=2**40), st.integers(min_value=0, max_value=3),
       st.sampled_from([1, -1]))
def test_any_batch_counts_as_one_entry_at_a_time(
        offsets: list[tuple[int, int]], base: int, spread_shift: int, sign: int) -> None:
    """Batches in one minute (counted from their extremes), across minutes, with
    negative timestamps (whose bytes do not order as their values): all the same."""
    scale = 10 ** spread_shift  # 1 ms to 1 s apart: one minute or many
    batch = [entry(base + due * scale % (2**41), stamp * scale, i)
             for i, (due, stamp) in enumerate(offsets)]
    one, counted = Change(), Change()
    for key, raw in batch:
        one.count(key, raw, sign)
    counted.count_all([k for k, _ in batch], [v for _, v in batch], sign)
    assert (counted.due, counted.slack) == (one.due, one.slack)
    ordered = sorted(dict(batch).items())  # keys in order, as a seal deletes them
    removed, alone = deleted_change([k for k, _ in ordered], [v for _, v in ordered]), Change()
    for key, raw in ordered:
        alone.count(key, raw, -1)
    assert (removed.due, removed.slack) == (alone.due, alone.slack)


@given(st.lists(st.tuples(st.integers(min_value=0, max_value=2**40),
                          st.integers(min_value=-(2**40), max_value=2**40)),
                min_size=1, max_size=60),
       st.integers(min_value=0, max_value=2**40), st.integers(min_value=0, max_value=3))
def test_fresh_puts_count_from_their_extremes_as_one_entry_at_a_time(
        offsets: list[tuple[int, int]], base: int, spread_shift: int) -> None:
    """Intake's fresh puts give the extremes they kept and their origin: the same counts
    as entry by entry, in one minute or across many, negative timestamps too."""
    scale = 10 ** spread_shift
    fresh, one = FreshPuts(0), Change()
    for i, (due, stamp) in enumerate(offsets):
        due_ms, stamp_ms = base + due * scale % (2**41), stamp * scale
        key, raw = entry(due_ms, stamp_ms, i)
        fresh.add(key, raw, due_ms, stamp_ms)
        one.count(key, raw, 1)
    counted = Change()
    counted.count_all(fresh.keys, fresh.values, 1, extremes=fresh.extremes(), origin=0)
    assert (counted.due, counted.slack, counted.origin) == (one.due, one.slack, one.origin)


@pytest.mark.parametrize("stamps", [(-5_000, 1_000), (-1, -1)], ids=["mixed", "negative"])
def test_a_batch_with_negative_timestamps_in_one_minute_counts_right(
        stamps: tuple[int, int]) -> None:
    batch = [entry(NOW, stamp, i) for i, stamp in enumerate(stamps)]
    one, counted = Change(), Change()
    for key, raw in batch:
        one.count(key, raw, 1)
    counted.count_all([k for k, _ in batch], [v for _, v in batch], 1)
    assert (counted.due, counted.slack) == (one.due, one.slack)


def test_a_short_key_is_refused_in_a_batch_as_alone() -> None:
    _, raw = entry(NOW, NOW)
    with pytest.raises(struct.error):
        Change().count_all([b"short"], [raw], 1)


def test_entries_are_counted_by_the_partition_their_request_lies_on() -> None:
    raw = entry(NOW, NOW)[1]
    own = [codec.encode_due_key(NOW + i, 3, i) for i in range(5)]
    mixed = [*own, codec.encode_due_key(NOW, 7, 9), codec.encode_due_key(NOW, 0, 1)]
    one, batch, alike = Change(), Change(), Change()
    for key in mixed:
        one.count(key, raw, 1)
    batch.count_all(mixed, [raw] * len(mixed), 1)
    alike.count_all(own, [raw] * len(own), -1)
    assert batch.origin == one.origin == {3: 5, 7: 1, 0: 1}
    assert alike.origin == {3: -5}
    tally = Tally.of(zip(mixed, [raw] * len(mixed), strict=True))
    loaded = Tally.load((k, codec.encode_count(n)) for k, n in tally.all_rows())
    assert tally.origin == loaded.origin == {3: 5, 7: 1, 0: 1}
    tally.commit(alike)
    assert tally.origin == {7: 1, 0: 1}


_TIMES = st.one_of(st.integers(0, 2**64 - 1),
                   st.integers(1_700_000_000_000, 1_700_000_000_000 + 10 * 3_600_000))
_STAMPS = st.one_of(st.integers(-(2**63), 2**63 - 1),
                    st.integers(1_700_000_000_000, 1_700_000_000_000 + 10 * 3_600_000))


@given(st.lists(st.tuples(_TIMES, _STAMPS), max_size=60))
def test_minute_runs_count_as_the_struct_passes(entries: list[tuple[int, int]]) -> None:
    """The compiled pass (:func:`tally._minute_runs`) counts each entry in the due and
    slack minutes the struct and Counter passes of ``count_all`` do, runs or not."""
    keys = [codec.encode_due_key(due, 0, i) for i, (due, _) in enumerate(entries)]
    values = [codec.encode_index_value(codec.IndexValue(codec.Fingerprint(stamp, 1), None, "t"))
              for _, stamp in entries]
    runs = tally._minute_runs(keys, values)
    assert runs is not None
    assert runs[0] == dict(Counter(due // MINUTE_MS for due, _ in entries))
    assert runs[1] == dict(Counter((stamp - due) // MINUTE_MS for due, stamp in entries))


def test_minute_runs_refuse_short_keys_and_values() -> None:
    """A key or value too short to hold its time gives None (count_all then raises)."""
    value = codec.encode_index_value(codec.IndexValue(codec.Fingerprint(1, 1), None, "t"))
    assert tally._minute_runs([b"short"], [value]) is None
    assert tally._minute_runs([codec.encode_due_key(1, 0, 0)], [b"short"]) is None
