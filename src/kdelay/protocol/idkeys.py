"""Schedule ids as kdelay keys them, and the outcome record of a request with an id.

A schedule id is unique within its lane (``kdelay-lane``): the same id in two
lanes names two schedules. kdelay therefore knows every id by its *id key*
(:func:`id_key`), which the index, the changelog's ended-id records, the
expiry index and the outcome records are keyed by. Without a lane the key is
the id and its bytes the UTF-8 id, exactly as before ids were scoped; with a
lane, ``0xFF | lane | "/" | UTF-8 id`` (:func:`encode_id_key`).

Like :mod:`kdelay.protocol.codec`, these are layouts kdelay persists: a change
here is a change of the disk and wire format.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

import orjson

from kdelay.protocol.envelope import LANE_NAME

# A lane's id key: this mark, the lane, ``/`` and the id. Written as bytes the mark
# is the byte 0xFF, which UTF-8 never holds: no id read from a header (always valid
# UTF-8) can spell a lane's key, and the first ``/`` ends the lane, whose name has none.
LANE_BYTE: Final = b"\xff"
_LANE_MARK: Final = LANE_BYTE.decode("utf-8", "surrogateescape")  # "\udcff", no literal
_LANE_BYTES: Final = re.compile(LANE_NAME.pattern.encode())


def id_key(schedule_id: str, lane: str | None) -> str:
    """The key of ``schedule_id`` in ``lane``: the id itself without a lane, else
    ``"\\udcff" + lane + "/" + id``. The same id in two lanes has two keys; an id
    key is what the index, the changelog and intake know an id by."""
    return schedule_id if lane is None else f"{_LANE_MARK}{lane}/{schedule_id}"


def split_id_key(key: str) -> tuple[str, str | None]:
    """The id and the lane (None: none) of an id key made by :func:`id_key`."""
    if not key.startswith(_LANE_MARK):
        return key, None
    lane, _, schedule_id = key[1:].partition("/")
    return schedule_id, lane


def shown_id(key: str) -> str:
    """An id key as logs and outcome details show it: ``order-43``, or
    ``order-43 (lane dev1)`` (the key itself is not printable text)."""
    if not key.startswith(_LANE_MARK):
        return key
    lane, _, schedule_id = key[1:].partition("/")
    return f"{schedule_id} (lane {lane})"


def encode_id_key(key: str) -> bytes:
    """An id key as bytes: the UTF-8 id without a lane; ``0xFF | lane (ASCII) | "/" |
    UTF-8 id`` with one. The index's ids, the changelog's ended-id records and the
    outcome records are keyed so."""
    return key.encode("utf-8", "surrogateescape")


def decode_id_key(raw: bytes) -> str:
    """Decode :func:`encode_id_key`; ValueError for bytes that are neither a UTF-8 id
    nor a lane's layout (a lane name, ``/`` and a non-empty UTF-8 id)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    lane, separator, schedule_id = raw[1:].partition(b"/")
    if raw[:1] != LANE_BYTE or not separator or not schedule_id \
            or _LANE_BYTES.fullmatch(lane) is None:
        raise ValueError(f"schedule id {raw[:80]!r} is not UTF-8, nor a lane's id key")
    try:
        return id_key(schedule_id.decode("utf-8"), lane.decode("ascii"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"the schedule id in lane key {raw[:80]!r} is not UTF-8") from exc


def outcome_key(schedule_id: str, lane: str | None) -> bytes:
    """The key of an outcome record of ``schedule_id`` in ``lane``: the UTF-8 id
    without a lane, else the lane's layout (:func:`encode_id_key`), so that two lanes'
    outcomes of one id are kept apart by compaction."""
    return encode_id_key(id_key(schedule_id, lane))


class Answer(NamedTuple):
    """The outcome of one request that carries an id, as the outcomes topic holds it.

    ``outcome`` is ``scheduled`` or ``duplicate`` for a schedule, ``cancelled``,
    ``unknown``, ``already-delivered`` or ``dead-lettered`` for a cancel, and
    ``rescheduled`` (or those three) for a reschedule.
    ``request`` names the request answered (``topic/partition/offset``, where
    it was written), ``at_ms`` when the service decided (its clock). For a
    duplicate and a cancel, ``schedule`` names the request that holds the id
    and ``first`` its state (``pending``, ``delivered``, ``cancelled``,
    ``dead-lettered``); ``differs`` says a duplicate's payload or due time is
    not the first's. ``lane`` is the request's lane (``kdelay-lane``), None
    without one: an id is unique within its lane.
    """

    schedule_id: str
    outcome: str
    request: str
    at_ms: int
    schedule: str | None = None
    first: str | None = None
    differs: bool = False
    lane: str | None = None


def encode_answer(answer: Answer) -> bytes:
    """Encode an outcome record's value: a JSON object (see :class:`Answer`; key ``id``;
    ``lane`` only when the request named one)."""
    body: dict[str, object] = {"id": answer.schedule_id, "outcome": answer.outcome,
                               "request": answer.request, "at_ms": answer.at_ms}
    if answer.schedule is not None:
        body["schedule"] = answer.schedule
    if answer.first is not None:
        body["first"] = answer.first
    if answer.differs:
        body["differs"] = True
    if answer.lane is not None:
        body["lane"] = answer.lane
    return orjson.dumps(body)


def decode_answer(raw: bytes) -> Answer:
    """Decode :func:`encode_answer`; ValueError for anything that is not such a record."""
    try:
        body = orjson.loads(raw)
        return Answer(str(body["id"]), str(body["outcome"]), str(body["request"]),
                      int(body["at_ms"]), _optional(body, "schedule"), _optional(body, "first"),
                      bool(body.get("differs", False)), _optional(body, "lane"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not an outcome record: {raw[:80]!r} ({exc})") from None


def _optional(body: dict[str, object], name: str) -> str | None:
    value = body.get(name)
    return None if value is None else str(value)
