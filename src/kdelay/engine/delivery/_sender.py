"""The sender: turns due entries into produces, to their targets or to the DLQ.

:meth:`Sender.slice` is delivery's hot path: for each entry of a run slice,
the fingerprint check, one pass over the original's headers (routing, and the
user's headers kept in their order) and one produce, with the slice's flight
as the delivery callback; routing is checked once per distinct target (the
target policy, whether the topic exists), not per record. An entry that needs
care goes back to delivery (``take_out``) and comes back as a job of the book,
which :meth:`Sender.job` sends one at a time: verified in full, to its target,
or to the DLQ with a stable reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, KafkaError, KafkaException, Message

from kdelay.engine.delivery._book import Job, Sink
from kdelay.engine.delivery._controls import Controls
from kdelay.engine.delivery._failures import TopicCheck
from kdelay.engine.delivery._flights import Flight, Produced
from kdelay.engine.delivery._runs import Run
from kdelay.plumbing.clients import Producing
from kdelay.protocol import codec, envelope, idkeys
from kdelay.protocol.codec import fingerprint_of
from kdelay.protocol.controls import Subject
from kdelay.protocol.envelope import ErrorCode, Headers
from kdelay.protocol.targets import TargetPolicy
from kdelay.state.originals import Missing

# Dead letters that carry the original record, so that it can be sent again as is.
WHOLE_DEAD_LETTERS = frozenset({ErrorCode.UNDELIVERABLE, ErrorCode.FORBIDDEN_TARGET,
                                 ErrorCode.TARGET_NOT_ALLOWED, ErrorCode.WRONG_LANE,
                                 ErrorCode.MISSING_LANE, ErrorCode.UNKNOWN_LANE})
_PREFIX = envelope.PREFIX
_TARGET = envelope.TARGET
_PARTITION = envelope.PARTITION
_LANE = envelope.LANE
_ORIGIN = envelope.ORIGIN
_DUE_MS = envelope.DUE_MS
_NO_TIME = TIMESTAMP_NOT_AVAILABLE

Routes = dict["bytes | str | RouteKey | None", "_Route"]
"""The routes of one dispatch, by the routing headers that lead to them (the target
alone when a record names no partition and no lane)."""


class Holder(Protocol):
    """Where an entry that needs care goes (the read-ahead, which holds the runs)."""

    def take_out(self, run: Run, at: int, flight: Flight | None = None,
                 refused: KafkaError | None = None) -> Job:
        """Move the entry at ``at`` out of ``run`` into the book, as a job of its own."""
        ...

    def hold_back(self, job: Job, subject: Subject) -> None:
        """Keep the book's ``job`` pending: the control of ``subject`` holds it back."""
        ...


@dataclass(frozen=True, slots=True)
class _Route:
    """Where records with one set of routing headers go, or why they cannot; and the
    lateness of the records the dispatch produced on it (see :meth:`Sender.gather`)."""

    target: str
    partition: int
    lane: str | None
    failure: tuple[ErrorCode, str] | None = None
    missing: KafkaError | None = None
    lateness: list[int] = field(default_factory=list)


RouteKey = tuple[envelope.HeaderValue, envelope.HeaderValue, envelope.HeaderValue]


class Sender:
    """Produces due entries to their targets (or dead-letters them).

    ``withheld`` is the live set of keys a planned cancel holds back;
    ``holder`` takes an entry that needs care out of its run. The
    lateness of every record produced is gathered by target in
    :attr:`lateness_ms` (on each route while a dispatch runs, see
    :meth:`gather`), which delivery takes at each settle.
    """

    def __init__(self, requests_topic: str, dlq_topic: str, targets: Producing,
                 internal: Producing, policy: TargetPolicy, topics: TopicCheck,
                 withheld: set[bytes], holder: Holder,
                 outage: Callable[[], bool], controls: Controls) -> None:
        self._requests_topic = requests_topic
        self._dlq_topic = dlq_topic
        self._producer = targets
        self._internal = internal
        self._policy = policy
        self._topics = topics
        self._withheld = withheld
        self._holder = holder
        self._outage = outage
        self._controls = controls
        self._origin = f"{requests_topic}/"
        self.lateness_ms: dict[str, list[int]] = {}

    def slice(self, run: Run, start: int, end: int, now: int, flight: Flight,
              routes: Routes) -> bool:
        """Produce the entries ``[start, end)`` of ``run``; False when the queue filled up.

        The hot path of a burst: per entry, the fingerprint check, the routing
        headers read in one pass, and one produce; everything else is per
        slice. An entry that needs care leaves the run for the book.
        """
        keys, values, originals, taken = run.keys, run.values, run.originals, run.taken
        fields = run.fields
        # Not "flight.producer or ...": a producer with an empty queue is falsy (len 0).
        producer = self._producer if flight.producer is None else flight.producer
        produce, report = producer.produce, flight.report
        withheld, lanes = self._withheld, flight.lanes
        controls = self._controls
        controlled = bool(controls)  # once a slice: no call per record when nothing is
        prefix = self._origin
        head = ""  # ``kdelay-origin`` up to the offset, for the partition ``seen``
        seen = -1
        # Bound once: module globals cost a lookup each (compiled, a dict lookup).
        message_type, no_time = Message, _NO_TIME
        kdelay, target_name, partition_name, lane_name = _PREFIX, _TARGET, _PARTITION, _LANE
        origin_name, due_name = _ORIGIN, _DUE_MS
        produced = 0
        due: tuple[str, envelope.HeaderValue] = (due_name, b"")
        due_seen = -1
        at = start
        try:
            while at < end:
                if taken is not None and at in taken:
                    at += 1
                    continue
                key = keys[at]
                original = originals[at]
                if (withheld and key in withheld) or original.__class__ is not message_type:
                    self._holder.take_out(run, at, flight, None)
                    at += 1
                    continue
                assert isinstance(original, Message)  # noqa: S101 - checked just above
                stamp, crc = codec.index_head(values[at])
                record_key, value = original.key(), original.value()
                kind, timestamp = original.timestamp()
                if (timestamp if kind != no_time else 0) != stamp or codec.framed_crc(
                        record_key, value) != crc:
                    self._holder.take_out(run, at, flight, None)
                    at += 1
                    continue
                user: Headers = []
                target: envelope.HeaderValue = None
                partition: envelope.HeaderValue = None
                lane: envelope.HeaderValue = None
                headers: Headers | None = original.headers()  # type: ignore[assignment]
                if headers is not None:
                    for pair in headers:
                        name = pair[0]
                        if name.startswith(kdelay):
                            if name == target_name:
                                target = pair[1]
                            elif name == partition_name:
                                partition = pair[1]
                            elif name == lane_name:
                                lane = pair[1]
                        else:
                            user.append(pair)
                plain = partition is None and lane is None
                route = routes.get(target if plain else (target, partition, lane))
                if route is None:
                    route = routes[target if plain else (target, partition, lane)] = (
                        self._route(target, partition, lane))
                    if self._outage():  # the topic check found the cluster silent
                        break
                if route.failure is not None or route.missing is not None:
                    self._holder.take_out(run, at, flight, route.missing)
                    at += 1
                    continue
                if controlled and (held := controls.admit(route.target, route.lane, now)):
                    self._holder.hold_back(self._holder.take_out(run, at), held)
                    at += 1
                    continue
                if fields is None:
                    due_ms, lies, offset = codec.unpack_due_key(key)
                else:
                    base = 3 * at
                    due_ms, lies, offset = fields[base], fields[base + 1], fields[base + 2]
                if due_ms != due_seen:
                    due_seen, due = due_ms, (due_name, str(due_ms))
                if lies != seen:
                    seen, head = lies, f"{prefix}{lies}/"
                # Header values as str: the client takes an ASCII string's bytes as they are.
                user.append((origin_name, head + str(offset)))
                user.append(due)
                try:
                    # By position, the report as callback: see Producing.produce.
                    produce(route.target, value, record_key, route.partition, report, None, now,
                            user)
                except KafkaException as exc:  # refused before anything was written
                    self._holder.take_out(run, at, flight, exc.args[0])
                    at += 1
                    continue
                produced += 1
                route.lateness.append(now - due_ms)
                if route.lane is not None:
                    lanes[route.lane] = lanes.get(route.lane, 0) + 1
                at += 1
        except BufferError:
            producer.poll(0)
            self._internal.poll(0)
        flight.produced += produced
        if at > start:
            run.sent = flight.end = at
        return at >= end

    def gather(self, routes: Routes) -> None:
        """Move the lateness a dispatch's ``routes`` gathered into :attr:`lateness_ms`, by
        target: once a dispatch, not once a record."""
        for route in routes.values():
            if route.lateness:
                self.lateness_ms.setdefault(route.target, []).extend(route.lateness)
                route.lateness.clear()

    def _route(self, target: envelope.HeaderValue, partition: envelope.HeaderValue,
               lane: envelope.HeaderValue) -> _Route:
        """Where records with these routing headers go, or why they cannot (cached per
        dispatch: one target policy and topic check per target, not per record)."""
        try:
            name = envelope.text_of(target)
            place = -1 if partition is None else max(int(partition), -1)  # -1: partitioner
            lane_name = None if lane is None else envelope.text_of(lane)
        except (ValueError, TypeError):
            return _Route("", -1, None, (ErrorCode.MISMATCH, "no longer carries a valid schedule"))
        refused = self._policy.refusal(name, lane_name)
        if refused is not None:
            return _Route(name, place, lane_name, (refused.code, refused.detail))
        return _Route(name, place, lane_name, None, self._topics.missing(name))

    def held_by(self, job: Job, now: int) -> Subject | None:
        """Return the control that holds ``job`` back at ``now`` (its tokens spent if none).

        The job is verified first: one that would be dead-lettered is not held
        (the DLQ is no controlled target). A job let go by its control is not
        held behind the records its control still holds.
        """
        if not self._controls:
            return None
        if job.failure is None and job.routing is None:
            job.failure = self._verify(job)
        routing = job.routing
        if job.failure is not None or routing is None:
            return None
        return self._controls.admit(routing.target, routing.lane, now,
                                    released=job.held_by is not None)

    def job(self, job: Job, now: int, flight: Flight) -> None:
        """Produce the job's record to its target, or to the DLQ with a reason."""
        if job.failure is None and job.routing is None:
            job.failure = self._verify(job)
        failure = job.failure
        sink = Sink.TARGET if failure is None else Sink.DLQ
        try:
            if failure is not None:
                self._produce_dead_letter(job, *failure, flight)
            elif isinstance(job.original, Message):
                self._produce_target(job, job.original, now, flight)
        except KafkaException as exc:
            # Refused before anything was written: nothing in a transaction to abort.
            flight.refused(job.key, sink, str(exc.args[0]))
        flight.jobs.append((job, sink))

    def _verify(self, job: Job) -> tuple[ErrorCode, str] | None:
        """Return why the fetched original cannot be delivered, or None if it can."""
        original = job.original
        if original is Missing.EXPIRED:
            return (ErrorCode.EXPIRED,
                    f"{self._where(job)} is below the log start offset (retention)")
        if original is Missing.ABSENT:
            return ErrorCode.MISMATCH, f"{self._where(job)} holds no record any more"
        assert isinstance(original, Message)  # noqa: S101 - Missing handled above
        expected = job.entry.value.fingerprint
        found = fingerprint_of(original)
        if found != expected:
            return (ErrorCode.MISMATCH,
                    f"{self._where(job)} fingerprint {found} differs from {expected}")
        routing = envelope.routing(original.headers())
        if routing is None:
            return ErrorCode.MISMATCH, f"{self._where(job)} no longer carries a valid schedule"
        # Intake refuses these targets; an entry indexed before the policy
        # narrowed (a new allow-list, an older kdelay) is refused here.
        refused = self._policy.refusal(routing.target, routing.lane)
        if refused is not None:
            return refused.code, refused.detail
        job.routing = routing
        return None

    def _where(self, job: Job) -> str:
        """Return the request's coordinates, ``topic/partition/offset`` (``kdelay-origin``)."""
        due = job.entry.due
        return envelope.origin_of(self._requests_topic, due.partition, due.offset)

    def _produce_target(self, job: Job, original: Message, now: int,
                        flight: Flight) -> None:
        routing = job.routing
        assert routing is not None  # noqa: S101 - _verify set it
        missing = self._topics.missing(routing.target)
        if missing is not None:
            raise KafkaException(missing)
        due = job.entry.due
        headers = [*routing.user, *envelope.delivery_tail(self._where(job), due.due_ms)]
        (self._producer if flight.producer is None else flight.producer).produce(
            routing.target, original.value(), original.key(),
            -1 if routing.partition is None else routing.partition, flight.report, None, now,
            headers,
        )
        flight.produced += 1
        self.lateness_ms.setdefault(routing.target, []).append(now - due.due_ms)
        if routing.lane is not None:
            flight.lanes[routing.lane] = flight.lanes.get(routing.lane, 0) + 1

    def _produce_dead_letter(self, job: Job, code: ErrorCode, detail: str,
                             flight: Flight) -> None:
        due = job.entry.due
        reason = envelope.rejection_headers(envelope.Rejection(code, detail))
        tail = [*reason, *envelope.delivery_tail(self._where(job), due.due_ms)]
        if isinstance(job.original, Message) and code in WHOLE_DEAD_LETTERS:
            # The original's own kdelay-* headers are replaced by the target and
            # due time, so the DLQ record can be sent back as a request as is.
            original = job.original
            headers = [*envelope.user_headers(original.headers()),
                       *envelope.routing_headers(envelope.routing(original.headers())), *tail]
            self._internal.produce(self._dlq_topic, value=original.value(),
                                   key=original.key(), headers=headers,
                                   on_delivery=flight.dead_letter_report)
        else:
            # No original to copy: the DLQ record carries what the index knows of it.
            _, sid, target = job.entry.value
            known: envelope.Headers = []
            if sid is not None:  # an id key: the id, and its lane if it has one
                schedule_id, lane = idkeys.split_id_key(sid)
                known.append((envelope.SCHEDULE_ID, schedule_id.encode()))
                if lane is not None:
                    known.append((envelope.LANE, lane.encode()))
            if target is not None:
                known.append((envelope.SCHEDULED_TARGET, target.encode()))
            self._internal.produce(self._dlq_topic, value=None, key=None,
                                   headers=[*known, *tail],
                                   on_delivery=flight.dead_letter_report)
        flight.dead_letters += 1

    def produced(self, flight: Flight) -> Iterator[tuple[bytes, Produced]]:
        """Each entry ``flight`` produced, with what its delivery report tells of it:
        sink, topic, key and value (a report carries no headers)."""
        run = flight.run
        if run is not None:
            for at in run.live(flight.start, flight.end):
                original = run.originals[at]
                if isinstance(original, Message):
                    routing = envelope.routing(original.headers())
                    target = None if routing is None else routing.target
                    yield run.keys[at], (Sink.TARGET, target, original.key(), original.value())
        for job, sink in flight.jobs:
            original = job.original
            whole = isinstance(original, Message) and (sink is Sink.TARGET or (
                job.failure is not None and job.failure[0] in WHOLE_DEAD_LETTERS))
            routing = job.routing
            if routing is None and isinstance(original, Message):
                # Produced from its run, then detached (see Delivery.seal): the job was
                # never verified, and its report names the target the headers give.
                routing = envelope.routing(original.headers())
            routed = None if routing is None else routing.target
            topic = self._dlq_topic if sink is Sink.DLQ else routed
            if whole and isinstance(original, Message):
                yield job.key, (sink, topic, original.key(), original.value())
            else:
                yield job.key, (sink, topic, None, None)
