"""Where a schedule id lives, and the forward records that bring a request to it.

Every schedule id has one request partition, :func:`id_partition`: the
partition whose index holds the id's schedule, so that a cancel and a
duplicate find it. The client library writes requests with an id there; a
producer that places records by a business key does not. The owner of the
partition such a request landed on then writes a *forward* to the id's
partition: a record with no key, no value and these headers, nothing of the
payload, which stays where it was written (one copy):

- ``kdelay-forward``: ``<partition>/<offset>`` of the original request;
- ``kdelay-due-ms``: its absolute due time, as the first owner resolved it;
- ``kdelay-id``: the schedule id;
- ``kdelay-fingerprint``: ``<timestamp ms>/<crc>`` of the original (see
  :func:`kdelay.protocol.codec.fingerprint`), checked when it is read back;
- ``kdelay-scheduled-target``: the target the request names, for the index
  entry (so that a dead letter of a lost original can name it); absent from
  forwards of older versions;
- ``kdelay-lane``: the request's lane, when it names one: an id is unique
  within its lane, so the id's home keys it by lane and id.

An id's home is the same in every lane (murmur2 of the id alone), so a
producer that writes to the id's partition needs to know nothing of lanes.

Every record kdelay forwards also carries ``kdelay-forward-partitions``: the
request partition count the forwarder placed the id's home by. A forwarded
record is handled where it lands, never forwarded again, unless it was placed
under another count and the id's home moved (the requests topic grew while it
was in flight): then it goes on once to the home under the current count.

A forward carries no ``kdelay-target``: an instance that does not know
forwards dead-letters it (``missing-target``, the record intact) instead of
delivering an empty record. A cancel written off its id's partition is
forwarded as itself (id, lane, time) plus ``kdelay-forward``; a record that carries
``kdelay-forward`` is never forwarded again, so no record goes round in
circles even if two instances disagree on the partition count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import confluent_kafka

from kdelay.protocol import envelope
from kdelay.protocol.codec import Fingerprint
from kdelay.protocol.envelope import AnyHeaders, ErrorCode, Headers, Rejection
from kdelay.protocol.idkeys import split_id_key

FORWARD = "kdelay-forward"
FINGERPRINT = "kdelay-fingerprint"
PARTITIONS = "kdelay-forward-partitions"

_U32 = (0, 2**32 - 1)
_U64 = (0, 2**64 - 1)
_I64 = (-(2**63), 2**63 - 1)
_Found = dict[str, envelope.HeaderValue]


def id_partition(schedule_id: str, partitions: int) -> int:
    """The request partition of every record that carries ``schedule_id``.

    Kafka's murmur2 partitioner applied to the UTF-8 id, as the Java client's
    default partitioner computes it for a key: a Java producer gets the same
    partition with ``Utils.toPositive(Utils.murmur2(id.getBytes(UTF_8))) % n``.
    """
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    return confluent_kafka.murmur2(schedule_id.encode("utf-8"), partitions)


def home_of(key: str, partitions: int) -> int:
    """The request partition of the id key ``key`` (:func:`kdelay.protocol.idkeys.id_key`):
    its id's, whatever its lane."""
    return id_partition(split_id_key(key)[0], partitions)


class Forward(NamedTuple):
    """A schedule forwarded to its id's partition: what its index entry needs."""

    schedule_id: str
    due_ms: int
    partition: int
    offset: int
    fingerprint: Fingerprint
    target: str | None = None
    lane: str | None = None


def _lane(lane: str | None) -> Headers:
    return [] if lane is None else [(envelope.LANE, lane.encode("ascii"))]


def schedule_headers(forward: Forward) -> Headers:
    """The headers of the forward record of a schedule (it has no key and no value)."""
    timestamp_ms, crc = forward.fingerprint
    headers: Headers = [(FORWARD, f"{forward.partition}/{forward.offset}".encode("ascii")),
                        (envelope.DUE_MS, str(forward.due_ms).encode("ascii")),
                        (envelope.SCHEDULE_ID, forward.schedule_id.encode("utf-8")),
                        (FINGERPRINT, f"{timestamp_ms}/{crc}".encode("ascii"))]
    if forward.target is not None:
        headers.append((envelope.SCHEDULED_TARGET, forward.target.encode("utf-8")))
    return [*headers, *_lane(forward.lane)]


def cancel_headers(schedule_id: str, partition: int, offset: int,
                   lane: str | None = None) -> Headers:
    """The headers of a forwarded cancel: the cancel, its lane, and where it was written."""
    return [(envelope.CANCEL, schedule_id.encode("utf-8")),
            (FORWARD, f"{partition}/{offset}".encode("ascii")), *_lane(lane)]


def reschedule_headers(schedule_id: str, due_ms: int, partition: int, offset: int,
                       lane: str | None = None) -> Headers:
    """The headers of a forwarded reschedule: the reschedule with its due time resolved
    (absolute), its lane, and where it was written."""
    return [(envelope.RESCHEDULE, schedule_id.encode("utf-8")),
            (envelope.DUE_MS, str(due_ms).encode("ascii")),
            (FORWARD, f"{partition}/{offset}".encode("ascii")), *_lane(lane)]


def counted(headers: Headers, partitions: int) -> Headers:
    """``headers`` with the partition count the id's home was placed by."""
    return [*headers, (PARTITIONS, str(partitions).encode("ascii"))]


def placed_under(headers: AnyHeaders) -> int | None:
    """The partition count a forwarded record's home was placed by; None when absent
    (forwards of older versions) or unreadable."""
    raw = _found(headers).get(PARTITIONS)
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    return int(text) if text is not None and text.isdigit() else None


def is_forward(headers: AnyHeaders) -> bool:
    """Whether a record carries ``kdelay-forward`` (it was forwarded already)."""
    return FORWARD in _found(headers)


def origin(headers: AnyHeaders) -> tuple[int, int] | None:
    """Where a forwarded record was first written (``kdelay-forward``); None if not
    forwarded or unreadable."""
    found = _found(headers)
    if FORWARD not in found:
        return None
    try:
        return _pair(found, FORWARD, _U32, _U64)
    except ValueError:
        return None


def _found(headers: AnyHeaders) -> _Found:
    """The ``kdelay-*`` headers of a record by name (the last of a repeated one)."""
    if headers is None:
        return {}
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return {name: value for name, value in pairs if name.startswith(envelope.PREFIX)}


def parse(headers: AnyHeaders) -> Forward | Rejection | None:
    """Read a schedule's forward record; None when ``headers`` are not a forward's.

    A forward with a missing or malformed field is a :class:`Rejection`
    (``bad-forward``), for the DLQ.
    """
    found = _found(headers)
    if FORWARD not in found or envelope.CANCEL in found or envelope.RESCHEDULE in found:
        return None
    try:
        partition, offset = _pair(found, FORWARD, _U32, _U64)
        timestamp_ms, crc = _pair(found, FINGERPRINT, _I64, _U32)
        due_ms = int(_ascii(found, envelope.DUE_MS))
        schedule_id = _text(found, envelope.SCHEDULE_ID)
        target = (_text(found, envelope.SCHEDULED_TARGET)
                  if envelope.SCHEDULED_TARGET in found else None)
        lane = _text(found, envelope.LANE) if envelope.LANE in found else None
    except ValueError as exc:
        return Rejection(ErrorCode.BAD_FORWARD, f"a forward record is malformed: {exc}")
    if not 0 <= due_ms <= envelope.MAX_TIME_MS or not schedule_id:
        return Rejection(ErrorCode.BAD_FORWARD,
                         f"a forward record needs a due time >= 0 and an id, got {due_ms} "
                         f"and {schedule_id!r}")
    if lane is not None and envelope.LANE_NAME.fullmatch(lane) is None:
        return Rejection(ErrorCode.BAD_FORWARD, f"a forward record names lane {lane!r}, "
                         "which is not a lane name")
    return Forward(schedule_id, due_ms, partition, offset, Fingerprint(timestamp_ms, crc),
                   target or None, lane)


def _text(found: _Found, name: str) -> str:
    value = found.get(name)
    if value is None:
        raise ValueError(f"header {name} is missing")
    try:
        return value if isinstance(value, str) else value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"header {name} is not UTF-8") from exc


def _ascii(found: _Found, name: str) -> str:
    text = _text(found, name)
    if not text.isascii():
        raise ValueError(f"header {name} is not ASCII: {text!r}")
    return text


def _pair(found: _Found, name: str, first: tuple[int, int], second: tuple[int, int]
          ) -> tuple[int, int]:
    """Read ``<int>/<int>`` within the ranges ``first`` and ``second``; ValueError if not."""
    left, separator, right = _ascii(found, name).partition("/")
    if not separator:
        raise ValueError(f"header {name} is not <number>/<number>")
    a, b = int(left), int(right)
    if not (first[0] <= a <= first[1] and second[0] <= b <= second[1]):
        raise ValueError(f"header {name} value {a}/{b} is out of range")
    return a, b
