"""Changelog replay into a real index, confirmed positions, and opening a store for restore.

No broker: replay is driven through ``_apply`` with the records a restore would
stage, and :func:`open_restored` gets a fake restorer.
"""

from __future__ import annotations

import gc
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest
from confluent_kafka import KafkaError, Message
from prometheus_client import CollectorRegistry, Counter, Gauge

from kdelay.protocol import codec, idkeys
from kdelay.protocol.codec import Fingerprint, IdState, IndexValue
from kdelay.state.changelog import (
    Progress,
    RestoreError,
    Restorer,
    Staging,
    StaleIndex,
    Staleness,
    _apply,
    _collector_paused,
    _stage,
    logged_progress,
    open_restored,
)
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import (
    CHANGELOG,
    CONSUMED,
    PartitionIndex,
)
from kdelay.state.replay import FreshRun
from kdelay.state.statedir import IndexLocked
from kdelay.state.tally import Tally

T0 = 1_700_000_000_000
PART = 4
K1 = codec.encode_due_key(T0 + 10, PART, 1)
K2 = codec.encode_due_key(T0 + 20, PART, 2)
# Values as kdelay writes them now (with their target); V3 as versions before wrote them.
V1 = IndexValue(Fingerprint(T0, 111), "order-1", "orders")
V2 = IndexValue(Fingerprint(T0, 222), None, "orders")
V3 = IndexValue(Fingerprint(T0, 333), "order-3")


@pytest.fixture
def index(tmp_path: Path) -> Iterator[PartitionIndex]:
    idx = PartitionIndex(tmp_path / "store", PART)
    yield idx
    idx.close()


def staged(*records: tuple[bytes, IndexValue | None]) -> dict[bytes, bytes | None]:
    return {k: None if v is None else codec.encode_index_value(v) for k, v in records}


def entries(index: PartitionIndex) -> list[Entry]:
    return list(index.entries())


# -- replay ------------------------------------------------------------------------


def test_puts_become_entries_and_pending_ids(index: PartitionIndex) -> None:
    k3 = codec.encode_due_key(T0 + 3_000, 0, 3)
    _apply(index, staged((K1, V1), (K2, V2), (k3, V3)), 7)
    assert entries(index) == [Entry(K1, V1), Entry(K2, V2), Entry(k3, V3)]
    assert index.id_state("order-1") == IdState(K1, None)
    assert index.id_state("order-3") == IdState(k3, None), "a value of the first layout too"
    assert index.offset(CHANGELOG) == 7
    assert index.offset(CONSUMED) is None


def test_a_tombstone_deletes_the_entry_and_clears_its_id(index: PartitionIndex) -> None:
    other = codec.encode_due_key(T0 + 30, PART, 3)
    _apply(index, staged((K1, V1), (K2, V2), (other, IndexValue(Fingerprint(T0, 3), "keep"))), 3)
    _apply(index, staged((K1, None)), 9)
    assert [e.key for e in entries(index)] == [K2, other]
    assert index.get(K1) is None
    assert index.id_state("order-1") is None
    assert index.id_state("keep") == IdState(other, None)
    assert index.offset(CHANGELOG) == 9


def ended_record(sid: str, state: IdState) -> dict[bytes, bytes | None]:
    return {codec.id_record_key(sid): codec.encode_id_state(state)}


def test_an_ended_id_is_remembered_after_its_tombstone(index: PartitionIndex) -> None:
    _apply(index, staged((K1, V1)), 3)
    done = codec.ended(codec.End.DELIVERED, T0 + 11, K1, V1.fingerprint)
    _apply(index, {**staged((K1, None)), **ended_record("order-1", done)}, 5)
    assert entries(index) == []
    assert index.id_state("order-1") == done
    assert index.expired_ids(T0 + 12, 10) == [("order-1", codec.encode_expiry_key(T0 + 11,
                                                                                 "order-1"))]


def test_the_same_id_of_two_lanes_and_of_none_is_restored_as_three(
        index: PartitionIndex) -> None:
    dev1, dev2 = idkeys.id_key("order-1", "dev1"), idkeys.id_key("order-1", "dev2")
    laned = IndexValue(Fingerprint(T0, 444), dev1, "dev1.orders")
    k3 = codec.encode_due_key(T0 + 30, PART, 3)
    _apply(index, staged((K1, V1), (k3, laned)), 3)
    done = codec.ended(codec.End.CANCELLED, T0 + 11, K2, V1.fingerprint)
    _apply(index, ended_record(dev2, done), 4)
    assert index.id_state("order-1") == IdState(K1, None)
    assert index.id_state(dev1) == IdState(k3, None)
    assert index.id_state(dev2) == done
    assert sorted(index.id_states()) == sorted([("order-1", IdState(K1, None)),
                                                (dev1, IdState(k3, None)), (dev2, done)])
    assert index.expired_ids(T0 + 12, 10) == [(dev2, codec.encode_expiry_key(T0 + 11, dev2))]
    _apply(index, staged((k3, None)), 5)
    assert index.id_state(dev1) is None
    assert index.id_state("order-1") == IdState(K1, None), "the lane-less id is another"


def test_an_ended_id_in_the_same_batch_as_its_put_and_tombstone(index: PartitionIndex) -> None:
    done = codec.ended(codec.End.CANCELLED, T0, K1, V1.fingerprint)
    _apply(index, {**staged((K1, None)), **ended_record("order-1", done)}, 5)
    assert index.id_state("order-1") == done


def test_a_dropped_marker_forgets_an_ended_id_but_never_a_pending_one(
        index: PartitionIndex) -> None:
    done = codec.ended(codec.End.DELIVERED, T0, K2, V1.fingerprint)
    _apply(index, ended_record("old", done), 2)
    _apply(index, {codec.id_record_key("old"): None}, 3)
    assert index.id_state("old") is None
    _apply(index, staged((K1, V1)), 4)
    _apply(index, {codec.id_record_key("order-1"): None}, 5)
    assert index.id_state("order-1") == IdState(K1, None)


def test_an_id_scheduled_again_after_its_marker_was_dropped_is_pending(
        index: PartitionIndex) -> None:
    done = codec.ended(codec.End.DELIVERED, T0, K2, V1.fingerprint)
    _apply(index, ended_record("order-1", done), 2)
    _apply(index, {codec.id_record_key("order-1"): None, **staged((K1, V1))}, 4)
    assert index.id_state("order-1") == IdState(K1, None)


def test_a_tombstone_for_an_unknown_key_only_moves_the_position(index: PartitionIndex) -> None:
    _apply(index, staged((K2, V2)), 3)
    _apply(index, staged((K1, None)), 4)
    assert entries(index) == [Entry(K2, V2)]
    assert index.offset(CHANGELOG) == 4


def test_replaying_the_same_records_again_yields_the_same_store(index: PartitionIndex) -> None:
    records = staged((K1, V1), (K2, V2))
    _apply(index, records, 5)
    _apply(index, records, 5)
    assert entries(index) == [Entry(K1, V1), Entry(K2, V2)]
    assert index.id_state("order-1") == IdState(K1, None)


def test_the_consumed_marker_sets_the_consumed_offset(index: PartitionIndex) -> None:
    records: dict[bytes, bytes | None] = {codec.CONSUMED_MARKER: codec.encode_offset(1234),
                                          **staged((K1, V1))}
    _apply(index, records, 11)
    assert index.offset(CONSUMED) == 1234
    assert index.offset(CHANGELOG) == 11
    assert entries(index) == [Entry(K1, V1)], "the marker is not an entry"


def test_a_clock_probe_is_passed_over_without_a_warning(
    index: PartitionIndex, caplog: pytest.LogCaptureFixture,
) -> None:
    _apply(index, {codec.CLOCK_PROBE: None, **staged((K1, V1))}, 12)
    assert entries(index) == [Entry(K1, V1)]
    assert index.offset(CHANGELOG) == 12
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("key", [b"", b"short", K1[:-1], K1 + b"\x00", b"x" * 64])
def test_keys_of_another_length_are_ignored(index: PartitionIndex, key: bytes) -> None:
    _apply(index, {key: codec.encode_index_value(V2), **staged((K2, V2))}, 6)
    assert entries(index) == [Entry(K2, V2)]
    assert index.offset(CONSUMED) is None
    assert index.offset(CHANGELOG) == 6


def test_a_tombstone_of_the_consumed_marker_is_ignored(index: PartitionIndex) -> None:
    _apply(index, {codec.CONSUMED_MARKER: codec.encode_offset(50)}, 1)
    _apply(index, {codec.CONSUMED_MARKER: None}, 2)
    assert index.offset(CONSUMED) == 50
    assert index.offset(CHANGELOG) == 2


def test_the_position_is_written_even_for_an_empty_batch(index: PartitionIndex) -> None:
    _apply(index, {}, 42)
    assert index.offset(CHANGELOG) == 42
    assert entries(index) == []


def test_a_value_too_short_or_with_a_bad_id_is_ignored_and_the_rest_applied(
    index: PartitionIndex,
) -> None:
    bad_id = codec.encode_index_value(IndexValue(Fingerprint(T0, 5), None)) + b"\xff"
    other = codec.encode_due_key(T0 + 30, PART, 3)
    _apply(index, {K1: b"short", other: bad_id, **staged((K2, V1))}, 8)
    assert entries(index) == [Entry(K2, V1)]
    assert index.id_state("order-1") == IdState(K2, None)
    assert index.offset(CHANGELOG) == 8


def test_a_rescheduled_id_points_at_its_new_entry(index: PartitionIndex) -> None:
    _apply(index, staged((K1, V1)), 1)
    again = IndexValue(Fingerprint(T0, 333), "order-1")
    _apply(index, staged((K1, None), (K2, again)), 3)
    assert entries(index) == [Entry(K2, again)]
    assert index.id_state("order-1") == IdState(K2, None)


# -- staging consumed messages ----------------------------------------------------------


def message(offset: int, key: bytes | None, value: bytes | None,
            error: KafkaError | None = None) -> Message:
    return Message(topic="kdelay.changelog", partition=PART, offset=offset, key=key,
                   value=value, error=error)


def eof(offset: int) -> Message:
    return message(offset, None, None, KafkaError(KafkaError._PARTITION_EOF))


def test_staging_keeps_the_latest_value_per_key_and_returns_the_next_offset() -> None:
    into = Staging()
    v1, v2 = codec.encode_index_value(V1), codec.encode_index_value(V2)
    reached = _stage(into, [message(4, K1, v1), message(5, K2, v2), message(6, K1, None)],
                     100, "chg")
    assert reached == 7
    assert into.after == {K1: None, K2: v2}


def test_staging_an_empty_batch_reaches_nothing() -> None:
    into = Staging()
    assert _stage(into, [], 100, "chg") is None
    assert len(into) == 0


def test_staging_stops_at_the_end_of_the_partition_and_skips_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    into = Staging()
    failed = message(0, None, None, KafkaError(KafkaError._TRANSPORT))
    batch = [message(4, K1, b"a"), failed, message(5, None, b"b"), eof(6), message(6, K2, b"c")]
    assert _stage(into, batch, 6, "chg") == 6
    assert into.after == {K1: b"a", b"": b"b"}, "a null key stages as empty, to be dropped as odd"
    assert "restoring chg" in caplog.text


def test_staging_skips_errors_and_reaches_past_the_last_message() -> None:
    into = Staging()
    failed = message(0, None, None, KafkaError(KafkaError._TRANSPORT))
    assert _stage(into, [message(4, K1, b"a"), failed], 100, "chg") == 5
    assert into.after == {K1: b"a"}


# -- replay in batches against a record-at-a-time model ----------------------------------

Record = tuple[bytes, bytes | None]


def replay(index: PartitionIndex, records: list[Record], batch: int) -> None:
    """Stage and apply ``records`` (offsets 0…) ``batch`` messages at a time, as a restore does."""
    for start in range(0, len(records), batch):
        chunk = records[start : start + batch]
        into = Staging()
        reached = _stage(into, [message(start + i, k, v) for i, (k, v) in enumerate(chunk)],
                         len(records), "chg")
        assert reached is not None
        _apply(index, into, reached)


@dataclass
class Model:
    """A changelog applied one record at a time: what a replay must end with."""

    store: dict[bytes, bytes] = field(default_factory=dict)
    ids: dict[str, bytes] = field(default_factory=dict)
    consumed: int | None = None
    # Keys a watermark found done with no record of their own since: each needs a
    # tombstone; and every key a watermark ever found done (a tombstone may be redundant).
    sweep: set[bytes] = field(default_factory=set)
    covered: set[bytes] = field(default_factory=set)
    bound: bytes = codec.encode_due_key(0, 0, 0)

    def apply(self, key: bytes, raw: bytes | None) -> None:
        if key == codec.CONSUMED_MARKER:
            self.consumed = None if raw is None else codec.decode_offset(raw)
        elif key == codec.WATERMARK_MARKER:
            assert raw is not None
            mark = codec.decode_watermark(raw)
            for done in [k for k in self.store if mark.covers(k)]:
                self._drop(done)
                self.sweep.add(done)
                self.covered.add(done)
        elif raw is None:
            self._drop(key)
            self.sweep.discard(key)
        else:
            self.store[key] = raw
            self.sweep.discard(key)
            schedule_id = codec.schedule_id_of(raw)
            if schedule_id is not None:
                self.ids[schedule_id] = key

    def _drop(self, key: bytes) -> None:
        old = self.store.pop(key, None)
        old_id = None if old is None else codec.schedule_id_of(old)
        if old_id is not None:
            del self.ids[old_id]


def model(records: list[Record]) -> Model:
    """Apply ``records`` one at a time."""
    result = Model()
    for key, raw in records:
        result.apply(key, raw)
    return result


def history(seed: int, length: int, watermarks: bool = True) -> list[Record]:
    """A random changelog over a few keys: puts, tombstones, consumed markers and watermarks.

    Every third key carries a schedule id of its own, so no two pending
    entries share one, as intake guarantees. Watermarks keep the protocol's
    promise (:class:`~kdelay.protocol.codec.Watermark`): a bound never lower
    than the last one, and pending keys among those pending at the time.
    """
    rng = random.Random(seed)
    keys = [codec.encode_due_key(T0 + rng.randrange(1_000), PART, i) for i in range(12)]
    records: list[Record] = []
    now = Model()
    for offset in range(length):
        pick = rng.randrange(len(keys))
        roll = rng.random()
        if roll < 0.1:
            records.append((codec.CONSUMED_MARKER, codec.encode_offset(offset)))
        elif roll < 0.16 and watermarks:
            picked = rng.choice(keys)
            bound = max(now.bound, rng.choice([picked, codec.key_after(picked)]))
            below = [k for k in now.store if k < bound]
            pending = frozenset(k for k in below if rng.random() < 0.3)
            now.bound = bound
            records.append((codec.WATERMARK_MARKER,
                            codec.encode_watermark(codec.Watermark(bound, pending))))
        elif roll < 0.45:
            records.append((keys[pick], None))
        else:
            schedule_id = f"id-{pick}" if pick % 3 == 0 else None
            value = IndexValue(Fingerprint(T0, rng.randrange(2**32)), schedule_id,
                               rng.choice([None, "orders"]))
            records.append((keys[pick], codec.encode_index_value(value)))
        now.apply(*records[-1])
    return records


@pytest.mark.parametrize("batch", [1, 3, 7, 50, 400])
@pytest.mark.parametrize("seed", range(5))
def test_batched_replay_equals_record_at_a_time(tmp_path: Path, seed: int, batch: int) -> None:
    records = history(seed, 400)
    index = PartitionIndex(tmp_path / "store", PART)
    try:
        replay(index, records, batch)
        expected = model(records)
        store = expected.store
        assert {e.key: codec.encode_index_value(e.value) for e in entries(index)} == store
        for pick in range(0, 12, 3):
            pending = expected.ids.get(f"id-{pick}")
            state = index.id_state(f"id-{pick}")
            assert state == (None if pending is None else IdState(pending, None))
        assert index.offset(CONSUMED) == expected.consumed
        assert index.offset(CHANGELOG) == len(records)
        swept = {key for _, chunk in index.unswept(100_000) for key in chunk}
        assert expected.sweep <= swept, "every put a watermark covered awaits its tombstone"
        assert swept <= expected.covered, "and only those"
        counted = Tally.of(store.items())
        assert (index.tally.total, index.tally.due, index.tally.slack) == (
            counted.total, counted.due, counted.slack), "the tally is exact after a replay"
        replay(index, records, batch)
        assert {e.key: codec.encode_index_value(e.value) for e in entries(index)} == store, \
            "replaying again yields the same store"
        assert index.tally.total == len(store), "and counts nothing twice"
    finally:
        index.close()


# -- a restore into an empty store: runs of new puts ---------------------------------------


def intake_history(seed: int, length: int) -> list[Record]:
    """A changelog as intake and delivery write one: stretches of puts of increasing
    request offsets without an id, with consumed offsets and clock probes between
    them; and between those, a few records of the rest: a put replayed again, a
    tombstone, a put with an id, a forwarded schedule (a key of another request
    partition), a request timestamp before 1970, a watermark."""
    rng = random.Random(seed)
    records: list[Record] = []
    puts: list[bytes] = []
    offset, bound = 0, codec.encode_due_key(0, 0, 0)
    now = Model()

    def put(partition: int, schedule_id: str | None, stamp: int = T0) -> None:
        key = codec.encode_due_key(T0 + rng.randrange(300_000), partition, offset)
        value = IndexValue(Fingerprint(stamp, offset), schedule_id, rng.choice([None, "orders"]))
        records.append((key, codec.encode_index_value(value)))
        puts.append(key)

    while len(records) < length:
        for _ in range(rng.choice([0, 3, 30, 200, 700, 1_500])):  # intake's stretch
            roll = rng.random()
            if roll < 0.9:
                offset += rng.randint(1, 3)
                put(PART, None, T0 if roll > 0.02 else -rng.randrange(200_000))
            else:
                records.append((codec.CONSUMED_MARKER, codec.encode_offset(offset + 1))
                               if roll < 0.97 else (codec.CLOCK_PROBE, None))
            now.apply(*records[-1])
        for _ in range(rng.randrange(4) if puts else 0):  # the rest
            roll = rng.random()
            if roll < 0.2:
                again = rng.choice(puts)
                records.append(next(r for r in reversed(records) if r[0] == again and r[1]))
            elif roll < 0.4:
                records.append((rng.choice(puts), None))
            elif roll < 0.6:
                offset += 1
                put(PART, f"id-{offset}")
            elif roll < 0.8:
                put(PART + 1, None)
            else:
                bound = max(bound, codec.key_after(rng.choice(puts)))
                pending = frozenset(k for k in now.store if k < bound and rng.random() < 0.2)
                records.append((codec.WATERMARK_MARKER,
                                codec.encode_watermark(codec.Watermark(bound, pending))))
            now.apply(*records[-1])
    return records


def replay_slices(index: PartitionIndex, records: list[Record], take: int, per_write: int,
                  fresh: bool) -> None:
    """Replay ``records`` as :class:`Replay` does: ``take`` messages a consume, staged until
    ``per_write`` records and applied; with runs of new puts when ``fresh``."""
    offset = 0
    while offset < len(records):
        into = Staging(run=FreshRun() if fresh else None)
        while len(into) < per_write and offset < len(records):
            chunk = records[offset : offset + take]
            _stage(into, [message(offset + i, k, v) for i, (k, v) in enumerate(chunk)],
                   len(records), "chg")
            offset += len(chunk)
        _apply(index, into, offset)


@pytest.mark.parametrize(("take", "per_write"), [(1, 1), (5, 20), (40, 100), (200, 600)])
@pytest.mark.parametrize("seed", range(4))
def test_a_fresh_replay_in_runs_equals_record_at_a_time(
        tmp_path: Path, seed: int, take: int, per_write: int) -> None:
    records = intake_history(seed, 4_000)
    expected = model(records)
    index = PartitionIndex(tmp_path / "runs", PART)
    general = PartitionIndex(tmp_path / "general", PART)
    written: list[bool] = []
    put_run = index.put_run

    def spied(run: FreshRun, changelog: int) -> bool:
        written.append(put_run(run, changelog))
        return written[-1]

    index.put_run = spied  # type: ignore[method-assign]
    try:
        index.fresh(True)
        replay_slices(index, records, take, per_write, fresh=True)
        index.fresh(False)
        replay_slices(general, records, take, per_write, fresh=False)
        assert any(written), "runs were written as such"
        store = expected.store
        assert dict(index.raw_items()) == store == dict(general.raw_items())
        assert index.offset(CONSUMED) == expected.consumed == general.offset(CONSUMED)
        assert index.offset(CHANGELOG) == len(records)
        assert sorted(index.id_states()) == sorted(general.id_states())
        assert index.watermark == general.watermark
        assert {k for _, c in index.unswept(100_000) for k in c} == \
            {k for _, c in general.unswept(100_000) for k in c}
        counted = Tally.of(store.items())
        assert (index.tally.due, index.tally.slack, index.tally.origin) == (
            counted.due, counted.slack, counted.origin), "the tally is exact after a replay"
        assert sorted(index.tally.all_rows()) == sorted(general.tally.all_rows())
    finally:
        index.close()
        general.close()


def test_a_run_whose_first_key_was_put_before_is_written_the_general_way(
        index: PartitionIndex) -> None:
    def run_of(offsets: range) -> Staging:
        into = Staging(run=FreshRun())
        into.add([codec.encode_due_key(T0 + o * 60_000, PART, o) for o in offsets],
                 [codec.encode_index_value(V2)] * len(offsets))
        return into

    index.fresh(True)
    assert index.put_run(cast(FreshRun, run_of(range(10, 20)).run), 1)
    again, earlier = run_of(range(15, 25)), run_of(range(5, 8))
    assert not index.put_run(cast(FreshRun, again.run), 2), "15-19 may be in the store"
    assert not index.put_run(cast(FreshRun, earlier.run), 3), "and 5-7 may have been"
    _apply(index, again, 2)
    _apply(index, earlier, 3)
    assert index.tally.total == len(entries(index)) == 18, "each key counted once"
    assert index.offset(CHANGELOG) == 3


def test_a_run_is_not_written_as_such_into_a_store_that_was_not_empty(
        index: PartitionIndex) -> None:
    into = Staging(run=FreshRun())
    into.add([K1], [codec.encode_index_value(V2)])
    assert not index.put_run(cast(FreshRun, into.run), 4)
    _apply(index, into, 4)
    assert [e.key for e in entries(index)] == [K1]
    assert index.tally.total == 1


# -- the collector during a restore ------------------------------------------------------


def fail_while_paused() -> None:
    with _collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("restore failed")


def test_the_collector_is_paused_during_a_restore_and_resumed_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="restore failed"):
        fail_while_paused()
    assert gc.isenabled()


def test_a_collector_paused_elsewhere_stays_paused() -> None:
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


# -- open_restored ------------------------------------------------------------------------


class FakeRestorer:
    """Records what each restore saw in the index; raises StaleIndex ``stale`` times first."""

    def __init__(self, stale: int = 0, error: BaseException | None = None) -> None:
        self.stale = stale
        self.error = error
        self.seen: list[tuple[list[bytes], int | None]] = []
        self.progress: list[Progress | None] = []

    def restore(self, index: PartitionIndex, progress: Progress | None = None) -> int:
        self.seen.append(([e.key for e in index.entries()], index.offset(CHANGELOG)))
        self.progress.append(progress)
        if self.error is not None:
            raise self.error
        if self.stale:
            self.stale -= 1
            raise StaleIndex("index at changelog offset 50, changelog ends at 0")
        return 3


def restored(path: Path, restorer: FakeRestorer, progress: Progress | None = None,
             staleness: Staleness | None = None) -> tuple[PartitionIndex, int]:
    return open_restored(path, PART, cast(Restorer, restorer), progress, staleness)


def seed(path: Path, synced_ms: int | None = None) -> None:
    """Leave a closed store at ``path`` holding one entry and a changelog position of 50,
    marked in step with the changelog at ``synced_ms``."""
    idx = PartitionIndex(path, PART)
    idx.apply(Changes(puts=[Entry(K1, V1)], ids={"order-1": IdState(K1, None)}, changelog=50))
    if synced_ms is not None:
        idx.mark_synced(synced_ms)
    idx.close()


DAY_MS = 86_400_000


@pytest.mark.parametrize("age_ms", [0, DAY_MS // 2 - 1])
def test_a_store_in_step_within_half_the_tombstone_retention_is_caught_up(
    tmp_path: Path, age_ms: int,
) -> None:
    path = tmp_path / "store"
    seed(path, synced_ms=T0)
    restorer = FakeRestorer()
    index, _ = restored(path, restorer, staleness=Staleness(T0 + age_ms, DAY_MS))
    try:
        assert restorer.seen == [([K1], 50)]
        assert index.synced_ms() == T0 + age_ms, "marked in step as of the restore"
    finally:
        index.close()


@pytest.mark.parametrize("synced_ms", [T0 - DAY_MS // 2, None])
def test_a_store_out_of_step_too_long_or_never_marked_is_rebuilt_whole(
    tmp_path: Path, synced_ms: int | None,
) -> None:
    path = tmp_path / "store"
    seed(path, synced_ms=synced_ms)
    restorer = FakeRestorer()
    index, count = restored(path, restorer, staleness=Staleness(T0, DAY_MS))
    try:
        assert count == 3
        assert restorer.seen == [([], None)], "replayed whole into an empty store"
        assert index.get(K1) is None
        assert index.id_state("order-1") is None
        assert index.synced_ms() == T0
    finally:
        index.close()


def test_a_new_store_needs_no_mark_and_without_staleness_none_is_checked(tmp_path: Path) -> None:
    fresh, _ = restored(tmp_path / "new", FakeRestorer(), staleness=Staleness(T0, DAY_MS))
    fresh.close()
    path = tmp_path / "store"
    seed(path)
    restorer = FakeRestorer()
    index, _ = restored(path, restorer)
    try:
        assert restorer.seen == [([K1], 50)]
        assert index.synced_ms() is None
    finally:
        index.close()


def test_a_healthy_store_is_caught_up_in_place(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed(path)
    restorer = FakeRestorer()

    def progress(done: int, total: int) -> None:
        del done, total

    index, count = restored(path, restorer, progress)
    try:
        assert count == 3
        assert restorer.seen == [([K1], 50)]
        assert restorer.progress == [progress]
        assert index.get(K1) == V1
    finally:
        index.close()


def test_a_stale_store_is_destroyed_and_rebuilt_whole(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed(path)
    restorer = FakeRestorer(stale=1)
    index, count = restored(path, restorer)
    try:
        assert count == 3
        assert restorer.seen == [([K1], 50), ([], None)], "restore ran again on an empty store"
        assert index.get(K1) is None
        assert index.id_state("order-1") is None
        assert index.offset(CHANGELOG) is None
    finally:
        index.close()


def test_a_store_still_stale_after_a_rebuild_raises_and_is_released(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed(path)
    restorer = FakeRestorer(stale=2)
    with pytest.raises(StaleIndex):
        restored(path, restorer)
    assert len(restorer.seen) == 2
    PartitionIndex(path, PART).close()  # not left locked


def test_a_restore_error_releases_the_store(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed(path)
    with pytest.raises(RestoreError):
        restored(path, FakeRestorer(error=RestoreError("stuck")))
    again = PartitionIndex(path, PART)
    try:
        assert again.get(K1) == V1, "a failed catch-up keeps the store"
    finally:
        again.close()


def garbage_current(path: Path) -> None:
    path.mkdir()
    (path / "CURRENT").write_bytes(b"\xff\xfe not a manifest name")


def dangling_manifest(path: Path) -> None:
    path.mkdir()
    (path / "CURRENT").write_bytes(b"MANIFEST-000099\n")
    (path / "000001.sst").write_bytes(b"\x00" * 128)


@pytest.mark.parametrize("corrupt", [garbage_current, dangling_manifest])
def test_a_corrupt_store_is_rebuilt(tmp_path: Path, corrupt: Callable[[Path], None]) -> None:
    path = tmp_path / "store"
    corrupt(path)
    restorer = FakeRestorer()
    index, count = restored(path, restorer)
    try:
        assert count == 3
        assert restorer.seen == [([], None)]
        index.apply(Changes(puts=[Entry(K2, V2)]))
        assert index.get(K2) == V2
    finally:
        index.close()


def test_a_file_where_the_store_directory_should_be_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.write_bytes(b"not a rocksdb directory")
    restorer = FakeRestorer()
    index, count = restored(path, restorer)
    try:
        assert count == 3
        assert restorer.seen == [([], None)]
        assert path.is_dir()
    finally:
        index.close()


def test_a_store_held_open_elsewhere_raises_index_locked_and_stays_intact(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store"
    seed(path)
    held = PartitionIndex(path, PART)
    try:
        restorer = FakeRestorer()
        with pytest.raises(IndexLocked):
            restored(path, restorer)
        assert restorer.seen == [], "a locked store is never restored into"
        assert held.get(K1) == V1
        assert held.id_state("order-1") == IdState(K1, None)
    finally:
        held.close()
    reopened = PartitionIndex(path, PART)
    try:
        assert [e.key for e in reopened.entries()] == [K1]
        assert reopened.offset(CHANGELOG) == 50
    finally:
        reopened.close()


def test_restore_progress_sets_its_gauges_and_logs_at_most_every_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    restored = Counter("restored", "", registry=registry)
    remaining = Gauge("remaining", "", ["partition"], registry=registry)
    total = Gauge("total", "", ["partition"], registry=registry)
    now = [0.0]
    progress = logged_progress(2, restored, remaining, total, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kdelay.state.changelog"):
        progress(100, 1_000)
        now[0] = 5.0
        progress(300, 1_000)  # too soon to log
        now[0] = 11.0
        progress(600, 1_000)
        progress(1_000, 1_000)  # the end is always logged
    assert registry.get_sample_value("restored_total") == 1_000
    assert registry.get_sample_value("remaining", {"partition": "2"}) == 0
    assert registry.get_sample_value("total", {"partition": "2"}) == 1_000
    assert [r.getMessage() for r in caplog.records] == [
        "partition 2: restored 600/1000 changelog offsets",
        "partition 2: restored 1000/1000 changelog offsets"]
