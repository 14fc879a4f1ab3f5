"""Intake planning: request records become index changes, changelog records and DLQ records."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_NOT_AVAILABLE, Message

from kdelay.engine.delivery._rereads import Rereads
from kdelay.engine.intake import (
    OUTCOMES_LOGGED,
    IdWindow,
    Outcome,
    Plan,
    Planner,
    Record,
    Topics,
    consumed_marker,
    count_outcomes,
)
from kdelay.engine.metrics import Metrics
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import codec, idkeys
from kdelay.protocol.codec import (
    End,
    Fingerprint,
    IdState,
    IndexValue,
    fingerprint_of,
    record_time,
)
from kdelay.protocol.durations import DEFAULT_LEVELS, Limits, parse_levels
from kdelay.protocol.envelope import (
    CANCEL,
    DELAY_MS,
    DUE_MS,
    ERROR,
    ERROR_DETAIL,
    LANE,
    LEVEL,
    ORIGIN,
    SCHEDULE_ID,
    TARGET,
    Headers,
    cancel_headers,
    reschedule_headers,
    schedule_headers,
)
from kdelay.protocol.forward import id_partition
from kdelay.protocol.targets import Lanes, TargetPolicy
from kdelay.state.changes import Entry

TOPICS = Topics(requests="kdelay.requests", changelog="kdelay.changelog", dlq="kdelay.dlq")
OUTCOMES = "kdelay.outcomes"
LIMITS = Limits(parse_levels(DEFAULT_LEVELS), None)
TS = 1_700_000_000_000
NOW = TS + 3_600_000
PART = 3


def request(offset: int, headers: Headers | None, *, ts: int | None = TS, key: bytes | None = b"k",
            value: bytes | None = b"payload") -> Message:
    """A request record of partition ``PART`` as the consumer would hand it over."""
    timestamp = (TIMESTAMP_NOT_AVAILABLE, 0) if ts is None else (TIMESTAMP_CREATE_TIME, ts)
    return Message(topic=TOPICS.requests, partition=PART, offset=offset, key=key, value=value,
                   headers=headers, timestamp=timestamp)


class Ids:
    """An in-memory id lookup and in-flight set standing in for the index and delivery."""

    def __init__(self) -> None:
        self.states: dict[str, IdState] = {}
        self.flying: set[bytes] = set()
        self.withheld: set[bytes] = set()

    def lookup(self, schedule_id: str) -> IdState | None:
        return self.states.get(schedule_id)

    def withhold(self, key: bytes) -> bool:
        if key in self.flying:
            return False
        self.withheld.add(key)
        return True


@pytest.fixture
def ids() -> Ids:
    return Ids()


def plan(ids: Ids, messages: Sequence[Message], limits: Limits = LIMITS, *,
         answers: bool = False) -> Plan:
    topics = dataclasses.replace(TOPICS, outcomes=OUTCOMES, outcome_partitions=4) if answers \
        else TOPICS
    return Planner(topics, limits, ids.lookup, ids.withhold).plan(PART, messages)


def key(due_ms: int, offset: int) -> bytes:
    return codec.encode_due_key(due_ms, PART, offset)


def header(headers: Headers | None, name: str) -> list[bytes | str | None]:
    return [v for n, v in headers or [] if n == name]


# -- schedule --------------------------------------------------------------------


def test_a_delay_counts_from_the_record_timestamp_not_from_now(ids: Ids) -> None:
    msg = request(42, schedule_headers("orders", delay_ms=5_000))
    result = plan(ids, [msg])
    value = IndexValue(codec.fingerprint(b"k", b"payload", TS), None, "orders")
    expected_key = key(TS + 5_000, 42)
    assert result.partition == PART
    assert result.changes.entries() == [Entry(expected_key, value)]
    assert result.changelog == [
        Record(TOPICS.changelog, PART, expected_key, codec.encode_index_value(value))
    ]
    assert result.changes.deletes == []
    assert result.changes.ids == {}
    assert result.changes.consumed == 43
    assert result.dead_letters == []
    assert result.outcomes == [(Outcome.SCHEDULED, "")]
    assert type(result.changes.entries()[0].value) is IndexValue
    assert type(result.changelog[0]) is Record
    assert result.changes.entries()[0].raw == result.changelog[0].value
    assert result.changes.entries()[0].value.fingerprint == fingerprint_of(msg)


def test_the_same_request_planned_later_yields_the_same_key(ids: Ids) -> None:
    msg = request(7, schedule_headers("orders", delay_ms=250))
    early, late = plan(ids, [msg]), plan(ids, [msg])
    assert early == late
    assert [e.key for e in early.changes.entries()] == [key(TS + 250, 7)]


def test_a_schedule_id_is_stored_with_the_entry_and_as_pending(ids: Ids) -> None:
    msg = request(5, schedule_headers("orders", delay_ms=10, schedule_id="order-1"))
    result = plan(ids, [msg])
    k = key(TS + 10, 5)
    assert result.changes.entries() == [
        Entry(k, IndexValue(codec.fingerprint(b"k", b"payload", TS), "order-1", "orders"))
    ]
    assert result.changes.ids == {"order-1": IdState(k, None)}
    assert result.outcomes == [(Outcome.SCHEDULED, "order-1")]
    assert result.changelog[0].value == codec.encode_index_value(result.changes.entries()[0].value)


@pytest.mark.parametrize(
    ("level", "delay_ms"),
    [(1, 1_000), (2, 5_000), (4, 30_000), (5, 60_000), (16, 1_800_000), (17, 3_600_000),
     (18, 7_200_000), (19, 7_200_000), (1_000, 7_200_000), (10**30, 7_200_000)],
)
def test_levels_map_to_the_table_and_clamp_at_the_top(ids: Ids, level: int,
                                                       delay_ms: int) -> None:
    msg = request(9, [(TARGET, b"orders"), (LEVEL, str(level).encode())])
    result = plan(ids, [msg])
    assert [e.key for e in result.changes.entries()] == [key(TS + delay_ms, 9)]


def test_a_custom_level_table_is_used(ids: Ids) -> None:
    limits = Limits((100, 200), None)
    msgs = [request(i, schedule_headers("orders", level=lvl)) for i, lvl in enumerate([1, 2, 3])]
    result = plan(ids, msgs, limits=limits)
    assert [e.key for e in result.changes.entries()] == [
        key(TS + 100, 0), key(TS + 200, 1), key(TS + 200, 2)
    ]


@pytest.mark.parametrize("due", [0, TS - 60_000, TS, TS + 1, 2**62])
def test_an_absolute_due_time_is_taken_as_given(ids: Ids, due: int) -> None:
    result = plan(ids, [request(11, schedule_headers("orders", due_ms=due))])
    assert [e.key for e in result.changes.entries()] == [key(due, 11)]
    assert result.outcomes == [(Outcome.SCHEDULED, "")]


def test_a_batch_keeps_offset_order_and_advances_consumed_to_the_last(ids: Ids) -> None:
    msgs = [request(o, schedule_headers("t", delay_ms=1_000 - o)) for o in (100, 101, 102)]
    result = plan(ids, msgs)
    assert [e.key for e in result.changes.entries()] == [
        key(TS + 900, 100), key(TS + 899, 101), key(TS + 898, 102)
    ]
    assert [r.key for r in result.changelog] == [e.key for e in result.changes.entries()]
    assert result.changes.consumed == 103


def test_the_planner_notes_the_age_of_each_record_with_a_timestamp(ids: Ids) -> None:
    ages: list[int] = []
    batch = [request(1, schedule_headers("orders", due_ms=NOW)),
             request(2, schedule_headers("orders", due_ms=NOW), ts=None),
             request(3, schedule_headers("orders", due_ms=NOW), ts=TS + 40)]
    Planner(TOPICS, LIMITS, ids.lookup, ids.withhold).plan(PART, batch, TS + 100, ages)
    assert ages == [100, 60], "a record without a timestamp has no age"


def test_a_plan_keeps_the_records_of_entries_due_soon_for_delivery_to_adopt(ids: Ids) -> None:
    soon, later = (request(1, schedule_headers("orders", due_ms=TS + 5_000)),
                   request(2, schedule_headers("orders", due_ms=TS + 5_001)))
    planner = Planner(TOPICS, LIMITS, ids.lookup, ids.withhold, originals_ms=5_000)
    result = planner.plan(PART, [soon, later], TS)
    assert [e.key for e in result.changes.entries()] == [key(TS + 5_000, 1), key(TS + 5_001, 2)]
    assert result.originals == {key(TS + 5_000, 1): soon}, "the later one is read back"
    assert result.log_keys == [key(TS + 5_000, 1), key(TS + 5_001, 2)]
    unbounded = Planner(TOPICS, LIMITS, ids.lookup, ids.withhold).plan(PART, [soon, later], TS)
    assert len(unbounded.originals) == 2


def test_an_empty_batch_changes_nothing(ids: Ids) -> None:
    result = plan(ids, [])
    assert result == Plan(PART)
    assert not result.changes


def test_the_fingerprint_covers_key_value_and_timestamp(ids: Ids) -> None:
    headers = schedule_headers("orders", delay_ms=1)
    base = plan(ids, [request(1, headers)]).changes.entries()[0].value.fingerprint
    for variant in (request(1, headers, key=None), request(1, headers, value=b"other"),
                    request(1, headers, ts=TS + 1)):
        other = plan(ids, [variant]).changes.entries()[0].value.fingerprint
        assert other != base
        assert other == fingerprint_of(variant)


# -- records without a timestamp -------------------------------------------------


def test_a_record_without_timestamp_is_scheduled_by_its_absolute_due(ids: Ids) -> None:
    msg = request(4, schedule_headers("orders", due_ms=TS + 500), ts=None)
    assert record_time(msg, 1234) == 1234
    result = plan(ids, [msg])
    assert result.changes.entries() == [
        Entry(key(TS + 500, 4), IndexValue(codec.fingerprint(b"k", b"payload", 0), None, "orders"))
    ]
    assert fingerprint_of(msg) == codec.fingerprint(b"k", b"payload", 0)


@pytest.mark.parametrize("headers", [[(TARGET, b"orders"), (DELAY_MS, b"1000")],
                                     [(TARGET, b"orders"), (LEVEL, b"2")]])
def test_a_relative_request_without_timestamp_is_rejected_as_bad_time(
    ids: Ids, headers: Headers
) -> None:
    # Measuring the delay from "now" would derive a new key on every re-read.
    result = plan(ids, [request(4, headers, ts=None)])
    assert result.changes.entries() == []
    assert [o for o, _ in result.outcomes] == [Outcome.REJECTED]
    assert result.outcomes[0][1].startswith("bad-time")


# -- malformed requests ----------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ([(DELAY_MS, b"5")], "missing-target"),
        (None, "missing-target"),
        ([(TARGET, b"orders")], "missing-time"),
        ([(TARGET, b"orders"), (DELAY_MS, b"5"), (DUE_MS, b"9")], "conflicting-time"),
        ([(TARGET, b"orders"), (DELAY_MS, b"soon")], "bad-time"),
        ([(TARGET, b"orders"), (LEVEL, b"0")], "unknown-level"),
        ([(CANCEL, b"")], "bad-cancel"),
        ([(CANCEL, b"x"), (TARGET, b"orders")], "bad-cancel"),
        ([(TARGET, b"orders"), (DELAY_MS, b"5"), (SCHEDULE_ID, b"")], "bad-header"),
    ],
)
def test_a_malformed_request_is_dead_lettered_intact(
    ids: Ids, headers: Headers | None, code: str
) -> None:
    user = [("trace", b"abc"), ("bin", b"\x00\xff")]
    original = [*(headers or []), *user]
    msg = request(42, original, key=b"the-key", value=b"\x01 raw value")
    result = plan(ids, [msg])
    assert result.changes.entries() == []
    assert result.changes.deletes == []
    assert result.changelog == []
    assert result.changes.consumed == 43, "a bad record never stops the partition"
    [dead] = result.dead_letters
    assert dead.topic == TOPICS.dlq
    assert (dead.key, dead.value) == (b"the-key", b"\x01 raw value")
    assert dead.headers is not None
    assert dead.headers[: len(original)] == original
    assert header(dead.headers, ERROR) == [code.encode()]
    [detail] = header(dead.headers, ERROR_DETAIL)
    assert isinstance(detail, bytes)
    assert len(detail) > 10
    assert header(dead.headers, ORIGIN) == [b"kdelay.requests/3/42"]
    [(outcome, text)] = result.outcomes
    assert outcome is Outcome.REJECTED
    assert text.startswith(f"{code}: ")


def test_a_delay_beyond_the_retention_bound_is_delay_too_long(ids: Ids) -> None:
    limits = Limits(LIMITS.levels, max_due_after_ms=60_000)
    ok = request(1, schedule_headers("orders", delay_ms=60_000))
    late = request(2, schedule_headers("orders", delay_ms=60_001))
    result = plan(ids, [ok, late], limits=limits)
    assert [e.key for e in result.changes.entries()] == [key(TS + 60_000, 1)]
    assert [header(d.headers, ERROR) for d in result.dead_letters] == [[b"delay-too-long"]]


def test_a_bad_record_between_good_ones_only_affects_itself(ids: Ids) -> None:
    msgs = [request(10, schedule_headers("a", delay_ms=1)),
            request(11, [(TARGET, b"a")]),
            request(12, schedule_headers("b", delay_ms=2))]
    result = plan(ids, msgs)
    assert [e.key for e in result.changes.entries()] == [key(TS + 1, 10), key(TS + 2, 12)]
    assert [header(d.headers, ORIGIN) for d in result.dead_letters] == [[b"kdelay.requests/3/11"]]
    assert [o for o, _ in result.outcomes] == [
        Outcome.SCHEDULED, Outcome.REJECTED, Outcome.SCHEDULED
    ]
    assert result.changes.consumed == 13


def test_the_target_policy_decides_every_request_a_remembered_target_would_not_pass(
        ids: Ids) -> None:
    """The planner remembers targets open to requests without a lane; a lane, a
    refused target or another planner's batch still goes through the policy."""
    policy = TargetPolicy((TOPICS.requests, TOPICS.changelog, TOPICS.dlq), (),
                          Lanes({"dev1": "dev1."}))
    planner = Planner(TOPICS, LIMITS, ids.lookup, ids.withhold, policy)
    first = planner.plan(PART, [request(10, schedule_headers("orders", delay_ms=1)),
                                request(11, schedule_headers("dev1.orders", delay_ms=1))])
    second = planner.plan(PART, [
        request(12, schedule_headers("orders", delay_ms=1)),
        request(13, [*schedule_headers("orders", delay_ms=1), (LANE, b"dev1")]),
        request(14, schedule_headers(TOPICS.changelog, delay_ms=1)),
        request(15, [*schedule_headers("dev1.orders", delay_ms=1), (LANE, b"dev1")]),
        request(16, schedule_headers("dev1.orders", delay_ms=1))])
    codes = [next((d for d in header(r.headers, ERROR)), None) for r in second.dead_letters]
    assert [o for o, _ in first.outcomes] == [Outcome.SCHEDULED, Outcome.REJECTED]
    assert [o for o, _ in second.outcomes] == [
        Outcome.SCHEDULED, Outcome.REJECTED, Outcome.REJECTED, Outcome.SCHEDULED,
        Outcome.REJECTED]
    assert codes == [b"wrong-lane", b"forbidden-target", b"missing-lane"]


# -- dedup -------------------------------------------------------------------------


def test_a_second_schedule_with_a_pending_id_is_a_duplicate(ids: Ids) -> None:
    ids.states["order-1"] = IdState(key(TS + 10, 1), None)
    msg = request(8, schedule_headers("orders", delay_ms=99, schedule_id="order-1"))
    result = plan(ids, [msg])
    assert result.changes.entries() == []
    assert result.changelog == []
    assert result.changes.ids == {}
    assert result.outcomes == [(Outcome.DUPLICATE, "order-1 (first: pending)")]
    assert result.changes.consumed == 9
    [conflict] = result.conflicts
    assert "kdelay.requests/3/8" in conflict
    assert "kdelay.requests/3/1" in conflict
    assert "due time" in conflict


def test_a_duplicate_within_one_batch_is_caught(ids: Ids) -> None:
    msgs = [request(o, schedule_headers("orders", delay_ms=o, schedule_id="x")) for o in (1, 2)]
    result = plan(ids, msgs)
    assert [e.key for e in result.changes.entries()] == [key(TS + 1, 1)]
    assert result.changes.ids == {"x": IdState(key(TS + 1, 1), None)}
    assert result.outcomes == [(Outcome.SCHEDULED, "x"), (Outcome.DUPLICATE, "x (first: pending)")]


def test_a_duplicate_with_the_same_due_time_and_payload_is_no_conflict(ids: Ids) -> None:
    headers = schedule_headers("orders", due_ms=TS + 9, schedule_id="x")
    msgs = [request(1, headers), request(2, headers, ts=TS + 5)]  # a retry, written later
    result = plan(ids, msgs)
    assert [o for o, _ in result.outcomes] == [Outcome.SCHEDULED, Outcome.DUPLICATE]
    assert result.conflicts == []


def test_a_duplicate_with_another_payload_is_a_conflict(ids: Ids) -> None:
    msgs = [request(1, schedule_headers("orders", due_ms=TS + 9, schedule_id="x")),
            request(2, schedule_headers("orders", due_ms=TS + 9, schedule_id="x"), value=b"new")]
    [conflict] = plan(ids, msgs).conflicts
    assert "payload" in conflict
    assert "due time" not in conflict

def test_a_request_read_again_while_pending_is_answered_scheduled_and_not_put_again(
    ids: Ids,
) -> None:
    # Put again, its changelog record could follow the tombstone of a delivery under
    # way and bring the delivered entry back.
    msg = request(8, schedule_headers("orders", delay_ms=99, schedule_id="order-1"))
    first = plan(ids, [msg])
    assert [e.key for e in first.changes.entries()] == [key(TS + 99, 8)]
    ids.states["order-1"] = IdState(key(TS + 99, 8), None)
    again = plan(ids, [msg])
    assert (again.changes.entries(), again.changes.ids, again.changelog) == ([], {}, [])
    assert again.outcomes == [(Outcome.SCHEDULED, "order-1")]


class Pending:
    """An index holding ``keys`` pending, as the planner's id window reads it."""

    def __init__(self, *keys: bytes) -> None:
        self.keys = set(keys)

    def get(self, key: bytes) -> IndexValue | None:
        return IndexValue(Fingerprint(0, 0), None) if key in self.keys else None

    def expired_ids(self, before_ms: int, limit: int) -> list[tuple[str, bytes]]:
        return []


def test_a_request_without_id_read_again_is_put_again_only_if_no_longer_pending() -> None:
    # Requests below rereads_below may have been indexed by an instance that died
    # before it recorded their offset: one still pending is not put again.
    window = IdWindow(60_000, ManualClock(TS), Pending(key(TS + 99, 8)))
    planner = Planner(TOPICS, LIMITS, Ids().lookup, Ids().withhold, ids=window,
                      rereads_below=10)
    pending, new = (request(offset, schedule_headers("orders", delay_ms=99))
                    for offset in (8, 9))
    result = planner.plan(PART, [pending, new])
    assert [e.key for e in result.changes.entries()] == [key(TS + 99, 9)]
    assert result.outcomes == [(Outcome.SCHEDULED, "")] * 2
    beyond = Planner(TOPICS, LIMITS, Ids().lookup, Ids().withhold, ids=window,
                     rereads_below=8).plan(PART, [pending])
    assert [e.key for e in beyond.changes.entries()] == [key(TS + 99, 8)], "not looked up"


def test_only_requests_read_for_the_first_time_are_put_as_absent_from_the_index() -> None:
    """Their tally needs no lookup: past the rereads, and past what this planner planned
    (a batch given back and read again may have been applied meanwhile)."""
    planner = Planner(TOPICS, LIMITS, Ids().lookup, Ids().withhold, rereads_below=10)

    def absent(offsets: range) -> set[bytes]:
        batch = [request(o, schedule_headers("orders", delay_ms=99)) for o in offsets]
        result = planner.plan(PART, batch)
        assert [e.key for e in result.changes.entries()] == [key(TS + 99, o) for o in offsets]
        return result.changes.absent | set(result.changes.fresh.keys)

    assert absent(range(8, 12)) == {key(TS + 99, 10), key(TS + 99, 11)}
    assert absent(range(11, 13)) == {key(TS + 99, 12)}, "offset 11 is read again"
    first = Planner(TOPICS, LIMITS, Ids().lookup, Ids().withhold)  # an empty index
    batch = [request(o, schedule_headers("orders", delay_ms=99)) for o in (0, 1)]
    assert first.plan(PART, batch).changes.fresh.keys == [key(TS + 99, 0), key(TS + 99, 1)]


def test_a_request_read_again_after_its_entry_was_delivered_is_not_put_again() -> None:
    """The restarted instance delivered the entry (gone from the index) before intake read
    its request again: putting it again would send it twice in one run."""
    rereads = Rereads()
    window = IdWindow(60_000, ManualClock(TS), Pending())
    planner = Planner(TOPICS, LIMITS, Ids().lookup, Ids().withhold, ids=window,
                      rereads_below=10, delivered=rereads.watch(PART, 5, 10))
    rereads.note(PART, [key(TS + 99, 8), key(TS + 99, 3), key(TS + 99, 12)])
    delivered, fresh = (request(offset, schedule_headers("orders", delay_ms=99))
                        for offset in (8, 9))
    result = planner.plan(PART, [delivered, fresh])
    assert [e.key for e in result.changes.entries()] == [key(TS + 99, 9)]
    assert rereads.delivered(PART, key(TS + 99, 8))
    assert not rereads.delivered(PART, key(TS + 99, 3)), "below the range: never read again"
    assert not rereads.delivered(PART, key(TS + 99, 12)), "past the range: read for the first time"
    rereads.passed(PART, 9)
    assert rereads.delivered(PART, key(TS + 99, 8)), "offset 9 may still be read again"
    rereads.passed(PART, 10)
    assert not rereads.delivered(PART, key(TS + 99, 8)), "forgotten once past the range"
    rereads.note(PART, [key(TS + 99, 8)])
    assert not rereads.delivered(PART, key(TS + 99, 8)), "nothing is noted once past it"


@pytest.mark.parametrize("end", [End.DELIVERED, End.CANCELLED])
def test_an_id_whose_schedule_ended_is_answered_with_its_first_outcome(
        ids: Ids, end: End) -> None:
    first = key(TS - 10, 2)
    ids.states["order-1"] = codec.ended(end, TS - 1, first, codec.fingerprint(b"k", b"payload", TS))
    msg = request(8, schedule_headers("orders", due_ms=TS - 10, schedule_id="order-1"))
    result = plan(ids, [msg])
    assert result.changes.ids == {}
    assert result.changes.entries() == []
    assert result.outcomes == [(Outcome.DUPLICATE, f"order-1 (first: {end.word})")]
    assert result.conflicts == [], "same due time and payload"


def test_a_dead_letter_sent_again_schedules_again_but_not_its_own_request(ids: Ids) -> None:
    first = key(TS - 10, 2)
    ids.states["order-1"] = codec.ended(End.DEAD_LETTERED, TS - 1, first,
                                        codec.fingerprint(b"k", b"payload", TS))
    resent = request(8, schedule_headers("orders", due_ms=TS - 10, schedule_id="order-1"))
    assert plan(ids, [resent]).outcomes == [(Outcome.SCHEDULED, "order-1")]
    reread = Message(topic=TOPICS.requests, partition=PART, offset=2, key=b"k",
                     value=b"payload", headers=resent.headers(),
                     timestamp=(TIMESTAMP_CREATE_TIME, TS))
    assert plan(ids, [reread]).outcomes == [(Outcome.DUPLICATE,
                                             "order-1 (first: dead-lettered)")]


def test_the_first_request_read_again_after_its_end_is_no_new_duplicate(ids: Ids) -> None:
    msg = request(8, schedule_headers("orders", delay_ms=5, schedule_id="order-1"))
    ids.states["order-1"] = codec.ended(End.DELIVERED, TS + 6, key(TS + 5, 8), fingerprint_of(msg))
    result = plan(ids, [msg], answers=True)
    assert result.changes.entries() == []
    assert result.answers == [], "its outcome was published when it was first read"



def test_the_first_request_read_again_after_a_reschedule_and_its_end_is_no_conflict(
        ids: Ids) -> None:
    """Rescheduled, then delivered, then read again after a partition moved: the id's first
    key has the new due time but the same request, so nothing differs and nothing is said."""
    msg = request(8, schedule_headers("orders", delay_ms=5, schedule_id="order-1"))
    moved = key(TS + 60_000, 8)
    ids.states["order-1"] = codec.ended(End.DELIVERED, TS + 60_001, moved, fingerprint_of(msg))
    result = plan(ids, [msg], answers=True)
    assert result.changes.entries() == []
    assert result.outcomes == [(Outcome.DUPLICATE, "order-1 (first: delivered)")]
    assert result.conflicts == [], "the same request, rescheduled: no conflict to warn of"
    assert result.answers == [], "its outcome was published when it was first read"

# -- cancel --------------------------------------------------------------------------


def test_cancel_before_due_deletes_and_writes_a_tombstone(ids: Ids) -> None:
    pending = key(TS + 60_000, 1)
    ids.states["order-1"] = IdState(pending, None)
    result = plan(ids, [request(20, cancel_headers("order-1"), key=None, value=b"order-1")])
    assert result.changes.deletes == [pending]
    assert result.changes.entries() == []
    state = result.changes.ids["order-1"]
    assert state is not None
    assert (state.pending_key, state.end, state.first_key) == (None, End.CANCELLED, pending)
    assert result.changelog == [
        Record(TOPICS.changelog, PART, pending, None),
        Record(TOPICS.changelog, PART, codec.id_record_key("order-1"),
               codec.encode_id_state(state))]
    assert result.outcomes == [(Outcome.CANCELLED, "order-1")]
    assert result.dead_letters == []
    assert result.changes.consumed == 21


def test_cancel_removes_a_put_made_earlier_in_the_same_batch(ids: Ids) -> None:
    msgs = [request(1, schedule_headers("orders", delay_ms=10, schedule_id="x")),
            request(2, schedule_headers("orders", delay_ms=20)),
            request(3, cancel_headers("x"))]
    result = plan(ids, msgs)
    cancelled, kept = key(TS + 10, 1), key(TS + 20, 2)
    assert [e.key for e in result.changes.entries()] == [kept]
    assert result.changes.deletes == [cancelled]
    state = result.changes.ids["x"]
    assert state is not None
    assert (state.end, state.fingerprint) == (End.CANCELLED, fingerprint_of(msgs[0]))
    assert [(r.key, r.value is None) for r in result.changelog] == [
        (cancelled, False), (kept, False), (cancelled, True), (codec.id_record_key("x"), False)
    ]
    assert [o for o, _ in result.outcomes] == [
        Outcome.SCHEDULED, Outcome.SCHEDULED, Outcome.CANCELLED
    ]


def test_an_id_cancelled_earlier_in_the_batch_is_not_scheduled_again(ids: Ids) -> None:
    ids.states["x"] = IdState(key(TS + 50, 0), None)
    msgs = [request(1, cancel_headers("x")),
            request(2, schedule_headers("orders", delay_ms=30, schedule_id="x"))]
    result = plan(ids, msgs)
    assert result.changes.deletes == [key(TS + 50, 0)]
    assert result.changes.entries() == []
    assert result.outcomes[1] == (Outcome.DUPLICATE, "x (first: cancelled)")


def test_cancel_of_an_unknown_id_is_unknown(ids: Ids) -> None:
    result = plan(ids, [request(5, cancel_headers("ghost"))])
    assert result.outcomes == [(Outcome.UNKNOWN, "ghost")]
    assert not result.changes.deletes
    assert result.changes.ids == {}
    assert result.changelog == []
    assert result.dead_letters == []
    assert result.changes.consumed == 6


def test_a_second_cancel_is_answered_cancelled_again(ids: Ids) -> None:
    ids.states["x"] = IdState(key(TS + 50, 0), None)
    result = plan(ids, [request(1, cancel_headers("x")), request(2, cancel_headers("x"))])
    assert result.outcomes == [(Outcome.CANCELLED, "x"), (Outcome.CANCELLED, "x")]
    assert result.changes.deletes == [key(TS + 50, 0)]


def test_a_cancel_of_a_dead_lettered_id_is_dead_lettered(ids: Ids) -> None:
    ids.states["x"] = codec.ended(End.DEAD_LETTERED, TS, key(TS, 0), codec.Fingerprint(1, 2))
    result = plan(ids, [request(1, cancel_headers("x"))])
    assert result.outcomes == [(Outcome.DEAD_LETTERED, "x")]
    assert result.changes.deletes == []


def test_cancel_of_a_delivered_id_is_already_delivered(ids: Ids) -> None:
    ids.states["order-1"] = IdState(None, TS - 5)
    result = plan(ids, [request(5, cancel_headers("order-1"))])
    assert result.outcomes == [(Outcome.ALREADY_DELIVERED, "order-1")]
    assert result.changes.deletes == []
    assert result.changes.ids == {}
    assert result.changelog == []


def test_cancel_while_the_delivery_is_in_flight_is_already_delivered(ids: Ids) -> None:
    pending = key(TS - 1, 0)
    ids.states["order-1"] = IdState(pending, None)
    ids.flying.add(pending)
    result = plan(ids, [request(5, cancel_headers("order-1"))])
    assert result.outcomes == [(Outcome.ALREADY_DELIVERED, "order-1")]
    assert result.changes.deletes == []
    assert result.changes.ids == {}
    assert result.changelog == []


def test_in_flight_is_asked_about_the_pending_key(ids: Ids) -> None:
    other = key(TS - 1, 99)
    ids.states["order-1"] = IdState(key(TS - 1, 0), None)
    ids.flying.add(other)
    result = plan(ids, [request(5, cancel_headers("order-1"))])
    assert result.outcomes == [(Outcome.CANCELLED, "order-1")]
    assert ids.withheld == {key(TS - 1, 0)}, "a cancelled entry is held back from delivery"


def test_a_cancel_too_late_to_hold_the_entry_back_withholds_nothing(ids: Ids) -> None:
    pending = key(TS - 1, 0)
    ids.states["order-1"] = IdState(pending, None)
    ids.flying.add(pending)
    plan(ids, [request(5, cancel_headers("order-1"))])
    assert ids.withheld == set()


# -- the consumed marker and the batch's first offset ------------------------------


def test_the_consumed_marker_records_how_far_the_batch_reaches(ids: Ids) -> None:
    msgs = [request(40, schedule_headers("orders", delay_ms=1)),
            request(41, [(TARGET, b"orders")]),
            request(42, schedule_headers("orders", delay_ms=2))]
    result = plan(ids, msgs)
    [marker] = consumed_marker(TOPICS, result)
    assert marker == Record(TOPICS.changelog, PART, codec.CONSUMED_MARKER,
                            codec.encode_offset(43))
    assert marker.value is not None
    assert codec.decode_offset(marker.value) == result.changes.consumed == 43
    assert not marker.headers, "the marker carries no headers"


def test_the_consumed_marker_goes_to_the_plans_own_partition() -> None:
    other = Plan(7)
    other.changes.consumed = 5
    assert consumed_marker(TOPICS, other) == [
        Record(TOPICS.changelog, 7, codec.CONSUMED_MARKER, codec.encode_offset(5))
    ]


def test_a_batch_of_rejects_and_unknown_cancels_still_has_a_consumed_marker(ids: Ids) -> None:
    result = plan(ids, [request(9, None), request(10, cancel_headers("ghost"))])
    assert result.changelog == []
    assert consumed_marker(TOPICS, result) == [
        Record(TOPICS.changelog, PART, codec.CONSUMED_MARKER, codec.encode_offset(11))
    ]


def test_a_plan_without_a_consumed_offset_has_no_marker(ids: Ids) -> None:
    assert consumed_marker(TOPICS, plan(ids, [])) == []
    assert consumed_marker(TOPICS, Plan(PART)) == []


def test_the_consumed_marker_key_can_never_be_a_due_key() -> None:
    assert len(codec.CONSUMED_MARKER) != codec.DUE_KEY_SIZE


@pytest.mark.parametrize("first_headers", [schedule_headers("orders", delay_ms=1), None,
                                           cancel_headers("ghost")])
def test_plan_first_is_the_first_offset_of_the_batch(
    ids: Ids, first_headers: Headers | None
) -> None:
    msgs = [request(100, first_headers), request(101, schedule_headers("orders", delay_ms=1)),
            request(102, schedule_headers("orders", delay_ms=2))]
    result = plan(ids, msgs)
    assert result.first == 100
    assert result.changes.consumed == 103


def test_an_empty_batch_has_no_first_offset(ids: Ids) -> None:
    assert plan(ids, []).first is None


# -- outcome records -------------------------------------------------------------------------


def answers(result: Plan) -> list[tuple[str, int | None, bytes | None, idkeys.Answer]]:
    return [(r.topic, r.partition, r.key, idkeys.decode_answer(r.value or b""))
            for r in result.answers]


def test_requests_with_an_id_are_answered_on_the_ids_outcome_partition(ids: Ids) -> None:
    ids.states["gone"] = codec.ended(End.DELIVERED, TS, key(TS, 0), codec.Fingerprint(TS, 1))
    msgs = [request(1, schedule_headers("orders", delay_ms=10, schedule_id="x")),
            request(2, schedule_headers("orders", delay_ms=10)),
            request(3, schedule_headers("orders", delay_ms=20, schedule_id="x")),
            request(4, cancel_headers("x")),
            request(5, cancel_headers("ghost")),
            request(6, cancel_headers("gone"))]
    found = answers(plan(ids, msgs, answers=True))
    assert [(topic, key) for topic, _, key, _ in found] == [
        (OUTCOMES, sid.encode()) for sid in ("x", "x", "x", "ghost", "gone")], "none without an id"
    assert all(p == id_partition(sid, 4) for (_, p, _, _), sid in
               zip(found, ("x", "x", "x", "ghost", "gone"), strict=True))
    got = [(a.outcome, a.request, a.schedule, a.first, a.differs) for *_, a in found]
    first = "kdelay.requests/3/1"
    assert got == [
        ("scheduled", first, None, None, False),
        ("duplicate", "kdelay.requests/3/3", first, "pending", True),
        ("cancelled", "kdelay.requests/3/4", first, None, False),
        ("unknown", "kdelay.requests/3/5", None, None, False),
        ("already-delivered", "kdelay.requests/3/6", "kdelay.requests/3/0", "delivered", False),
    ]


def test_no_outcome_records_without_an_outcomes_topic(ids: Ids) -> None:
    msgs = [request(1, schedule_headers("orders", delay_ms=10, schedule_id="x"))]
    assert plan(ids, msgs).answers == []


class Memory:
    """An index's ended-id markers, for the planner's window."""

    def __init__(self, ids: Ids) -> None:
        self.ids = ids

    def get(self, key: bytes) -> IndexValue | None:
        return None

    def expired_ids(self, before_ms: int, limit: int) -> list[tuple[str, bytes]]:
        return sorted(((sid, codec.encode_expiry_key(s.ended_ms, sid))
                       for sid, s in self.ids.states.items()
                       if s.ended_ms is not None and s.ended_ms < before_ms),
                      key=lambda found: found[1])[:limit]


def test_markers_past_the_id_window_are_dropped_with_a_changelog_tombstone(ids: Ids) -> None:
    clock = ManualClock(NOW)
    ids.states["old"] = codec.ended(End.DELIVERED, NOW - 2_000, key(TS, 0), codec.Fingerprint(1, 1))
    ids.states["new"] = codec.ended(End.DELIVERED, NOW - 500, key(TS, 1), codec.Fingerprint(1, 1))
    planner = Planner(TOPICS, LIMITS, ids.lookup, ids.withhold,
                      ids=IdWindow(1_000, clock, Memory(ids)))
    result = planner.plan(PART, [request(9, schedule_headers("orders", delay_ms=1))])
    assert result.changes.ids == {"old": None}
    assert result.changes.expired == [codec.encode_expiry_key(NOW - 2_000, "old")]
    assert result.changelog[0] == Record(TOPICS.changelog, PART, codec.id_record_key("old"), None)
    reused = schedule_headers("orders", delay_ms=1, schedule_id="old")
    again = planner.plan(PART, [request(10, reused)])
    assert again.changes.expired == [], "looked again only a second later"
    assert again.outcomes == [(Outcome.SCHEDULED, "old")], "a new schedule once forgotten"


def test_a_series_next_occurrence_takes_the_id_its_predecessor_ended_with(ids: Ids) -> None:
    ids.states["series-1"] = codec.ended(End.DELIVERED, TS, key(TS - 10, 2),
                                         codec.fingerprint(b"k", b"payload", TS))
    headers = [("kdelay.series", b"{}"), *schedule_headers("orders", delay_ms=60_000,
                                                            schedule_id="series-1")]
    result = plan(ids, [request(8, headers)])
    assert result.outcomes == [(Outcome.SCHEDULED, "series-1")]
    plain = plan(ids, [request(9, schedule_headers("orders", delay_ms=60_000,
                                                   schedule_id="series-1"))])
    assert [o for o, _ in plain.outcomes] == [Outcome.DUPLICATE], "only an occurrence does"


# -- reschedule -------------------------------------------------------------------------------


def test_a_reschedule_moves_the_pending_entry_to_a_new_due_key(ids: Ids) -> None:
    pending = key(TS + 60_000, 1)
    ids.states["x"] = IdState(pending, None)
    result = plan(ids, [request(5, reschedule_headers("x", due_ms=TS + 5_000))], answers=True)
    moved = key(TS + 5_000, 1)
    assert result.changes.deletes == [pending]
    assert [e.key for e in result.changes.entries()] == [moved], (
        "same original: partition 3, offset 1")
    assert result.changes.ids == {"x": IdState(moved, None)}
    assert [(r.key, r.value is None) for r in result.changelog] == [(pending, True), (moved, False)]
    assert result.outcomes == [(Outcome.RESCHEDULED, "x")]
    [(*_, answer)] = answers(result)
    assert (answer.outcome, answer.request, answer.schedule) == (
        "rescheduled", "kdelay.requests/3/5", "kdelay.requests/3/1")
    assert ids.withheld == {pending}


def test_a_rescheduled_entry_keeps_its_fingerprint_and_target(ids: Ids) -> None:
    result = plan(ids, [request(1, schedule_headers("orders", delay_ms=60_000, schedule_id="x")),
                        request(2, reschedule_headers("x", due_ms=TS + 5_000))])
    assert [(e.key, e.value) for e in result.changes.entries()] == [(key(TS + 5_000, 1), IndexValue(
        codec.fingerprint(b"k", b"payload", TS), "x", "orders"))]


def test_a_reschedule_counts_a_delay_from_its_own_timestamp(ids: Ids) -> None:
    ids.states["x"] = IdState(key(TS + 60_000, 1), None)
    result = plan(ids, [request(5, reschedule_headers("x", delay_ms=10), ts=TS + 100)])
    assert [e.key for e in result.changes.entries()] == [key(TS + 110, 1)]


def test_a_reschedule_of_a_schedule_in_flight_or_ended_or_unknown_moves_nothing(
        ids: Ids) -> None:
    pending = key(TS - 1, 0)
    ids.states["flying"] = IdState(pending, None)
    ids.flying.add(pending)
    ids.states["done"] = codec.ended(End.DELIVERED, TS, key(TS - 5, 1), codec.Fingerprint(1, 1))
    msgs = [request(o, reschedule_headers(sid, due_ms=TS + 9)) for o, sid in
            enumerate(("flying", "done", "ghost"))]
    result = plan(ids, msgs)
    assert result.outcomes == [(Outcome.ALREADY_DELIVERED, "flying"),
                               (Outcome.ALREADY_DELIVERED, "done"), (Outcome.UNKNOWN, "ghost")]
    assert result.changes.entries() == []
    assert result.changes.deletes == []


def test_a_reschedule_past_the_originals_retention_is_refused(ids: Ids) -> None:
    bounded = Limits(parse_levels(DEFAULT_LEVELS), 1_000)
    msgs = [request(1, schedule_headers("orders", delay_ms=10, schedule_id="x")),
            request(2, reschedule_headers("x", due_ms=TS + 5_000))]
    result = plan(ids, msgs, bounded)
    [dead] = result.dead_letters
    assert header(dead.headers, ERROR) == [b"delay-too-long"]
    assert [e.key for e in result.changes.entries()] == [key(TS + 10, 1)], "the schedule stands"


def test_a_malformed_reschedule_is_dead_lettered(ids: Ids) -> None:
    headers: Headers = [("kdelay-reschedule", b"x"), (TARGET, b"orders"), (DUE_MS, b"1")]
    [dead] = plan(ids, [request(1, headers)]).dead_letters
    assert header(dead.headers, ERROR) == [b"bad-reschedule"]


def test_a_reschedule_of_an_id_living_elsewhere_is_forwarded_with_its_due_time(
        ids: Ids) -> None:
    partitions = 8
    sid = next(f"id-{n}" for n in range(100) if id_partition(f"id-{n}", partitions) != PART)
    planner = Planner(TOPICS, LIMITS, ids.lookup, ids.withhold, partitions=partitions)
    result = planner.plan(PART, [request(4, reschedule_headers(sid, delay_ms=50))])
    [sent] = result.forwards
    assert sent.partition == id_partition(sid, partitions)
    assert header(sent.headers, "kdelay-reschedule") == [sid.encode()]
    assert header(sent.headers, DUE_MS) == [str(TS + 50).encode()], "resolved where written"
    assert header(sent.headers, "kdelay-forward") == [f"{PART}/4".encode()]


def test_a_batch_of_duplicates_logs_a_few_lines_not_one_a_request(
        caplog: pytest.LogCaptureFixture) -> None:
    """A re-sent campaign answers millions of duplicates: each batch logs the first few and
    one line for the rest, while the metric counts every one; a cancel is logged as ever."""
    metrics = Metrics()
    outcomes = [(Outcome.DUPLICATE, f"id-{n}") for n in range(1_000)]
    outcomes += [(Outcome.CANCELLED, "order-43")]
    with caplog.at_level("INFO", logger="kdelay.engine.intake"):
        count_outcomes(metrics, outcomes)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [*(f"request duplicate: id-{n}" for n in range(OUTCOMES_LOGGED)),
                     "request cancelled: order-43",
                     f"... and {1_000 - OUTCOMES_LOGGED} more requests duplicate in this batch "
                     "(kdelay_intake_records_total)"]
    assert metrics.registry.get_sample_value("kdelay_intake_records_total",
                                             {"outcome": "duplicate"}) == 1_000
