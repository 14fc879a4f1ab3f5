"""The index changelog: a compacted topic that can rebuild any partition's index.

Record key = due key, value = encoded index value; a tombstone (value None)
when the entry is cancelled, or delivered or dead-lettered without a watermark
to cover it. Delivery mostly writes no tombstone per entry: a *watermark*
record (:data:`codec.WATERMARK_MARKER`, see :class:`~kdelay.protocol.codec.Watermark`)
says that every entry put before it with a key below its bound is done, but
for a few pending keys it names; the covered puts get their tombstones later,
off the delivery path (the index's ``sweep`` column family), so that compaction
still drops them. Partition ``p`` of the changelog mirrors partition ``p`` of
the requests topic. Payloads never go in.

Restore replays a changelog partition into a local index from the offset the
index says it has replayed up to (``CHANGELOG`` in its metadata; the whole
partition when the store is new). Replay is idempotent: re-applying a put, a
tombstone or a watermark yields the same store. It reads with
``read_committed``, so effects of transactions that never committed are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar, cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition
from prometheus_client import Counter, Gauge

from kdelay.plumbing.clients import reader_config, take, watermarks
from kdelay.protocol import codec
from kdelay.protocol.codec import IdState, Watermark
from kdelay.state.changes import Changes
from kdelay.state.index import CHANGELOG, IndexCorrupt, PartitionIndex
from kdelay.state.memory import StoreMemory
from kdelay.state.replay import FreshRun

T = TypeVar("T")
log = logging.getLogger(__name__)

APPLY_EVERY = 50_000
TAKE = 10_000  # the most records one consume returns
Progress = Callable[[int, int], None]
PartitionProgress = Callable[[int, int, int], None]
# Replayed records by changelog key, the latest value winning; None is a tombstone.
Staged = dict[bytes, bytes | None]


@dataclass(slots=True)
class Staging:
    """Records replayed but not yet written, split at the latest watermark record.

    ``before`` holds what came before the latest watermark (``mark``), ``after``
    what came after it: a put in ``before`` that the watermark covers is done,
    one in ``after`` is not, whatever its key. A newer watermark says all an
    older one did (:class:`~kdelay.protocol.codec.Watermark`), so only the
    latest is kept, and ``after`` joins ``before`` when one arrives.

    With a ``run`` (a restore into an empty store), records are kept in it for
    as long as they continue it (:class:`~kdelay.state.replay.FreshRun`); the
    first batch that does not moves the run into ``after``, and it and the rest
    are staged as above.
    """

    before: Staged = field(default_factory=dict)
    after: Staged = field(default_factory=dict)
    mark: Watermark | None = None
    run: FreshRun | None = None

    def __len__(self) -> int:
        return len(self.before) + len(self.after) + (len(self.run) if self.run else 0)

    def add(self, keys: list[bytes | None], values: list[bytes | None]) -> None:
        """Stage records in changelog order, cutting at each watermark record."""
        run = self.run
        if run is not None:
            if run.extend(keys, values):
                return
            self.end_run()
        self._add([key or b"" for key in keys], values)

    def end_run(self) -> None:
        """Stage the run's records as any others (its puts, its consumed offset) and
        keep no run from now on."""
        run, self.run = self.run, None
        if run is None:
            return
        self.after.update(zip(run.keys, run.values, strict=True))
        if run.consumed is not None:
            self.after[codec.CONSUMED_MARKER] = run.consumed

    def _add(self, keys: list[bytes], values: list[bytes | None]) -> None:
        start = 0
        while True:
            try:
                at = keys.index(codec.WATERMARK_MARKER, start)
            except ValueError:
                break
            self.after.update(zip(keys[start:at], values[start:at], strict=True))
            self._watermark(values[at])
            start = at + 1
        self.after.update(zip(keys[start:], values[start:], strict=True))

    def _watermark(self, raw: bytes | None) -> None:
        try:
            mark = None if raw is None else codec.decode_watermark(raw)
        except ValueError as exc:
            log.warning("changelog watermark ignored: %s", exc)
            return
        if mark is None:
            return
        self.before.update(self.after)
        self.after.clear()
        self.mark = mark


class StaleIndex(Exception):
    """The index claims changelog offsets the changelog does not have (topic recreated)."""


class RestoreError(Exception):
    """The changelog could not be read to its end before the deadline."""


class Restoring(Protocol):
    """What the service asks of a restorer."""

    def restore(self, index: PartitionIndex, progress: Progress | None = None) -> int:
        """Replay the changelog into ``index`` up to its end; return the records applied."""
        ...

    def begin(self, index: PartitionIndex, progress: Progress | None = None) -> Replay | None:
        """Start replaying the changelog into ``index``; None when it is already at the end."""
        ...

    def behind(self, index: PartitionIndex) -> bool:
        """Whether the changelog holds records ``index`` has not replayed."""
        ...

    def close(self) -> None:
        """Release the restorer's consumer."""
        ...


def restore_config(config: Mapping[str, str | int | bool],
                   fetch: Mapping[str, str | int | bool] | None = None
                   ) -> dict[str, str | int | bool]:
    """Return a consumer configuration for replaying changelog partitions; ``fetch``
    overrides its fetch and queue sizes (:meth:`~kdelay.state.budget.StoreBudget.fetch`)."""
    tuning: dict[str, str | int | bool] = {
        "auto.offset.reset": "earliest",
        # Changelog records are ~70 bytes: fetch in large chunks, not the 1 MiB default.
        "max.partition.fetch.bytes": 8 * 1024 * 1024,
        "fetch.max.bytes": 8 * 1024 * 1024,
        # The queue is bounded in records and bytes: a queued record costs
        # librdkafka several hundred bytes beside its own ~70, and a queue of a
        # million (64 MiB of records) took 520 MB of RSS in a 10 M restore. A fetch
        # holds ~100 k records, so the queue is often past queued.min.messages:
        # librdkafka then waits fetch.queue.backoff.ms before fetching again, 1 s by
        # default, on which restore stalled; 5 ms keeps it fed.
        "queued.min.messages": 100_000,
        "queued.max.messages.kbytes": 16 * 1024,
        "fetch.queue.backoff.ms": 5,
        # A fetch at the partition's end waits this long for records at the broker, and
        # a watermark lookup on the same connection waits behind it: the next
        # partition's restore began 0.35 s late with the default 500 ms.
        "fetch.wait.max.ms": 10,
    }
    tuning.update(fetch or {})
    return reader_config(config, "kdelay-restore", **tuning)


class Restorer:
    """Replays changelog partitions into indexes with one group-less consumer."""

    def __init__(self, config: Mapping[str, str | int | bool], topic: str, *,
                 timeout_s: float = 600.0,
                 fetch: Mapping[str, str | int | bool] | None = None) -> None:
        self._consumer = Consumer(restore_config(config, fetch))
        self._topic = topic
        self._timeout_s = timeout_s

    def close(self) -> None:
        """Close the consumer."""
        self._consumer.close()

    def __enter__(self) -> Restorer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def partitions(self) -> list[int]:
        """Return the changelog topic's partitions; :class:`RestoreError` if it is missing."""
        metadata = self._consumer.list_topics(self._topic, timeout=30)
        topic = metadata.topics.get(self._topic)
        if topic is None or topic.error is not None or not topic.partitions:
            raise RestoreError(f"changelog topic {self._topic} does not exist: run "
                               "`kdelay topics create`")
        return sorted(topic.partitions)

    def restore(self, index: PartitionIndex, progress: Progress | None = None) -> int:
        """Replay the changelog into ``index`` up to its current end; return records applied.

        :meth:`begin` and :meth:`Replay.advance` until done. Raises
        :class:`RestoreError` when the replay makes no progress for the
        timeout, and :class:`StaleIndex` when the index is past the changelog's
        end (the changelog was recreated): such an index must be rebuilt whole.
        """
        replay = self.begin(index, progress)
        if replay is None:
            return 0
        with replay:
            while not replay.advance():
                pass
        return replay.applied

    def behind(self, index: PartitionIndex) -> bool:
        """Whether the changelog holds records ``index`` has not replayed (a look at the
        partition's offsets, no read). :class:`StaleIndex` as :meth:`restore`."""
        low, high = self._watermarks(index.partition)
        start = index.offset(CHANGELOG)
        if start is not None and start > high:
            raise StaleIndex(f"index at changelog offset {start}, changelog ends at {high}")
        return (low if start is None or start < low else start) < high

    def begin(self, index: PartitionIndex, progress: Progress | None = None) -> Replay | None:
        """Start replaying the changelog into ``index`` up to its current end, or return
        None when the index is already there. :class:`StaleIndex` as :meth:`restore`.

        The restorer's consumer reads for the replay until it ends (it is
        closed, or done): one replay at a time.
        """
        low, high = self._watermarks(index.partition)
        start = index.offset(CHANGELOG)
        if start is not None and start > high:
            raise StaleIndex(f"index at changelog offset {start}, changelog ends at {high}")
        begin = low if start is None or start < low else start
        if begin >= high:
            return None
        tp = TopicPartition(self._topic, index.partition,
                            begin if start is not None else OFFSET_BEGINNING)
        self._consumer.assign([tp])
        return Replay(self._consumer, self._topic, index, begin, high, progress, self._timeout_s)

    def _watermarks(self, partition: int) -> tuple[int, int]:
        return watermarks(self._consumer, TopicPartition(self._topic, partition), 30)


class Replay:
    """One partition's restore under way, advanced a slice at a time (:meth:`advance`).

    The index is written without its write-ahead log meanwhile and flushed
    when the replay ends (:meth:`PartitionIndex.bulk`); an empty store counts
    its tally as it goes without looking up the keys it is given for the first
    time (:meth:`PartitionIndex.fresh`). :meth:`close` ends it, done or not
    (a replay given up leaves a store that the next restore carries on from).
    """

    def __init__(self, consumer: Consumer, topic: str, index: PartitionIndex, begin: int,
                 high: int, progress: Progress | None, stall_s: float) -> None:
        self._consumer = consumer
        self._topic = topic
        self.index = index
        self._begin = begin
        self.high = high
        self.position = begin
        self._progress = progress
        self._stall_s = stall_s
        self._moved = time.monotonic()
        self.applied = 0
        self._open = True
        # An empty store: its keys are new until seen, and runs of them are written
        # as such (:class:`FreshRun`).
        self._fresh = index.offset(CHANGELOG) is None and not index.tally.total and \
            index.first_key_any() is None
        if self._fresh:
            index.fresh(True)
        index.bulk(True)

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def done(self) -> bool:
        """Whether the changelog is replayed up to the end it had when the replay began."""
        return self.position >= self.high

    def advance(self, budget_s: float = math.inf) -> bool:
        """Replay for about ``budget_s`` seconds (at least one batch); return :attr:`done`.

        Once done, the store is flushed. :class:`RestoreError` when no record
        came for the stall timeout.
        """
        until = time.monotonic() + budget_s
        with _collector_paused():
            while not self.done:
                self._slice(until)
                if time.monotonic() >= until:
                    break
        if self.done and self._open:
            self.index.bulk(False)
            self.index.fresh(False)
        return self.done

    def _slice(self, until: float) -> None:
        """Stage up to :data:`APPLY_EVERY` records (fewer once ``until`` has passed) and
        write them in one batch."""
        staging = Staging(run=FreshRun() if self._fresh else None)
        while len(staging) < APPLY_EVERY and not self.done:
            if len(staging) and time.monotonic() >= until:
                break
            now = time.monotonic()
            if now - self._moved > self._stall_s:
                raise RestoreError(f"{self._topic}[{self.index.partition}] stuck at "
                                   f"{self.position}/{self.high}")
            reached = _stage(staging, take(self._consumer, TAKE, 0.5), self.high,
                             self._topic)
            if reached is not None and reached > self.position:
                self.position, self._moved = reached, now
        if not len(staging) and staging.mark is None and not self.done:
            return
        self.applied += len(staging) + (staging.mark is not None)
        _apply(self.index, staging, self.position)
        if self._progress is not None:
            self._progress(self.position - self._begin, self.high - self._begin)

    def close(self) -> None:
        """End the replay: the store leaves bulk mode (flushed), the consumer its partition."""
        if not self._open:
            return
        self._open = False
        self.index.fresh(False)
        try:
            self.index.bulk(False)
        finally:
            self._consumer.unassign()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block, if it is running.

    Every replayed record is a ``Message`` the collector tracks; a million of
    them trigger over a thousand collections, some over the whole heap, which
    cost a restore a fifth of its time. Messages hold no cycles, so reference
    counting frees them without the collector. Concurrent restores leave it
    paused until the one that paused it ends.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _stage(staged: Staging, messages: list[Message], high: int, topic: str) -> int | None:
    """Stage the keys and values of ``messages``; return the changelog position they reach.

    The position is ``high`` once the end-of-partition event is seen (messages
    after it are left for the next restore), else the offset after the last
    message, and None for an empty batch. Errors are rare, so the batch is
    searched for them once and then staged without a per-message branch.
    """
    reached = None
    if any(map(Message.error, messages)):
        messages, reached = _usable(messages, high, topic)
    staged.add(list(map(Message.key, messages)), list(map(Message.value, messages)))
    if reached is None and messages:
        reached = int(messages[-1].offset() or 0) + 1
    return reached


def _usable(messages: list[Message], high: int, topic: str) -> tuple[list[Message], int | None]:
    """Return the messages before the end-of-partition event, dropping (and logging) errors,
    and ``high`` if the event was seen."""
    usable: list[Message] = []
    for message in messages:
        error = message.error()
        if error is None:
            usable.append(message)
        elif error.code() == KafkaError._PARTITION_EOF:
            return usable, high
        else:
            log.warning("restoring %s: %s", topic, error)
    return usable, None


def _apply(index: PartitionIndex, staging: Staging | Staged, position: int) -> None:
    """Write replayed records and the changelog position they reach in one batch.

    The latest watermark, if any, goes first: it deletes the entries of the
    store it covers (all were put before it) and drops the puts staged before
    it that it covers; those are noted for a sweep tombstone. What is staged
    then becomes the batch's puts. Odd keys, tombstones and schedule ids are
    rare; each is looked for with one scan that runs in C (``map``, ``in``)
    and handled in Python only when present, so a batch of plain puts is
    sorted out without Python code per record.
    """
    if not isinstance(staging, Staging):  # records with no watermark among them
        staging = Staging(before=staging)
    if staging.run is not None:
        if index.put_run(staging.run, position):
            return
        staging.end_run()
    changes = Changes(changelog=position)
    staged = staging.before
    if staging.mark is not None:
        changes = _covered(index, staging, position)
    if staged:
        staged.update(staging.after)
    else:  # nothing before a watermark (a restore's usual batch): no copy
        staged = staging.after
    marker = staged.pop(codec.CONSUMED_MARKER, None)
    staged.pop(codec.CLOCK_PROBE, None)
    if marker is not None:
        changes.consumed = codec.decode_offset(marker)
    ended: Staged = {}
    if set(map(len, staged)) - {codec.DUE_KEY_SIZE}:
        ended = _ended_ids(staged)
        _drop_odd_keys(staged)
    if None in staged.values():
        _delete(index, staged, changes)
    if ended:
        _note_ended(index, ended, changes)
    # No tombstone is left in ``staged``.
    changes.raw_puts = cast(dict[bytes, bytes], staged)
    if changes.deletes and changes.raw_puts:  # put again after the watermark: pending
        changes.deletes = [key for key in changes.deletes if key not in changes.raw_puts]
    if set(map(len, changes.raw_puts.values())) - {codec.INDEX_HEAD_SIZE}:
        _note_ids(changes)
    index.apply(changes)


def _covered(index: PartitionIndex, staging: Staging, position: int) -> Changes:
    """Apply ``staging.mark`` to the store and to the puts staged before it.

    Returns the store's changes (deletes, released ids, sweep keys, the
    watermark itself) with the changelog position; the covered puts leave
    ``staging.before`` (a key whose latest record comes after the watermark
    stays, in ``staging.after``).
    """
    mark = staging.mark
    assert mark is not None  # noqa: S101 - the caller checks
    changes = index.cover(mark)
    changes.changelog = position
    before, after = staging.before, staging.after
    size = codec.DUE_KEY_SIZE
    covered = [key for key, raw in before.items()
               if raw is not None and len(key) == size and key not in after and mark.covers(key)]
    for key in covered:
        del before[key]
    changes.swept.extend(covered)
    return changes


def _ended_ids(staged: Staged) -> Staged:
    """Move the records of ended ids (see :func:`codec.id_record_key`) out of ``staged``."""
    prefix = codec.ID_RECORD_PREFIX
    return {key: staged.pop(key) for key in [k for k in staged if k.startswith(prefix)]}


def _note_ended(index: PartitionIndex, ended: Staged, changes: Changes) -> None:
    """Remember the ids whose schedules ended; forget those whose record was dropped.

    They apply after the batch's tombstones (which release their ids) and
    before its puts: an id scheduled again after its marker expired is pending.
    A dropped record never clears an id the index holds pending.
    """
    for key, raw in ended.items():
        try:
            schedule_id = codec.id_of_record_key(key)
            state = None if raw is None else codec.decode_id_state(raw)
        except ValueError as exc:
            log.warning("changelog record %r ignored: %s", key, exc)
            continue
        assert schedule_id is not None  # noqa: S101 - _ended_ids picked prefixed keys
        if state is not None:
            changes.ids[schedule_id] = state
            continue
        held = changes.ids.get(schedule_id, index.id_state(schedule_id))
        if held is None or held.pending_key is None:
            changes.ids[schedule_id] = None


def _drop_odd_keys(staged: Staged) -> None:
    """Remove (and log) keys that are not due keys: nothing else belongs in the changelog."""
    for key in [key for key in staged if len(key) != codec.DUE_KEY_SIZE]:
        log.warning("changelog key %r ignored: not a due key", key)
        del staged[key]


def _delete(index: PartitionIndex, staged: Staged, changes: Changes) -> None:
    """Move the tombstones out of ``staged`` into deletes, releasing their schedule ids.

    Keys the index does not hold (put and tombstoned inside one batch, or
    replayed twice) need no write at all; the values of those it holds, just
    read, spare the tally a second lookup (``changes.known``).
    """
    tombstones = [key for key, raw in staged.items() if raw is None]
    for key, old in zip(tombstones, index.raw_values(tombstones), strict=True):
        del staged[key]
        if old is not None:
            changes.deletes.append(key)
            changes.known[key] = old
            schedule_id = codec.schedule_id_of(old)
            if schedule_id is not None:
                changes.ids[schedule_id] = None


def _note_ids(changes: Changes) -> None:
    """Register the schedule ids of ``changes.raw_puts``; drop (and log) undecodable values."""
    plain, no_id = codec.INDEX_HEAD_SIZE, codec.NO_ID_WITH_TARGET
    # Values that name a target and no id, told in one C loop (no slice, no Python
    # call per value): a batch of only those needs nothing more.
    values = changes.raw_puts.values()
    if all(map(bytes.startswith, values, itertools.repeat(no_id), itertools.repeat(plain))):
        return
    for key, raw in [(k, v) for k, v in changes.raw_puts.items()
                     if len(v) != plain and not v.startswith(no_id, plain)]:
        try:
            schedule_id = codec.schedule_id_of(raw)
        except ValueError as exc:
            log.warning("changelog value for %r ignored: %s", key, exc)
            del changes.raw_puts[key]
            continue
        if schedule_id is not None:
            changes.ids[schedule_id] = IdState(key, None)


@dataclass(frozen=True, slots=True)
class Staleness:
    """When a store is too old to catch up: ``now_ms`` against the changelog's
    ``delete.retention.ms`` (``kept_ms``).

    Compaction removes a tombstone no sooner than ``kept_ms`` after it was
    appended. A store last in step with the changelog longer ago than that may
    hold entries whose tombstones are gone, and replaying from its changelog
    offset would bring them back as pending: delivered twice. Such a store is
    rebuilt whole. Half of ``kept_ms`` is the limit, so that a clock step of
    less than that between two runs cannot hide the age.
    """

    now_ms: int
    kept_ms: int

    @property
    def limit_ms(self) -> int:
        """The longest a store may have been out of step and still be caught up."""
        return self.kept_ms // 2

    def reason(self, index: PartitionIndex) -> str | None:
        """Why ``index`` must be rebuilt whole, or None when it may be caught up."""
        if index.offset(CHANGELOG) is None and not index.tally.due:
            return None  # a new store: replayed whole anyway
        synced = index.synced_ms()
        if synced is None:
            return "it does not record when it was last in step with the changelog"
        age = self.now_ms - synced
        if age < self.limit_ms:
            return None
        return (f"it was last in step with the changelog {age} ms ago, longer than "
                f"{self.limit_ms} ms (half the changelog's delete.retention.ms): "
                "compaction may have removed tombstones it has not seen")


LOG_EVERY_S = 10.0


def logged_progress(partition: int, restored: Counter, remaining: Gauge | None = None,
                    total: Gauge | None = None,
                    clock: Callable[[], float] = time.monotonic) -> Progress:
    """A restore's :data:`Progress` for ``partition``: counted in ``restored``, the
    offsets left and in all set in ``remaining`` and ``total`` (labelled by partition),
    and logged at most every :data:`LOG_EVERY_S` seconds and at the end."""
    last = [0]
    logged = [clock()]
    label = str(partition)

    def progress(done: int, all_: int) -> None:
        restored.inc(done - last[0])
        last[0] = done
        if remaining is not None:
            remaining.labels(partition=label).set(all_ - done)
        if total is not None:
            total.labels(partition=label).set(all_)
        now = clock()
        if done >= all_ or now - logged[0] >= LOG_EVERY_S:
            logged[0] = now
            log.info("partition %d: restored %d/%d changelog offsets", partition, done, all_)

    return progress


def open_restored(path: Path, partition: int, restorer: Restoring,
                  progress: Progress | None = None,
                  staleness: Staleness | None = None,
                  memory: StoreMemory | None = None) -> tuple[PartitionIndex, int]:
    """Open the index at ``path`` and catch it up from the changelog; return it and the count.

    A corrupt store, one past the changelog's end (the topic was recreated),
    and, given ``staleness``, one out of step with the changelog for too long
    (:class:`Staleness`) are destroyed and rebuilt whole; with ``staleness``
    the restored store is then marked in step as of ``staleness.now_ms``.
    :class:`IndexLocked` (another process holds the store) propagates: such a
    store is never touched. ``memory`` is the RocksDB budget the store shares.
    The whole replay runs in this call; :func:`begin_restore` runs it a slice
    at a time.
    """
    index, replayed = _rebuilt_if_stale(path, partition, staleness, memory,
                                         lambda index: restorer.restore(index, progress))
    return restored(index, staleness), replayed


def open_checked(path: Path, partition: int, restorer: Restoring,
                 staleness: Staleness | None = None,
                 memory: StoreMemory | None = None) -> tuple[PartitionIndex, bool]:
    """Open the index at ``path``; return it and whether the changelog is ahead of it.

    When it is not, the store is in step: finish it with :func:`restored`.
    When it is, replay it (:meth:`Restorer.begin`, :meth:`Replay.advance`)
    first. Stores are rebuilt whole, and errors propagate, as in
    :func:`open_restored`; ``memory`` is the RocksDB budget the store shares.
    """
    return _rebuilt_if_stale(path, partition, staleness, memory, restorer.behind)


def _rebuilt_if_stale(path: Path, partition: int, staleness: Staleness | None,
                      memory: StoreMemory | None,
                      use: Callable[[PartitionIndex], T]) -> tuple[PartitionIndex, T]:
    """Open the store at ``path`` and return it with what ``use`` makes of it; a store
    ``use`` finds past the changelog's end (:class:`StaleIndex`) is destroyed and opened
    once more, empty. The store is closed when ``use`` raises anything else."""
    for attempt in range(2):
        index = _open_fresh_enough(path, partition, staleness, memory)
        try:
            return index, use(index)
        except StaleIndex as exc:
            log.warning("partition %d: %s; rebuilding it whole", partition, exc)
            index.close()
            PartitionIndex.destroy(path)
            if attempt:
                raise
        except BaseException:
            index.close()
            raise
    raise AssertionError("unreachable")


def restored(index: PartitionIndex, staleness: Staleness | None) -> PartitionIndex:
    """Finish a store whose replay is done: with ``staleness``, mark it in step with the
    changelog as of ``staleness.now_ms``. Returns ``index``."""
    if staleness is not None:
        index.mark_synced(staleness.now_ms)
    return index


def _open_fresh_enough(path: Path, partition: int, staleness: Staleness | None,
                       memory: StoreMemory | None) -> PartitionIndex:
    """Open the store at ``path``, first destroying it if it is corrupt or too old."""
    try:
        index = PartitionIndex(path, partition, memory)
    except IndexCorrupt as exc:
        log.warning("%s; rebuilding it from the changelog", exc)
        PartitionIndex.destroy(path)
        return PartitionIndex(path, partition, memory)
    reason = None if staleness is None else staleness.reason(index)
    if reason is None:
        return index
    log.warning("partition %d: rebuilding the local store %s from the changelog: %s",
                partition, path, reason)
    index.close()
    PartitionIndex.destroy(path)
    return PartitionIndex(path, partition, memory)


def rebuild(restorer: Restorer, paths: Callable[[int], Path], *,
            partitions: Sequence[int] | None = None, fresh: bool = False,
            progress: PartitionProgress | None = None,
            staleness: Staleness | None = None) -> dict[int, int]:
    """Rebuild or catch up the local indexes of ``partitions`` (all when None) from the changelog.

    ``paths`` gives the store of a partition. With ``fresh`` the local stores
    are deleted first and rebuilt whole; ``staleness`` rebuilds whole the
    stores too old to catch up (:class:`Staleness`). Returns the records replayed per
    partition. Raises :class:`IndexLocked` when a running service holds a
    store, and :class:`RestoreError` when the changelog topic does not exist.
    The caller closes ``restorer``.
    """
    chosen = list(partitions) if partitions is not None else restorer.partitions()
    replayed: dict[int, int] = {}
    for partition in chosen:
        path = paths(partition)
        if fresh:
            PartitionIndex(path, partition).close()  # raises IndexLocked if in use
            PartitionIndex.destroy(path)
        step = None if progress is None else functools.partial(progress, partition)
        index, replayed[partition] = open_restored(path, partition, restorer, step, staleness)
        index.close()
    return replayed
