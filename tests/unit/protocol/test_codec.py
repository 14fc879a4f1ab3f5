"""Byte layouts: every encode/decode pair round-trips, due keys sort in time order."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kdelay.protocol.codec import (
    DUE_KEY_SIZE,
    SMALL_RECORD,
    DueKey,
    Fingerprint,
    IdState,
    IndexValue,
    Watermark,
    decode_due_key,
    decode_expiry_key,
    decode_id_state,
    decode_index_value,
    decode_offset,
    decode_watermark,
    due_times,
    due_upper_bound,
    encode_due_key,
    encode_expiry_key,
    encode_id_state,
    encode_index_fields,
    encode_index_value,
    encode_offset,
    encode_watermark,
    expiry_upper_bound,
    fingerprint,
    framed_crc,
    key_after,
    record_times,
    same_request,
    schedule_id_of,
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
due_keys = st.builds(DueKey, u64, u32, u64)
optional_bytes = st.none() | st.binary(max_size=64)
fingerprints = st.builds(Fingerprint, i64, u32)
utf8_ids = st.text(st.characters(exclude_categories=["Cs"]), min_size=1)


@given(due_keys)
def test_due_key_round_trips(key: DueKey) -> None:
    raw = encode_due_key(*key)
    assert len(raw) == DUE_KEY_SIZE == 20
    assert decode_due_key(raw) == key


@given(due_keys, due_keys)
def test_due_key_byte_order_is_tuple_order(a: DueKey, b: DueKey) -> None:
    assert (encode_due_key(*a) < encode_due_key(*b)) == (tuple(a) < tuple(b))



@given(due_keys, due_keys)
def test_same_request_compares_partition_and_offset_only(a: DueKey, b: DueKey) -> None:
    same = same_request(encode_due_key(*a), encode_due_key(*b))
    assert same == ((a.partition, a.offset) == (b.partition, b.offset))
    assert same_request(encode_due_key(*a), encode_due_key(b.due_ms, a.partition, a.offset))

@given(st.lists(due_keys, max_size=20), st.lists(fingerprints, max_size=20))
def test_batch_time_readers_agree_with_the_decoders(keys: list[DueKey],
                                                    prints: list[Fingerprint]) -> None:
    assert due_times([encode_due_key(*k) for k in keys]) == [k.due_ms for k in keys]
    values = [encode_index_value(IndexValue(f, None)) for f in prints]
    assert record_times(values) == [f.timestamp_ms for f in prints]


def test_due_key_layout_is_big_endian() -> None:
    raw = encode_due_key(1, 2, 3)
    assert raw == (1).to_bytes(8, "big") + (2).to_bytes(4, "big") + (3).to_bytes(8, "big")


@pytest.mark.parametrize(
    ("due_ms", "partition", "offset"),
    [(-1, 0, 0), (0, -1, 0), (0, 0, -1), (2**64, 0, 0), (0, 2**32, 0), (0, 0, 2**64)],
)
def test_due_key_rejects_out_of_range_fields(due_ms: int, partition: int, offset: int) -> None:
    with pytest.raises(ValueError, match="must be in"):
        encode_due_key(due_ms, partition, offset)


@pytest.mark.parametrize("size", [0, 19, 21])
def test_due_key_decode_rejects_wrong_length(size: int) -> None:
    with pytest.raises(ValueError, match="must be 20 bytes"):
        decode_due_key(b"\x00" * size)


@given(st.integers(0, 2**63), u32, u64)
def test_upper_bound_admits_due_now_and_excludes_later(
    now_ms: int, partition: int, offset: int
) -> None:
    bound = due_upper_bound(now_ms)
    assert encode_due_key(now_ms, partition, offset) < bound
    assert encode_due_key(now_ms + 1, partition, offset) >= bound


def test_upper_bound_is_smallest_key_of_next_millisecond() -> None:
    assert due_upper_bound(999) == encode_due_key(1000, 0, 0)


def test_fingerprint_keeps_timestamp() -> None:
    assert fingerprint(b"k", b"v", 1234).timestamp_ms == 1234


def test_decoders_build_their_named_tuples() -> None:
    assert type(fingerprint(b"k", b"v", 1)) is Fingerprint
    assert type(decode_due_key(encode_due_key(1, 2, 3))) is DueKey


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((None, b"v"), (b"", b"v")),
        ((b"k", None), (b"k", b"")),
        ((None, None), (b"", b"")),
        ((b"ab", b"c"), (b"a", b"bc")),
        ((b"abc", None), (None, b"abc")),
        ((b"", b"x"), (b"x", b"")),
    ],
)
def test_fingerprint_framing_is_unambiguous(
    a: tuple[bytes | None, bytes | None], b: tuple[bytes | None, bytes | None]
) -> None:
    assert fingerprint(*a, 0).crc != fingerprint(*b, 0).crc


def test_fingerprint_crc_is_the_documented_framing() -> None:
    framed = b"\x01" + (1).to_bytes(4, "big") + b"k" + b"\x00"
    assert fingerprint(b"k", None, 0).crc == zlib.crc32(framed)


def documented_framing(field: bytes | None) -> bytes:
    return b"\x00" if field is None else b"\x01" + len(field).to_bytes(4, "big") + field


@given(optional_bytes, optional_bytes, st.sampled_from([0, 1, SMALL_RECORD]))
def test_fingerprint_crc_is_the_framing_whether_copied_or_chained(
    key: bytes | None, value: bytes | None, padding: int
) -> None:
    """A record up to SMALL_RECORD bytes is framed into one copy, a larger one is
    chained: both are the CRC of the documented framing, and framed_crc is the same."""
    value = None if value is None else value + b"p" * padding
    expected = zlib.crc32(documented_framing(key) + documented_framing(value))
    assert fingerprint(key, value, 0).crc == framed_crc(key, value) == expected


@given(optional_bytes, optional_bytes, i64)
def test_fingerprint_is_deterministic_and_fits_u32(
    key: bytes | None, value: bytes | None, timestamp_ms: int
) -> None:
    fp = fingerprint(key, value, timestamp_ms)
    assert fp == fingerprint(key, value, timestamp_ms)
    assert 0 <= fp.crc < 2**32


@given(fingerprints, st.none() | utf8_ids, st.none() | utf8_ids)
def test_index_value_round_trips(fp: Fingerprint, schedule_id: str | None,
                                 target: str | None) -> None:
    value = IndexValue(fp, schedule_id, target)
    assert decode_index_value(encode_index_value(value)) == value


@given(fingerprints, st.none() | utf8_ids, st.none() | utf8_ids)
def test_index_fields_encode_as_their_value(fp: Fingerprint, schedule_id: str | None,
                                            target: str | None) -> None:
    value = IndexValue(fp, schedule_id, target)
    assert encode_index_fields(fp.timestamp_ms, fp.crc, schedule_id, target) == (
        encode_index_value(value))


def test_index_value_layout() -> None:
    raw = encode_index_value(IndexValue(Fingerprint(-1, 7), "id-1"))
    assert raw == b"\xff" * 8 + (7).to_bytes(4, "big") + b"id-1"
    assert len(encode_index_value(IndexValue(Fingerprint(0, 0), None))) == 12
    head = (5).to_bytes(8, "big") + (7).to_bytes(4, "big")
    raw = encode_index_value(IndexValue(Fingerprint(5, 7), "id-1", "orders"))
    assert raw == head + b"\xff\x00\x04" + b"id-1" + b"orders"
    assert encode_index_value(IndexValue(Fingerprint(5, 7), None, "t")) == head + b"\xff\x00\x00t"


@given(fingerprints, st.none() | utf8_ids, st.none() | utf8_ids)
def test_the_id_alone_reads_as_the_whole_value_does(fp: Fingerprint, schedule_id: str | None,
                                                     target: str | None) -> None:
    # Restore reads only the id of each value it replays.
    raw = encode_index_value(IndexValue(fp, schedule_id, target))
    assert schedule_id_of(raw) == schedule_id


@given(fingerprints, utf8_ids)
def test_an_index_value_of_the_first_layout_still_decodes(fp: Fingerprint, sid: str) -> None:
    # Values written before entries named their target: the id right after the head.
    raw = fp.timestamp_ms.to_bytes(8, "big", signed=True) + fp.crc.to_bytes(4, "big")
    assert decode_index_value(raw) == IndexValue(fp, None, None)
    assert decode_index_value(raw + sid.encode()) == IndexValue(fp, sid, None)


def test_an_id_too_long_to_sit_next_to_a_target_is_refused() -> None:
    with pytest.raises(ValueError, match="65535 bytes"):
        encode_index_value(IndexValue(Fingerprint(0, 0), "x" * 65_536, "orders"))


def test_index_value_rejects_empty_id() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        encode_index_value(IndexValue(Fingerprint(0, 0), ""))


@pytest.mark.parametrize("fp", [Fingerprint(2**63, 0), Fingerprint(0, -1), Fingerprint(0, 2**32)])
def test_index_value_rejects_out_of_range_fingerprint(fp: Fingerprint) -> None:
    with pytest.raises(ValueError, match="must be in"):
        encode_index_value(IndexValue(fp, None))


def test_index_value_decode_rejects_short_and_non_utf8() -> None:
    with pytest.raises(ValueError, match="needs 12 bytes"):
        decode_index_value(b"\x00" * 11)
    with pytest.raises(ValueError, match="not UTF-8"):
        decode_index_value(b"\x00" * 12 + b"\xfe")
    with pytest.raises(ValueError, match="cut short"):
        decode_index_value(b"\x00" * 12 + b"\xff\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        decode_index_value(b"\x00" * 12 + b"\xff\x00\x00\xfe")


@given(due_keys)
def test_pending_id_state_round_trips(key: DueKey) -> None:
    state = IdState(encode_due_key(*key), None)
    raw = encode_id_state(state)
    assert raw[:1] == b"P"
    assert decode_id_state(raw) == state


@given(u64)
def test_delivered_id_state_round_trips(delivered_ms: int) -> None:
    state = IdState(None, delivered_ms)
    raw = encode_id_state(state)
    assert raw == b"D" + delivered_ms.to_bytes(8, "big")
    assert decode_id_state(raw) == state


@pytest.mark.parametrize(
    "state",
    [IdState(None, None), IdState(b"\x00" * 20, 5), IdState(b"short", None), IdState(None, -1)],
)
def test_id_state_encode_rejects_invalid(state: IdState) -> None:
    with pytest.raises(ValueError, match=r"exactly one|must be"):
        encode_id_state(state)


@pytest.mark.parametrize("raw", [b"", b"X" + b"\x00" * 8, b"P" + b"\x00" * 19, b"D\x00"])
def test_id_state_decode_rejects_invalid(raw: bytes) -> None:
    with pytest.raises(ValueError, match=r"must start with|must be"):
        decode_id_state(raw)


@given(i64)
def test_offset_round_trips(offset: int) -> None:
    raw = encode_offset(offset)
    assert len(raw) == 8
    assert decode_offset(raw) == offset


def test_offset_minus_one_means_none() -> None:
    assert encode_offset(-1) == b"\xff" * 8
    assert decode_offset(b"\xff" * 8) == -1


def test_offset_errors() -> None:
    with pytest.raises(ValueError, match="must be in"):
        encode_offset(2**63)
    with pytest.raises(ValueError, match="must be 8 bytes"):
        decode_offset(b"\x00" * 7)


@given(u64, utf8_ids)
def test_expiry_key_round_trips(delivered_ms: int, schedule_id: str) -> None:
    assert decode_expiry_key(encode_expiry_key(delivered_ms, schedule_id)) == (
        delivered_ms, schedule_id)


@given(u64, u64, utf8_ids, utf8_ids)
def test_expiry_keys_sort_by_delivery_time(a: int, b: int, ida: str, idb: str) -> None:
    if a < b:
        assert encode_expiry_key(a, ida) < encode_expiry_key(b, idb)


@given(u64, utf8_ids)
def test_expiry_bound_separates_earlier_from_later_deliveries(ms: int, sid: str) -> None:
    assert encode_expiry_key(ms, sid) >= expiry_upper_bound(ms)
    if ms < 2**64 - 1:
        assert encode_expiry_key(ms, sid) < expiry_upper_bound(ms + 1)


def test_expiry_key_errors() -> None:
    with pytest.raises(ValueError, match="must be in"):
        encode_expiry_key(-1, "x")
    with pytest.raises(ValueError, match="at least 8 bytes"):
        decode_expiry_key(b"\x00" * 7)
    with pytest.raises(ValueError, match="not UTF-8"):
        decode_expiry_key(b"\x00" * 8 + b"\xff")


@given(due_keys, st.lists(due_keys, max_size=20))
def test_watermark_round_trips_with_the_pending_keys_below_its_bound(
        bound: DueKey, below: list[DueKey]) -> None:
    raw_bound = encode_due_key(*bound)
    pending = frozenset(k for k in (encode_due_key(*b) for b in below) if k < raw_bound)
    mark = Watermark(raw_bound, pending)
    assert decode_watermark(encode_watermark(mark)) == mark


def test_a_watermark_covers_keys_below_its_bound_but_its_pending_ones() -> None:
    a, b, c = (encode_due_key(1_000, 0, offset) for offset in (1, 2, 3))
    mark = Watermark(c, frozenset({b}))
    assert [mark.covers(k) for k in (a, b, c)] == [True, False, False]
    assert encode_watermark(mark) == b"\x01" + c + b, "version, bound, pending keys sorted"


def test_a_watermark_refuses_pending_keys_at_or_above_its_bound_and_odd_bytes() -> None:
    key = encode_due_key(5, 0, 0)
    with pytest.raises(ValueError, match="below its bound"):
        encode_watermark(Watermark(key, frozenset({key})))
    with pytest.raises(ValueError, match="20 bytes"):
        encode_watermark(Watermark(b"short"))
    for raw in (b"", b"\x02" + key, b"\x01", b"\x01" + key + b"x"):
        with pytest.raises(ValueError, match="not a watermark"):
            decode_watermark(raw)


@given(due_keys)
def test_key_after_is_the_next_key_in_byte_order(key: DueKey) -> None:
    raw = encode_due_key(*key)
    if raw == b"\xff" * DUE_KEY_SIZE:
        with pytest.raises(ValueError, match="no due key follows"):
            key_after(raw)
        return
    following = key_after(raw)
    assert following > raw
    assert len(following) == DUE_KEY_SIZE
    assert Watermark(following).covers(raw)
