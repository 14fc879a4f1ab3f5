"""The RocksDB index of one request partition.

One store (rocksdict, raw mode) per request partition, three column families:

- ``default``: the due index, ``due key -> index value`` (see :mod:`kdelay.protocol.codec`);
- ``ids``: ``id key -> pending due key | how and when its schedule ended``,
  for dedup, cancel and their outcomes; an id key is the id, and its lane when
  the request named one (:func:`~kdelay.protocol.idkeys.encode_id_key`);
- ``expiry``: ``end time | schedule id -> ""``, so that ended-id markers older
  than the id window can be found (:meth:`expired_ids`) without a scan of every id;
- ``sweep``: ``first due key | u64 sequence -> due keys end to end``, chunks of
  the entries that are done and covered by the partition's watermark (see
  :class:`~kdelay.protocol.codec.Watermark`) but whose put is still in the
  changelog: each gets a tombstone later, off the delivery path, so that
  compaction can drop the put (:meth:`unswept`). A chunk per write, not a key
  per entry: a delivered batch costs one sweep write;
- ``meta``: the offsets the index covers (``consumed``: the next requests offset
  to read; ``changelog``: the next changelog offset to replay), when the store
  was last known in step with the changelog (``synced``, see :meth:`mark_synced`),
  the latest watermark written or replayed (``watermark``), and the exact
  tally of pending entries (:mod:`kdelay.state.tally`), written with every batch.

Every change, with the offsets it covers, is written in one ``WriteBatch``, so
the store is never ahead of or behind its own offsets. Scans are bounded by an
``iterate_upper_bound`` and start from a remembered head instead of the first
key: delivered entries leave tombstones at the front of a queue-like keyspace,
and seeking past them again on every tick would cost more the longer a store
lives.
"""

from __future__ import annotations

import itertools
import operator
import shutil
import struct
import time
from collections import deque
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, cast

from rocksdict import AccessType, Rdict, ReadOptions, WriteBatch, WriteOptions

from kdelay.protocol import codec, idkeys
from kdelay.protocol.codec import IdState, IndexValue, Watermark
from kdelay.state.changes import Changes, Entry, collect, put_all, put_each
from kdelay.state.memory import PropertyReader, StoreMemory, shared
from kdelay.state.replay import FreshRun
from kdelay.state.statedir import IndexLocked, StateDirFull, no_space
from kdelay.state.tally import MINUTE_MS, Change, Tally, change_of, deleted_change

IDS_CF = "ids"
META_CF = "meta"
EXPIRY_CF = "expiry"
SWEEP_CF = "sweep"
# The most keys one sweep chunk holds (20 kB).
SWEEP_CHUNK = 1_000
_SEQUENCE = struct.Struct(">Q")
# The request partition and offset of a due key, as bytes that order as the pair.
_WHERE = operator.itemgetter(slice(codec.DUE_KEY_SIZE - 12, codec.DUE_KEY_SIZE))
_PARTITION_BYTES = 4
_LAST_PARTITION, _LAST_OFFSET = 2**32 - 1, 2**64 - 1  # the largest a due key holds
CONSUMED = b"consumed"
CHANGELOG = b"changelog"
SYNCED = b"synced"
WATERMARK = b"watermark"
# The most scanned entries whose values an index keeps for their deletion (13 MB):
# delivery holds at most 20 batches of a partition (20 000 entries by default). Past
# the cap the values are dropped and deletes look their keys up again.
SCANNED_CAP = 100_000
# The key spans of the latest writes with puts an index remembers: a range of keys
# read before the oldest of them is deleted key by key (see PartitionIndex._delete).
PUT_SPANS = 1_024
# What rocksdict's stubs accept as a key; a list of them makes ``get`` a multi-get.
_RdictKey = str | int | float | bytes | bool


def _after_prefix(prefix: bytes) -> bytes:
    """The smallest key above every key that starts with ``prefix`` (its last byte is not 0xff)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class IndexCorrupt(Exception):
    """The store on disk cannot be opened or read; it must be rebuilt from the changelog."""


class Scan(NamedTuple):
    """What :meth:`PartitionIndex.scan_raw` read: keys and encoded values as columns."""

    keys: list[bytes]
    values: list[bytes]
    gapless: bool  # no key between the first and last read was skipped: they are all there
    puts_seen: int  # PartitionIndex.puts_applied when they were read
    shelf_first: bytes = b""  # the first key passed over as shelved (b"": none)
    shelf_last: bytes = b""  # the last one


@dataclass(frozen=True, slots=True)
class DueSummary:
    """The entries due by some time: how many (up to a limit) and their oldest request."""

    count: int
    # The smallest request timestamp (ms) among the entries counted; None if none.
    oldest_request_ms: int | None
    # Whether counting stopped at the limit with more entries due.
    capped: bool


class PartitionIndex:
    """The index of one request partition, stored under ``path``.

    Not thread-safe: one thread at a time owns it. Its RocksDB memory comes
    out of ``memory`` (:func:`kdelay.state.memory.shared` when None). Raises
    :class:`IndexLocked` when another process holds the store, and
    :class:`IndexCorrupt` when it cannot be opened for any other reason.
    With a :class:`~kdelay.state.budget.StoreBudget` as ``memory`` (an operator's
    copy) its memory is bounded tighter and it writes no write-ahead log.
    """

    def __init__(self, path: Path, partition: int, memory: StoreMemory | None = None) -> None:
        self.path = path
        self.partition = partition
        self.memory = memory = memory or shared()
        path.parent.mkdir(parents=True, exist_ok=True)
        families = {IDS_CF: memory.options(looked_up=True), META_CF: memory.options(),
                    EXPIRY_CF: memory.options(), SWEEP_CF: memory.options()}
        try:
            self._db = Rdict(str(path), memory.store_options(),
                             column_families=families, access_type=AccessType.read_write())
        except Exception as exc:
            if no_space(exc):
                raise StateDirFull(path, str(exc)) from None
            if "lock" in str(exc).lower():
                raise IndexLocked(f"index {path} is in use by another process: {exc}") from exc
            raise IndexCorrupt(f"cannot open index {path}: {exc}") from exc
        self._ids = self._db.get_column_family(IDS_CF)
        self._meta = self._db.get_column_family(META_CF)
        self._expiry = self._db.get_column_family(EXPIRY_CF)
        self._sweep = self._db.get_column_family(SWEEP_CF)
        self._ids_handle = self._db.get_column_family_handle(IDS_CF)
        self._meta_handle = self._db.get_column_family_handle(META_CF)
        self._expiry_handle = self._db.get_column_family_handle(EXPIRY_CF)
        self._sweep_handle = self._db.get_column_family_handle(SWEEP_CF)
        written = memory.write_options()
        if written is not None:
            for db in (self._db, self._ids, self._meta, self._expiry, self._sweep):
                db.set_write_options(written)
        self._head = b""
        # Where the next :meth:`unswept` starts: every sweep chunk below it is swept.
        self._sweep_head = b""
        # Sweep chunk ids end with a sequence number: unique within this process,
        # and starting from the time, unique across its restarts too.
        self._chunks = time.time_ns()
        # The keys in the sweep list, and the size of each chunk :meth:`unswept` handed out.
        self.sweep_backlog = self._count_unswept()
        self._handed: dict[bytes, int] = {}
        self._full = False
        # The encoded values of entries :meth:`scan` returned, by key, while they are
        # certainly in the store: every write to the due keys goes through
        # :meth:`apply`, which drops the keys it deletes or puts. Deleting a scanned
        # entry (a delivery) then needs no lookup to count it out of the tally.
        self._scanned: dict[bytes, bytes] = {}
        # How many writes with puts were applied, and the key span of the latest
        # (their sequence number, lowest and highest key put): a range of keys read
        # before is deleted as a range only when no put since fell inside it.
        self.puts_applied = 0
        self._put_spans: deque[tuple[int, bytes, bytes]] = deque(maxlen=PUT_SPANS)
        self.tally = self._load_tally()
        # While set (a restore into an empty store), the highest request partition and
        # offset (:data:`_WHERE`) of any key put since, by request partition: see
        # :meth:`fresh`.
        self._fresh: dict[bytes, bytes] | None = None
        self._bulk = False  # writing without the write-ahead log: see :meth:`bulk`
        raw = self._meta.get(WATERMARK)
        self.watermark: Watermark | None = None if raw is None else codec.decode_watermark(raw)

    def close(self) -> None:
        """Close the store and release its lock; the object is unusable afterwards.

        Raises :class:`StateDirFull` when closing finds no room on the volume
        (it flushes what the store holds in memory): a store other than the
        one whose write failed meets the full volume here.
        """
        try:
            self._ids.close()
            self._meta.close()
            self._expiry.close()
            self._sweep.close()
            del self._ids_handle, self._meta_handle, self._expiry_handle, self._sweep_handle
            self._db.close()
        except Exception as exc:
            # After a write found no room, closing fails with the writer's
            # "previous error": StateDirFull already reported it.
            if self._full:
                return
            if no_space(exc):
                self._full = True
                raise StateDirFull(self.path, str(exc)) from None
            raise

    def families(self) -> list[PropertyReader]:
        """The store's column families, for reading RocksDB properties (memory use)."""
        return [self._db, self._ids, self._meta, self._expiry, self._sweep]

    def bulk(self, on: bool) -> None:
        """Write without the write-ahead log while ``on`` (a restore), flushing when it ends.

        Unlogged writes that a crash loses are harmless in a restore: the
        changelog offset is written in the same batches, and the store flushes
        its column families atomically when a memtable fills
        (:meth:`StoreMemory.store_options`), so what survives a crash is a
        prefix of the batches, offset included, and the next restore replays
        from wherever the flushed store stands. Turning it off flushes every
        column family (:meth:`_flush_all`), after which the store is as durable
        as one written with the log. Meanwhile the due index's memtable is
        smaller (:meth:`StoreMemory.memtable_bytes`): most of the restore is
        flushed in the background as it goes, not in that last flush.
        """
        if on == self._bulk:
            return
        self._bulk = on
        options = WriteOptions()
        # A property at run time, a method in rocksdict's stubs.
        options.disable_wal = on  # type: ignore[method-assign,assignment]
        self._db.set_write_options(options)
        self._db.set_options({"write_buffer_size": str(self.memory.memtable_bytes(on))})
        if not on:
            self._flush_all()

    def _flush_all(self) -> None:
        """Flush every column family's memtable, the offsets last.

        A manual flush of one family flushes that family alone, atomic flush
        or not: flushing only the due index once left the offsets, watermark,
        tally and ids of a whole restore in memory, unlogged, and a kill then
        lost them while the entries stayed (a store whose watermark was gone
        judged entries done that were pending). Entries go first and ``meta``
        last, so a crash between two flushes leaves the offsets behind the
        entries, never ahead: the next restore replays the difference again.
        """
        for family in (self._db, self._ids, self._expiry, self._sweep, self._meta):
            family.flush()

    @staticmethod
    def destroy(path: Path) -> None:
        """Remove a store from disk, whatever state it is in (even a file in its place)."""
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def offset(self, name: bytes) -> int | None:
        """Return a covered offset (``CONSUMED`` or ``CHANGELOG``), or None if never set."""
        raw = self._meta.get(name)
        return None if raw is None else codec.decode_offset(raw)

    def synced_ms(self) -> int | None:
        """Return when the store was last known in step with the changelog, or None if never."""
        return self.offset(SYNCED)

    def mark_synced(self, now_ms: int) -> None:
        """Record that at ``now_ms`` the store holds every changelog record's effect but
        those of records appended since (the writes in flight).

        Compaction removes a tombstone no sooner than the changelog's
        ``delete.retention.ms`` after it was appended, so a store last in step
        within that time can still be caught up from its changelog offset; an
        older one may miss deletions and must be rebuilt whole.
        """
        self._meta[SYNCED] = codec.encode_offset(now_ms)

    def id_state(self, schedule_id: str) -> IdState | None:
        """Return what the index knows of a schedule id (its id key, :func:`idkeys.id_key`:
        the id and its lane), or None."""
        raw = self._ids.get(idkeys.encode_id_key(schedule_id))
        return None if raw is None else codec.decode_id_state(raw)

    def get(self, key: bytes) -> IndexValue | None:
        """Return the index value stored under a due key, or None."""
        raw = self._db.get(key)
        return None if raw is None else codec.decode_index_value(raw)

    def raw_values(self, keys: list[bytes]) -> list[bytes | None]:
        """Return the encoded index values under ``keys`` (None where absent), in one lookup."""
        if not keys:
            return []
        return cast(list[bytes | None], self._db.get(cast(list[_RdictKey], keys)))

    def apply(self, changes: Changes) -> bytes | None:
        """Write ``changes``, the offsets they cover and the tally's change in one atomic batch.

        One multi-get tells which put keys are new and which deleted keys are
        there: only those change the :attr:`tally`, so re-applying a batch (a
        request read again, a changelog record replayed twice) counts nothing twice.
        Returns the lowest key put, or None when the changes put nothing: a
        reader of the index (delivery) learns from it that an entry may have
        landed inside a range it has already read.
        """
        batch = WriteBatch(raw_mode=True)
        put = batch.put
        fresh = changes.fresh
        # Fresh puts alone (intake's usual batch) are written from their lists, no dict.
        new = changes.encoded_puts() if changes.puts or changes.raw_puts else {}
        put_keys = [*new] if new else fresh.keys
        absent = changes.absent
        if self._fresh is not None:
            if new:
                absent = self._unseen(list(new), absent, self._fresh)
            if fresh.keys:  # certainly new; only the highest put moves
                self._unseen(fresh.keys, set(), self._fresh)
        change = self._tally_change(new, changes, absent)
        self._put_tally(batch, change)
        if new:
            put_all(put, new)
        else:
            put_each(put, fresh.keys, fresh.values)
        lowest = min(put_keys) if put_keys else None
        if lowest is not None:
            self.puts_applied += 1
            self._put_spans.append((self.puts_applied, lowest, max(put_keys)))
        self._delete(batch, changes)
        for schedule_id, state in changes.ids.items():
            raw_id = idkeys.encode_id_key(schedule_id)
            if state is None:
                batch.delete(raw_id, self._ids_handle)
            else:
                put(raw_id, codec.encode_id_state(state), self._ids_handle)
                if state.ended_ms is not None:
                    put(codec.encode_expiry_key(state.ended_ms, schedule_id), b"",
                        self._expiry_handle)
        for key in changes.expired:
            batch.delete(key, self._expiry_handle)
        if changes.consumed is not None:
            put(CONSUMED, codec.encode_offset(changes.consumed), self._meta_handle)
        if changes.changelog is not None:
            put(CHANGELOG, codec.encode_offset(changes.changelog), self._meta_handle)
        if changes.watermark is not None:
            put(WATERMARK, codec.encode_watermark(changes.watermark), self._meta_handle)
        swept = changes.swept
        for start in range(0, len(swept), SWEEP_CHUNK):
            chunk = swept[start : start + SWEEP_CHUNK]
            self._chunks += 1
            put(min(chunk) + _SEQUENCE.pack(self._chunks), b"".join(chunk), self._sweep_handle)
        for chunk_id in changes.unswept:
            batch.delete(chunk_id, self._sweep_handle)
        self.sweep_backlog += len(swept) - sum(self._handed.pop(chunk_id, 0)
                                                for chunk_id in changes.unswept)
        if lowest is not None and self._head and lowest < self._head:
            self._head = lowest  # the next scan starts no later than the keys written
        self._write(batch)
        self.tally.commit(change)
        if changes.watermark is not None:
            self.watermark = changes.watermark
        if swept and self._sweep_head and min(swept) < self._sweep_head:
            self._sweep_head = min(swept)
        scanned = self._scanned
        if scanned:
            for key in (*changes.deletes, *put_keys):
                scanned.pop(key, None)
        return lowest

    def _delete(self, batch: WriteBatch, changes: Changes) -> None:
        """Add the deletes of ``changes`` to ``batch``: each of its ``ranges`` that no
        put since it was read fell into as one range tombstone (a burst's settle writes
        one instead of a thousand), every other key on its own."""
        deletes, delete = changes.deletes, batch.delete
        at = 0
        for start, end, seen in changes.ranges:
            first, last = deletes[start], deletes[end - 1]
            if not self._untouched(first, last, seen):
                continue
            for key in deletes[at:start]:
                delete(key)
            batch.delete_range(first, last + b"\x00")  # the least key after ``last``
            at = end
        for key in deletes[at:]:
            delete(key)

    def _untouched(self, first: bytes, last: bytes, seen: int) -> bool:
        """Whether no write since the ``seen``-th with puts (this one's too) put a key
        between ``first`` and ``last``: false when the spans kept do not go back so far."""
        spans = self._put_spans
        if seen < self.puts_applied and (not spans or spans[0][0] > seen + 1):
            return False
        for sequence, lowest, highest in reversed(spans):
            if sequence <= seen:
                return True
            if lowest <= last and highest >= first:
                return False
        return True

    def _write(self, batch: WriteBatch) -> None:
        """Write ``batch`` atomically; :class:`StateDirFull` when the volume has no room."""
        try:
            self._db.write(batch)
        except Exception as exc:
            if no_space(exc):
                self._full = True
                raise StateDirFull(self.path, str(exc)) from None
            raise

    def _tally_change(self, new: dict[bytes, bytes], changes: Changes,
                      absent: set[bytes]) -> Change:
        """How the puts ``new`` and the deletes of ``changes`` move the tally
        (:func:`change_of`). Deletes whose values ``changes`` names, or that a scan
        read (untouched since: certainly in the store), need no lookup; a batch of
        only such deletes (delivery's) is counted without one; nor do puts
        ``absent`` names (certainly not in the store)."""
        deletes, given, fresh = changes.deletes, changes.known, changes.fresh
        if not new and not fresh.keys and changes.deleted_values is not None:
            return deleted_change(deletes, changes.deleted_values)
        if not new and not deletes and not given:
            # Intake's usual batch: fresh puts alone, certainly new, nothing deleted; no
            # lookup, and no pass over the keys to find their extremes or origin.
            change = Change()
            change.count_all(fresh.keys, fresh.values, 1, extremes=fresh.extremes(),
                             origin=fresh.origin)
            return change
        if fresh.keys:
            if not new:
                new = dict(zip(fresh.keys, fresh.values, strict=True))
            absent = absent.union(fresh.keys)
        if new and not deletes and not given and absent.issuperset(new):
            # Every put certainly new, nothing deleted: no lookup, no pass in Python.
            change = Change()
            change.count_all([*new], [*new.values()], 1)
            return change
        known, scanned = given, self._scanned
        if scanned and (new or len(given) != len(deletes)):  # else given names every delete
            known = {key: scanned[key] for key in deletes if key in scanned}
            known.update(given)
        return change_of(new, deletes, known, absent, self.raw_values)

    def fresh(self, on: bool) -> None:
        """While ``on`` (a restore into an empty store), tell most keys put new without
        looking them up.

        Every entry of a store that was empty was put since: a key whose
        request offset lies above the highest of its request partition (both in
        the due key) put since cannot be in the store, and the tally counts it
        new without the multi-get that tells new keys from keys already there
        (most of a restore's cost). A changelog replays a partition's requests
        in about their offset order, so that is nearly every key; the others
        (a schedule rescheduled back, a record replayed twice) are looked up as
        usual. The tally stays exact and is written with every batch, so a
        restore cut short leaves a counted store. ValueError when ``on`` and the
        store holds entries.
        """
        if not on:
            self._fresh = None
            return
        if self.tally.total or self.first_key_any() is not None:
            raise ValueError(f"index {self.path} holds entries: it is not fresh")
        self._fresh = {}

    @staticmethod
    def _unseen(keys: list[bytes], absent: set[bytes], seen: dict[bytes, bytes]
                ) -> set[bytes]:
        """``absent`` and the put ``keys`` above the highest put so far of their request
        partition (``seen``, see :meth:`fresh`), which takes ``keys`` in.

        The bytes of partition and offset are compared in C; a batch of one
        request partition (the usual) costs no Python code a key.
        """
        where = list(map(_WHERE, keys))
        low, high = min(where), max(where)
        partition = low[:_PARTITION_BYTES]
        if high.startswith(partition):  # one request partition
            before = seen.get(partition, b"")
            unseen = set(keys) if low > before else {
                key for key, at in zip(keys, where, strict=True) if at > before}
            seen[partition] = max(high, before)
        else:
            unseen = {key for key, at in zip(keys, where, strict=True)
                      if at > seen.get(at[:_PARTITION_BYTES], b"")}
            for at in where:
                if at > seen.get(at[:_PARTITION_BYTES], b""):
                    seen[at[:_PARTITION_BYTES]] = at
        return unseen | absent if absent else unseen

    def _put_tally(self, batch: WriteBatch, change: Change) -> None:
        """Add to ``batch`` the tally rows ``change`` moves (a row counted down to 0 deleted)."""
        for key, count in self.tally.rows(change):
            if count > 0:
                batch.put(key, codec.encode_count(count), self._meta_handle)
            else:
                batch.delete(key, self._meta_handle)

    def put_run(self, run: FreshRun, changelog: int) -> bool:
        """Write a restore's run of new puts (:class:`FreshRun`), its tally counted, with
        its consumed offset and the changelog offset it reaches, in one batch, as
        :meth:`apply` would; False (nothing written) unless the store is :meth:`fresh`
        and the run's first key lies above every key put since for its request partition.
        """
        seen, keys = self._fresh, run.keys
        if seen is None or not keys:
            return False
        first, last = _WHERE(keys[0]), _WHERE(keys[-1])  # the run's offsets increase
        partition = first[:_PARTITION_BYTES]
        if first <= seen.get(partition, b""):
            return False
        change = run.change()
        batch = WriteBatch(raw_mode=True)
        put = batch.put
        self._put_tally(batch, change)
        put_each(put, keys, run.values)
        if run.consumed is not None:
            put(CONSUMED, codec.encode_offset(codec.decode_offset(run.consumed)),
                self._meta_handle)
        put(CHANGELOG, codec.encode_offset(changelog), self._meta_handle)
        # Bounds of the keys put, from their due times (no pass over the keys): at or
        # below the lowest, at or above the highest.
        lowest = codec.encode_due_key(run.first_due, 0, 0)
        self.puts_applied += 1
        self._put_spans.append((self.puts_applied, lowest, codec.encode_due_key(
            run.last_due, _LAST_PARTITION, _LAST_OFFSET)))
        if self._head and lowest < self._head:
            self._head = lowest
        self._write(batch)
        self.tally.commit(change)
        seen[partition] = last
        if self._scanned:
            for key in keys:
                self._scanned.pop(key, None)
        return True

    def first_key_any(self) -> bytes | None:
        """The smallest key of the due index, tombstones skipped (one seek from the start)."""
        it = self._db.iter(ReadOptions())
        it.seek_to_first()
        key = cast(bytes, it.key()) if it.valid() else None
        del it
        return key

    def _load_tally(self) -> Tally:
        """The stored tally; a store without one, or with one of an older layout (made
        before it existed or counted by request partition), is counted once."""
        if self._meta.get(codec.TALLY_COMPLETE) == codec.TALLY_VERSION:
            it = self._meta.iter(ReadOptions())
            it.seek(codec.TALLY_PREFIX)
            stored = []
            while it.valid() and it.key().startswith(codec.TALLY_PREFIX):
                stored.append((it.key(), it.value()))
                it.next()
            return Tally.load(stored)
        return self._counted()

    def _counted(self) -> Tally:
        """Count the store from scratch, store that tally (in place of any stored before)
        as complete, and return it."""
        # The store's own iterator, not raw_items' generator: a third of the time.
        tally = Tally.of(cast(Iterator[tuple[bytes, bytes]], self._db.items()), ordered=True)
        batch = WriteBatch(raw_mode=True)
        batch.delete_range(codec.TALLY_PREFIX, _after_prefix(codec.TALLY_PREFIX),
                           self._meta_handle)
        for key, count in tally.all_rows():
            batch.put(key, codec.encode_count(count), self._meta_handle)
        batch.put(codec.TALLY_COMPLETE, codec.TALLY_VERSION, self._meta_handle)
        self._write(batch)
        return tally

    def scan_raw(self, upper_ms: int, limit: int, skip: Container[bytes] = (),
                 start: bytes | None = None,
                 shelved: Callable[[bytes, bytes], bool] | None = None) -> Scan:
        """Return the keys and encoded values :meth:`scan` would return, as two lists.

        For delivery's read-ahead, which holds entries as columns: nothing is
        decoded, and the caller passes the values back (``Changes.known``) when
        it deletes the entries, as a range when the scan was gapless
        (``Changes.ranges``). Entries that ``shelved`` answers True for, given
        key and encoded value, are passed over (see :func:`~kdelay.state.changes.collect`):
        the scan says the first and last of them.
        """
        keys: list[bytes] = []
        values: list[bytes] = []
        seen = self.puts_applied
        if limit <= 0:
            return Scan(keys, values, True, seen)
        upper = codec.due_upper_bound(upper_ms)
        options = ReadOptions()
        options.set_iterate_upper_bound(upper)
        begin = start if start is not None else self._head
        # gap: how many keys were read when the first key was passed over after them
        gap, first_live, shelf_first, shelf_last = collect(
            cast(Iterator[tuple[bytes, bytes]], self._db.items(from_key=begin, read_opt=options)),
            skip, limit, keys, values, shelved)
        if start is None:  # as in scan: start the next scan past the tombstones
            self._head = first_live or upper
        del options
        return Scan(keys, values, gap < 0 or gap == len(keys), seen, shelf_first, shelf_last)

    def scan(self, upper_ms: int, limit: int, skip: Container[bytes] = (),
             start: bytes | None = None) -> list[Entry]:
        """Return up to ``limit`` entries due at or before ``upper_ms``, in key order.

        Keys in ``skip`` (entries in flight or waiting for a retry) are passed
        over without counting towards ``limit``, so a failing target never
        hides the entries behind it. With ``start`` the scan begins at that key
        (a caller's cursor past what it already holds) instead of the head.
        """
        found: list[Entry] = []
        if limit <= 0:
            return found
        scanned = self._scanned
        if len(scanned) > SCANNED_CAP:  # entries read but never written since: start over
            scanned.clear()
        if start is not None:
            for key, raw in self._iterate(codec.due_upper_bound(upper_ms), start=start):
                if key not in skip:
                    found.append(Entry(key, codec.decode_index_value(raw)))
                    scanned[key] = raw
                    if len(found) >= limit:
                        break
            return found
        first_live = b""
        for key, raw in self._iterate(codec.due_upper_bound(upper_ms)):
            first_live = first_live or key
            if key in skip:
                continue
            found.append(Entry(key, codec.decode_index_value(raw)))
            scanned[key] = raw
            if len(found) >= limit:
                break
        # Everything below the bound that is not found is deleted: start the next
        # scan past those tombstones. Inserts below the head move it back.
        self._head = first_live or codec.due_upper_bound(upper_ms)
        return found

    def cover(self, watermark: Watermark) -> Changes:
        """Return the changes that apply ``watermark`` to the entries in the store.

        Every entry in the store was put before the watermark record (changelog
        replay applies what came before a watermark first), so each one it
        covers is done: deleted, its id released unless the id already names
        another state, and noted for a sweep tombstone. The changes also record
        the watermark. For changelog replay; reads every key below the bound.
        """
        changes = Changes(watermark=watermark)
        pending = watermark.pending
        for key, raw in self._iterate(watermark.bound, from_head=False):
            if key in pending:
                continue
            changes.deletes.append(key)
            changes.swept.append(key)
            schedule_id = codec.schedule_id_of(raw)
            if schedule_id is not None:
                state = self.id_state(schedule_id)
                if state is not None and state.pending_key == key:
                    changes.ids[schedule_id] = None
        return changes

    def unswept(self, limit: int) -> list[tuple[bytes, list[bytes]]]:
        """Return sweep chunks (their id, and their keys) of up to about ``limit`` keys.

        At least one chunk, whole, when any is left. The scan starts at the
        remembered sweep head (chunks swept leave tombstones at the front of the
        column family, as delivered entries do in the due index) and moves it
        past what it returns.
        """
        it = self._sweep.iter(ReadOptions())
        if self._sweep_head:
            it.seek(self._sweep_head)
        else:
            it.seek_to_first()
        found: list[tuple[bytes, list[bytes]]] = []
        count = 0
        while it.valid() and (not found or count < limit):
            raw = cast(bytes, it.value())
            keys = [raw[at : at + codec.DUE_KEY_SIZE]
                    for at in range(0, len(raw), codec.DUE_KEY_SIZE)]
            found.append((cast(bytes, it.key()), keys))
            self._handed[found[-1][0]] = len(keys)
            count += len(keys)
            it.next()
        del it
        if found:
            self._sweep_head = found[-1][0] + b"\x00"
        return found

    def _count_unswept(self) -> int:
        """Count the keys in the sweep list (a walk over it: at open)."""
        return sum(len(raw) for raw in cast(Iterator[bytes], self._sweep.values())
                   ) // codec.DUE_KEY_SIZE

    def rewind_sweep(self) -> None:
        """Start the next :meth:`unswept` from the first key again (a sweep was given up)."""
        self._sweep_head = b""

    def entries(self, upper_ms: int | None = None) -> Iterator[Entry]:
        """Iterate over every pending entry (due at or before ``upper_ms``), in key order."""
        bound = None if upper_ms is None else codec.due_upper_bound(upper_ms)
        for key, raw in self._iterate(bound, from_head=False):
            yield Entry(key, codec.decode_index_value(raw))

    def raw_items(self, upper_ms: int | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Iterate over ``(due key, encoded index value)`` of every pending entry, in key order.

        Bounded by ``upper_ms`` like :meth:`entries`, without decoding: for
        readers that go over a whole store and need only part of each entry.
        """
        options = ReadOptions()
        if upper_ms is not None:
            options.set_iterate_upper_bound(codec.due_upper_bound(upper_ms))
        # A generator keeps ``options`` alive while iterating: RocksDB's
        # iterator reads its upper bound from them.
        yield from cast(Iterator[tuple[bytes, bytes]], self._db.items(read_opt=options))

    def first_key(self) -> bytes | None:
        """Return the smallest pending due key, or None when nothing is pending.

        The :attr:`tally` bounds the walk over the tombstones of delivered
        entries (which a RocksDB iterator steps over one by one until they are
        compacted away): nothing is read when it counts no entry, and the walk
        starts no earlier than the earliest due minute it counts.
        """
        due = self.tally.due
        if not due:
            return None
        start = max(self._head, codec.encode_due_key(min(due) * MINUTE_MS, 0, 0))
        for key, _ in self._iterate(None, start=start):
            self._head = key
            return key
        return None

    def keys_below(self, bound: bytes) -> list[bytes]:
        """Every pending due key below ``bound``, in key order.

        For delivery's watermark state after an open or a restore: every entry
        still in the store below the partition's watermark bound is pending,
        whether the watermark lists it or it was put after the watermark was
        written. The walk starts at the earliest due minute the :attr:`tally`
        counts, so the tombstones of delivered entries below it are not read.
        """
        due = self.tally.due
        if not due:
            return []
        start = codec.encode_due_key(min(due) * MINUTE_MS, 0, 0)
        return [key for key, _ in self._iterate(bound, start=start)]

    def last_key(self) -> bytes | None:
        """Return the largest pending due key, or None when nothing is pending.

        A seek back from the end of the latest due minute the :attr:`tally`
        counts: the tombstones of entries due later are never read. (A plain
        seek to the last key walked back over every tombstone of a drained
        index: 0.15-0.5 s a partition after a few minutes at 5 k/s.)
        """
        due = self.tally.due
        if not due:
            return None
        it = self._db.iter(ReadOptions())
        it.seek_for_prev(codec.encode_due_key((max(due) + 1) * MINUTE_MS, 0, 0))
        key = cast(bytes, it.key()) if it.valid() else None
        del it
        return key

    def due_summary(self, upper_ms: int, limit: int) -> DueSummary:
        """Count the entries due at or before ``upper_ms`` and find their oldest request.

        Stops after ``limit`` entries (then ``capped`` is set and the oldest
        request is the oldest among those counted). Reads from the remembered
        head, so its cost is bounded by ``limit`` plus the tombstones ahead.
        """
        due = itertools.islice(self._iterate(codec.due_upper_bound(upper_ms)), limit + 1)
        stamps = [codec.request_timestamp_of(raw) for _, raw in due]
        capped = len(stamps) > limit
        del stamps[limit:]
        return DueSummary(len(stamps), min(stamps, default=None), capped)

    def count_due(self, from_ms: int, upper_ms: int) -> int:
        """Count the entries due from ``from_ms`` to ``upper_ms``, both included, key by key
        (for a span the :attr:`tally`'s minutes cannot tell: part of one minute)."""
        if upper_ms < from_ms:
            return 0
        return sum(1 for _ in self._iterate(codec.due_upper_bound(upper_ms),
                                            start=codec.encode_due_key(from_ms, 0, 0)))

    def first_key_after(self, after_ms: int) -> bytes | None:
        """Return the smallest key due after ``after_ms``, or None (one seek)."""
        if not self.tally.due:
            return None
        it = self._db.iter(ReadOptions())
        it.seek(codec.due_upper_bound(after_ms))
        key = cast(bytes, it.key()) if it.valid() else None
        del it
        return key

    def expired_ids(self, before_ms: int, limit: int) -> list[tuple[str, bytes]]:
        """Up to ``limit`` ids whose schedules ended before ``before_ms``, with their expiry keys.

        An ended-id marker answers a late duplicate or cancel of its id with
        the first outcome; past the id window it serves nothing. An id
        scheduled again since (pending, or ended later) keeps its newer state:
        its id comes back as ``""`` so that only the stale expiry key goes.
        The caller deletes both (``Changes.ids``, ``Changes.expired``).
        """
        options = ReadOptions()
        options.set_iterate_upper_bound(codec.expiry_upper_bound(before_ms))
        it = self._expiry.iter(options)
        it.seek_to_first()
        found: list[tuple[str, bytes]] = []
        while it.valid() and len(found) < limit:
            key = it.key()
            ended_ms, schedule_id = codec.decode_expiry_key(key)
            state = self.id_state(schedule_id)
            current = state is not None and state.ended_ms == ended_ms
            found.append((schedule_id if current else "", key))
            it.next()
        del it
        return found

    def id_states(self) -> Iterator[tuple[str, IdState]]:
        """Every schedule id (id key) the store holds, with its state (a full scan; for tools)."""
        for raw_id, raw in self._ids.items():
            yield (idkeys.decode_id_key(cast(bytes, raw_id)),
                   codec.decode_id_state(cast(bytes, raw)))

    def id_count(self) -> int:
        """Return the number of schedule ids the store holds (a full scan; for tests, tools)."""
        return sum(1 for _ in self._ids.keys())

    def _iterate(
        self, upper: bytes | None, *, from_head: bool = True, start: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        options = ReadOptions()
        if upper is not None:
            options.set_iterate_upper_bound(upper)
        it = self._db.iter(options)
        if start is not None:
            it.seek(start)
        elif from_head and self._head:
            it.seek(self._head)
        else:
            it.seek_to_first()
        while it.valid():
            yield it.key(), it.value()
            it.next()
