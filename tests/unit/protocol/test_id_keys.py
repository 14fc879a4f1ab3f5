"""Id keys: an id scoped by its lane, as the index, the changelog and the outcomes hold it.

Without a lane the key is the id and its bytes are the UTF-8 id, as before lanes
scoped ids; with one it is ``0xFF | lane | "/" | UTF-8 id``, which no UTF-8 id
can spell. Every layout that holds an id round-trips a lane's key.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kdelay.protocol import codec, idkeys
from kdelay.protocol.codec import End, Fingerprint, IndexValue
from kdelay.protocol.envelope import LANE_NAME

ids = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1)
lanes = st.none() | st.from_regex(LANE_NAME, fullmatch=True)
FP = Fingerprint(1_700_000_000_000, 7)


@given(ids, lanes)
def test_an_id_key_round_trips_through_every_layout_that_holds_one(sid: str,
                                                                  lane: str | None) -> None:
    key = idkeys.id_key(sid, lane)
    assert idkeys.split_id_key(key) == (sid, lane)
    assert idkeys.decode_id_key(idkeys.encode_id_key(key)) == key
    assert codec.id_of_record_key(codec.id_record_key(key)) == key
    assert codec.decode_expiry_key(codec.encode_expiry_key(5, key)) == (5, key)
    for target in (None, "orders"):
        raw = codec.encode_index_value(IndexValue(FP, key, target))
        assert codec.decode_index_value(raw) == IndexValue(FP, key, target)
        assert codec.schedule_id_of(raw) == key
        assert codec.has_schedule_id(raw)


@given(ids)
def test_without_a_lane_every_byte_is_as_before(sid: str) -> None:
    assert idkeys.id_key(sid, None) == sid
    assert idkeys.encode_id_key(sid) == sid.encode("utf-8")
    assert codec.id_record_key(sid) == codec.ID_RECORD_PREFIX + sid.encode("utf-8")
    assert idkeys.outcome_key(sid, None) == sid.encode("utf-8")
    assert codec.encode_index_value(IndexValue(FP, sid, None)).endswith(sid.encode("utf-8"))


@given(ids, ids, st.from_regex(LANE_NAME, fullmatch=True))
def test_no_id_without_a_lane_has_the_key_of_an_id_with_one(plain: str, sid: str,
                                                             lane: str) -> None:
    assert idkeys.encode_id_key(plain) != idkeys.encode_id_key(idkeys.id_key(sid, lane))
    assert idkeys.id_key(sid, lane) != idkeys.id_key(sid, None)


def test_a_lanes_key_layout() -> None:
    key = idkeys.id_key("order-43", "dev1")
    assert idkeys.encode_id_key(key) == b"\xffdev1/order-43"
    assert idkeys.outcome_key("order-43", "dev1") == b"\xffdev1/order-43"
    assert codec.id_record_key(key) == b"kdelay/ended-schedule-id/\xffdev1/order-43"
    assert idkeys.shown_id(key) == "order-43 (lane dev1)"
    assert idkeys.split_id_key(idkeys.id_key("a/b", "dev1")) == ("a/b", "dev1")


@pytest.mark.parametrize("raw", [b"\xff", b"\xffdev1", b"\xffdev1/", b"\xff/x", b"\xffa b/x",
                                 b"\xffdev1/\xff", b"\xfe/x", b"ok\xff"])
def test_bytes_that_are_no_id_key_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not UTF-8"):
        idkeys.decode_id_key(raw)
    with pytest.raises(ValueError, match="does not decode"):
        codec.id_of_record_key(codec.ID_RECORD_PREFIX + raw)


def test_an_ended_lane_id_is_recorded_under_its_lanes_key() -> None:
    key = idkeys.id_key("order-43", "dev1")
    state, record = codec.end_of(key, End.CANCELLED, 9, codec.encode_due_key(1, 0, 0), FP)
    assert record is not None
    assert record[0] == b"kdelay/ended-schedule-id/\xffdev1/order-43"
    assert codec.decode_id_state(record[1]) == state


@given(lanes)
def test_an_answer_names_its_lane_only_when_it_has_one(lane: str | None) -> None:
    answer = idkeys.Answer("order-43", "scheduled", "r/0/1", 5, lane=lane)
    raw = idkeys.encode_answer(answer)
    assert idkeys.decode_answer(raw) == answer
    assert (b'"lane"' in raw) == (lane is not None)
