"""The cluster-wide view of what is pending, for operators.

The compacted changelog is the record of every pending entry of every request
partition, whichever instance owns it. :class:`PendingView` keeps a local copy
of it under a view directory of its own (never the service's ``--state-dir``,
whose stores ``kdelay run`` holds locked): one index store per partition, in
the service's own format, restored with :mod:`kdelay.state.changelog` and caught up
incrementally from the changelog offset it reached last time.

Cost: the first run replays the whole changelog (as a service restore does)
and takes as much disk as the service's indexes together, about 100 bytes per
pending entry; later runs replay only what was written since. A view left
unsynced longer than the changelog's ``delete.retention.ms`` may have missed
tombstones that compaction has since removed, so it is rebuilt whole.

The original records (target, key, value size, headers) are read back by
offset in sorted ranges with :class:`kdelay.state.originals.OriginalReader`, as
delivery reads them, and only for the entries a command shows; counting by
target (or by lane) reads every pending original once and keeps the targets
and lanes in the view (:class:`Targets`), so later counts read only what is new.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple, cast

from confluent_kafka import Message
from rocksdict import Options, Rdict, WriteBatch

from kdelay.errors import KdelayError
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import admin_client, topic_config
from kdelay.protocol import codec, envelope, idkeys
from kdelay.protocol.codec import record_time
from kdelay.state.budget import StoreBudget
from kdelay.state.changelog import RestoreError, Restorer, StaleIndex, open_restored
from kdelay.state.index import CONSUMED, PartitionIndex
from kdelay.state.originals import Found, Missing, OriginalReader
from kdelay.state.statedir import IndexLocked, store_path
from kdelay.state.tally import Tally

SYNCED_FILE = "synced_ms"
DEFAULT_DELETE_RETENTION_MS = 86_400_000
READ_CHUNK = 20_000
# The cache of (target, lane) by due key; the name changed when the lane joined
# the target, so a cache of targets alone is never read as one without lanes.
TARGETS_DIR = "routes"
_OLD_TARGETS_DIR = "targets"
# What rocksdict's stubs accept as a key; a list of them makes ``get`` a multi-get.
_RdictKey = str | int | float | bytes | bool
# librdkafka log level for short-lived admin clients: their teardown logs at 6 (info).
QUIET = 5
# (what, done, total): progress of a long step, for a bar on stderr.
Progress = Callable[[str, int, int], None]


class ViewBusy(KdelayError):
    """Another command holds the view directory; ``code`` is stable."""

    code = "view-in-use"


@dataclass(frozen=True, slots=True)
class Pending:
    """One pending entry: when it is due, where its request lies, how to recognise it."""

    due_ms: int
    partition: int
    offset: int
    fingerprint: codec.Fingerprint
    schedule_id: str | None
    lane: str | None = None  # the lane of schedule_id (an id is unique within its lane)

    @property
    def record_ms(self) -> int:
        """The request record's own timestamp, as intake fingerprinted it."""
        return self.fingerprint.timestamp_ms


class Columns(NamedTuple):
    """The pending entries of one partition, column by column, in due order."""

    due_ms: list[int]
    offsets: list[int]
    record_ms: list[int]


def pending_of(key: bytes, raw: bytes) -> Pending:
    """Decode one index entry; ValueError for bytes that are not one."""
    due_ms, partition, offset = codec.decode_due_key(key)
    value = codec.decode_index_value(raw)
    sid = value.schedule_id  # an id key: split into the id and its lane
    schedule_id, lane = (None, None) if sid is None else idkeys.split_id_key(sid)
    return Pending(due_ms, partition, offset, value.fingerprint, schedule_id, lane)


def view_path(view_dir: Path, settings: Settings) -> Path:
    """The view of one deployment: named by its changelog, told apart by cluster and topics."""
    identity = f"{settings.bootstrap_servers}|{settings.requests_topic}|{settings.changelog_topic}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return view_dir / f"{settings.changelog_topic}-{digest}"


def encode_route(target: str, lane: str | None) -> bytes:
    """The cached form of an original's target and lane: ``target`` or ``target\nlane``.

    Neither a topic nor a lane name can hold a line feed.
    """
    return target.encode() if lane is None else f"{target}\n{lane}".encode()


def decode_route(raw: bytes) -> tuple[str, str | None]:
    """The ``(target, lane)`` of a cached route (:func:`encode_route`)."""
    target, _, lane = raw.decode("utf-8", "replace").partition("\n")
    return target, lane or None


class Targets:
    """The routes (target and lane) of originals already read, by due key, kept between runs.

    An original never changes at its offset (the fingerprint was checked
    when it was read), so its target is read from Kafka once. Keys below
    the smallest pending due key can no longer be pending and are dropped by
    :meth:`prune`; a cancelled far-future entry stays until its due time
    passes.
    """

    def __init__(self, path: Path, budget: StoreBudget | None = None) -> None:
        """Open the cache at ``path``; one that cannot be opened (corrupt) starts empty.
        ``budget`` bounds its memory (see :mod:`kdelay.state.budget`).

        Raises :class:`ViewBusy` when another command holds it.
        """
        options = Options(raw_mode=True) if budget is None else budget.options()
        try:
            self._db = Rdict(str(path), options)
        except Exception as exc:
            if "lock" in str(exc).lower():
                raise ViewBusy(f"the target cache {path} is in use: {exc}") from None
            PartitionIndex.destroy(path)
            self._db = Rdict(str(path), options)
        if budget is not None:
            self._db.set_write_options(budget.write_options())

    def close(self) -> None:
        """Close the store."""
        self._db.close()

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        """The cached routes of ``keys`` (None where not cached), in one lookup."""
        if not keys:
            return []
        return cast(list[bytes | None], self._db.get(cast(list[_RdictKey], keys)))

    def put(self, found: dict[bytes, bytes]) -> None:
        """Remember routes (:func:`encode_route`) by due key."""
        self.put_many(found.keys(), found.values())

    def put_many(self, keys: Iterable[bytes], routes: Iterable[bytes]) -> None:
        """Remember ``routes`` (:func:`encode_route`) under the due ``keys``, pairwise."""
        batch = WriteBatch(raw_mode=True)
        put = batch.put
        for key, route in zip(keys, routes, strict=True):
            put(key, route)
        self._db.write(batch)

    def prune(self, lowest_pending: bytes | None) -> None:
        """Drop every key below ``lowest_pending`` (all keys when nothing is pending)."""
        self._db.delete_range(b"", lowest_pending or b"\xff" * (codec.DUE_KEY_SIZE + 1))


class PendingView:
    """A local copy of the changelog: every pending entry of the cluster.

    Use it as a context manager: entering syncs it with the changelog (see
    :meth:`sync`), leaving closes its stores. Raises :class:`ViewBusy` when
    another command holds the view, and
    :class:`~kdelay.state.changelog.RestoreError` when the changelog topic is missing
    or cannot be read to its end.

    A view may also stay open and be synced again (the console's): its stores are
    then caught up in place, and may be read from other threads meanwhile (RocksDB
    reads see a consistent state; the syncs themselves must take turns). ``budget``
    bounds its memory (:mod:`kdelay.state.budget`).
    """

    def __init__(self, settings: Settings, view_dir: Path, now_ms: int,
                 progress: Progress | None = None, budget: StoreBudget | None = None) -> None:
        self._settings = settings
        self._dir = view_path(view_dir, settings)
        self._now_ms = now_ms
        self._progress = progress
        self._budget = budget
        self._indexes: dict[int, PartitionIndex] = {}
        self._targets: Targets | None = None
        self.replayed: dict[int, int] = {}
        """The changelog records the sync on entering replayed, by partition."""

    def __enter__(self) -> PendingView:
        try:
            self.replayed = self.sync()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every store of the view."""
        for index in self._indexes.values():
            index.close()
        self._indexes.clear()
        if self._targets is not None:
            self._targets.close()
            self._targets = None

    @property
    def partitions(self) -> list[int]:
        """The request partitions the view holds."""
        return sorted(self._indexes)

    def sync(self, now_ms: int | None = None) -> dict[int, int]:
        """Catch every partition's store up with the changelog (as of ``now_ms`` when given);
        return records replayed.

        A view older than the changelog's ``delete.retention.ms`` is deleted
        and rebuilt whole first: tombstones it has not seen may be gone. An open
        view found so is not (other threads may be reading it): it raises
        :class:`~kdelay.state.changelog.RestoreError`, and is rebuilt when opened again.
        """
        if now_ms is not None:
            self._now_ms = now_ms
        fetch = None if self._budget is None else self._budget.fetch()
        restorer = Restorer(self._settings.client_config(), self._settings.changelog_topic,
                            fetch=fetch)
        try:
            partitions = restorer.partitions()
            if self._outlived_tombstones():
                if self._indexes:
                    raise RestoreError(
                        "this copy of the changelog was last synced longer ago than the "
                        "changelog's delete.retention.ms: tombstones may be gone; restart to "
                        "rebuild it")
                self._destroy(partitions)
            replayed = {p: self._open(p, restorer) for p in partitions}
        finally:
            restorer.close()
        self._dir.mkdir(parents=True, exist_ok=True)
        if self._targets is None:
            PartitionIndex.destroy(self._dir / _OLD_TARGETS_DIR)
            self._targets = Targets(self._dir / TARGETS_DIR, self._budget)
        (self._dir / SYNCED_FILE).write_text(str(self._now_ms))
        return replayed

    def _open(self, partition: int, restorer: Restorer) -> int:
        path = store_path(self._dir, self._settings.requests_topic, partition)
        progress = self._progress

        def step(done: int, total: int) -> None:
            if progress is not None:
                progress(f"changelog partition {partition}", done, total)

        index = self._indexes.get(partition)
        if index is not None:  # open: caught up in place
            try:
                return restorer.restore(index, step)
            except StaleIndex as exc:
                raise RestoreError(f"partition {partition} of this copy: {exc} (the changelog "
                                   "was recreated); restart to rebuild it") from None
        try:
            index, replayed = open_restored(path, partition, restorer, step,
                                            memory=self._budget)
        except IndexLocked as exc:
            raise ViewBusy(f"{exc}; another kdelay command is reading the same view "
                           "(wait for it or give another --view-dir)") from None
        self._indexes[partition] = index
        return replayed

    def _outlived_tombstones(self) -> bool:
        marker = self._dir / SYNCED_FILE
        if not marker.exists():
            return False
        synced_ms = int(marker.read_text() or "0")
        admin = admin_client(self._settings, log_level=QUIET)
        config = topic_config(admin, self._settings.changelog_topic)
        keep_ms = int(config.get("delete.retention.ms", DEFAULT_DELETE_RETENTION_MS))
        return self._now_ms - synced_ms >= keep_ms

    def _destroy(self, partitions: Iterable[int]) -> None:
        PartitionIndex.destroy(self._dir / TARGETS_DIR)
        for partition in partitions:
            PartitionIndex.destroy(store_path(self._dir, self._settings.requests_topic,
                                              partition))

    def report(self, what: str, done: int, total: int) -> None:
        """Pass progress of a long scan over the view to the progress callback, if any."""
        if self._progress is not None:
            self._progress(what, done, total)

    def entries(self, upper_ms: int | None = None,
                partitions: Iterable[int] | None = None) -> Iterator[Pending]:
        """Every pending entry due at or before ``upper_ms`` (all when None), in due order.

        Entries due at the same millisecond come in (partition, offset) order,
        the order delivery sends them in.
        """
        chosen = self.partitions if partitions is None else sorted(set(partitions))
        streams = [self._indexes[p].raw_items(upper_ms) for p in chosen if p in self._indexes]
        for key, raw in heapq.merge(*streams):
            yield pending_of(key, raw)

    def due_times(self, partition: int) -> Iterator[tuple[int, int, int]]:
        """``(due_ms, partition, offset)`` of every pending entry of ``partition``, in due order.

        Decodes only the keys, in one pass: for counting whole partitions.
        """
        keys = map(itemgetter(0), self._indexes[partition].raw_items())
        return codec.decode_due_keys(b"".join(keys))

    def columns(self, partition: int) -> dict[int, Columns]:
        """Due times, offsets and record times of every pending entry of ``partition``'s index,
        by the request partition its original lies on.

        That is the index's own partition, or another one for a schedule
        forwarded to its id's partition. Decoded in bulk, without a
        :class:`Pending` per entry: for checks over whole partitions.
        """
        items = list(self._indexes[partition].raw_items())
        keys = codec.decode_due_keys(b"".join(map(itemgetter(0), items)))
        stamps = codec.record_times(map(itemgetter(1), items))
        found: dict[int, Columns] = {}
        for (due_ms, origin, offset), record_ms in zip(keys, stamps, strict=True):
            columns = found.get(origin)
            if columns is None:
                columns = found[origin] = Columns([], [], [])
            columns.due_ms.append(due_ms)
            columns.offsets.append(offset)
            columns.record_ms.append(record_ms)
        return found

    @property
    def targets(self) -> Targets:
        """The view's cache of targets already read; only while the view is open."""
        if self._targets is None:
            raise RuntimeError("the view is not open")
        return self._targets

    def key_stream(self, partition: int) -> Iterator[bytes]:
        """Every pending due key of ``partition``, in due order, one at a time."""
        return map(itemgetter(0), self._indexes[partition].raw_items())

    def keys(self, partition: int) -> list[bytes]:
        """Every pending due key of ``partition``, in due order."""
        return [key for key, _ in self._indexes[partition].raw_items()]

    def raw_values(self, partition: int, keys: list[bytes]) -> list[bytes | None]:
        """The encoded index values of ``partition`` under ``keys`` (None: gone since)."""
        return self._indexes[partition].raw_values(keys)

    def count(self, partition: int) -> int:
        """How many entries ``partition``'s index holds (its tally)."""
        return self._indexes[partition].tally.total

    def tally(self, partition: int) -> Tally:
        """The exact counts of ``partition``'s index by due minute and by request
        partition (:mod:`kdelay.state.tally`): nothing is read."""
        return self._indexes[partition].tally

    def due_range(self, partition: int) -> tuple[int, int] | None:
        """The earliest and latest due times of ``partition``'s index, or None when it
        holds nothing (two seeks)."""
        index = self._indexes[partition]
        first, last = index.first_key(), index.last_key()
        if first is None or last is None:
            return None
        return codec.due_ms_of(first), codec.due_ms_of(last)

    def count_due(self, partition: int, from_ms: int, upper_ms: int) -> int:
        """How many entries of ``partition``'s index are due from ``from_ms`` to
        ``upper_ms``, both included (read key by key: keep the span short)."""
        return self._indexes[partition].count_due(from_ms, upper_ms)

    def pending(self, partition: int, keys: list[bytes]) -> list[Pending]:
        """The pending entries of ``partition`` under ``keys`` (skipping any gone since)."""
        raws = self._indexes[partition].raw_values(keys)
        return [pending_of(key, raw) for key, raw in zip(keys, raws, strict=True)
                if raw is not None]

    def find_id(self, schedule_id: str, lane: str | None = None) -> Pending | None:
        """The pending entry that holds ``schedule_id`` in ``lane`` (None: of no lane), or
        None (delivered, cancelled, unknown)."""
        key = idkeys.id_key(schedule_id, lane)
        for index in self._indexes.values():
            state = index.id_state(key)
            if state is not None and state.pending_key is not None:
                raw = index.raw_values([state.pending_key])[0]
                if raw is not None:
                    return pending_of(state.pending_key, raw)
        return None

    def ended_id(self, schedule_id: str, lane: str | None = None) -> codec.IdState | None:
        """How the schedule that held ``schedule_id`` in ``lane`` ended (delivered,
        cancelled, dead-lettered: the changelog's ended-id record, kept for the id
        window), or None while it is pending, or when the view knows no end of it."""
        key = idkeys.id_key(schedule_id, lane)
        for index in self._indexes.values():
            state = index.id_state(key)
            if state is not None and state.ended_ms is not None:
                return state
        return None

    def find(self, partition: int, offset: int) -> Pending | None:
        """The pending entry of the request at ``partition``/``offset``, or None.

        Scans the partition's keys (an entry is keyed by due time first), then
        those of the other partitions: a request whose id belongs to another
        partition is held by that partition's index.
        """
        if partition not in self._indexes:
            return None
        others = [p for p in self.partitions if p != partition]
        for index in (self._indexes[p] for p in [partition, *others]):
            for key, raw in index.raw_items():
                _, where, at = codec.decode_due_key(key)
                if (where, at) == (partition, offset):
                    return pending_of(key, raw)
        return None

    def find_request(self, partition: int, offset: int, due_ms: int,
                     schedule_id: str | None, lane: str | None = None) -> Pending | None:
        """The pending entry of the request at ``partition``/``offset``, given what its
        record says (its due time, schedule id and lane), or None; a few lookups,
        whatever the pending count.

        A request with an id is pending only as its id's entry: the id index names
        that entry's key, in whichever partition's index holds it (forwarded to its
        id's partition, rescheduled to another due time), and the entry is this
        request's only if the key names ``partition``/``offset`` (else it is another
        request with the same id). A request without an id is neither forwarded nor
        rescheduled: it is pending under the key of its own due time and coordinates.
        """
        if partition not in self._indexes:
            return None
        if schedule_id is not None:
            key = idkeys.id_key(schedule_id, lane)
            for index in self._indexes.values():
                state = index.id_state(key)
                held = None if state is None else state.pending_key
                if held is not None and codec.same_request(
                        held, codec.encode_due_key(0, partition, offset)):
                    raw = index.raw_values([held])[0]
                    return None if raw is None else pending_of(held, raw)
            return None
        due_key = codec.encode_due_key(due_ms, partition, offset)
        raw = self._indexes[partition].raw_values([due_key])[0]
        return None if raw is None else pending_of(due_key, raw)

    def intake_position(self, partition: int) -> int | None:
        """The next requests offset intake will read, as the changelog last recorded it."""
        index = self._indexes.get(partition)
        return None if index is None else index.offset(CONSUMED)


class OriginalState(StrEnum):
    """What reading a pending entry's original by offset found."""

    FOUND = "found"
    EXPIRED = "expired"
    ABSENT = "absent"
    MISMATCH = "mismatch"
    UNREAD = "unread"


@dataclass(frozen=True, slots=True)
class Original:
    """The original request record of a pending entry, or why there is none.

    ``record`` is set only when ``state`` is ``FOUND``: the record at the
    entry's offset, whose fingerprint matches the one intake stored.
    """

    state: OriginalState
    record: Message | None = None

    @property
    def target(self) -> str | None:
        """The ``kdelay-target`` the record is delivered to, or None."""
        value = header(self.record, envelope.TARGET) if self.record is not None else None
        return None if value is None else value.decode("utf-8", "replace")

    @property
    def lane(self) -> str | None:
        """The ``kdelay-lane`` the request names, or None (no lane, or no record)."""
        value = header(self.record, envelope.LANE) if self.record is not None else None
        return None if value is None else value.decode("utf-8", "replace")

    @property
    def key(self) -> bytes | None:
        return None if self.record is None else self.record.key()

    @property
    def value_bytes(self) -> int | None:
        """The value's length in bytes (0 for a null value), or None without a record."""
        if self.record is None:
            return None
        value = self.record.value()
        return 0 if value is None else len(value)


def headers_of(record: Message) -> list[tuple[str, bytes | None]]:
    """Every header of ``record`` in order, values as bytes (None for a null value)."""
    raw = record.headers() or []
    items = raw.items() if isinstance(raw, dict) else raw
    return [(str(key), value.encode() if isinstance(value, str) else value)
            for key, value in items]


def header(record: Message, name: str) -> bytes | None:
    """The value of the last header ``name`` of ``record``, or None."""
    found = [value for key, value in headers_of(record) if key == name]
    return found[-1] if found else None


def judge(entry: Pending, found: Message | Missing | None) -> Original:
    """Turn what the reader returned for ``entry`` into an :class:`Original`."""
    if found is None:
        return Original(OriginalState.UNREAD)
    if isinstance(found, Missing):
        return Original(OriginalState(found.value))
    print_ = codec.fingerprint(found.key(), found.value(), record_time(found, 0))
    if print_ != entry.fingerprint:
        return Original(OriginalState.MISMATCH)
    return Original(OriginalState.FOUND, found)


class Originals:
    """Reads the originals of pending entries back by offset, in sorted ranges."""

    def __init__(self, settings: Settings, progress: Progress | None = None,
                 fetch: Mapping[str, str | int | bool] | None = None) -> None:
        """``fetch`` overrides the reader's fetch and queue sizes
        (:meth:`~kdelay.state.budget.StoreBudget.originals`)."""
        self._reader = OriginalReader({**settings.client_config(), **(fetch or {})},
                                      settings.requests_topic, timeout_s=30.0)
        self._progress = progress

    def close(self) -> None:
        """Close the reader's consumer."""
        self._reader.close()

    def __enter__(self) -> Originals:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def fetch(self, wanted: dict[int, list[int]]) -> dict[int, dict[int, Found]]:
        """The records at the ``wanted`` offsets by partition (or why there are none), as
        :meth:`~kdelay.state.originals.OriginalReader.read` returns them: unchecked, and
        without an offset not read in time."""
        return self._reader.read(wanted)

    def read_raw(self, partition: int, offset: int) -> Message | Missing | None:
        """Whatever record lies at ``partition``/``offset`` (None: not read in time)."""
        return self._reader.read({partition: [offset]})[partition].get(offset)

    def records(self, places: Iterable[tuple[int, int]]) -> dict[tuple[int, int], Message]:
        """The request records at ``places`` (``(partition, offset)``), in one sorted read;
        a place whose record is gone, or was not read in time, is absent."""
        wanted: dict[int, list[int]] = {}
        for partition, offset in sorted(set(places)):
            wanted.setdefault(partition, []).append(offset)
        found = self._reader.read(wanted) if wanted else {}
        return {(partition, offset): record for partition, by_offset in found.items()
                for offset, record in by_offset.items() if isinstance(record, Message)}

    def read(self, entries: Sequence[Pending]) -> dict[tuple[int, int], Original]:
        """Return ``(partition, offset) -> Original`` for ``entries``.

        Offsets are read a chunk at a time, each as sorted ranges per
        partition; an offset the reader could not resolve in time is
        ``UNREAD``.
        """
        result: dict[tuple[int, int], Original] = {}
        ordered = sorted(entries, key=lambda e: (e.partition, e.offset))
        for start in range(0, len(ordered), READ_CHUNK):
            chunk = ordered[start:start + READ_CHUNK]
            wanted: dict[int, list[int]] = {}
            for entry in chunk:
                wanted.setdefault(entry.partition, []).append(entry.offset)
            found = self._reader.read(wanted)
            for entry in chunk:
                result[(entry.partition, entry.offset)] = judge(
                    entry, found[entry.partition].get(entry.offset))
            if self._progress is not None:
                self._progress("original records", start + len(chunk), len(ordered))
        return result
