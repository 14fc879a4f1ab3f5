"""Every byte layout kdelay persists, as encode/decode pairs.

These bytes live in RocksDB and in the compacted ``kdelay.changelog``, so they
outlast any one process: a layout here may only change together with a
migration. All integers are big-endian, which makes the byte order of a due key
its time order. Encoders raise :class:`ValueError` for values the layout cannot
hold; decoders raise :class:`ValueError` for bytes that are not a valid
encoding, so corrupt state is reported instead of being misread.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

_DUE_KEY = struct.Struct(">QIQ")
_INDEX_HEAD = struct.Struct(">qI")
_FIELD_HEAD = struct.Struct(">BI")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")

DUE_KEY_SIZE = _DUE_KEY.size
"""Length in bytes of an encoded due key (20)."""
INDEX_HEAD_SIZE = _INDEX_HEAD.size
"""Length in bytes of an encoded index value without a schedule id (12)."""
# The changelog key under which intake records its consumed offset; any length
# but DUE_KEY_SIZE keeps it apart from due keys.
CONSUMED_MARKER = b"kdelay/consumed"
# The changelog key of the tombstones the service writes to read the broker's
# clock (see :mod:`kdelay.engine.skew`); replay ignores it.
CLOCK_PROBE = b"kdelay/clock"

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1

_PENDING = b"P"
_DELIVERED = b"D"
_ABSENT_FIELD = b"\x00"

# Bound once: these run for every request intake reads and every record it
# delivers. tuple.__new__ builds a named tuple from all its fields without the
# generated Python-level __new__, which costs three times as much.
_crc32 = zlib.crc32
_pack_field_head = _FIELD_HEAD.pack
_tuple_new = tuple.__new__


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
    """The value stored under a due key: the request's fingerprint and optional id."""

    fingerprint: Fingerprint
    schedule_id: str | None


class IdState(NamedTuple):
    """What a schedule id refers to; exactly one field is set.

    ``pending_key`` is the encoded due key of the pending request that holds the
    id; ``delivered_ms`` is when the request held under it was delivered (by
    the service clock).
    """

    pending_key: bytes | None
    delivered_ms: int | None


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
        return _DUE_KEY.pack(due_ms, partition, offset)
    except struct.error:  # the checks run only to name the bad field
        _check_range("due_ms", due_ms, 0, _U64_MAX)
        _check_range("partition", partition, 0, _U32_MAX)
        _check_range("offset", offset, 0, _U64_MAX)
        raise


def decode_due_key(raw: bytes) -> DueKey:
    """Decode a key made by :func:`encode_due_key`; ValueError on a wrong length."""
    _check_size("a due key", raw, DUE_KEY_SIZE)
    return _tuple_new(DueKey, _DUE_KEY.unpack(raw))


def decode_due_keys(joined: bytes) -> Iterator[tuple[int, int, int]]:
    """Decode due keys laid end to end (``b"".join(keys)``) as ``(due_ms, partition, offset)``.

    One C-level pass for scans over whole stores; ValueError unless the length
    is a multiple of :data:`DUE_KEY_SIZE`.
    """
    if len(joined) % DUE_KEY_SIZE:
        raise ValueError(f"joined due keys must be a multiple of {DUE_KEY_SIZE} bytes, "
                         f"got {len(joined)}")
    return _DUE_KEY.iter_unpack(joined)


def due_upper_bound(now_ms: int) -> bytes:
    """Return an exclusive ``iterate_upper_bound`` admitting every key due by ``now_ms``.

    This is the smallest key due at ``now_ms + 1``, so every key with
    ``due_ms <= now_ms`` sorts below it and nothing due later does.
    """
    return encode_due_key(now_ms + 1, 0, 0)


def _crc_field(crc: int, field: bytes | None) -> int:
    """Fold one framed field into ``crc``: a presence flag, a u32 length, the bytes."""
    if field is None:
        return _crc32(_ABSENT_FIELD, crc)
    return _crc32(field, _crc32(_pack_field_head(1, len(field)), crc))


def fingerprint(key: bytes | None, value: bytes | None, timestamp_ms: int) -> Fingerprint:
    """Fingerprint a record by its timestamp and a CRC-32 of its key and value.

    Each field is framed by a presence flag and its length before it enters the
    CRC, so a null key differs from an empty one and bytes cannot move between
    key and value unnoticed. The CRC is persisted: its framing must not change.
    The CRC is chained over frame and field, never over a concatenated copy.
    """
    return _tuple_new(Fingerprint, (timestamp_ms, _crc_field(_crc_field(0, key), value)))


def record_time(message: Message, fallback_ms: int) -> int:
    """Return the record's timestamp, or ``fallback_ms`` when the record has none."""
    kind, timestamp = message.timestamp()
    return fallback_ms if kind == TIMESTAMP_NOT_AVAILABLE else timestamp


def fingerprint_of(message: Message) -> Fingerprint:
    """Return the fingerprint of a request record, as stored in its index entry."""
    return fingerprint(message.key(), message.value(), record_time(message, 0))


def encode_index_value(v: IndexValue) -> bytes:
    """Encode ``i64 timestamp | u32 crc`` followed by the schedule id in UTF-8.

    An absent id encodes as nothing after the fixed head. Raises ValueError for
    an empty id (it could not be told from an absent one) or a field out of
    range.
    """
    timestamp_ms, crc = v.fingerprint
    try:
        head = _INDEX_HEAD.pack(timestamp_ms, crc)
    except struct.error:  # the checks run only to name the bad field
        _check_range("fingerprint timestamp_ms", timestamp_ms, _I64_MIN, _I64_MAX)
        _check_range("fingerprint crc", crc, 0, _U32_MAX)
        raise
    if v.schedule_id is None:
        return head
    if not v.schedule_id:
        raise ValueError("a schedule id must not be empty")
    return head + v.schedule_id.encode("utf-8")


def decode_index_value(raw: bytes) -> IndexValue:
    """Decode :func:`encode_index_value`; ValueError if short or the id is not UTF-8."""
    if len(raw) < _INDEX_HEAD.size:
        raise ValueError(f"an index value needs {_INDEX_HEAD.size} bytes, got {len(raw)}")
    timestamp_ms, crc = _INDEX_HEAD.unpack_from(raw)
    tail = raw[_INDEX_HEAD.size :]
    try:
        schedule_id = tail.decode("utf-8") if tail else None
    except UnicodeDecodeError as exc:
        raise ValueError(f"the schedule id in an index value is not UTF-8: {exc}") from exc
    # Built with tuple.__new__: a NamedTuple's own __new__ is a Python call, and
    # delivery decodes one value per entry it reads ahead.
    return _tuple_new(IndexValue, (_tuple_new(Fingerprint, (timestamp_ms, crc)), schedule_id))


def due_ms_of(key: bytes) -> int:
    """Return the due time of an encoded due key without decoding the rest.

    Raises struct.error for a key shorter than 8 bytes.
    """
    due_ms: int = _U64.unpack_from(key)[0]
    return due_ms


def due_times(keys: Iterable[bytes]) -> list[int]:
    """The due times of encoded due keys, without decoding the rest.

    For batches (the tally counts every key a write adds or removes); raises
    struct.error for a key shorter than 8 bytes.
    """
    unpack = _U64.unpack_from
    return [unpack(key)[0] for key in keys]


def record_times(values: Iterable[bytes]) -> list[int]:
    """The fingerprint timestamps of encoded index values, without decoding the rest.

    For scans over whole stores; raises struct.error for a value shorter than
    :data:`INDEX_HEAD_SIZE`.
    """
    unpack = _INDEX_HEAD.unpack_from
    return [unpack(raw)[0] for raw in values]


def request_timestamp_of(raw: bytes) -> int:
    """Return the request timestamp (ms) of an encoded index value without decoding the rest.

    Raises ValueError if ``raw`` is shorter than the fixed head.
    """
    if len(raw) < _INDEX_HEAD.size:
        raise ValueError(f"an index value needs {_INDEX_HEAD.size} bytes, got {len(raw)}")
    timestamp_ms: int = _INDEX_HEAD.unpack_from(raw)[0]
    return timestamp_ms


def schedule_id_of(raw: bytes) -> str | None:
    """Return the schedule id of an encoded index value without decoding the rest.

    Raises ValueError, as :func:`decode_index_value` does, for a short value or
    an id that is not UTF-8.
    """
    if len(raw) < _INDEX_HEAD.size:
        raise ValueError(f"an index value needs {_INDEX_HEAD.size} bytes, got {len(raw)}")
    if len(raw) == _INDEX_HEAD.size:
        return None
    try:
        return raw[_INDEX_HEAD.size :].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the schedule id in an index value is not UTF-8: {exc}") from exc


def encode_id_state(state: IdState) -> bytes:
    """Encode ``b"P" + due key`` for a pending id, ``b"D" + u64 ms`` for a delivered one.

    Raises ValueError unless exactly one field is set, the pending key is a
    full due key, and the delivered time is a non-negative u64.
    """
    pending_key, delivered_ms = state
    if pending_key is not None and delivered_ms is None:
        _check_size("a pending due key", pending_key, DUE_KEY_SIZE)
        return _PENDING + pending_key
    if delivered_ms is not None and pending_key is None:
        _check_range("delivered_ms", delivered_ms, 0, _U64_MAX)
        return _DELIVERED + _U64.pack(delivered_ms)
    raise ValueError("an IdState needs exactly one of pending_key and delivered_ms")


def decode_id_state(raw: bytes) -> IdState:
    """Decode :func:`encode_id_state`; ValueError on an unknown tag or a wrong length."""
    tag, body = raw[:1], raw[1:]
    if tag == _PENDING:
        _check_size("a pending id state's due key", body, DUE_KEY_SIZE)
        return IdState(body, None)
    if tag == _DELIVERED:
        _check_size("a delivered id state's time", body, _U64.size)
        return IdState(None, _U64.unpack(body)[0])
    raise ValueError(f"an id state must start with b'P' or b'D', got {tag!r}")


def encode_expiry_key(delivered_ms: int, schedule_id: str) -> bytes:
    """Encode ``u64 delivered_ms | UTF-8 id``: the expiry index of delivered-id markers.

    Byte order is delivery-time order, so the markers old enough to drop form
    a prefix of the keyspace. Raises ValueError for a negative or oversized time.
    """
    _check_range("delivered_ms", delivered_ms, 0, _U64_MAX)
    return _U64.pack(delivered_ms) + schedule_id.encode("utf-8")


def decode_expiry_key(raw: bytes) -> tuple[int, str]:
    """Decode :func:`encode_expiry_key`; ValueError for a short key or an id not UTF-8."""
    if len(raw) < _U64.size:
        raise ValueError(f"an expiry key needs at least {_U64.size} bytes, got {len(raw)}")
    try:
        schedule_id = raw[_U64.size :].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the schedule id in an expiry key is not UTF-8: {exc}") from exc
    return _U64.unpack(raw[: _U64.size])[0], schedule_id


def expiry_upper_bound(before_ms: int) -> bytes:
    """The exclusive upper bound of expiry keys of markers delivered before ``before_ms``."""
    return _U64.pack(max(0, min(before_ms, _U64_MAX)))


TALLY_PREFIX = b"tally/"
"""Meta-column-family keys of the pending tally (see :mod:`kdelay.state.tally`) start with this."""
TALLY_COMPLETE = b"tally/complete"
"""Present once the tally stored in a meta column family covers the whole store."""


def encode_tally_key(kind: bytes, minute: int) -> bytes:
    """Encode ``tally/ | kind (1 byte) | i64 minute``: one bucket of the pending tally.

    ``kind`` is ``b"d"`` (by due minute) or ``b"s"`` (by slack minute: request
    time minus due time). Raises ValueError for another kind or a minute out of range.
    """
    if len(kind) != 1 or kind not in b"ds":
        raise ValueError(f"a tally kind is b'd' or b's', got {kind!r}")
    _check_range("minute", minute, _I64_MIN, _I64_MAX)
    return TALLY_PREFIX + kind + _I64.pack(minute)


def decode_tally_key(raw: bytes) -> tuple[bytes, int]:
    """Decode :func:`encode_tally_key`; ValueError for anything else."""
    body = raw[len(TALLY_PREFIX):]
    if not raw.startswith(TALLY_PREFIX) or len(body) != 1 + _I64.size or body[:1] not in (
            b"d", b"s"):
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
    value: int = _I64.unpack(raw)[0]
    return value
