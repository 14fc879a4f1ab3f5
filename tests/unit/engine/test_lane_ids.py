"""Ids scoped by lane: the same id in two lanes names two schedules.

A schedule, cancel or reschedule that names a lane (``kdelay-lane``) reaches
only the schedule its own lane holds under the id; one without a lane only the
lane-less one, keyed exactly as before lanes scoped ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from confluent_kafka import TIMESTAMP_CREATE_TIME, Message

from kdelay.engine.intake import Outcome, Plan, Planner
from kdelay.protocol import codec, forward, idkeys
from kdelay.protocol.codec import End, IdState, IndexValue
from kdelay.protocol.envelope import (
    Headers,
    cancel_headers,
    reschedule_headers,
    schedule_headers,
)
from kdelay.protocol.forward import Forward, id_partition
from kdelay.protocol.targets import Lanes, TargetPolicy
from tests.unit.engine.test_intake import LIMITS, PART, TOPICS, TS, Ids, key, request

LANES = Lanes({"dev1": "dev1.", "dev2": "dev2."})
POLICY = TargetPolicy((TOPICS.requests, TOPICS.changelog, TOPICS.dlq), (), LANES)
OUTCOMES = "kdelay.outcomes"
DEV1, DEV2 = idkeys.id_key("order-43", "dev1"), idkeys.id_key("order-43", "dev2")


def planner(ids: Ids, partitions: int | None = None) -> Planner:
    topics = dataclasses.replace(TOPICS, outcomes=OUTCOMES, outcome_partitions=4)
    return Planner(topics, LIMITS, ids.lookup, ids.withhold, POLICY, partitions)


def plan(ids: Ids, messages: Sequence[Message]) -> Plan:
    return planner(ids).plan(PART, messages)


def lane_schedule(offset: int, lane: str | None, sid: str = "order-43") -> Message:
    target = "orders" if lane is None else f"{lane}.orders"
    return request(offset, schedule_headers(target, delay_ms=offset, schedule_id=sid, lane=lane))


def test_the_same_id_in_two_lanes_is_two_schedules() -> None:
    ids = Ids()
    result = plan(ids, [lane_schedule(1, "dev1"), lane_schedule(2, "dev2"), lane_schedule(3, None)])
    assert [e.key for e in result.changes.entries()] == [
        key(TS + 1, 1), key(TS + 2, 2), key(TS + 3, 3)]
    assert result.changes.ids == {DEV1: IdState(key(TS + 1, 1), None),
                                  DEV2: IdState(key(TS + 2, 2), None),
                                  "order-43": IdState(key(TS + 3, 3), None)}
    assert [v.schedule_id for v in (e.value for e in result.changes.entries())] == [
        DEV1, DEV2, "order-43"]
    assert [o for o, _ in result.outcomes] == [Outcome.SCHEDULED] * 3


def test_a_duplicate_is_one_only_within_its_lane() -> None:
    ids = Ids()
    ids.states[DEV1] = IdState(key(TS, 0), None)
    result = plan(ids, [lane_schedule(1, "dev1"), lane_schedule(2, "dev2")])
    assert result.outcomes == [(Outcome.DUPLICATE, "order-43 (lane dev1) (first: pending)"),
                               (Outcome.SCHEDULED, "order-43 (lane dev2)")]
    assert [e.key for e in result.changes.entries()] == [key(TS + 2, 2)]


def test_a_cancel_reaches_only_its_own_lanes_schedule() -> None:
    ids = Ids()
    ids.states[DEV2] = IdState(key(TS, 0), None)
    ids.states["order-43"] = IdState(key(TS, 1), None)
    result = plan(ids, [request(5, cancel_headers("order-43", "dev1")),
                        request(6, cancel_headers("order-43", "dev2"))])
    assert result.outcomes == [(Outcome.UNKNOWN, "order-43 (lane dev1)"),
                               (Outcome.CANCELLED, "order-43 (lane dev2)")]
    assert result.changes.deletes == [key(TS, 0)], "the lane-less schedule stands"
    assert set(result.changes.ids) == {DEV2}
    assert [r.key for r in result.changelog if r.value is not None] == [
        codec.id_record_key(DEV2)]


def test_a_cancel_without_a_lane_never_reaches_a_lanes_schedule() -> None:
    ids = Ids()
    ids.states[DEV1] = IdState(key(TS, 0), None)
    result = plan(ids, [request(5, cancel_headers("order-43"))])
    assert result.outcomes == [(Outcome.UNKNOWN, "order-43")]
    assert result.changes.deletes == []


def test_a_reschedule_moves_only_its_own_lanes_schedule() -> None:
    ids = Ids()
    ids.states[DEV1] = IdState(key(TS + 1, 1), None)
    result = plan(ids, [request(5, reschedule_headers("order-43", due_ms=TS + 9, lane="dev2")),
                        request(6, reschedule_headers("order-43", due_ms=TS + 9)),
                        request(7, reschedule_headers("order-43", due_ms=TS + 9, lane="dev1"))])
    assert [o for o, _ in result.outcomes] == [Outcome.UNKNOWN, Outcome.UNKNOWN,
                                               Outcome.RESCHEDULED]
    assert result.changes.ids == {DEV1: IdState(key(TS + 9, 1), None)}


def test_an_ended_id_is_remembered_per_lane() -> None:
    ids = Ids()
    ids.states[DEV1] = codec.ended(End.DELIVERED, TS, key(TS, 0), codec.Fingerprint(TS, 1))
    result = plan(ids, [lane_schedule(1, "dev1"), lane_schedule(2, "dev2"),
                        request(3, cancel_headers("order-43", "dev1"))])
    assert [o for o, _ in result.outcomes] == [Outcome.DUPLICATE, Outcome.SCHEDULED,
                                               Outcome.ALREADY_DELIVERED]


def test_outcome_records_of_a_lane_are_keyed_by_lane_and_id_on_the_ids_partition() -> None:
    result = plan(Ids(), [lane_schedule(1, "dev1"), lane_schedule(2, None)])
    laned, plain = result.answers
    assert (laned.key, plain.key) == (b"\xffdev1/order-43", b"order-43")
    assert laned.partition == plain.partition == id_partition("order-43", 4)
    assert idkeys.decode_answer(laned.value or b"").lane == "dev1"
    assert idkeys.decode_answer(plain.value or b"").lane is None
    assert b"lane" not in (plain.value or b""), "a lane-less outcome is as before"


def test_a_forward_carries_the_lane_and_is_indexed_under_the_lanes_key() -> None:
    partitions = 8
    sid = next(f"id-{n}" for n in range(100) if id_partition(f"id-{n}", partitions) != PART)
    home = id_partition(sid, partitions)
    out = planner(Ids(), partitions).plan(PART, [lane_schedule(5, "dev1", sid),
                                                  request(6, cancel_headers(sid, "dev1")),
                                                  request(7, reschedule_headers(
                                                      sid, due_ms=TS + 9, lane="dev1"))])
    assert [r.partition for r in out.forwards] == [home] * 3, "home: the id's, whatever its lane"
    found = forward.parse(out.forwards[0].headers)
    assert isinstance(found, Forward)
    assert found.lane == "dev1"
    assert out.changes.ids == {}

    def landed(offset: int, headers: Headers | None) -> Message:
        return Message(topic=TOPICS.requests, partition=home, offset=offset,
                       headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, TS))

    ids = Ids()
    there = planner(ids, partitions)
    first = there.plan(home, [landed(0, out.forwards[0].headers)])
    laned = idkeys.id_key(sid, "dev1")
    original = codec.encode_due_key(TS + 5, PART, 5)
    assert first.changes.ids == {laned: IdState(original, None)}
    assert first.changes.entries()[0].value == IndexValue(found.fingerprint, laned, "dev1.orders")
    ids.states[laned] = IdState(original, None)
    there.done(first)
    second = there.plan(home, [landed(1, out.forwards[1].headers),
                               landed(2, out.forwards[2].headers)])
    assert [o for o, _ in second.outcomes] == [Outcome.CANCELLED, Outcome.UNKNOWN]
    assert second.changes.deletes == [original]
