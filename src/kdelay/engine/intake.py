"""Intake: turn request records into index changes, changelog records and DLQ records.

Intake reads headers only, never the value. For each request partition, a batch
of records in offset order becomes one :class:`Plan`: the index changes (with
the next offset to consume), the changelog records that mirror them, the
records to dead-letter, the forwards of requests whose id lives on another
partition, the outcome of every request and the outcome records of those
with an id.

Each id is remembered for the id window after its schedule ended
(delivered, cancelled, dead-lettered): a request or cancel that repeats it
is answered with that first outcome, never scheduled again. The window's
expired markers are dropped as batches are planned, in the index and, with
a tombstone, in the changelog. Planning is pure; the service
applies a plan (index write, changelog, DLQ and forward produce) and only then
stores the consumed offset, so a crash at any point re-reads the batch and
re-derives the same keys and the same forwards: intake is idempotent.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, NamedTuple, Protocol

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Message

from kdelay.engine.metrics import Metrics
from kdelay.plumbing.clock import Clock
from kdelay.protocol import codec, envelope, forward, idkeys
from kdelay.protocol.codec import End, Fingerprint, IdState, IndexValue
from kdelay.protocol.durations import Limits
from kdelay.protocol.envelope import (
    AnyHeaders,
    Cancel,
    ErrorCode,
    Headers,
    Rejection,
    Reschedule,
    Schedule,
)
from kdelay.protocol.forward import Forward, id_partition
from kdelay.protocol.targets import TargetPolicy
from kdelay.state.changes import Changes, Entry, FreshPuts

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    """What became of one request record; counted and logged."""

    SCHEDULED = "scheduled"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"
    ALREADY_DELIVERED = "already-delivered"
    DEAD_LETTERED = "dead-lettered"
    RESCHEDULED = "rescheduled"
    FORWARDED = "forwarded"


# What a cancel, and a reschedule, of an id whose schedule ended answer.
_CANCEL_OF_ENDED: Final = {End.DELIVERED: Outcome.ALREADY_DELIVERED,
                           End.CANCELLED: Outcome.CANCELLED,
                           End.DEAD_LETTERED: Outcome.DEAD_LETTERED}
_MOVE_OF_ENDED: Final = {**_CANCEL_OF_ENDED, End.CANCELLED: Outcome.UNKNOWN}  # nothing left to move
# Most expired id markers one plan drops, and how often (service clock) a planner looks.
PRUNE_LIMIT: Final = 1_000
PRUNE_EVERY_MS: Final = 1_000


class Record(NamedTuple):
    """A record to produce: to the changelog, the DLQ or a target.

    A named tuple rather than a dataclass: intake builds one per request.
    ``headers`` is None for a record without headers (changelog records).
    """

    topic: str
    partition: int | None
    key: bytes | None
    value: bytes | None
    headers: Headers | None = None


@dataclass(slots=True)
class Plan:
    """Everything one batch of one request partition changes."""

    partition: int
    first: int | None = None
    changes: Changes = field(default_factory=Changes)
    # The changelog records mirroring ``changes``, in order: keys and values (None: a
    # tombstone) side by side, no record object a request.
    log_keys: list[bytes] = field(default_factory=list)
    log_values: list[bytes | None] = field(default_factory=list)
    dead_letters: list[Record] = field(default_factory=list)
    # Forward records to the partitions of ids that live elsewhere (requests topic),
    # and the offset of the first request forwarded.
    forwards: list[Record] = field(default_factory=list)
    first_forward: int | None = None
    outcomes: list[tuple[Outcome, str]] = field(default_factory=list)
    # Outcome records of requests with an id (outcomes topic), and the duplicates
    # whose payload or due time differ from the first request's (one sentence each).
    answers: list[Record] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    # The request records behind those of ``changes.puts`` due soon (see Planner), so
    # delivery can take them without reading them back from Kafka.
    originals: dict[bytes, Message] = field(default_factory=dict)
    log_topic: str = field(default="", compare=False)  # the changelog, for :attr:`changelog`

    def log(self, key: bytes, value: bytes | None) -> None:
        """Add a changelog record (``value`` None: a tombstone) after those planned."""
        self.log_keys.append(key)
        self.log_values.append(value)

    @property
    def changelog(self) -> list[Record]:
        """The changelog records of the plan, in order, as records to ``log_topic``."""
        return [Record(self.log_topic, self.partition, key, value)
                for key, value in zip(self.log_keys, self.log_values, strict=True)]


_SCHEDULED: Final = (Outcome.SCHEDULED, "")
_SCHEDULED_KIND: Final = Outcome.SCHEDULED
_REJECTED: Final = Outcome.REJECTED
_FORWARDED: Final = Outcome.FORWARDED
_DUPLICATE: Final = Outcome.DUPLICATE
# Message's methods, looked up once: compiled, a call through the method itself
# skips the lookup by name (about a quarter of each of the five calls a request).
_OFFSET: Final = Message.offset
_TIMESTAMP: Final = Message.timestamp
_HEADERS: Final = Message.headers
_KEY: Final = Message.key
_VALUE: Final = Message.value
_OPEN_TARGETS: Final = 1_024  # targets remembered as open to requests without a lane
_EVERY_KEY: Final = b"\xff" * (codec.DUE_KEY_SIZE + 1)  # above every due key
# Builds a named tuple from all its fields without the generated Python-level
# ``__new__``, which costs three times as much: for the objects made per request.
_new: Final = tuple.__new__

IdLookup = Callable[[str], IdState | None]
# Asked before a pending entry is cancelled: True when delivery now holds the
# key back (see Delivery.withhold), False when its produce is already in flight.
Withhold = Callable[[bytes], bool]


def _never(_: bytes) -> bool:
    """No entry was delivered since the assignment (no request is read again)."""
    return False


class Memory(Protocol):
    """What a planner reads of its partition's index besides id states."""

    def get(self, key: bytes) -> IndexValue | None:
        """The entry under ``key``, if pending."""
        ...

    def expired_ids(self, before_ms: int, limit: int) -> list[tuple[str, bytes]]:
        """Ids whose schedules ended before ``before_ms`` (see PartitionIndex.expired_ids)."""
        ...


@dataclass(frozen=True, slots=True)
class Topics:
    """The topic names intake writes to; ``outcomes`` None: no outcome records."""

    requests: str
    changelog: str
    dlq: str
    outcomes: str | None = None
    outcome_partitions: int = 1


@dataclass(frozen=True, slots=True)
class IdWindow:
    """How long ended ids are remembered (``window_ms``), by ``clock``, in ``memory``."""

    window_ms: int
    clock: Clock
    memory: Memory


def consumed_marker(topics: Topics, plan: Plan) -> list[Record]:
    """Return the changelog record that says how far intake has read, if the plan says so.

    Written after the plan's own changelog records, on the same partition, it
    lets a restore recover the consumed offset together with the index, so a
    rebuilt instance never re-reads (and re-schedules) requests the changelog
    already covers, even when the group's committed offset lags behind.
    """
    if plan.changes.consumed is None:
        return []
    return [Record(topics.changelog, plan.partition, codec.CONSUMED_MARKER,
                   codec.encode_offset(plan.changes.consumed))]


def dead_letter(message: Message, rejection: Rejection, dlq: str) -> Record:
    """Return the DLQ copy of a request: the record intact plus reason headers."""
    origin = envelope.origin_of(str(message.topic()), int(message.partition() or 0),
                                int(message.offset() or 0))
    headers = [*(message.headers() or []), *envelope.rejection_headers(rejection),
               (envelope.ORIGIN, origin.encode())]
    return Record(dlq, None, message.key(), message.value(), headers)


def _occurrence(message: Message | None) -> bool:
    """Whether ``message`` is a recurring series' occurrence (``kdelay.series`` header)."""
    headers = None if message is None else message.headers()
    return headers is not None and any(pair[0] == envelope.SERIES for pair in headers)


class Planner:
    """Plans the batches of one request partition against its index.

    A schedule whose target ``policy`` refuses (kdelay's own topics always,
    see :class:`~kdelay.protocol.targets.TargetPolicy`) is dead-lettered here, before
    anything is indexed.

    A request or cancel with an id whose partition (:func:`id_partition` of
    ``partitions``) is another is not indexed here: a forward record goes to
    the id's partition (see :mod:`kdelay.protocol.forward`), whose planner
    indexes the original where it lies. The exception is an id this partition
    holds pending already (written before ids were forwarded): it is handled
    here. ``partitions`` None keeps every id where it was written.

    A plan is applied to the index only once its records are acknowledged,
    and later batches are planned meanwhile: the schedule ids of the plans
    not applied yet are kept here, newest last, so a duplicate or a cancel in
    a later batch sees them (:meth:`done` forgets a plan applied or given back).
    ``ids`` (None: ended ids are kept until the index is rebuilt) drops the
    markers of ids that ended longer ago than the id window.

    Requests below ``rereads_below`` may have been indexed already, by an
    instance that died before it recorded their offset (at-least-once records
    it once their changelog records are acknowledged). One whose entry is still
    pending is not put again: the put would be written after the tombstone of a
    delivery under way, and bring the delivered entry back. Nor is one whose
    entry ``delivered`` says left the index, done, since the assignment (see
    :mod:`kdelay.engine.delivery._rereads`).

    A plan keeps the request records of the entries it puts (:attr:`Plan.originals`)
    for delivery to adopt, only for those due within ``originals_ms`` of the
    time the batch is planned (None: all). Delivery adopts only entries inside
    its read-ahead window; one it does not adopt is read back by offset once
    due, so the bound costs no correctness, and most requests of a busy
    intake, due far ahead, cost no dict entry.
    """

    def __init__(self, topics: Topics, limits: Limits, lookup: IdLookup,
                 withhold: Withhold, policy: TargetPolicy | None = None,
                 partitions: int | None = None, ids: IdWindow | None = None,
                 rereads_below: int | None = None,
                 delivered: Callable[[bytes], bool] = _never,
                 originals_ms: int | None = None) -> None:
        self._topics = topics
        self._originals_ms = originals_ms
        self._keep_below = _EVERY_KEY  # the due keys whose records a plan keeps
        self._rereads_below = rereads_below
        # Requests from this offset on are read for the first time: their keys are not in
        # the index (past the rereads; and this planner never planned them).
        self._fresh_from = rereads_below or 0
        self._delivered = delivered
        self._partitions = partitions
        self._policy = policy or TargetPolicy((topics.requests, topics.changelog, topics.dlq), ())
        self._limits = limits
        self._lookup = lookup
        self._withhold = withhold
        self._ids = ids
        self._next_prune_ms = 0
        self._unapplied: dict[str, tuple[Plan, IdState | None]] = {}
        self._open: set[str] = set()  # targets the policy opens to requests without a lane

    def plan(self, partition: int, messages: Iterable[Message], now_ms: int = 0,
             ages: list[int] | None = None) -> Plan:
        """Plan a batch of records of ``partition``, given in offset order; append the
        age at ``now_ms`` of each record with a timestamp to ``ages``, if given."""
        plan = Plan(partition, changes=Changes(fresh=FreshPuts(partition)),
                    log_topic=self._topics.changelog)
        if self._originals_ms is not None:
            self._keep_below = codec.due_upper_bound(now_ms + self._originals_ms)
        self._prune(plan)
        limits, refusal, open_targets = self._limits, self._policy.refusal, self._open
        offset = None
        for message in messages:
            offset = _OFFSET(message) or 0
            if plan.first is None:
                plan.first = offset
            kind, timestamp = _TIMESTAMP(message)
            known = kind != TIMESTAMP_NOT_AVAILABLE
            if known and ages is not None:
                ages.append(now_ms - timestamp)
            # A record without a timestamp gets -1: relative delays are then
            # rejected (bad-time) instead of being measured from "now", which
            # would give a different key each time the record is re-read.
            headers = _HEADERS(message)
            try:  # the usual request, read with no object made (envelope.parse's fast path)
                target, due_ms, _, sid, lane = envelope.schedule_fields(
                    headers, timestamp if known else -1, limits)
            except envelope.Uncommon:
                parsed = envelope.parse_general(headers, timestamp if known else -1, limits)
                if not isinstance(parsed, Schedule):
                    self._not_scheduled(plan, message, parsed, offset,
                                        timestamp if known else None)
                    continue
                target, due_ms, _, sid, lane = parsed
            if lane is not None or target not in open_targets:
                refused = refusal(target, lane)  # the policy is fixed
                if refused is not None:
                    self._reject(plan, message, refused)
                    continue
                if lane is None and len(open_targets) < _OPEN_TARGETS:
                    open_targets.add(target)
            self._schedule(plan, message, target, due_ms, sid, lane, offset,
                           timestamp if known else 0)
        if offset is not None:
            plan.changes.consumed = offset + 1
            self._fresh_from = max(self._fresh_from, offset + 1)
        for sid, state in plan.changes.ids.items():
            self._unapplied[sid] = (plan, state)
        return plan

    def _not_scheduled(self, plan: Plan, message: Message,
                       parsed: Cancel | Reschedule | Rejection, offset: int,
                       timestamp: int | None) -> None:
        """Plan a request that schedules nothing: a cancel, a reschedule, a forward or
        a rejection (``timestamp`` None: the record has none)."""
        if isinstance(parsed, Cancel):
            self._cancel(plan, message, parsed, offset, timestamp)
        elif isinstance(parsed, Reschedule):
            self._reschedule(plan, message, parsed, offset)
        else:
            self._other(plan, message, parsed)

    def done(self, plan: Plan) -> None:
        """Forget the ids of ``plan``: it is in the index now, or it was given back."""
        unapplied = self._unapplied
        for sid in plan.changes.ids:
            held = unapplied.get(sid)
            if held is not None and held[0] is plan:
                del unapplied[sid]

    def _prune(self, plan: Plan) -> None:
        """Drop (index and changelog) the markers of ids that ended before the window."""
        ids = self._ids
        if ids is None:
            return
        now = ids.clock.now_ms()
        if now < self._next_prune_ms:
            return
        self._next_prune_ms = now + PRUNE_EVERY_MS
        for sid, expiry_key in ids.memory.expired_ids(now - ids.window_ms, PRUNE_LIMIT):
            plan.changes.expired.append(expiry_key)
            if sid and sid not in plan.changes.ids and sid not in self._unapplied:
                plan.changes.ids[sid] = None
                plan.log(codec.id_record_key(sid), None)

    def _now(self, fallback: int | None) -> int:
        """The service clock's time; without one, ``fallback`` (a record's timestamp) or 0."""
        if self._ids is not None:
            return self._ids.clock.now_ms()
        return max(0, fallback or 0)

    def _id_state(self, plan: Plan, schedule_id: str) -> IdState | None:
        if schedule_id in plan.changes.ids:
            return plan.changes.ids[schedule_id]
        held = self._unapplied.get(schedule_id)
        if held is not None:
            return held[1]
        return self._lookup(schedule_id)

    def _fingerprint(self, plan: Plan, key: bytes) -> Fingerprint | None:
        """The fingerprint of the pending entry ``key``: planned, unapplied or indexed."""
        value = self._pending_value(plan, key)
        return value.fingerprint if value is not None else None

    def _pending_value(self, plan: Plan, key: bytes) -> IndexValue | None:
        """The index value of the pending entry ``key``: planned, unapplied or indexed."""
        plans = [plan, *(held for held, _ in self._unapplied.values())]
        for planned in plans:
            for entry in planned.changes.puts:
                if entry.key == key:
                    return entry.value
        return self._ids.memory.get(key) if self._ids is not None else None

    def _elsewhere(self, plan: Plan, schedule_id: str) -> int | None:
        """The home of id key ``schedule_id`` if another and the id is not pending here."""
        if self._partitions is None:
            return None
        home = forward.home_of(schedule_id, self._partitions)
        if home == plan.partition:
            return None
        state = self._id_state(plan, schedule_id)
        return home if state is None or state.pending_key is None else None

    def _moved(self, plan: Plan, schedule_id: str, headers: AnyHeaders) -> int | None:
        """The id's partition when a record forwarded here must go on to it; else None.

        A forwarded record is handled where it lands, unless it was placed by
        another partition count and its id lives elsewhere under this one: the
        requests topic grew (``kdelay topics grow``) while it was in flight.
        Records placed by this count never move twice, so none goes round.
        """
        if self._partitions is None or forward.placed_under(headers) == self._partitions:
            return None
        return self._elsewhere(plan, schedule_id)

    def _forward(self, plan: Plan, offset: int, home: int, sid: str, headers: Headers,
                 value: bytes | None = None) -> None:
        if plan.first_forward is None:
            plan.first_forward = offset
        if self._partitions is not None:
            headers = forward.counted(headers, self._partitions)
        plan.forwards.append(Record(self._topics.requests, home, None, value, headers))
        plan.outcomes.append((Outcome.FORWARDED, idkeys.shown_id(sid)))

    def _other(self, plan: Plan, message: Message, rejection: Rejection) -> None:
        """A record that is no request: a forward to index, else a rejection."""
        found = (forward.parse(message.headers())
                 if rejection.code is ErrorCode.MISSING_TARGET else None)
        if found is None:
            self._reject(plan, message, rejection)
        elif isinstance(found, Rejection):
            self._reject(plan, message, found)
        else:
            self._take(plan, message, found)

    def _take(self, plan: Plan, message: Message, found: Forward) -> None:
        """Index a schedule forwarded here: its key names the original where it lies."""
        sid = idkeys.id_key(found.schedule_id, found.lane)
        moved = self._moved(plan, sid, message.headers())
        if moved is not None:
            self._forward(plan, message.offset() or 0, moved, sid, forward.schedule_headers(found))
            return
        key = codec.encode_due_key(found.due_ms, found.partition, found.offset)
        self._index(plan, key, _new(IndexValue, (found.fingerprint, sid, found.target)), None)

    def _reject(self, plan: Plan, message: Message, rejection: Rejection) -> None:
        plan.dead_letters.append(dead_letter(message, rejection, self._topics.dlq))
        plan.outcomes.append((Outcome.REJECTED, f"{rejection.code}: {rejection.detail}"))

    def _schedule(self, plan: Plan, message: Message, target: str, due_ms: int,
                  sid: str | None, lane: str | None, offset: int, timestamp: int) -> None:
        """Index a valid request (the fields of its :class:`Schedule`), its id by its id
        key (:func:`idkeys.id_key`: unique within its lane); ``timestamp`` is as
        :func:`fingerprint_of` reads it."""
        if sid is None:  # most requests: no id to look up, nowhere else to go
            key = codec.encode_due_key(due_ms, plan.partition, offset)
            if offset >= self._fresh_from:  # read the first time: a new key, no Entry
                raw = codec.encode_index_fields(
                    timestamp, codec.framed_crc(_KEY(message), _VALUE(message)), None,
                    target)
                plan.changes.fresh.add(key, raw, due_ms, timestamp)
                if key < self._keep_below:
                    plan.originals[key] = message
                plan.log_keys.append(key)  # plan.log(key, raw), without the call
                plan.log_values.append(raw)
            elif not self._pending_before(key, message):
                crc = codec.framed_crc(_KEY(message), _VALUE(message))
                self._put(plan, key, None, codec.encode_index_fields(
                    timestamp, crc, None, target), message, False)
            plan.outcomes.append(_SCHEDULED)
            return
        if lane is not None:
            sid = idkeys.id_key(sid, lane)
        fingerprint = codec.fingerprint(_KEY(message), _VALUE(message), timestamp)
        home = None if sid is None else self._elsewhere(plan, sid)
        if home is not None:
            assert sid is not None  # noqa: S101 - home is None without an id
            found = Forward(idkeys.split_id_key(sid)[0], due_ms, plan.partition, offset,
                            fingerprint, target, lane)
            self._forward(plan, offset, home, sid, forward.schedule_headers(found))
            return
        key = codec.encode_due_key(due_ms, plan.partition, offset)
        self._index(plan, key, _new(IndexValue, (fingerprint, sid, target)), message,
                    offset >= self._fresh_from)

    def _index(self, plan: Plan, key: bytes, value: IndexValue,
               message: Message | None, fresh: bool = False) -> None:
        """Put an entry under ``key``, unless its id is pending under another key or ended;
        ``fresh``: the key is certainly not in the index (its request is read the first time).

        An id whose schedule went to the DLQ takes a new request (a dead letter
        produced again once its cause is fixed), and so does an id whose
        schedule ended when the new request is a recurring series' next
        occurrence (it carries ``kdelay.series``; a series reuses its ids);
        only the first request itself, read again, is a duplicate.
        """
        sid = value.schedule_id
        pending = False
        if sid is not None:
            state = self._id_state(plan, sid)
            if state is not None and state.pending_key != key and not (
                    state.pending_key is None and state.first_key != key
                    and (state.end is End.DEAD_LETTERED or _occurrence(message))):
                self._duplicate(plan, key, sid, value.fingerprint, state)
                return
            pending = state is not None and state.pending_key == key
        if not (pending or self._pending_before(key, message)):
            if sid is not None:
                plan.changes.ids[sid] = IdState(key, None)
            self._put(plan, key, value, codec.encode_index_value(value), message, fresh)
        if sid is None:
            plan.outcomes.append(_SCHEDULED)
        else:
            plan.outcomes.append((Outcome.SCHEDULED, idkeys.shown_id(sid)))
            self._answer(plan, Outcome.SCHEDULED, sid, key)

    def _put(self, plan: Plan, key: bytes, value: IndexValue | None, raw: bytes,
             message: Message | None, fresh: bool) -> None:
        """Put the entry ``key`` (``raw``: its value encoded; ``value`` decoded, if at hand),
        with its changelog record; ``fresh`` and ``message`` as for :meth:`_index`."""
        plan.changes.puts.append(Entry(key, value, raw))
        if fresh:
            plan.changes.absent.add(key)
        if message is not None and key < self._keep_below:
            plan.originals[key] = message
        plan.log_keys.append(key)  # plan.log(key, raw), without the call
        plan.log_values.append(raw)

    def _pending_before(self, key: bytes, message: Message | None) -> bool:
        """Whether a request read again (below ``rereads_below``) is pending in the index,
        or was delivered from it since the assignment."""
        below = self._rereads_below
        if below is None or message is None or self._ids is None:
            return False
        return (message.offset() or 0) < below and (
            self._ids.memory.get(key) is not None or self._delivered(key))

    def _duplicate(self, plan: Plan, key: bytes, sid: str, fingerprint: Fingerprint,
                   state: IdState) -> None:
        """Answer a request whose id is pending under another key, or ended, with the first."""
        first_key = state.pending_key or state.first_key
        first = "pending" if state.pending_key is not None else state.end.word
        plan.outcomes.append((Outcome.DUPLICATE, f"{idkeys.shown_id(sid)} (first: {first})"))
        if first_key is not None and codec.same_request(first_key, key):
            return  # the first request itself read again, maybe rescheduled since
        kept = (self._fingerprint(plan, state.pending_key) if state.pending_key is not None
                else state.fingerprint)
        differs = []
        if first_key is not None and codec.due_ms_of(first_key) != codec.due_ms_of(key):
            differs.append("due time")
        if kept is not None and kept.crc != fingerprint.crc:  # key and value; not the timestamp
            differs.append("payload")
        if differs:
            plan.conflicts.append(
                f"id {idkeys.shown_id(sid)}: request {self._where(key)} differs from the first, "
                f"{self._where(first_key)} ({first}), in its {' and '.join(differs)}; "
                "the first is kept")
        self._answer(plan, Outcome.DUPLICATE, sid, key, first_key, first, bool(differs))

    def _where(self, key: bytes | None) -> str:
        """The coordinates of the request behind due key ``key`` (``topic/partition/offset``)."""
        if key is None:
            return "(unknown)"
        due = codec.decode_due_key(key)
        return envelope.origin_of(self._topics.requests, due.partition, due.offset)

    def _answer(self, plan: Plan, outcome: Outcome, sid: str, request: bytes | tuple[int, int],
                schedule: bytes | None = None, first: str | None = None,
                differs: bool = False) -> None:
        """Add the outcome record of the request at ``request`` (a due key, or partition and
        offset) to the plan, when outcome records are published; keyed by the id key ``sid``."""
        topics = self._topics
        if topics.outcomes is None:
            return
        where = (self._where(request) if isinstance(request, bytes)
                 else envelope.origin_of(topics.requests, *request))
        schedule_id, lane = idkeys.split_id_key(sid)
        answer = idkeys.Answer(schedule_id, str(outcome), where, self._now(None),
                        None if schedule is None else self._where(schedule), first, differs, lane)
        home = id_partition(schedule_id, topics.outcome_partitions)  # the id's, whatever its lane
        plan.answers.append(Record(topics.outcomes, home, idkeys.encode_id_key(sid),
                                   idkeys.encode_answer(answer)))

    def _cancel(self, plan: Plan, message: Message, cancel: Cancel, offset: int,
                timestamp: int | None) -> None:
        headers = message.headers()
        origin = forward.origin(headers)
        schedule_id = idkeys.id_key(cancel.schedule_id, cancel.lane)
        home = (self._elsewhere(plan, schedule_id) if origin is None
                else self._moved(plan, schedule_id, headers))
        request = origin or (plan.partition, offset)
        if home is not None:
            self._forward(plan, offset, home, schedule_id,
                          forward.cancel_headers(cancel.schedule_id, *request, cancel.lane),
                          cancel.schedule_id.encode("utf-8"))
            return
        state = self._id_state(plan, schedule_id)
        if state is None:
            outcome, key = Outcome.UNKNOWN, None
        elif state.pending_key is None:
            outcome, key = _CANCEL_OF_ENDED[state.end], state.first_key
        elif not self._withhold(state.pending_key):
            outcome, key = Outcome.ALREADY_DELIVERED, state.pending_key
        else:
            outcome, key = Outcome.CANCELLED, state.pending_key
            self._withdraw(plan, schedule_id, key, timestamp)
        plan.outcomes.append((outcome, idkeys.shown_id(schedule_id)))
        self._answer(plan, outcome, schedule_id, request, key,
                     None if state is None or state.pending_key is not None else state.end.word)

    def _withdraw(self, plan: Plan, schedule_id: str, key: bytes, timestamp: int | None) -> None:
        """Remove the pending entry ``key`` of a cancelled id; remember the id as cancelled."""
        fingerprint = self._fingerprint(plan, key) or Fingerprint(0, 0)
        self._take_out(plan, key)
        state = codec.ended(End.CANCELLED, self._now(timestamp), key, fingerprint)
        plan.changes.ids[schedule_id] = state
        plan.log(codec.id_record_key(schedule_id), codec.encode_id_state(state))

    def _reschedule(self, plan: Plan, message: Message, request: Reschedule,
                    offset: int) -> None:
        """Move the pending schedule of the request's lane and id: same original, new key."""
        sid, due_ms = idkeys.id_key(request.schedule_id, request.lane), request.due_ms
        shown = idkeys.shown_id(sid)
        origin = forward.origin(message.headers())
        home = (self._elsewhere(plan, sid) if origin is None
                else self._moved(plan, sid, message.headers()))
        where = origin or (plan.partition, offset)
        if home is not None:
            self._forward(plan, offset, home, sid, forward.reschedule_headers(
                request.schedule_id, due_ms, *where, request.lane))
            return
        state = self._id_state(plan, sid)
        key = None if state is None else state.pending_key or state.first_key
        if state is None or state.pending_key is None:
            outcome = Outcome.UNKNOWN if state is None else _MOVE_OF_ENDED[state.end]
            plan.outcomes.append((outcome, shown))
            self._answer(plan, outcome, sid, where, key,
                         None if state is None else state.end.word)
            return
        old = state.pending_key
        value = self._value(plan, old, sid)
        bound = self._limits.max_due_after_ms
        if bound is not None and due_ms > value.fingerprint.timestamp_ms + bound:
            self._reject(plan, message, Rejection(
                ErrorCode.DELAY_TOO_LONG, f"new due time {due_ms} is past the retention bound "
                f"of the original request {self._where(old)} ({bound} ms after its timestamp)"))
            return
        due = codec.decode_due_key(old)
        new = codec.encode_due_key(due_ms, due.partition, due.offset)
        if new != old and not self._withhold(old):
            plan.outcomes.append((Outcome.ALREADY_DELIVERED, shown))
            self._answer(plan, Outcome.ALREADY_DELIVERED, sid, where, old)
            return
        if new == old:  # the same due time: nothing moves
            plan.outcomes.append((Outcome.RESCHEDULED, shown))
            self._answer(plan, Outcome.RESCHEDULED, sid, where, old)
            return
        original = self._take_out(plan, old)
        raw = codec.encode_index_value(value)
        plan.changes.puts.append(Entry(new, value, raw))
        if original is not None:
            plan.originals[new] = original
        plan.log(new, raw)
        plan.changes.ids[sid] = IdState(new, None)
        plan.outcomes.append((Outcome.RESCHEDULED, shown))
        self._answer(plan, Outcome.RESCHEDULED, sid, where, new)

    def _take_out(self, plan: Plan, key: bytes) -> Message | None:
        """Delete the pending entry ``key`` (planned in ``plan`` or indexed), with its
        changelog tombstone; return its original if the plan had it."""
        plan.changes.puts = [e for e in plan.changes.puts if e.key != key]
        plan.changes.deletes.append(key)
        plan.log(key, None)
        return plan.originals.pop(key, None)

    def _value(self, plan: Plan, key: bytes, sid: str) -> IndexValue:
        """The index value of the pending entry ``key`` (planned, unapplied or indexed)."""
        return self._pending_value(plan, key) or IndexValue(Fingerprint(0, 0), sid)


# Most differing duplicates one batch logs one by one (all are counted).
CONFLICTS_LOGGED: Final = 5
# Duplicates logged one by one per batch; the rest in one line: a re-sent campaign of
# millions logs a line a batch, not a request. (Cancels and reschedules, an operator's
# or a client's acts, are logged one by one.)
OUTCOMES_LOGGED: Final = 5


def count_outcomes(metrics: Metrics, outcomes: list[tuple[Outcome, str]]) -> None:
    """Count a batch's outcomes (one metric update per kind) and log the notable ones.

    The requests scheduled without an id, most of a batch as a rule, share one
    tuple (``_SCHEDULED``): they are counted in one C call and skipped below.
    """
    kinds: Counter[Outcome] = Counter()
    reasons: Counter[str] = Counter()
    duplicates = 0
    plain = outcomes.count(_SCHEDULED)
    if plain:
        kinds[_SCHEDULED_KIND] = plain
    for outcome, detail in outcomes if plain < len(outcomes) else []:
        if outcome is _SCHEDULED_KIND and not detail:
            continue  # counted above
        kinds[outcome] += 1
        if outcome is _REJECTED:
            reasons[detail.split(":", 1)[0]] += 1
        elif outcome is _DUPLICATE:
            duplicates += 1
            if duplicates <= OUTCOMES_LOGGED:
                log.info("request %s: %s", outcome, detail)
        elif outcome is not _SCHEDULED_KIND and outcome is not _FORWARDED:
            log.info("request %s: %s", outcome, detail)
    if duplicates > OUTCOMES_LOGGED:
        log.info("... and %d more requests %s in this batch (kdelay_intake_records_total)",
                 duplicates - OUTCOMES_LOGGED, _DUPLICATE)
    for outcome, count in kinds.items():
        metrics.intake.records.labels(outcome=str(outcome)).inc(count)
    for reason, count in reasons.items():
        metrics.dead_lettered.labels(reason=reason).inc(count)


def count_conflicts(metrics: Metrics, conflicts: list[str]) -> None:
    """Count and log the duplicates that differ from their first request (a few per batch)."""
    if not conflicts:
        return
    metrics.intake.id_conflicts.inc(len(conflicts))
    for conflict in conflicts[:CONFLICTS_LOGGED]:
        log.warning("duplicate id dropped: %s", conflict)
    if len(conflicts) > CONFLICTS_LOGGED:
        log.warning("... and %d more such duplicates in this batch "
                    "(kdelay_duplicate_conflicts)", len(conflicts) - CONFLICTS_LOGGED)
