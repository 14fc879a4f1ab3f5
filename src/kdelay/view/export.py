"""Export every pending schedule of a deployment to a file, and import such a file.

:func:`export_pending` walks the synced :class:`~kdelay.view.pending.PendingView`
in the requests topic's offset order (sorted on disk in a scratch RocksDB
store, not in memory) and reads the originals in chunks of sequential ranges,
so memory stays bounded by one chunk whatever the number of entries or the
size of their payloads. It writes the file of :mod:`kdelay.view.archive`.

:func:`import_archive` sends each entry as a new request through the client
library: absolute due time (``kdelay-due-ms``), target, target partition, key,
value and user headers as they were, the lane, and the schedule id. An entry without an
id gets one derived from where it came from (:func:`derived_id`), so every
entry of a file carries an id and the service's duplicate check makes a
second import of the same file schedule nothing new while the first import's
schedules are pending. Ids are checked only while pending: an entry whose
first import was already delivered (one that was overdue, say) is delivered
again by a second import.

What an export is: a snapshot of what was pending when its view was synced.
Schedules the source service delivers after that are in the file all the
same; schedules written after it are not.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from confluent_kafka import Message
from rocksdict import Options, Rdict, WriteBatch

from kdelay.client import DelayProducer
from kdelay.errors import KdelayError
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import admin_client, topic_config
from kdelay.protocol import codec, envelope
from kdelay.view.archive import Archived, ArchiveReader, ArchiveWriter, Header
from kdelay.view.pending import QUIET, Original, Originals, OriginalState, Pending, PendingView
from kdelay.view.retention import recommend

CHUNK = 5_000
SCRATCH_BATCH = 20_000
SCRATCH_BUFFER = 8 << 20
PROGRESS_EVERY = 1_000
DERIVED_PREFIX = "kdelay-export:"
_BY_OFFSET = struct.Struct(">IQ")


class RetentionTooShort(KdelayError):
    """The destination's requests topic would reject a file's schedules; ``code`` is stable."""

    code = "retention-too-short"


class ExportError(KdelayError):
    """An export that could not read every original in time; ``code`` is stable."""

    code = "originals-unread"


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What an export wrote: ``exported`` of ``pending`` entries; the rest by reason."""

    pending: int
    exported: int
    unexported: dict[str, int]


@dataclass(frozen=True, slots=True)
class ImportSummary:
    """What an import did: requests ``sent`` (``derived`` of them with a derived id), and
    entries ``skipped`` because their id is already pending at the destination."""

    sent: int
    skipped: int
    derived: int


def derived_id(cluster_id: str | None, origin: str) -> str:
    """The schedule id of an exported entry that has none: its source request's place.

    ``kdelay-export:<cluster id>:<requests topic>:<partition>:<offset>``
    (``-`` for an unknown cluster id), from ``origin`` =
    ``topic/partition/offset``: the same entry always gets the same id, and no
    two requests of one cluster share one (a topic name holds no ``:``). Colons,
    not slashes, so that ``kdelay show`` takes it for an id, not coordinates.
    """
    return f"{DERIVED_PREFIX}{cluster_id or '-'}:{origin.replace('/', ':')}"


def cluster_id(settings: Settings) -> str | None:
    """The id of the cluster ``settings`` point at, or None when the broker does not say."""
    admin = admin_client(settings, log_level=QUIET)
    found = admin.describe_cluster(request_timeout=10).result(timeout=15).cluster_id
    return str(found) if found else None


def entry_of(pending: Pending, record: Message, requests_topic: str) -> Archived:
    """The export entry of a pending schedule whose original is ``record``.

    The due time and id are the index's (a relative delay or level was turned
    into an absolute time at intake); target, target partition and user headers
    come from the record. Raises ValueError for a record without a readable
    target (intake would not have scheduled it).
    """
    route = envelope.routing(record.headers())
    if route is None:
        raise ValueError(f"{requests_topic}/{pending.partition}/{pending.offset} has no target")
    headers = [(name, value.encode() if isinstance(value, str) else value)
               for name, value in route.user]
    return Archived(pending.due_ms, route.target, route.partition, pending.schedule_id,
                 record.key(), record.value(), headers,
                 f"{requests_topic}/{pending.partition}/{pending.offset}", pending.record_ms,
                 route.lane)


def export_pending(view: PendingView, originals: Originals, writer: Callable[[Header],
                   ArchiveWriter], header: Header, scratch_dir: Path) -> ExportSummary:
    """Write every pending entry of ``view`` with its original to the writer ``writer`` makes.

    ``header`` gives the source; its ``pending`` and ``latest_due_ms`` are
    filled in here. Entries whose original is gone (``expired``, ``absent``,
    ``mismatch``) are counted, not written. Raises :class:`ExportError` when
    an original cannot be read in time (broker down): the partial file is
    deleted, never left looking complete.
    """
    with _Scratch(scratch_dir) as scratch:
        pending, latest = scratch.fill(view)
        header = Header(header.requests_topic, header.cluster_id, header.exported_ms,
                        pending, latest)
        out = writer(header)
        try:
            unexported = _write_all(view, originals, scratch, out, pending)
            exported = out.finish(dict(unexported))
        finally:
            out.close()
    return ExportSummary(pending, exported, dict(unexported))


def _write_all(view: PendingView, originals: Originals, scratch: _Scratch,
               out: ArchiveWriter, pending: int) -> Counter[str]:
    """Read originals a chunk at a time in offset order and write their entries."""
    unexported: Counter[str] = Counter()
    topic = out.header.requests_topic
    done = 0
    for chunk in scratch.chunks(view):
        read = originals.read(chunk)
        for entry in chunk:
            original = read[(entry.partition, entry.offset)]
            _write_one(entry, original, out, unexported, topic)
        done += len(chunk)
        view.report("exporting schedules", done, pending)
    return unexported


def _write_one(entry: Pending, original: Original, out: ArchiveWriter,
               unexported: Counter[str], requests_topic: str) -> None:
    if original.state is OriginalState.UNREAD:
        raise ExportError(f"the original of request partition {entry.partition} offset "
                          f"{entry.offset} could not be read in time; check the brokers and "
                          "export again")
    if original.record is None:
        unexported[original.state.value] += 1
        return
    out.write(entry_of(entry, original.record, requests_topic))


class _Scratch:
    """Pending due keys sorted by ``(partition, offset)`` in a throw-away RocksDB store."""

    def __init__(self, parent: Path) -> None:
        parent.mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix="export-", dir=parent))
        options = Options(raw_mode=True)
        # Small memtables: the sorted keys go to disk as they come, not to memory.
        options.set_write_buffer_size(SCRATCH_BUFFER)
        self._db = Rdict(str(self._dir / "by-offset"), options)

    def __enter__(self) -> _Scratch:
        return self

    def __exit__(self, *_: object) -> None:
        self._db.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def fill(self, view: PendingView) -> tuple[int, int | None]:
        """Copy every pending due key; return how many and the latest due time."""
        count, latest = 0, None
        batch = WriteBatch(raw_mode=True)
        for number, partition in enumerate(view.partitions, start=1):
            for due_key in view.key_stream(partition):
                due_ms, _, offset = codec.decode_due_key(due_key)
                batch.put(_BY_OFFSET.pack(partition, offset), due_key)
                count += 1
                latest = due_ms if latest is None else max(latest, due_ms)
                if count % SCRATCH_BATCH == 0:
                    self._db.write(batch)
                    batch = WriteBatch(raw_mode=True)
            view.report("sorting pending entries by offset (partitions)", number,
                        len(view.partitions))
        self._db.write(batch)
        return count, latest

    def chunks(self, view: PendingView) -> Iterator[list[Pending]]:
        """The pending entries in ``(partition, offset)`` order, :data:`CHUNK` at a time.

        A chunk holds one partition's entries; those gone from the view since
        (it is not re-synced during an export) cannot occur.
        """
        keys: list[bytes] = []
        partition = None
        for raw_key, due_key in self._db.items():
            current = _BY_OFFSET.unpack(cast(bytes, raw_key))[0]
            if keys and (current != partition or len(keys) >= CHUNK):
                yield view.pending(partition or 0, keys)
                keys = []
            partition = current
            keys.append(due_key)
        if keys:
            yield view.pending(partition or 0, keys)


def check_room(settings: Settings, header: Header, now_ms: int) -> None:
    """Raise :class:`RetentionTooShort` unless the destination accepts the file's latest due time.

    The service dead-letters (``delay-too-long``) a request due later than its
    record time + the requests topic's ``retention.ms`` - the retention
    margin; an import's record time is after ``now_ms``, so a file that
    passes here is accepted. The message names the ``retention.ms`` to set.
    """
    if header.latest_due_ms is None:
        return
    config = topic_config(admin_client(settings, log_level=QUIET), settings.requests_topic)
    retention_ms = int(config.get("retention.ms", "-1"))
    ahead_ms = header.latest_due_ms - now_ms
    allowed_ms = retention_ms - settings.retention_margin_ms
    if retention_ms >= 0 and ahead_ms > allowed_ms:
        raise RetentionTooShort(
            f"the file's latest schedule is due in {ahead_ms} ms, but {settings.requests_topic} "
            f"accepts at most {max(allowed_ms, 0)} ms ahead (retention.ms {retention_ms} minus "
            f"the {settings.retention_margin_ms} ms margin); first run: kdelay retention set "
            f"{recommend(ahead_ms, settings)}")


def import_archive(reader: ArchiveReader, producer: DelayProducer,
                   is_pending: Callable[[str], bool],
                   progress: Callable[[int, int], None] | None = None,
                   flush_timeout_s: float = 300.0) -> ImportSummary:
    """Send every entry of ``reader`` as a request through ``producer``; wait until written.

    Entries whose id ``is_pending`` at the destination are skipped; any other
    duplicate (an import running at the same time, requests not yet taken in)
    is dropped by the service's own id check. Raises as the reader does for a
    bad or cut-short file (after sending the entries before the bad line: a
    second import of the mended file skips those), ``DeliveryError`` or
    ``TimeoutError`` when requests are not written.
    """
    sent = skipped = derived = 0
    for entry in reader.entries():
        schedule_id = entry.schedule_id
        if schedule_id is None:
            schedule_id = derived_id(reader.header.cluster_id, entry.origin)
            derived += 1
        if is_pending(schedule_id):
            skipped += 1
        else:
            producer.send_async(entry.target, entry.value, key=entry.key,
                                headers=entry.headers, due=entry.due_ms,
                                partition=entry.partition, id=schedule_id, lane=entry.lane)
            sent += 1
        if progress is not None and (sent + skipped) % PROGRESS_EVERY == 0:
            progress(sent + skipped, reader.header.pending)
    producer.flush(flush_timeout_s)
    return ImportSummary(sent, skipped, derived)
