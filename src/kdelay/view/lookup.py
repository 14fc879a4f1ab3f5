"""One request by schedule id or coordinates: ``kdelay show``.

A schedule id is found in the view's id index (only while it is pending); a
``topic/partition/offset`` reference is looked up in its partition and its
original is read back whatever became of it. Unknown ids and coordinates get
a :class:`Lookup` that says so, never an exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from kdelay.errors import KdelayError
from kdelay.protocol import codec, envelope
from kdelay.protocol.durations import Limits
from kdelay.protocol.envelope import Rejection
from kdelay.recurring import Description, SeriesError, describe, occurrence_ids
from kdelay.view.pending import (
    Original,
    Originals,
    OriginalState,
    Pending,
    PendingView,
    headers_of,
    judge,
)


class NotARequest(KdelayError, ValueError):
    """A ``topic/partition/offset`` reference that names another topic; ``code`` is stable."""

    code = "not-a-request"


@dataclass(frozen=True, slots=True)
class Lookup:
    """What ``kdelay show`` found for one reference.

    ``pending`` is the pending entry, if any; ``coordinates`` the request's
    ``(partition, offset)`` when known (always for a coordinate reference,
    for an id only while it is pending); ``original`` the record read back
    there; ``status`` one sentence on where the request stands; ``series``
    the recurring series a pending occurrence belongs to, with its next
    occurrence (see :func:`kdelay.recurring.describe`).
    """

    reference: str
    coordinates: tuple[int, int] | None
    pending: Pending | None
    original: Original | None
    status: str
    series: Description | None = None


def parse_reference(reference: str, requests_topic: str) -> tuple[int, int] | None:
    """``(partition, offset)`` of a ``topic/partition/offset`` reference, None for an id.

    Raises :class:`NotARequest` when the coordinates name a topic other than
    ``requests_topic``.
    """
    topic, _, rest = reference.rpartition("/")
    topic, _, partition = topic.rpartition("/")
    if not (topic and partition.isdigit() and rest.isdigit()):
        return None
    if topic != requests_topic:
        raise NotARequest(f"{reference} names topic {topic}, not the requests topic "
                          f"{requests_topic} (give --requests-topic, or a schedule id)")
    return int(partition), int(rest)


def lookup(view: PendingView, originals: Originals, reference: str,
           requests_topic: str, now_ms: int, lanes: Sequence[str | None] = (None,),
           levels: tuple[int, ...] | None = None) -> Lookup:
    """Find one request by schedule id or ``topic/partition/offset``; never raises for
    an unknown one (see :func:`parse_reference` for a foreign topic).

    Coordinates are found by reading the record there (see :func:`_at`);
    ``levels`` is intake's level table (``Settings.levels``), without which a
    request timed by ``kdelay-level`` is looked for by scanning the index.

    An id is unique within its lane: it is looked up in ``lanes`` in turn (None: the
    id of no lane), the first that holds it pending wins.

    A series id finds the series' pending occurrence under either of the two
    ids its occurrences alternate between.
    """
    coordinates = parse_reference(reference, requests_topic)
    if coordinates is None:
        found = _lookup_id(view, originals, reference, lanes)
        return replace(found, series=_series(found, now_ms))
    partition, offset = coordinates
    if partition not in view.partitions:
        return Lookup(reference, None, None, None,
                      f"{requests_topic} has no partition {partition}")
    entry, original = _at(view, originals, partition, offset, levels)
    found = Lookup(reference, coordinates, entry, original,
                   _status(view, entry, partition, offset))
    return replace(found, series=_series(found, now_ms))


def _at(view: PendingView, originals: Originals, partition: int, offset: int,
        levels: tuple[int, ...] | None) -> tuple[Pending | None, Original]:
    """The pending entry of the request at ``partition``/``offset``, and its original.

    The record is read first, and its envelope tells where its entry would be
    (:meth:`PendingView.find_request`: a few lookups at any pending count).
    The index is scanned only when the record tells nothing: gone or unread, or
    its due time given as a ``kdelay-level`` while ``levels`` (the level table
    intake uses) is not known. A record that is no schedule (a cancel, a
    reschedule, a forward, one rejected) is pending under no key of its own.
    """
    record = originals.read_raw(partition, offset)
    parsed = _schedule_of(record, levels) if isinstance(record, Message) else None
    if parsed is None or not isinstance(record, Message):
        entry = view.find(partition, offset)
        probe = entry or Pending(0, partition, offset, codec.Fingerprint(0, 0), None)
        return entry, _read_one(originals, probe, check=entry is not None)
    entry = None if isinstance(parsed, Rejection) else view.find_request(
        partition, offset, parsed.due_ms, parsed.schedule_id, parsed.lane)
    return entry, Original(OriginalState.FOUND, record) if entry is None else judge(entry, record)


def _schedule_of(record: Message, levels: tuple[int, ...] | None
                 ) -> envelope.Schedule | Rejection | None:
    """What intake made of ``record``: a schedule, or a rejection for anything else
    (a cancel, a reschedule, a forward, a malformed request); None when its due time
    is a level and the level table is unknown. Parsed as intake parses it, without
    the retention bound (a rejection for it is no entry either way)."""
    kind, stamp = record.timestamp()
    if levels is None and any(name == envelope.LEVEL for name, _ in headers_of(record)):
        return None
    parsed = envelope.parse(record.headers(), stamp if kind != TIMESTAMP_NOT_AVAILABLE else -1,
                            Limits(levels or (1,), None))
    if isinstance(parsed, envelope.Schedule | Rejection):
        return parsed
    return Rejection(envelope.ErrorCode.MISSING_TARGET, "not a schedule")


def _series(found: Lookup, now_ms: int) -> Description | None:
    """The series a pending request belongs to, from its original's headers, if any."""
    record = None if found.original is None else found.original.record
    if found.pending is None or record is None:
        return None
    try:
        return describe(record.headers() or [], now_ms)
    except SeriesError:
        return None


def _lookup_id(view: PendingView, originals: Originals, schedule_id: str,
               lanes: Sequence[str | None]) -> Lookup:
    entry = next((e for lane in lanes for sid in occurrence_ids(schedule_id)
                  if (e := view.find_id(sid, lane))), None)
    if entry is None:
        named = ", ".join(lane for lane in lanes if lane is not None)
        of_lane = f" (lanes looked in: {named})" if named else ""
        return Lookup(schedule_id, None, None, None,
                      f"no pending request holds id {schedule_id!r}{of_lane}: it was delivered, "
                      "cancelled or never scheduled, or intake has not read it yet")
    original = _read_one(originals, entry, check=True)
    return Lookup(schedule_id, (entry.partition, entry.offset), entry, original, "pending")


def _read_one(originals: Originals, entry: Pending, *, check: bool) -> Original:
    """Read one original; without ``check`` any record found there is accepted."""
    if check:
        return originals.read([entry])[(entry.partition, entry.offset)]
    found = originals.read_raw(entry.partition, entry.offset)
    if isinstance(found, Message):
        return Original(OriginalState.FOUND, found)
    return Original(OriginalState.UNREAD if found is None else OriginalState(found.value))


def _status(view: PendingView, entry: Pending | None, partition: int, offset: int) -> str:
    if entry is not None:
        return "pending"
    consumed = view.intake_position(partition)
    if consumed is None or offset >= consumed:
        return "not pending: intake has not read this offset yet (or it is not a request)"
    return ("not pending: delivered, cancelled, rejected to the DLQ, or a duplicate "
            "of a pending id")
