"""Intake of ids that live on another partition: forwards out, forwards in.

A request or cancel with an id is indexed on the id's partition. Planned on
another partition it becomes a forward record to the id's partition (no
payload); planned there, a forward becomes an entry whose key names the
original where it lies.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Message

from kdelay.engine.intake import Outcome, Plan, Planner, Record
from kdelay.protocol import codec, forward
from kdelay.protocol.codec import IdState, IndexValue
from kdelay.protocol.envelope import ERROR, Headers, cancel_headers, schedule_headers
from kdelay.protocol.forward import FORWARD, Forward, id_partition
from kdelay.state.changes import Entry
from tests.unit.engine.test_intake import LIMITS, TOPICS, TS, Ids, header, request

PARTITIONS = 4
HOME = 3  # the partition test_intake's requests are read from


def sid_on(partition: int) -> str:
    """A schedule id whose partition (of ``PARTITIONS``) is ``partition``."""
    return next(f"id-{n}" for n in range(1_000) if id_partition(f"id-{n}", PARTITIONS) == partition)


def plan(ids: Ids, messages: Sequence[Message], partition: int = HOME) -> Plan:
    planner = Planner(TOPICS, LIMITS, ids.lookup, ids.withhold, partitions=PARTITIONS)
    return planner.plan(partition, messages)


def on(partition: int, offset: int, headers: Headers,
       key: bytes | None = b"k", value: bytes | None = b"payload") -> Message:
    return Message(topic=TOPICS.requests, partition=partition, offset=offset, key=key,
                   value=value, headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, TS))


def test_an_id_on_its_own_partition_is_indexed_and_forwards_nothing() -> None:
    sid = sid_on(HOME)
    result = plan(Ids(), [request(5, schedule_headers("orders", delay_ms=10, schedule_id=sid))])
    assert result.forwards == []
    assert [e.key for e in result.changes.entries()] == [codec.encode_due_key(TS + 10, HOME, 5)]
    assert result.outcomes == [(Outcome.SCHEDULED, sid)]


def test_an_id_of_another_partition_is_forwarded_without_its_payload() -> None:
    sid = sid_on(1)
    result = plan(Ids(), [request(5, schedule_headers("orders", delay_ms=10, schedule_id=sid))])
    expected = Forward(sid, TS + 10, HOME, 5, codec.fingerprint(b"k", b"payload", TS),
                       "orders")
    assert result.forwards == [Record(TOPICS.requests, 1, None, None, forward.counted(
        forward.schedule_headers(expected), PARTITIONS))]
    assert forward.parse(result.forwards[0].headers) == expected
    assert (result.changes.entries(), result.changes.ids, result.changelog) == ([], {}, [])
    assert result.outcomes == [(Outcome.FORWARDED, sid)]
    assert result.changes.consumed == 6, "the forward is written before the offset is stored"


@pytest.mark.parametrize("target", ["orders", None], ids=["target", "forward-of-older-version"])
def test_a_forward_is_indexed_on_the_ids_partition_under_the_originals_coordinates(
    target: str | None,
) -> None:
    sid = sid_on(1)
    fingerprint = codec.fingerprint(b"k", b"payload", TS)
    fwd = on(1, 40, forward.schedule_headers(Forward(sid, TS + 10, HOME, 5, fingerprint, target)),
             key=None, value=None)
    result = plan(Ids(), [fwd], partition=1)
    original = codec.encode_due_key(TS + 10, HOME, 5)
    value = IndexValue(fingerprint, sid, target)
    assert result.changes.entries() == [Entry(original, value)]
    assert result.changes.absent == set(), "a forward may be read again: its put is looked up"
    assert result.changes.ids == {sid: IdState(original, None)}
    assert result.changelog == [
        Record(TOPICS.changelog, 1, original, codec.encode_index_value(value))]
    assert result.originals == {}, "the original is read where it lies, not from the forward"
    assert result.forwards == []
    assert result.dead_letters == []


def test_a_forward_of_an_id_pending_under_another_key_is_a_duplicate() -> None:
    sid = sid_on(1)
    ids = Ids()
    ids.states[sid] = IdState(codec.encode_due_key(TS, 0, 1), None)
    fwd = Forward(sid, TS + 10, HOME, 5, codec.fingerprint(b"k", b"payload", TS))
    result = plan(ids, [on(1, 40, forward.schedule_headers(fwd), None, None)], partition=1)
    assert result.changes.entries() == []
    assert result.outcomes == [(Outcome.DUPLICATE, f"{sid} (first: pending)")]


def test_the_same_forward_read_twice_is_indexed_once() -> None:
    # A forward written again (its first owner died before it recorded the request's
    # offset) names the same key: pending, it is not put again.
    sid = sid_on(1)
    headers = forward.schedule_headers(
        Forward(sid, TS + 10, HOME, 5, codec.fingerprint(b"k", b"v", TS)))
    ids = Ids()
    first = plan(ids, [on(1, 40, headers, None, None)], partition=1)
    assert [e.key for e in first.changes.entries()] == [codec.encode_due_key(TS + 10, HOME, 5)]
    ids.states[sid] = first.changes.ids[sid] or IdState(None, 0)
    again = plan(ids, [on(1, 41, headers, None, None)], partition=1)
    assert (again.changes.entries(), again.changelog) == ([], [])
    assert again.outcomes == [(Outcome.SCHEDULED, sid)]


def test_a_malformed_forward_is_dead_lettered_as_bad_forward() -> None:
    headers: Headers = [(FORWARD, b"3/x"), ("kdelay-due-ms", b"1"), ("kdelay-id", b"a"),
               (forward.FINGERPRINT, b"1/2")]
    result = plan(Ids(), [on(1, 40, headers, None, None)], partition=1)
    [dead] = result.dead_letters
    assert header(dead.headers, ERROR) == [b"bad-forward"]
    assert result.changes.entries() == []


def test_a_cancel_of_an_id_of_another_partition_is_forwarded() -> None:
    sid = sid_on(0)
    result = plan(Ids(), [request(8, cancel_headers(sid), key=None, value=sid.encode())])
    assert result.forwards == [Record(TOPICS.requests, 0, None, sid.encode(), forward.counted(
        forward.cancel_headers(sid, HOME, 8), PARTITIONS))]
    assert result.outcomes == [(Outcome.FORWARDED, sid)]
    assert result.changes.deletes == []
    assert result.changes.ids == {}


def test_a_forwarded_cancel_is_applied_on_the_ids_partition() -> None:
    sid = sid_on(0)
    pending = codec.encode_due_key(TS + 10, HOME, 5)
    ids = Ids()
    ids.states[sid] = IdState(pending, None)
    result = plan(ids, [on(0, 9, forward.cancel_headers(sid, HOME, 8), None, sid.encode())],
                  partition=0)
    assert result.changes.deletes == [pending]
    assert result.outcomes == [(Outcome.CANCELLED, sid)]


def test_a_forwarded_cancel_placed_by_this_partition_count_is_never_forwarded_again() -> None:
    # Instances that disagree on where an id lives must not send records round.
    sid = sid_on(0)
    headers = forward.counted(forward.cancel_headers(sid, HOME, 8), PARTITIONS)
    result = plan(Ids(), [on(2, 9, headers, None, sid.encode())], partition=2)
    assert result.forwards == []
    assert result.outcomes == [(Outcome.UNKNOWN, sid)]


@pytest.mark.parametrize("placed_under", [2, None], ids=["fewer-partitions", "older-version"])
def test_records_forwarded_before_the_topic_grew_go_on_once_to_the_ids_new_home(
    placed_under: int | None,
) -> None:
    # Forwarded by a count the topic had before it grew (or by a version that did not say)
    # to partition 2, which is not the id's home under PARTITIONS: each goes on to the
    # home, keeping where it was first written.
    sid = next(f"id-{n}" for n in range(1_000) if id_partition(f"id-{n}", PARTITIONS) == 1)
    fingerprint = codec.fingerprint(b"k", b"payload", TS)
    found = Forward(sid, TS + 10, 3, 5, fingerprint, "orders")

    def placed(headers: Headers) -> Headers:
        return headers if placed_under is None else forward.counted(headers, placed_under)

    records = [on(2, 9, placed(forward.schedule_headers(found)), None, None),
               on(2, 10, placed(forward.cancel_headers(sid, 3, 8)), None, sid.encode()),
               on(2, 11, placed(forward.reschedule_headers(sid, TS + 99, 3, 7)), None, None)]
    result = plan(Ids(), records, partition=2)
    assert result.forwards == [
        Record(TOPICS.requests, 1, None, None,
               forward.counted(forward.schedule_headers(found), PARTITIONS)),
        Record(TOPICS.requests, 1, None, sid.encode(),
               forward.counted(forward.cancel_headers(sid, 3, 8), PARTITIONS)),
        Record(TOPICS.requests, 1, None, None,
               forward.counted(forward.reschedule_headers(sid, TS + 99, 3, 7), PARTITIONS))]
    assert result.outcomes == [(Outcome.FORWARDED, sid)] * 3
    assert (result.changes.entries(), result.changes.ids) == ([], {})


def test_a_record_forwarded_under_another_count_for_an_id_pending_here_is_handled_here() -> None:
    sid = next(f"id-{n}" for n in range(1_000) if id_partition(f"id-{n}", PARTITIONS) == 1)
    pending = codec.encode_due_key(TS + 10, 3, 5)
    ids = Ids()
    ids.states[sid] = IdState(pending, None)
    headers = forward.counted(forward.cancel_headers(sid, 3, 8), 2)
    result = plan(ids, [on(2, 9, headers, None, sid.encode())], partition=2)
    assert result.forwards == []
    assert result.outcomes == [(Outcome.CANCELLED, sid)]


def test_an_id_already_pending_where_it_was_written_is_handled_there() -> None:
    sid = sid_on(0)
    local = codec.encode_due_key(TS + 10, HOME, 2)
    ids = Ids()
    ids.states[sid] = IdState(local, None)
    again = request(7, schedule_headers("orders", delay_ms=10, schedule_id=sid))
    cancel = request(8, cancel_headers(sid), key=None, value=sid.encode())
    result = plan(ids, [again, cancel])
    assert result.forwards == []
    assert result.outcomes == [(Outcome.DUPLICATE, f"{sid} (first: pending)"),
                               (Outcome.CANCELLED, sid)]
    assert result.changes.deletes == [local]


def test_a_schedule_and_its_cancel_forwarded_in_one_batch_keep_their_order() -> None:
    sid = sid_on(2)
    result = plan(Ids(), [
        request(1, schedule_headers("orders", delay_ms=10, schedule_id=sid)),
        request(2, cancel_headers(sid), key=None, value=sid.encode())])
    assert [r.partition for r in result.forwards] == [2, 2]
    assert isinstance(forward.parse(result.forwards[0].headers), Forward)
    assert forward.parse(result.forwards[1].headers) is None  # a cancel, parsed as one
