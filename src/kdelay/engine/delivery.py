"""Delivery: republish due originals to their targets, or dead-letter them.

Each tick reads ahead: entries due within ``lookahead_ms`` are taken from the
partition indexes (a bounded scan) and their originals fetched as sorted offset
ranges, so that when an entry comes due only a produce is left to do. Due
entries go out in key order (due time, then request partition, then offset).
What delivery holds, and where each delivery stands, is kept in its
:class:`~kdelay.engine.book.Book`.

An entry leaves the index only after its produce is acknowledged (target or
DLQ) and :meth:`Delivery.settle` is called; that is what makes delivery
at-least-once. When the changelog tombstone of a delivered entry is written is
not delivery's business: it tells its :class:`Durability` that a record was
sent and that it was delivered (see :mod:`kdelay.engine.checkpoint`). A target that
fails is retried with exponential backoff for ``retry_ms`` after its first
failure (minutes by default: a target topic may be created late), then the
original goes to the DLQ as ``undeliverable``. Entries waiting for a retry sit
apart, so they never block entries to other targets. Nothing is produced
before its due time by the injected clock, and the republished record carries
that clock's time.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException, Message

from kdelay.engine.book import Book, Job, Reports, Sink, State
from kdelay.engine.failures import FailureLog, TopicCheck, backoff_ms
from kdelay.engine.metrics import Metrics
from kdelay.engine.window import Window
from kdelay.plumbing.callbacks import latch, unheard
from kdelay.plumbing.clients import Producing
from kdelay.plumbing.clock import Clock
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import End, IdRecord, IdState, fingerprint_of
from kdelay.protocol.envelope import ErrorCode
from kdelay.protocol.targets import TargetPolicy
from kdelay.state.index import Changes, Entry, PartitionIndex
from kdelay.state.originals import Missing, Reading

log = logging.getLogger(__name__)

MAX_WAIT_MS = 100

Release = Callable[[int], int | None]
"""The latest due time delivery may release when the service clock says ``now``
(None: release nothing yet); see :class:`kdelay.engine.skew.BrokerGuard`."""


def by_service_clock(now_ms: int) -> int | None:
    """Release what the service clock says is due."""
    return now_ms


IN_FLIGHT_WAIT_MS = 1
# Entries waiting for a retry do not count against a partition's read-ahead
# room (so a failing target never hides entries behind it), but a partition
# holds at most this many batches in memory, whatever their state.
MAX_HELD_BATCHES = 20
# Of those, at most this many wait for a retry: the rest stays free for the
# entries of targets that work. A failure beyond it is dead-lettered at once.
MAX_RETRYING_BATCHES = MAX_HELD_BATCHES // 2


# Dead letters that carry the original record, so that it can be sent again as is.
_WHOLE_DEAD_LETTERS = frozenset({ErrorCode.UNDELIVERABLE, ErrorCode.FORBIDDEN_TARGET,
                                 ErrorCode.TARGET_NOT_ALLOWED, ErrorCode.WRONG_LANE,
                                 ErrorCode.MISSING_LANE, ErrorCode.UNKNOWN_LANE})


@dataclass(frozen=True, slots=True)
class DeliveryConfig:
    """What delivery needs from the settings."""

    requests_topic: str
    changelog_topic: str
    dlq_topic: str
    lookahead_ms: int = 2_000
    batch_size: int = 1_000
    attempts: int = 0
    """Attempts before a failing record is dead-lettered; 0: only ``retry_ms`` ends it."""
    backoff_ms: int = 500
    backoff_max_ms: int = 30_000
    targets: TargetPolicy | None = None
    """Which targets are allowed; None: any but kdelay's own three topics."""
    retry_ms: int = 900_000
    """How long after its first failure a record is retried before it is dead-lettered."""


Delivered = tuple[bytes, int, IdRecord | None]
"""An entry whose record is written: its key, its partition, and its id's end record
(None without an id)."""


class Durability(Protocol):
    """How delivery's work becomes durable: told of every send and every delivery.

    The at-least-once form writes an entry's tombstone once its record is
    acknowledged; the exactly-once form writes it with the record, in the
    same transaction (:mod:`kdelay.engine.checkpoint`).
    """

    def sent(self, key: bytes, partition: int, ended: IdRecord | None) -> None:
        """A record for the entry ``key`` was produced (to its target or the DLQ);
        ``ended`` is the changelog record of its id's end, if it has an id."""
        ...

    def delivered(self, done: list[Delivered]) -> None:
        """The records of ``done`` are written: their entries are about to leave the index."""
        ...

    def position(self, partition: int) -> int | None:
        """Return the changelog position the index may record for ``partition``."""
        ...

    def has_failures(self) -> bool:
        """Return whether a changelog write failed since the failures were last taken."""
        ...


@dataclass(slots=True)
class _Counts:
    """Per-record figures gathered between two settles, handed to Prometheus at once."""

    delivered: int = 0
    lateness_ms: list[int] = field(default_factory=list)
    by_lane: dict[str, int] = field(default_factory=dict)


class Delivery:
    """Reads due entries ahead, produces them when due, and settles the outcomes."""

    def __init__(self, config: DeliveryConfig, targets: Producing, internal: Producing,
                 reader: Reading, clock: Clock, metrics: Metrics,
                 durability: Durability, release: Release = by_service_clock,
                 outage: Callable[[], bool] = lambda: False,
                 away: Callable[[str], None] = unheard) -> None:
        """``outage`` tells whether Kafka is unreachable now: a failure then costs no attempt,
        and nothing more is sent until it answers; ``away`` is told when a metadata
        request finds the cluster silent."""
        self._config = config
        self._release = release
        self._outage = outage
        self._failures = FailureLog(clock)
        self._policy = config.targets or TargetPolicy(
            (config.requests_topic, config.changelog_topic, config.dlq_topic), ())
        self._producer = targets
        self._internal = internal
        self._reader = reader
        self._clock = clock
        self._metrics = metrics
        self._durability = durability
        self._book = Book()
        self._windows: dict[int, Window] = {}
        self._reports = Reports()
        # Acknowledged entries that are not in their index yet (see adopt).
        self._unindexed: list[tuple[bytes, Sink]] = []
        self._counts = _Counts()
        self._topics = TopicCheck(targets, clock, away=away)

    def in_flight(self, key: bytes) -> bool:
        """Return whether a produce for ``key`` awaits its report (too late to cancel)."""
        return self._book.in_flight(key)

    def withhold(self, key: bytes) -> bool:
        """Keep ``key`` from being produced, for a cancel being planned; False if too late.

        Returns False when a produce for ``key`` already awaits its report: the
        record is on its way and the cancel's truthful outcome is
        ``already-delivered``. Otherwise the key is not produced (even if it
        comes due, or is read ahead later) until :meth:`forget` or
        :meth:`release` is called for it, so a ``cancelled`` outcome is never
        followed by a delivery.
        """
        return self._book.withhold(key)

    def release(self, keys: list[bytes]) -> None:
        """Let withheld keys go out again: the cancels that withheld them were not applied."""
        self._book.release(keys)

    def idle(self) -> bool:
        """Return whether no produce awaits a report."""
        return not self._book.flying()

    def forget(self, keys: list[bytes]) -> None:
        """Drop read-ahead entries that left the index by other means (cancel)."""
        self._book.forget(keys)

    def noted(self, partition: int, lowest: bytes | None) -> None:
        """Learn that entries down to ``lowest`` were put in ``partition``'s index by others.

        An entry put inside the window already read ahead is found by the next
        scan, which starts no later than ``lowest``.
        """
        if lowest is None:
            return
        window = self._window(partition)
        if window.lowest_put is None or lowest < window.lowest_put:
            window.lowest_put = lowest

    def adopt(self, partition: int, entries: list[Entry],
              originals: Mapping[bytes, Message]) -> None:
        """Take entries intake has just written, with their records, if due inside the window.

        They then need no read back from Kafka, and may go out as soon as they
        are due, before intake's plan is acknowledged and applied to the index;
        an adopted entry leaves the index only after :meth:`indexed` says it
        is in it. Entries not taken are found by a scan once they are indexed.
        """
        window = self._window(partition)
        covered = window.covered
        if covered is None:
            return
        # Adopted entries cost no read: only the cap on held entries bounds them.
        room = self._cap(partition)
        held = self._book.keys
        for entry in entries:
            if room <= 0:
                return
            original = originals.get(entry.key)
            if entry.due.due_ms > covered or entry.key in held or original is None:
                continue
            job = Job(entry, original, partition, State.ADOPTED, indexed=False)
            # The record the entry was just made from: its fingerprint matches by
            # construction, so only its routing is read (None leaves it to _verify).
            job.routing = envelope.routing(original.headers())
            self._book.hold(job)
            room -= 1

    def indexed(self, partition: int, entries: list[Entry]) -> None:
        """Learn that intake's ``entries`` are in ``partition``'s index now.

        Adopted ones may leave it from now on; an entry inside the window that
        was not adopted is found by the next scan, which starts no later than it.
        """
        window = self._window(partition)
        covered = window.covered
        book = self._book
        lowest: bytes | None = None
        for entry in entries:
            job = book.get(entry.key)
            if job is not None:
                job.indexed = True
            elif (covered is None or entry.due.due_ms <= covered) and (
                    lowest is None or entry.key < lowest):
                lowest = entry.key
        if lowest is not None:
            # Scan again (from no later than ``lowest``) until a scan had room for it.
            window.covered = None
            self.noted(partition, lowest)

    def disown(self, entries: list[Entry]) -> None:
        """Drop the adopted jobs of entries whose plan was given back (never indexed)."""
        for entry in entries:
            job = self._book.get(entry.key)
            if job is not None and not job.indexed and job.state is not State.IN_FLIGHT:
                self._book.drop(entry.key)

    def drop_partition(self, partition: int) -> None:
        """Forget every job of a partition this instance no longer owns."""
        for key in self._book.keys_of(partition):
            self._book.drop(key)
        self._windows.pop(partition, None)

    def tick(self, indexes: Mapping[int, PartitionIndex]) -> int:
        """Read ahead, produce what is due; return the milliseconds until there is more to do."""
        self.prepare(indexes)
        self.dispatch()
        return self.wait_ms()

    def prepare(self, indexes: Mapping[int, PartitionIndex]) -> bool:
        """Read ahead and take back retries whose backoff is over; return whether work is due."""
        now = self._clock.now_ms()
        self._read_ahead(indexes, now)
        self._book.promote(now)
        return self._next_wakeup_ms(now) == 0

    def dispatch(self) -> None:
        """Produce every read-ahead entry that is due by the clock, in key order.

        Due means due by ``release`` too (by default the service clock alone).
        """
        now = self._clock.now_ms()
        limit = self._release(now)
        if limit is None:
            return
        book = self._book
        while (job := book.next_to_send()) is not None and job.entry.due.due_ms <= limit:
            if self._outage():  # learnt mid-way (a silent metadata request): wait for Kafka
                return
            try:
                self._send(job, now)
            except BufferError:
                self._producer.poll(0)
                self._internal.poll(0)
                return

    def wait_ms(self) -> int:
        """Return the milliseconds until there is work: the next due entry, or at most
        ``IN_FLIGHT_WAIT_MS`` while produces await their reports (at most ``MAX_WAIT_MS``)."""
        wait = self._next_wakeup_ms(self._clock.now_ms())
        return min(wait, IN_FLIGHT_WAIT_MS) if self._book.flying() else wait

    def has_failures(self) -> bool:
        """Return whether a produce or a tombstone reported a failure since the last settle."""
        return bool(self._reports.failed) or self._durability.has_failures()

    def settle(self, indexes: Mapping[int, PartitionIndex]) -> None:
        """Apply the delivery reports collected since the last call.

        An acknowledged entry leaves the index (its :class:`Durability` is told
        first); a failed one backs off for a retry, or goes to the DLQ.
        """
        reports, self._reports = self._reports, Reports()
        changes: dict[int, Changes] = {}
        now = self._clock.now_ms()
        done = reports.done
        if self._unindexed:
            done, self._unindexed = [*self._unindexed, *done], []
        if done:
            self._succeeded(done, now, changes)
        for key, sink, reason in [*reports.failed, *reports.refused]:
            self._failed(key, sink, reason, now)
        self._failures.flush()
        self._apply(changes, indexes)

    def abandon(self) -> None:
        """Take back every produce of an aborted transaction: the entries go out again.

        Failed and refused produces back off as after any failure; the others
        (whatever their report said) are ready to be sent at once.
        """
        reports, self._reports = self._reports, Reports()
        now = self._clock.now_ms()
        for key, sink, reason in [*reports.refused, *reports.failed]:
            self._failed(key, sink, reason, now)
        self._failures.flush()
        for job in self._book.jobs_in(State.IN_FLIGHT):
            self._book.move(job, State.READY)

    def _apply(self, changes: dict[int, Changes], indexes: Mapping[int, PartitionIndex]) -> None:
        self._flush_metrics()
        for partition, change in changes.items():
            if partition in indexes:
                change.changelog = self._durability.position(partition)
                indexes[partition].apply(change)

    # -- read-ahead -------------------------------------------------------------

    def _window(self, partition: int) -> Window:
        window = self._windows.get(partition)
        if window is None:
            window = self._windows[partition] = Window()
        return window

    def _read_ahead(self, indexes: Mapping[int, PartitionIndex], now: int) -> None:
        horizon = now + self._config.lookahead_ms
        wanted: dict[int, list[Entry]] = {}
        for partition, index in indexes.items():
            window = self._window(partition)
            if window.needs_scan(now, self._config.lookahead_ms):
                room = self._room(partition)
                if room <= 0:
                    continue
                entries = index.scan(horizon, room, skip=self._book.keys,
                                     start=window.cursor)
                if entries:
                    # Everything below the last key read is held or gone: the next
                    # scan resumes right after it instead of walking the held keys.
                    window.cursor = entries[-1].key + b"\x00"
                    wanted[partition] = entries
                window.covered = horizon
                window.truncated = len(entries) >= room
        if wanted:
            self._fetch(wanted)

    def _room(self, partition: int) -> int:
        """Return how many more entries of ``partition`` the read-ahead may take.

        Only ready entries count against the batch: not those in flight or
        backing off (the next batch is read while the last one is
        acknowledged), nor those adopted from intake and not yet sent (they
        were never read, and under steady load with short delays they alone
        would fill the batch and stop the read-ahead). The cap on all held
        entries keeps memory bounded.
        """
        ready = self._book.count(partition, State.READY)
        return min(self._config.batch_size - ready, self._cap(partition))

    def _cap(self, partition: int) -> int:
        """Return how many more entries ``partition`` may hold in memory, whatever their state."""
        return MAX_HELD_BATCHES * self._config.batch_size - self._book.held(partition)

    def _fetch(self, wanted: dict[int, list[Entry]]) -> None:
        # An original lies on the partition its key names (another for a forwarded id).
        offsets: dict[int, list[int]] = defaultdict(list)
        for entry in itertools.chain.from_iterable(wanted.values()):
            offsets[entry.due.partition].append(entry.due.offset)
        originals = self._reader.read(offsets)
        for partition, entries in wanted.items():
            window = self._window(partition)
            for entry in entries:
                found = originals.get((entry.due.partition, entry.due.offset))
                if found is None:
                    window.covered = None
                    window.rewind(entry.key)
                    continue
                self._book.hold(Job(entry, found, partition))

    # -- sending ------------------------------------------------------------------

    def _send(self, job: Job, now: int) -> None:
        """Produce the job's record to its target, or to the DLQ with a reason."""
        if job.failure is None and job.routing is None:
            job.failure = self._verify(job)
        failure = job.failure
        sink = Sink.TARGET if failure is None else Sink.DLQ
        key = job.entry.key
        try:
            if failure is not None:
                self._produce_dead_letter(job, *failure)
            elif isinstance(job.original, Message):
                self._produce_target(job, job.original, now)
            ended = (None if job.entry.value.schedule_id is None
                     else self._ended(job, sink, now)[1])
            self._durability.sent(key, job.partition, ended)
        except KafkaException as exc:
            # Refused before anything was written: nothing in a transaction to abort.
            self._reports.refused.append((key, sink, str(exc.args[0])))
        self._book.sent(job)

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
        return envelope.origin_of(self._config.requests_topic, due.partition, due.offset)

    def _produce_target(self, job: Job, original: Message, now: int) -> None:
        routing = job.routing
        assert routing is not None  # noqa: S101 - _verify set it
        missing = self._topics.missing(routing.target)
        if missing is not None:
            raise KafkaException(missing)
        due = job.entry.due
        headers = [*routing.user, *envelope.delivery_tail(self._where(job), due.due_ms)]
        self._producer.produce(
            routing.target, value=original.value(), key=original.key(),
            partition=-1 if routing.partition is None else routing.partition,
            headers=headers, timestamp=now, on_delivery=self._callback(job.key, Sink.TARGET),
        )
        self._counts.lateness_ms.append(now - due.due_ms)

    def _produce_dead_letter(self, job: Job, code: ErrorCode, detail: str) -> None:
        due = job.entry.due
        reason = envelope.rejection_headers(envelope.Rejection(code, detail))
        tail = [*reason, *envelope.delivery_tail(self._where(job), due.due_ms)]
        if isinstance(job.original, Message) and code in _WHOLE_DEAD_LETTERS:
            # The original's own kdelay-* headers are replaced by the target and
            # due time, so the DLQ record can be sent back as a request as is.
            original = job.original
            headers = [*envelope.user_headers(original.headers()),
                       *envelope.routing_headers(envelope.routing(original.headers())), *tail]
            self._internal.produce(self._config.dlq_topic, value=original.value(),
                                   key=original.key(), headers=headers,
                                   on_delivery=self._callback(job.key, Sink.DLQ))
        else:
            # No original to copy: the DLQ record carries what the index knows of it.
            _, sid, target = job.entry.value
            known = [] if sid is None else [(envelope.SCHEDULE_ID, sid.encode())]
            if target is not None:
                known.append((envelope.SCHEDULED_TARGET, target.encode()))
            self._internal.produce(self._config.dlq_topic, value=None, key=None,
                                   headers=[*known, *tail],
                                   on_delivery=self._callback(job.key, Sink.DLQ))

    def _callback(self, key: bytes, sink: Sink) -> Callable[[KafkaError | None, Message], None]:
        return functools.partial(self._on_report, key, sink)

    def _on_report(self, key: bytes, sink: Sink, error: KafkaError | None, _: Message) -> None:
        # Served once per record: guarded here rather than by a wrapper (see latch).
        try:
            if error is None:
                self._reports.done.append((key, sink))
            else:
                self._reports.failed.append((key, sink, error.str()))
        except BaseException as exc:
            latch(exc)
            raise

    # -- settling ---------------------------------------------------------------

    def _succeeded(self, done: list[tuple[bytes, Sink]], now: int,
                   changes: dict[int, Changes]) -> None:
        """Take the acknowledged entries out of the book, into ``changes`` (their index
        deletes, and their ids' ends), and tell the durability of all of them at once."""
        book = self._book
        counts = self._counts
        delivered: list[Delivered] = []
        for key, sink in done:
            job = book.get(key)
            if job is None:
                continue
            if not job.indexed:
                self._unindexed.append((key, sink))
                continue
            book.drop(key)
            partition = job.partition
            change = changes.get(partition)
            if change is None:  # not setdefault: that would build a Changes per entry
                change = changes[partition] = Changes()
            change.deletes.append(key)
            sid = job.entry.value.schedule_id
            if sid is None:
                delivered.append((key, partition, None))
            else:
                state, record = self._ended(job, sink, now)
                change.ids[sid] = state
                delivered.append((key, partition, record))
            if sink is Sink.TARGET:
                counts.delivered += 1
                lane = job.routing.lane if job.routing is not None else None
                if lane is not None:  # one the policy knows: the label's values are bounded
                    counts.by_lane[lane] = counts.by_lane.get(lane, 0) + 1
            else:
                code = job.failure[0] if job.failure else ErrorCode.UNDELIVERABLE
                self._metrics.dead_lettered.labels(reason=str(code)).inc()
        if delivered:
            self._durability.delivered(delivered)

    @staticmethod
    def _ended(job: Job, sink: Sink, now: int) -> tuple[IdState | None, IdRecord | None]:
        """The end of the job's id at ``now`` and its changelog record (None: no id)."""
        end = End.DELIVERED if sink is Sink.TARGET else End.DEAD_LETTERED
        return codec.end_of(job.entry.value.schedule_id, end, now, job.key,
                            job.entry.value.fingerprint)

    def _flush_metrics(self) -> None:
        """Hand the per-record counts gathered since the last call to Prometheus at once."""
        counts, self._counts = self._counts, _Counts()
        if counts.delivered:
            self._metrics.delivered.inc(counts.delivered)
        for lane, count in counts.by_lane.items():
            self._metrics.lane_delivered.labels(lane=lane).inc(count)
        self._metrics.lateness.observe_ms(counts.lateness_ms)

    def _failed(self, key: bytes, sink: Sink, reason: str, now: int) -> None:
        job = self._book.get(key)
        if job is None:
            return
        outage = self._outage()
        if not outage:  # Kafka away is no fault of the target's: no attempt is spent
            job.attempts += 1
        job.detail = reason
        if job.first_failed_ms is None:
            job.first_failed_ms = now
        given_up = self._given_up(job, now) if sink is Sink.TARGET else None
        if given_up is not None:
            job.failure = (ErrorCode.UNDELIVERABLE,
                           f"{job.attempts} attempts {given_up}; last: {reason}")
            wait = 0
        else:
            wait = backoff_ms(max(1, job.attempts), self._config.backoff_ms,
                              self._config.backoff_max_ms)
            # The last attempt falls at the end of the retry window, not after it.
            wait = max(0, min(wait, job.first_failed_ms + self._config.retry_ms - now))
        self._failures.add(job.entry.due, reason, job.attempts, wait, outage)
        self._metrics.retries.inc()
        job.not_before_ms = now + wait
        self._book.move(job, State.BACKING_OFF)

    def _given_up(self, job: Job, now: int) -> str | None:
        """Return why a failed record is not retried any more, or None to retry it.

        It is retried for ``retry_ms`` after its first failure (and at most
        ``attempts`` times, if set), unless its partition already holds
        ``MAX_RETRYING_BATCHES`` batches of records waiting for a retry:
        memory stays bounded and entries of working targets keep their room.
        """
        config = self._config
        assert job.first_failed_ms is not None  # noqa: S101 - set by _failed
        if config.attempts and job.attempts >= config.attempts:
            return "failed"
        if now - job.first_failed_ms >= config.retry_ms:
            return f"failed over {(now - job.first_failed_ms) // 1000} s"
        waiting = self._book.count(job.partition, State.BACKING_OFF)
        if waiting >= MAX_RETRYING_BATCHES * config.batch_size:
            return (f"failed, and {waiting} records of partition {job.partition} already "
                    "wait for a retry")
        return None

    def _next_wakeup_ms(self, now: int) -> int:
        wakeup = self._book.next_wakeup_ms()
        if wakeup is None:
            return MAX_WAIT_MS
        limit = self._release(now)
        if limit is None:
            return MAX_WAIT_MS
        if limit < now and wakeup <= now:
            # Due by the service clock, held by the release limit: look again soon.
            return max(0, min(MAX_WAIT_MS, wakeup - limit))
        return max(0, min(MAX_WAIT_MS, wakeup - now))
