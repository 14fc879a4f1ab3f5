"""Every byte layout kdelay persists, as encode/decode pairs (ids as keys, and the
outcome records, in :mod:`kdelay.protocol.idkeys`).

These bytes live in RocksDB and in the compacted ``kdelay.changelog``, so they
outlast any one process: a layout here may only change together with a
migration. All integers are big-endian, which makes the byte order of a due key
its time order. Encoders raise :class:`ValueError` for values the layout cannot
hold; decoders raise :class:`ValueError` for bytes that are not a valid
encoding, so corrupt state is reported instead of being misread.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Iterator
from enum import IntEnum
from typing import Final, NamedTuple

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from kdelay.protocol import checksum
from kdelay.protocol.idkeys import LANE_BYTE, decode_id_key, encode_id_key

_DUE_KEY: Final = struct.Struct(">QIQ")
_KEY_BLOCK: Final = 64  # due_key_fields' structs: n due keys end to end, n up to this
_DUE_KEYS: Final = [struct.Struct(">" + "QIQ" * n) for n in range(_KEY_BLOCK + 1)]
_INDEX_HEAD: Final = struct.Struct(">qI")
_FIELD_HEAD: Final = struct.Struct(">BI")
_U64: Final = struct.Struct(">Q")
_I64: Final = struct.Struct(">q")

DUE_KEY_SIZE: Final = _DUE_KEY.size
"""Length in bytes of an encoded due key (20)."""
INDEX_HEAD_SIZE: Final = _INDEX_HEAD.size
"""Length in bytes of an encoded index value without a schedule id (12)."""
# The changelog key under which intake records its consumed offset; any length
# but DUE_KEY_SIZE keeps it apart from due keys.
CONSUMED_MARKER: Final = b"kdelay/consumed"
# The changelog key of the tombstones the service writes to read the broker's
# clock (see :mod:`kdelay.engine.skew`); replay ignores it.
CLOCK_PROBE: Final = b"kdelay/clock"
# The changelog key of each partition's delivered watermark (value
# :func:`encode_watermark`): the entries it covers need no tombstone of their own.
# Not DUE_KEY_SIZE long and no ID_RECORD_PREFIX, so it is told apart from both.
WATERMARK_MARKER: Final = b"kdelay/delivered-below"
# Changelog keys of the ids whose schedules ended (``ID_RECORD_PREFIX + UTF-8 id``,
# value :func:`encode_id_state`): a rebuilt index remembers them for the id window.
# Longer than a due key, so no such key is ever DUE_KEY_SIZE long.
ID_RECORD_PREFIX: Final = b"kdelay/ended-schedule-id/"

_U32_MAX: Final = 2**32 - 1
_U64_MAX: Final = 2**64 - 1
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1

_PENDING: Final = b"P"
_DELIVERED: Final = b"D"
_ENDED: Final = b"E"
_ENDED_BODY: Final = struct.Struct(">BQ20sqI")
_ABSENT_FIELD: Final = b"\x00"
SMALL_RECORD: Final = 4_096  # key and value up to this many bytes: one CRC call (framed_crc)
_FRAMES: Final[dict[int, bytes]] = {}  # the frame of a present field up to SMALL_RECORD, by length
# An index value that names its target: after the head, this byte (never part of
# UTF-8, so no value of the first layout has it there), the id's length (0: no
# id), the id, then the target to the end.
_WITH_TARGET: Final = 0xFF
_NO_ID_TAILS: Final[dict[str, bytes]] = {}  # what follows the head without an id, by target
_TARGET_HEAD: Final = struct.Struct(">BH")
# What follows the head of an index value that names a target and no id: a value
# whose bytes from INDEX_HEAD_SIZE on start with these carries no schedule id.
NO_ID_WITH_TARGET: Final = bytes((_WITH_TARGET, 0, 0))

# Bound once: these run for every request intake reads and every record it
# delivers. tuple.__new__ builds a named tuple from all its fields without the
# generated Python-level __new__, which costs three times as much.
_crc32: Final = checksum.crc32
_pack_field_head: Final = _FIELD_HEAD.pack
_unpack_index_head: Final = _INDEX_HEAD.unpack_from
_unpack_due_key: Final = _DUE_KEY.unpack
_pack_due_key: Final = _DUE_KEY.pack
_pack_index_head: Final = _INDEX_HEAD.pack
_tuple_new: Final = tuple.__new__


class DueKey(NamedTuple):
    """A key of the due index: when an entry is due and where its request lies."""

    due_ms: int
    partition: int
    offset: int


class Fingerprint(NamedTuple):
    """A small summary of a request record, checked when the record is read back."""

    timestamp_ms: int
    crc: int


class IndexValue(NamedTuple):
    """The value stored under a due key: the request's fingerprint, optional id and the
    target it was scheduled for (None in entries of older kdelay versions)."""

    fingerprint: Fingerprint
    schedule_id: str | None
    target: str | None = None


class End(IntEnum):
    """How the schedule that held an id ended."""

    DELIVERED = 1
    CANCELLED = 2
    DEAD_LETTERED = 3

    @property
    def word(self) -> str:
        """The outcome's name in logs and outcome records: ``delivered``, ``cancelled``, ..."""
        return self.name.lower().replace("_", "-")


class IdState(NamedTuple):
    """What a schedule id refers to: a pending schedule, or how and when one ended.

    ``pending_key`` is the encoded due key of the pending request that holds the
    id (and nothing else is set). Otherwise ``ended_ms`` is when its schedule
    ended (service clock, or the cancel's timestamp), ``end`` how, and
    ``first_key``/``fingerprint`` name the request that held the id (None in
    markers of older kdelay versions, which only knew deliveries).
    """

    pending_key: bytes | None
    ended_ms: int | None
    end: End = End.DELIVERED
    first_key: bytes | None = None
    fingerprint: Fingerprint | None = None


def ended(end: End, at_ms: int, key: bytes, fingerprint: Fingerprint) -> IdState:
    """The state of an id whose schedule under ``key`` ended ``end`` at ``at_ms``."""
    return IdState(None, at_ms, end, key, fingerprint)


IdRecord = tuple[bytes, bytes]
"""A changelog record of an ended id: :func:`id_record_key` and :func:`encode_id_state`."""


def end_of(schedule_id: str | None, end: End, at_ms: int, key: bytes,
           fingerprint: Fingerprint) -> tuple[IdState | None, IdRecord | None]:
    """The ended state of ``schedule_id`` and its changelog record; both None without an id."""
    if schedule_id is None:
        return None, None
    state = ended(end, at_ms, key, fingerprint)
    return state, (id_record_key(schedule_id), encode_id_state(state))


def _id_text(raw: bytes) -> str:
    """:func:`decode_id_key` for a lane's key in an index value (always in the layout
    with a target): UnicodeDecodeError, as the text around it raises, for bytes that
    are no id key."""
    try:
        return decode_id_key(raw)
    except ValueError:
        raise UnicodeDecodeError("utf-8", raw, 0, len(raw), "not an id key") from None


def id_record_key(schedule_id: str) -> bytes:
    """The changelog key of an ended id's record: ``kdelay/ended-schedule-id/`` and the
    id key (:func:`encode_id_key`: the UTF-8 id, or a lane's layout)."""
    return ID_RECORD_PREFIX + encode_id_key(schedule_id)


def id_of_record_key(key: bytes) -> str | None:
    """The id key of a changelog key made by :func:`id_record_key`; None for any other
    key, ValueError for an id key that does not decode."""
    if not key.startswith(ID_RECORD_PREFIX):
        return None
    try:
        return decode_id_key(key[len(ID_RECORD_PREFIX):])
    except ValueError as exc:
        raise ValueError(f"the schedule id in changelog key {key!r} does not decode: "
                         f"{exc}") from exc


class Watermark(NamedTuple):
    """What one watermark record of a changelog partition says is done.

    Every entry *put before the record* (in changelog order) whose due key is
    below ``bound`` is done (delivered, dead-lettered or cancelled), except
    the keys in ``pending``: the few entries below the bound that were still
    pending when it was written (a retry backing off, a request indexed after
    its due time had passed). An entry put after the record is not covered,
    whatever its key. A later record of the same partition says everything an
    earlier one said (its bound is never lower, and its ``pending`` holds every
    key that is still pending), so compaction may keep only the latest.
    """

    bound: bytes
    pending: frozenset[bytes] = frozenset()

    def covers(self, key: bytes) -> bool:
        """Whether an entry put before this watermark under ``key`` is done."""
        return key < self.bound and key not in self.pending


_WATERMARK_VERSION: Final = b"\x01"


def key_after(key: bytes) -> bytes:
    """Return the smallest due key above ``key`` (a watermark bound that covers it);
    ValueError for the largest possible key or one that is not a due key."""
    _check_size("a due key", key, DUE_KEY_SIZE)
    following = int.from_bytes(key, "big") + 1
    if following >= 1 << (8 * DUE_KEY_SIZE):
        raise ValueError("no due key follows the largest one")
    return following.to_bytes(DUE_KEY_SIZE, "big")


def encode_watermark(watermark: Watermark) -> bytes:
    """Encode ``0x01 | bound (a due key) | pending due keys, sorted, end to end``;
    ValueError for a bound or pending key that is not a due key, or one not below the bound."""
    _check_size("a watermark bound", watermark.bound, DUE_KEY_SIZE)
    for key in watermark.pending:
        _check_size("a pending key of a watermark", key, DUE_KEY_SIZE)
        if key >= watermark.bound:
            raise ValueError(f"a pending key of a watermark must be below its bound: {key!r}")
    return _WATERMARK_VERSION + watermark.bound + b"".join(sorted(watermark.pending))


def decode_watermark(raw: bytes) -> Watermark:
    """Decode :func:`encode_watermark`; ValueError for anything else."""
    body = raw[1:]
    if raw[:1] != _WATERMARK_VERSION or not body or len(body) % DUE_KEY_SIZE:
        raise ValueError(f"not a watermark: {raw[:60]!r}")
    keys = [body[i : i + DUE_KEY_SIZE] for i in range(0, len(body), DUE_KEY_SIZE)]
    return Watermark(keys[0], frozenset(keys[1:]))


def _check_range(name: str, value: int, low: int, high: int) -> None:
    """Raise ValueError unless ``low <= value <= high``."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_size(what: str, raw: bytes, size: int) -> None:
    """Raise ValueError unless ``raw`` is exactly ``size`` bytes long."""
    if len(raw) != size:
        raise ValueError(f"{what} must be {size} bytes, got {len(raw)}")


def encode_due_key(due_ms: int, partition: int, offset: int) -> bytes:
    """Encode a due key as ``u64 due_ms | u32 partition | u64 offset``, big-endian.

    Byte order equals the order of ``(due_ms, partition, offset)``, so a
    RocksDB scan yields entries in due order, ties broken by partition then
    offset. Re-reading the same request gives the same key, which keeps intake
    idempotent. Raises ValueError for a negative or oversized field.
    """
    try:
        return _pack_due_key(due_ms, partition, offset)
    except struct.error:  # the checks run only to name the bad field
        _check_range("due_ms", due_ms, 0, _U64_MAX)
        _check_range("partition", partition, 0, _U32_MAX)
        _check_range("offset", offset, 0, _U64_MAX)
        raise


def decode_due_key(raw: bytes) -> DueKey:
    """Decode a key made by :func:`encode_due_key`; ValueError on a wrong length."""
    _check_size("a due key", raw, DUE_KEY_SIZE)
    return _tuple_new(DueKey, _DUE_KEY.unpack(raw))


def same_request(first: bytes, second: bytes) -> bool:
    """Whether due keys ``first`` and ``second`` name one request (partition and offset),
    whatever their due times: a reschedule moves an entry to a new due time and keeps its
    request."""
    return first[_U64.size:] == second[_U64.size:]


def unpack_due_key(raw: bytes) -> tuple[int, int, int]:
    """Return ``(due_ms, partition, offset)`` of a due key, unchecked (struct.error if short):
    for the keys delivery read from its own index, once per record delivered."""
    fields: tuple[int, int, int] = _unpack_due_key(raw)
    return fields


def decode_due_keys(joined: bytes) -> Iterator[tuple[int, int, int]]:
    """Decode due keys laid end to end (``b"".join(keys)``) as ``(due_ms, partition, offset)``;
    ValueError unless the length is a multiple of :data:`DUE_KEY_SIZE`."""
    fields = due_key_fields(joined)
    return zip(fields[0::3], fields[1::3], fields[2::3], strict=True)


def due_key_fields(joined: bytes) -> list[int]:
    """Decode due keys laid end to end as one flat list, ``[due_ms, partition, offset,
    due_ms, ...]``, a block of keys a C call and no tuple a key (the read-ahead takes
    the offsets as ``[2::3]``); ValueError as :func:`decode_due_keys`."""
    count, rest = divmod(len(joined), DUE_KEY_SIZE)
    if rest:
        raise ValueError(f"joined due keys must be a multiple of {DUE_KEY_SIZE} bytes, "
                         f"got {len(joined)}")
    whole = (count - count % _KEY_BLOCK) * DUE_KEY_SIZE
    fields = list(itertools.chain.from_iterable(_DUE_KEYS[-1].iter_unpack(joined[:whole])))
    fields.extend(_DUE_KEYS[count % _KEY_BLOCK].unpack_from(joined, whole))
    return fields


def due_upper_bound(now_ms: int) -> bytes:
    """Return an exclusive ``iterate_upper_bound`` admitting every key due by ``now_ms``.

    This is the smallest key due at ``now_ms + 1``, so every key with
    ``due_ms <= now_ms`` sorts below it and nothing due later does.
    """
    return encode_due_key(now_ms + 1, 0, 0)


def _frame(field: bytes | None) -> bytes:
    """The frame that goes before ``field`` in the CRC (the field's bytes follow it)."""
    if field is None:
        return _ABSENT_FIELD
    head = _FRAMES.get(len(field))
    if head is None:
        head = _pack_field_head(1, len(field))
        if len(field) <= SMALL_RECORD:
            _FRAMES[len(field)] = head
    return head


def fingerprint(key: bytes | None, value: bytes | None, timestamp_ms: int) -> Fingerprint:
    """Fingerprint a record by its timestamp and a CRC-32 of its key and value.

    Each field is framed by a presence flag and its length before it enters the CRC,
    so a null key differs from an empty one and bytes cannot move between key and
    value unnoticed. The CRC is persisted: its framing must not change."""
    return _tuple_new(Fingerprint, (timestamp_ms, framed_crc(key, value)))


def framed_crc(key: bytes | None, value: bytes | None) -> int:
    """The CRC of :func:`fingerprint` alone. A small record is framed into one copy
    for one CRC call (the calls cost more than the copy); a large one is chained."""
    key_frame, value_frame = _frame(key), _frame(value)
    key_bytes = b"" if key is None else key
    value_bytes = b"" if value is None else value
    if len(key_bytes) + len(value_bytes) <= SMALL_RECORD:
        return _crc32(b"".join((key_frame, key_bytes, value_frame, value_bytes)), 0)
    crc = _crc32(key_bytes, _crc32(key_frame, 0))
    return _crc32(value_bytes, _crc32(value_frame, crc))


def index_head(raw: bytes) -> tuple[int, int]:
    """Return ``(timestamp_ms, crc)`` of an encoded index value without decoding the rest;
    struct.error for a value shorter than :data:`INDEX_HEAD_SIZE`."""
    head: tuple[int, int] = _unpack_index_head(raw)
    return head


def record_time(message: Message, fallback_ms: int) -> int:
    """Return the record's timestamp, or ``fallback_ms`` when the record has none."""
    kind, timestamp = message.timestamp()
    return fallback_ms if kind == TIMESTAMP_NOT_AVAILABLE else timestamp


def fingerprint_of(message: Message) -> Fingerprint:
    """Return the fingerprint of a request record, as stored in its index entry."""
    return fingerprint(message.key(), message.value(), record_time(message, 0))


def encode_index_value(v: IndexValue) -> bytes:
    """Encode ``i64 timestamp | u32 crc``, then the id and the target.

    Without a target (entries of older versions), the id follows the head in
    UTF-8, and an absent id encodes as nothing. With one, the head is followed
    by ``0xFF | u16 id length (0: no id) | id | target`` (UTF-8). The id is its
    id key (:func:`encode_id_key`); a lane's key starts with 0xFF too, so one
    without a target takes the second layout with an empty target. Raises
    ValueError for an empty id (it could not be told from an absent one), an id
    longer than 65 535 bytes next to a target, or a field out of range.
    """
    timestamp_ms, crc = v.fingerprint
    return encode_index_fields(timestamp_ms, crc, v.schedule_id, v.target)


def encode_index_fields(timestamp_ms: int, crc: int, sid: str | None,
                        target: str | None) -> bytes:
    """:func:`encode_index_value` of the value with these fields, built from them: intake
    encodes each request's value so, without the tuples of an :class:`IndexValue`."""
    try:
        head = _pack_index_head(timestamp_ms, crc)
    except struct.error:  # the checks run only to name the bad field
        _check_range("fingerprint timestamp_ms", timestamp_ms, _I64_MIN, _I64_MAX)
        _check_range("fingerprint crc", crc, 0, _U32_MAX)
        raise
    if sid is not None and not sid:
        raise ValueError("a schedule id must not be empty")
    if sid is None and target is not None:  # most requests: a deployment has few targets
        return head + (_NO_ID_TAILS.get(target) or _no_id_tail(target))
    raw_id = b"" if sid is None else sid.encode("utf-8", "surrogateescape")  # encode_id_key
    if target is None and raw_id[:1] != LANE_BYTE:
        return head + raw_id
    if len(raw_id) > 0xFFFF:
        raise ValueError(f"a schedule id next to a target has at most 65535 bytes, "
                         f"got {len(raw_id)}")
    named = b"" if target is None else target.encode()  # empty: a lane's id, no target
    return head + _TARGET_HEAD.pack(_WITH_TARGET, len(raw_id)) + raw_id + named


def _no_id_tail(target: str) -> bytes:
    tail = _TARGET_HEAD.pack(_WITH_TARGET, 0) + target.encode()
    if len(_NO_ID_TAILS) < 1_024:  # bounded all the same
        _NO_ID_TAILS[target] = tail
    return tail


def decode_index_value(raw: bytes) -> IndexValue:
    """Decode :func:`encode_index_value`; ValueError if short or not UTF-8 where text is."""
    size = _INDEX_HEAD.size
    if len(raw) < size:
        raise ValueError(f"an index value needs {size} bytes, got {len(raw)}")
    timestamp_ms, crc = _INDEX_HEAD.unpack_from(raw)
    target = None
    try:
        if len(raw) > size and raw[size] == _WITH_TARGET:
            if len(raw) < size + _TARGET_HEAD.size:
                raise ValueError(f"an index value with a target is cut short: {raw!r}")
            length = _TARGET_HEAD.unpack_from(raw, size)[1]
            start = size + _TARGET_HEAD.size
            ident = raw[start : start + length]
            schedule_id = ((_id_text(ident) if ident[:1] == LANE_BYTE else ident.decode("utf-8"))
                           if length else None)
            target = raw[start + length :].decode("utf-8") or None
        else:
            schedule_id = raw[size:].decode("utf-8") if len(raw) > size else None
    except UnicodeDecodeError as exc:
        raise ValueError(f"the text in an index value is not UTF-8: {exc}") from exc
    # Built with tuple.__new__: a NamedTuple's own __new__ is a Python call, and
    # delivery decodes one value per entry it reads ahead.
    return _tuple_new(IndexValue, (_tuple_new(Fingerprint, (timestamp_ms, crc)), schedule_id,
                                   target))


def due_ms_of(key: bytes) -> int:
    """Return the due time of an encoded due key without decoding the rest; struct.error
    for a key shorter than 8 bytes."""
    due_ms: int = _U64.unpack_from(key)[0]
    return due_ms


def due_times(keys: Iterable[bytes]) -> list[int]:
    """The due times of encoded due keys, without decoding the rest (the tally's, for
    every key a write adds or removes); struct.error for a key shorter than 8 bytes."""
    unpack = _U64.unpack_from
    return [unpack(key)[0] for key in keys]


def record_times(values: Iterable[bytes]) -> list[int]:
    """The fingerprint timestamps of encoded index values, without decoding the rest;
    struct.error for a value shorter than :data:`INDEX_HEAD_SIZE`."""
    unpack = _INDEX_HEAD.unpack_from
    return [unpack(raw)[0] for raw in values]


def request_timestamp_of(raw: bytes) -> int:
    """Return the request timestamp (ms) of an encoded index value without decoding the
    rest; ValueError if ``raw`` is shorter than the fixed head."""
    if len(raw) < _INDEX_HEAD.size:
        raise ValueError(f"an index value needs {_INDEX_HEAD.size} bytes, got {len(raw)}")
    timestamp_ms: int = _INDEX_HEAD.unpack_from(raw)[0]
    return timestamp_ms


def has_schedule_id(raw: bytes) -> bool:
    """Whether an encoded index value carries a schedule id (without decoding it)."""
    size = INDEX_HEAD_SIZE
    if len(raw) <= size:
        return False
    return raw[size] != _WITH_TARGET or raw[size + 1 : size + 3] != b"\x00\x00"


def schedule_id_of(raw: bytes) -> str | None:
    """Return the schedule id of an encoded index value without decoding the rest;
    ValueError, as :func:`decode_index_value`, for a short value or an id not UTF-8."""
    if len(raw) < _INDEX_HEAD.size:
        raise ValueError(f"an index value needs {_INDEX_HEAD.size} bytes, got {len(raw)}")
    if len(raw) == _INDEX_HEAD.size:
        return None
    start = _INDEX_HEAD.size
    try:
        if raw[start] == _WITH_TARGET:
            if len(raw) < start + _TARGET_HEAD.size:
                raise ValueError(f"an index value with a target is cut short: {raw!r}")
            length = raw[start + 1] << 8 | raw[start + 2]
            start += _TARGET_HEAD.size
            ident = raw[start : start + length]
            if not length:
                return None
            return _id_text(ident) if ident[:1] == LANE_BYTE else ident.decode("utf-8")
        return raw[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the schedule id in an index value is not UTF-8: {exc}") from exc


def index_value_target(raw: bytes) -> bytes:
    """The target of an encoded index value (:func:`encode_index_value`) as UTF-8
    bytes, without decoding the rest; b"" when it names none (or is cut short)."""
    size = _INDEX_HEAD.size
    if len(raw) < size + _TARGET_HEAD.size or raw[size] != _WITH_TARGET:
        return b""
    return raw[size + _TARGET_HEAD.size + _TARGET_HEAD.unpack_from(raw, size)[1]:]


def encode_id_state(state: IdState) -> bytes:
    """Encode ``b"P" + due key`` for a pending id, ``b"E" + end, time, key, fingerprint``
    for an ended one (``b"D" + u64 ms`` when an old marker knows only its delivery time).

    Raises ValueError unless exactly one of ``pending_key`` and ``ended_ms`` is
    set, the keys are full due keys, and the time is a non-negative u64.
    """
    pending_key, ended_ms, end, first_key, fingerprint = state
    if pending_key is not None and ended_ms is None:
        _check_size("a pending due key", pending_key, DUE_KEY_SIZE)
        return _PENDING + pending_key
    if ended_ms is None or pending_key is not None:
        raise ValueError("an IdState needs exactly one of pending_key and ended_ms")
    _check_range("ended_ms", ended_ms, 0, _U64_MAX)
    if first_key is None or fingerprint is None:
        if end is not End.DELIVERED:
            raise ValueError("an ended IdState names the key and fingerprint it ended with")
        return _DELIVERED + _U64.pack(ended_ms)
    _check_size("an ended id's due key", first_key, DUE_KEY_SIZE)
    try:
        return _ENDED + _ENDED_BODY.pack(end, ended_ms, first_key, *fingerprint)
    except struct.error as exc:
        raise ValueError(f"an ended id's fingerprint {fingerprint} is out of range") from exc


def decode_id_state(raw: bytes) -> IdState:
    """Decode :func:`encode_id_state`; ValueError on an unknown tag or a wrong length."""
    tag, body = raw[:1], raw[1:]
    if tag == _PENDING:
        _check_size("a pending id state's due key", body, DUE_KEY_SIZE)
        return IdState(body, None)
    if tag == _ENDED:
        _check_size("an ended id state", body, _ENDED_BODY.size)
        end, ended_ms, key, timestamp_ms, crc = _ENDED_BODY.unpack(body)
        try:
            how = End(end)
        except ValueError:
            raise ValueError(f"an ended id state has an unknown end {end}") from None
        return IdState(None, ended_ms, how, key, Fingerprint(timestamp_ms, crc))
    if tag == _DELIVERED:
        _check_size("a delivered id state's time", body, _U64.size)
        return IdState(None, _U64.unpack(body)[0])
    raise ValueError(f"an id state must start with b'P', b'E' or b'D', got {tag!r}")


def encode_expiry_key(ended_ms: int, schedule_id: str) -> bytes:
    """Encode ``u64 ended_ms | id key`` (:func:`encode_id_key`): the expiry index of
    ended-id markers.

    Byte order is delivery-time order, so the markers old enough to drop form
    a prefix of the keyspace. Raises ValueError for a negative or oversized time.
    """
    _check_range("ended_ms", ended_ms, 0, _U64_MAX)
    return _U64.pack(ended_ms) + encode_id_key(schedule_id)


def decode_expiry_key(raw: bytes) -> tuple[int, str]:
    """Decode :func:`encode_expiry_key`; ValueError for a short key or an id key that
    does not decode."""
    if len(raw) < _U64.size:
        raise ValueError(f"an expiry key needs at least {_U64.size} bytes, got {len(raw)}")
    try:
        schedule_id = decode_id_key(raw[_U64.size :])
    except ValueError as exc:
        raise ValueError(f"the schedule id in an expiry key does not decode: {exc}") from exc
    return _U64.unpack(raw[: _U64.size])[0], schedule_id


def expiry_upper_bound(before_ms: int) -> bytes:
    """The exclusive upper bound of expiry keys of markers delivered before ``before_ms``."""
    return _U64.pack(max(0, min(before_ms, _U64_MAX)))


TALLY_PREFIX: Final = b"tally/"
"""Meta-column-family keys of the pending tally (see :mod:`kdelay.state.tally`) start with this."""
TALLY_COMPLETE: Final = b"tally/complete"
"""Present once the tally stored in a meta column family covers the whole store; its value
is :data:`TALLY_VERSION`, the layout of the buckets stored."""
TALLY_VERSION: Final = b"2"
"""The stored tally's layout: ``2`` counts by request partition too (b"": due and slack only)."""


def encode_tally_key(kind: bytes, minute: int) -> bytes:
    """Encode ``tally/ | kind (1 byte) | i64 minute``: one bucket of the pending tally.

    ``kind`` is ``b"d"`` (by due minute), ``b"s"`` (by slack minute: request
    time minus due time) or ``b"o"`` (by request partition, in place of the
    minute). Raises ValueError for another kind or a minute out of range.
    """
    if len(kind) != 1 or kind not in b"dso":
        raise ValueError(f"a tally kind is b'd', b's' or b'o', got {kind!r}")
    _check_range("minute", minute, _I64_MIN, _I64_MAX)
    return TALLY_PREFIX + kind + _I64.pack(minute)


def decode_tally_key(raw: bytes) -> tuple[bytes, int]:
    """Decode :func:`encode_tally_key`; ValueError for anything else."""
    body = raw[len(TALLY_PREFIX):]
    if not raw.startswith(TALLY_PREFIX) or len(body) != 1 + _I64.size or body[:1] not in (
            b"d", b"s", b"o"):
        raise ValueError(f"not a tally key: {raw!r}")
    minute: int = _I64.unpack(body[1:])[0]
    return body[:1], minute


def encode_count(count: int) -> bytes:
    """Encode a non-negative count as u64 big-endian; ValueError when out of range."""
    _check_range("count", count, 0, _U64_MAX)
    return _U64.pack(count)


def decode_count(raw: bytes) -> int:
    """Decode :func:`encode_count`; ValueError unless ``raw`` is 8 bytes."""
    _check_size("a count", raw, _U64.size)
    count: int = _U64.unpack(raw)[0]
    return count


def encode_offset(offset: int) -> bytes:
    """Encode a Kafka offset as i64 big-endian; ``-1`` means "no offset yet"."""
    _check_range("offset", offset, _I64_MIN, _I64_MAX)
    return _I64.pack(offset)


def decode_offset(raw: bytes) -> int:
    """Decode :func:`encode_offset`; ValueError unless ``raw`` is 8 bytes."""
    _check_size("an offset", raw, _I64.size)
    return int(_I64.unpack(raw)[0])
