"""What an operator does from the console: cancel, reschedule, deliver now; and the audit.

Each action is one request record of the protocol, written with the client
library exactly as any producer writes it (:class:`~kdelay.client.DelayProducer`:
``cancel``, ``reschedule``; "deliver now" is a reschedule to now), and its
outcome is the service's outcome record, read back from the outcomes topic.
Then who did it, when, why and what came of it goes to the audit topic as
one JSON record keyed by the schedule id, on the id's partition (murmur2, as
the outcomes are placed), so a schedule's trace reads one partition. An id is
unique within its lane: every action names the schedule's lane (None: no
lane), and the audit record says which.

An action without a reason is refused before anything is written. An audit
record that cannot be written fails the action's answer (``audit-failed``):
the request was written, and the caller is told that its audit is missing.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import orjson
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from kdelay import controls, recurring
from kdelay.client import DelayProducer, RequestRefused, Ticket
from kdelay.outcomes import NoOutcome
from kdelay.plumbing.clock import Clock
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import admin_client
from kdelay.protocol.controls import Control, Subject, parse_rate
from kdelay.protocol.envelope import LANE_NAME
from kdelay.protocol.forward import id_partition
from kdelay.view.deadletters import request_headers
from kdelay.web.access import Principal
from kdelay.web.problems import Problem, bad_input

MAX_REASON = 500
MAX_ID = 512
DEFAULT_AUDIT_TOPIC = "kdelay.audit"
AUDIT_RETENTION_MS = 365 * 86_400_000


@dataclass(frozen=True, slots=True)
class Done:
    """One action and what came of it, as the audit topic keeps it.

    ``outcome`` is the service's answer (``cancelled``, ``rescheduled``,
    ``unknown``, ``already-delivered``, ``dead-lettered``), or None with
    ``outcome_error`` (``no-outcome``, ``outcomes-missing``) when none could be read.
    """

    action: str
    schedule_id: str
    who: str
    role: str
    reason: str
    at_ms: int
    request: str
    outcome: str | None
    outcome_error: str | None = None
    due_ms: int | None = None
    lane: str | None = None

    def encode(self) -> bytes:
        """The audit record's value: this action as a JSON object."""
        return orjson.dumps(asdict(self))


@dataclass(frozen=True, slots=True)
class Order:
    """A record to schedule over HTTP: where, what, when (one of ``delay_ms`` and
    ``due_ms``) and under which id."""

    target: str
    value: str | None
    schedule_id: str
    key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_ms: int | None = None
    due_ms: int | None = None
    lane: str | None = None


def decode_done(raw: bytes) -> Done:
    """An audit record's value back as :class:`Done`; ValueError when it is not one."""
    try:
        return Done(**orjson.loads(raw))
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"not an audit record: {exc}") from None


def checked_id(schedule_id: str) -> str:
    """``schedule_id`` when it can be one; :class:`Problem` 400 ``invalid-id`` otherwise."""
    if not schedule_id or len(schedule_id) > MAX_ID or not schedule_id.isprintable():
        raise bad_input("invalid-id", f"a schedule id is 1 to {MAX_ID} printable characters")
    return schedule_id


def checked_lane(lane: str | None) -> str | None:
    """``lane`` (None or empty: no lane) when it is a lane name; :class:`Problem` 400
    ``invalid-lane`` otherwise (the protocol's rule, ``envelope.LANE_NAME``)."""
    if lane is None or not lane.strip():
        return None
    if LANE_NAME.fullmatch(lane.strip()) is None:
        raise bad_input("invalid-lane", f"{lane[:70]!r} is not a lane name (a letter or "
                        "digit, then up to 63 of A-Z a-z 0-9 . _ -)")
    return lane.strip()


def checked_reason(reason: str | None) -> str:
    """The stripped reason; :class:`Problem` 400 ``reason-required`` when empty or too long."""
    text = (reason or "").strip()
    if not text or len(text) > MAX_REASON:
        raise bad_input("reason-required",
                        f"every action needs a reason of 1 to {MAX_REASON} characters")
    return text


class Actions:
    """Writes the console's requests and audit records for one deployment.

    Thread-safe: the producers are librdkafka's. ``outcome_timeout_s`` bounds
    the wait for each outcome. Close it when the console stops.
    """

    def __init__(self, settings: Settings, clock: Clock, *, audit_topic: str =
                 DEFAULT_AUDIT_TOPIC, outcome_timeout_s: float = 15.0) -> None:
        self._settings = settings
        self._clock = clock
        self._requests = DelayProducer(settings, clock=clock)
        self._audit = Producer({**settings.client_config("producer"),
                                "enable.idempotence": True,
                                "allow.auto.create.topics": False})
        self.audit_topic = audit_topic
        self._timeout_s = outcome_timeout_s
        self._audit_partitions: int | None = None

    def close(self) -> None:
        """Flush and close both producers (bounded waits)."""
        self._requests.close(timeout=10)
        self._audit.flush(10)

    def schedule(self, who: Principal, order: Order, reason: str) -> Done:
        """Schedule a record, as ``DelayProducer.schedule`` does; the outcome is
        ``scheduled`` or ``duplicate``. Raises :class:`Problem` 400 ``invalid-request``
        for what the client library refuses as an argument (a reserved header, a bad
        target, lane or id), and lets ``RequestRefused`` (``delay-too-long``) through."""
        self._audit_partition_count()
        try:
            ticket = self._requests.schedule(
                order.target, order.value, id=order.schedule_id, key=order.key,
                headers=list(order.headers.items()), delay=order.delay_ms, due=order.due_ms,
                lane=order.lane)
        except RequestRefused:
            raise
        except (ValueError, TypeError) as exc:
            raise bad_input("invalid-request", str(exc)) from None
        return self._settle("schedule", who, ticket, reason, order.due_ms)

    def cancel(self, who: Principal, schedule_id: str, reason: str,
               lane: str | None = None) -> Done:
        """Cancel ``schedule_id`` of ``lane`` (a series too, as ``kdelay cancel`` does,
        when no lane: a series has none)."""
        self._audit_partition_count()  # a missing audit topic refuses before any write
        return self._settle("cancel", who, self._cancel(schedule_id, lane,
                                                        self._clock.now_ms()), reason, None)

    def _cancel(self, schedule_id: str, lane: str | None, now_ms: int) -> Ticket:
        if lane is not None:
            return self._requests.cancel(schedule_id, lane=lane)
        return recurring.cancel(self._settings, self._requests, schedule_id, now_ms)

    def reschedule(self, who: Principal, schedule_id: str, due_ms: int, reason: str,
                   lane: str | None = None) -> Done:
        """Move ``schedule_id`` of ``lane`` to ``due_ms``; a time already past means now."""
        self._audit_partition_count()
        due_ms = max(due_ms, self._clock.now_ms())
        ticket = self._requests.reschedule(schedule_id, due=due_ms, lane=lane)
        return self._settle("reschedule", who, ticket, reason, due_ms)

    def deliver_now(self, who: Principal, schedule_id: str, reason: str,
                    lane: str | None = None) -> Done:
        """Deliver ``schedule_id`` of ``lane`` as soon as the service sees it: a
        reschedule to now."""
        self._audit_partition_count()
        now_ms = self._clock.now_ms()
        ticket = self._requests.reschedule(schedule_id, due=now_ms, lane=lane)
        return self._settle("deliver-now", who, ticket, reason, now_ms)

    def control(self, who: Principal, action: str, subject: Subject, reason: str,
                rate: str | None) -> Control:
        """Pause ``subject`` (``reason`` kept in the control record), resume it (``rate``:
        the catch-up rate, none: unbounded) or cap it (``rate``, none: lift the cap),
        through the controls topic as ``kdelay target pause`` (``resume``, ``limit``)
        writes it; by the caller.
        ``ControlError`` (``bad-control``) for a bad rate, ``ControlsUnavailable`` when
        the record is not acknowledged."""
        per_s = parse_rate(rate) if rate and rate.strip() else None
        now_ms = self._clock.now_ms()
        if action == "pause":
            return controls.pause(self._settings, subject, who.name, reason, now_ms)
        if action == "resume":
            return controls.resume(self._settings, subject, who.name, now_ms, per_s)
        return controls.limit(self._settings, subject, who.name, now_ms, per_s)

    def resend(self, who: Principal, letter: Message, reason: str) -> Done:
        """Send the dead letter ``letter`` again to the requests topic, as the request it
        carries (:func:`kdelay.view.deadletters.request_headers`). With an id, the outcome
        is ``scheduled`` or ``duplicate``, audited under the id; without one there is
        no outcome (``outcome_error`` ``no-id``) and the audit is keyed by the dead
        letter's coordinates."""
        self._audit_partition_count()
        place = f"{letter.topic()}/{letter.partition()}/{letter.offset()}"
        sent = self._requests.resend(letter.value(), letter.key(), request_headers(letter))
        if isinstance(sent, Ticket):
            return self._settle("resend", who, sent, f"{reason} (dead letter {place})", None)
        done = Done("resend", place, who.name, who.role.value, reason, self._clock.now_ms(),
                    str(sent), None, "no-id")
        self._write_audit(done)
        return done

    def bulk(self, who: Principal, action: str, ids: list[tuple[str, str | None]],
             reason: str, due_ms: int | None = None) -> dict[str, int]:
        """Cancel (``due_ms`` None) or reschedule every ``(id, lane)`` of ``ids``, each in
        its own lane; count the outcomes.

        Every request is written first, then each outcome is awaited within
        one shared deadline (an id with none in time counts as ``no-outcome``);
        each id gets its own audit record (action ``bulk-cancel`` or
        ``bulk-reschedule``).
        """
        self._audit_partition_count()
        now_ms = self._clock.now_ms()
        if due_ms is None:
            tickets = [self._cancel(i, lane, now_ms) for i, lane in ids]
        else:
            due_ms = max(due_ms, now_ms)
            tickets = [self._requests.reschedule(i, due=due_ms, lane=lane) for i, lane in ids]
        deadline = time.monotonic() + self._timeout_s * 2
        counts: Counter[str] = Counter()
        for ticket in tickets:
            left = max(0.5, deadline - time.monotonic())
            done = self._settle(f"bulk-{action}", who, ticket, reason, due_ms, left)
            counts[done.outcome or done.outcome_error or "no-outcome"] += 1
        return dict(counts.most_common())

    def _settle(self, action: str, who: Principal, ticket: Ticket, reason: str,
                due_ms: int | None, timeout_s: float | None = None) -> Done:
        """Wait for the ticket's outcome, then write and return the audit record."""
        outcome, error = None, None
        try:
            outcome = ticket.outcome(timeout_s or self._timeout_s).outcome
        except NoOutcome as missing:
            error = missing.code
        done = Done(action, ticket.schedule_id, who.name, who.role.value, reason,
                    self._clock.now_ms(), str(ticket.coordinates), outcome, error, due_ms,
                    ticket.lane)
        self._write_audit(done)
        return done

    def _write_audit(self, done: Done) -> None:
        """Write ``done`` to the audit topic and wait for its acknowledgement."""
        failures: list[KafkaError] = []

        def delivered(error: KafkaError | None, _: Message) -> None:
            if error is not None:
                failures.append(error)

        partition = id_partition(done.schedule_id, self._audit_partition_count())
        self._audit.produce(self.audit_topic, done.encode(), done.schedule_id.encode(),
                            partition=partition, on_delivery=delivered)
        left = self._audit.flush(10)
        if left or failures:
            reason = failures[0].str() if failures else "no acknowledgement within 10 s"
            raise Problem(502, "audit-failed", f"the {done.action} request was written "
                          f"({done.request}) but its audit record was not: {reason}")

    def _audit_partition_count(self) -> int:
        if self._audit_partitions is None:
            topic = self._audit.list_topics(self.audit_topic, timeout=10).topics.get(
                self.audit_topic)
            if topic is None or topic.error is not None or not topic.partitions:
                raise Problem(503, "audit-missing", f"the audit topic {self.audit_topic} "
                              "does not exist: start `kdelay web` with --create-audit-topic "
                              "or create it")
            self._audit_partitions = len(topic.partitions)
        return self._audit_partitions


def ensure_audit_topic(settings: Settings, topic: str, *, partitions: int = 3,
                       timeout_s: float = 30.0) -> bool:
    """Create the audit topic (``cleanup.policy=delete``, a year's retention, the broker's
    replication) unless it exists; return whether it was created.

    Raises KafkaException when the broker refuses (ACLs: grant Create, or
    create the topic by hand).
    """
    admin = admin_client(settings)
    found = admin.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if found is not None and found.error is None and found.partitions:
        return False
    spec = NewTopic(topic, num_partitions=partitions, replication_factor=-1,
                    config={"cleanup.policy": "delete", "retention.ms": str(AUDIT_RETENTION_MS)})
    try:
        admin.create_topics([spec])[topic].result(timeout=timeout_s)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if not (isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS):
            raise
        return False
    return True
