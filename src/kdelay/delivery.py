"""Delivery: republish due originals to their targets, or dead-letter them.

Each tick reads ahead: entries due within ``lookahead_ms`` are taken from the
partition indexes (a bounded scan) and their originals fetched as sorted offset
ranges, so that when an entry comes due only a produce is left to do. Due
entries go out in key order (due time, then request partition, then offset).

An entry leaves the index only after its produce is acknowledged (target or
DLQ); that is what makes delivery at-least-once. A target that fails is retried
with exponential backoff; after ``attempts`` failures the original goes to the
DLQ as ``undeliverable``. Entries waiting for a retry sit apart, so they never
block entries to other targets. Nothing is produced before its due time by the
injected clock, and the republished record carries that clock's time.
"""

from __future__ import annotations

import functools
import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kdelay import codec, envelope
from kdelay.callbacks import guarded
from kdelay.changelog import Positions
from kdelay.clock import Clock
from kdelay.codec import IdState
from kdelay.envelope import ErrorCode
from kdelay.index import Changes, Entry, PartitionIndex
from kdelay.intake import fingerprint_of
from kdelay.metrics import Metrics
from kdelay.originals import Found, Missing, OriginalReader

log = logging.getLogger(__name__)

MAX_WAIT_MS = 100
IN_FLIGHT_WAIT_MS = 1
# Entries waiting for a retry do not count against a partition's read-ahead
# room (so a failing target never hides entries behind it), but a partition
# holds at most this many batches in memory, whatever their state.
MAX_HELD_BATCHES = 20


class Sink(Enum):
    """Where a produce for an entry went."""

    TARGET = "target"
    DLQ = "dlq"


@dataclass(frozen=True, slots=True)
class DeliveryConfig:
    """What delivery needs from the settings."""

    requests_topic: str
    changelog_topic: str
    dlq_topic: str
    lookahead_ms: int = 2_000
    batch_size: int = 1_000
    attempts: int = 5
    backoff_ms: int = 500
    backoff_max_ms: int = 30_000


@dataclass(slots=True)
class Task:
    """An entry read ahead: its original, and how its delivery is going."""

    entry: Entry
    original: Found
    partition: int
    adopted: bool = False
    attempts: int = 0
    not_before_ms: int = 0
    in_flight: bool = False
    backing_off: bool = False
    failure: tuple[ErrorCode, str] | None = None
    detail: str = ""
    routing: envelope.Routing | None = None


@dataclass(slots=True)
class _Reports:
    """Delivery reports collected by callbacks, applied by :meth:`Delivery.settle`."""

    done: list[tuple[bytes, Sink]] = field(default_factory=list)
    failed: list[tuple[bytes, Sink, str]] = field(default_factory=list)
    tombstones_failed: list[bytes] = field(default_factory=list)
    refused: list[tuple[bytes, Sink, str]] = field(default_factory=list)


def _routing(routing: envelope.Routing | None) -> envelope.Headers:
    """The target, target partition and schedule id headers of a request, if readable."""
    if routing is None:
        return []
    headers: envelope.Headers = [(envelope.TARGET, routing.target.encode())]
    if routing.partition is not None:
        headers.append((envelope.PARTITION, str(routing.partition).encode()))
    if routing.schedule_id is not None:
        headers.append((envelope.SCHEDULE_ID, routing.schedule_id.encode()))
    return headers


def backoff_ms(attempt: int, base_ms: int, cap_ms: int) -> int:
    """Return the wait before retry number ``attempt`` (1-based): doubling, capped."""
    return int(min(cap_ms, base_ms * 2 ** max(0, attempt - 1)))


class TopicCheck:
    """Asks the cluster whether a target topic exists, and remembers the answer a while.

    A produce to a missing topic would only fail after librdkafka gives up on
    its metadata; checking first turns that into an immediate, retryable
    failure, and keeps a transaction from being aborted for it.
    """

    def __init__(self, producer: Producer, ttl_s: float = 30.0) -> None:
        self._producer = producer
        self._ttl_s = ttl_s
        self._known: dict[str, tuple[float, KafkaError | None]] = {}

    def missing(self, topic: str) -> KafkaError | None:
        """Return the error that says ``topic`` cannot be produced to, or None."""
        now = time.monotonic()
        cached = self._known.get(topic)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            metadata = self._producer.list_topics(topic, timeout=5)
            error: KafkaError | None = metadata.topics[topic].error
        except KafkaException as exc:
            return KafkaError(exc.args[0].code(), f"metadata for {topic}: {exc.args[0].str()}")
        if error is not None and error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        self._known[topic] = (now + (self._ttl_s if error is None else 1.0), error)
        return error


class Delivery:
    """Reads due entries ahead, produces them when due, and settles the outcomes."""

    def __init__(self, config: DeliveryConfig, targets: Producer, internal: Producer,
                 reader: OriginalReader, clock: Clock, metrics: Metrics,
                 positions: Positions, *, transactional: bool = False) -> None:
        self._config = config
        self._producer = targets
        self._internal = internal
        self._reader = reader
        self._clock = clock
        self._metrics = metrics
        self._positions = positions
        self._tasks: dict[bytes, Task] = {}
        self._per_partition: Counter[int] = Counter()
        self._backing_off: Counter[int] = Counter()
        self._flying: Counter[int] = Counter()
        self._adopted: Counter[int] = Counter()
        self._ready: list[bytes] = []
        self._waiting: list[tuple[int, bytes]] = []
        self._covered: dict[int, int] = {}
        self._cursor: dict[int, bytes] = {}
        self._truncated: set[int] = set()
        self._reports = _Reports()
        self._transactional = transactional
        self._sent: list[bytes] = []
        self._topics = TopicCheck(targets)
        self._guarded_report = guarded(self._on_report)
        self._guarded_tombstone = guarded(self._on_tombstone)
        self._lateness: list[int] = []
        self._delivered = 0
        # Keys a planned cancel holds back: never produced until the plan is
        # applied (they leave) or abandoned (they are released).
        self._withheld: set[bytes] = set()

    def in_flight(self, key: bytes) -> bool:
        """Return whether a produce for ``key`` awaits its report (too late to cancel)."""
        task = self._tasks.get(key)
        return task is not None and task.in_flight

    def withhold(self, key: bytes) -> bool:
        """Keep ``key`` from being produced, for a cancel being planned; False if too late.

        Returns False when a produce for ``key`` already awaits its report: the
        record is on its way and the cancel's truthful outcome is
        ``already-delivered``. Otherwise the key is not produced (even if it
        comes due, or is read ahead later) until :meth:`forget` or
        :meth:`release` is called for it, so a ``cancelled`` outcome is never
        followed by a delivery.
        """
        if self.in_flight(key):
            return False
        self._withheld.add(key)
        return True

    def release(self, keys: list[bytes]) -> None:
        """Let withheld keys go out again: the cancels that withheld them were not applied."""
        for key in keys:
            self._withheld.discard(key)
            if key in self._tasks:
                heapq.heappush(self._ready, key)

    def idle(self) -> bool:
        """Return whether no produce awaits a report."""
        return not self._flying.total()

    def forget(self, keys: list[bytes]) -> None:
        """Drop read-ahead entries that left the index by other means (cancel)."""
        for key in keys:
            self._withheld.discard(key)
            task = self._tasks.get(key)
            if task is not None and not task.in_flight:
                self._drop(key)

    def adopt(self, partition: int, entries: list[Entry],
              originals: Mapping[bytes, Message], index: PartitionIndex) -> None:
        """Take entries intake has just indexed, with their records, if due inside the window.

        They then need no read back from Kafka. ``index`` is the partition's
        store: when every new entry inside the scanned window is taken, its
        "new entry below the window" signal is consumed, so no rescan follows.
        """
        covered = self._covered.get(partition)
        if covered is None:
            return
        # Adopted entries cost no read: only the cap on held entries bounds them.
        room = self._cap(partition)
        missed = False
        for entry in entries:
            original = originals.get(entry.key)
            if entry.due.due_ms > covered or entry.key in self._tasks:
                continue
            if room <= 0 or original is None:
                missed = True
                self._rewind(partition, entry.key)
                continue
            task = Task(entry, original, partition)
            # The record the entry was just made from: its fingerprint matches by
            # construction, so only its routing is read (None leaves it to _verify).
            task.routing = envelope.routing(original.headers())
            task.adopted = True
            self._adopted[partition] += 1
            self._hold(task)
            room -= 1
        if missed:
            self._covered.pop(partition, None)
        else:
            index.take_lowest_put()

    def drop_partition(self, partition: int) -> None:
        """Forget every task of a partition this instance no longer owns."""
        for key in [k for k, t in self._tasks.items() if t.partition == partition]:
            self._drop(key)
        self._covered.pop(partition, None)
        self._cursor.pop(partition, None)
        self._truncated.discard(partition)

    def tick(self, indexes: Mapping[int, PartitionIndex]) -> int:
        """Read ahead, produce what is due; return the milliseconds until there is more to do."""
        self.prepare(indexes)
        self.dispatch()
        return self.wait_ms()

    def prepare(self, indexes: Mapping[int, PartitionIndex]) -> bool:
        """Read ahead and take back retries whose backoff is over; return whether work is due."""
        now = self._clock.now_ms()
        self._read_ahead(indexes, now)
        self._promote_retries(now)
        return self._next_wakeup_ms(now) == 0

    def dispatch(self) -> None:
        """Produce every read-ahead entry that is due by the clock, in key order."""
        self._dispatch(self._clock.now_ms())

    def wait_ms(self) -> int:
        """Return the milliseconds until there is work: the next due entry, or at most
        ``IN_FLIGHT_WAIT_MS`` while produces await their reports (at most ``MAX_WAIT_MS``)."""
        wait = self._next_wakeup_ms(self._clock.now_ms())
        return min(wait, IN_FLIGHT_WAIT_MS) if self._flying.total() else wait

    def has_failures(self) -> bool:
        """Return whether a produce reported a failure since the reports were last taken."""
        return bool(self._reports.failed or self._reports.tombstones_failed)

    def finish_transaction(self, committed: bool, indexes: Mapping[int, PartitionIndex]) -> None:
        """Settle a transaction's produces: committed ones leave the index, aborted ones retry.

        Transactional mode only: tombstones were produced inside the
        transaction, so a commit only has to apply the deletes locally.
        """
        reports, self._reports = self._reports, _Reports()
        sent, self._sent = self._sent, []
        now = self._clock.now_ms()
        for key, sink, reason in reports.refused:
            self._failed(key, sink, reason, now)
        if committed and not reports.failed:
            changes: dict[int, Changes] = {}
            for key, sink in reports.done:
                self._succeeded(key, sink, now, changes)
            self._apply(changes, indexes)
            return
        for key, sink, reason in reports.failed:
            self._failed(key, sink, reason, now)
        for key in sent:
            task = self._tasks.get(key)
            if task is not None and task.in_flight:
                self._fly(task, False)
                heapq.heappush(self._ready, key)

    def settle(self, indexes: Mapping[int, PartitionIndex]) -> None:
        """Apply the delivery reports collected since the last call."""
        reports, self._reports = self._reports, _Reports()
        changes: dict[int, Changes] = {}
        now = self._clock.now_ms()
        for key, sink in reports.done:
            self._succeeded(key, sink, now, changes)
        for key, sink, reason in [*reports.failed, *reports.refused]:
            self._failed(key, sink, reason, now)
        self._apply(changes, indexes)

    def _apply(self, changes: dict[int, Changes], indexes: Mapping[int, PartitionIndex]) -> None:
        self._flush_metrics()
        for partition, change in changes.items():
            if partition in indexes:
                change.changelog = self._positions.get(partition)
                indexes[partition].apply(change)

    # -- read-ahead -------------------------------------------------------------

    def _read_ahead(self, indexes: Mapping[int, PartitionIndex], now: int) -> None:
        horizon = now + self._config.lookahead_ms
        wanted: dict[int, list[Entry]] = {}
        for partition, index in indexes.items():
            if self._needs_scan(partition, index, now):
                room = self._room(partition)
                if room <= 0:
                    continue
                entries = index.scan(horizon, room, skip=self._tasks,
                                     start=self._cursor.get(partition))
                if entries:
                    # Everything below the last key read is held or gone: the next
                    # scan resumes right after it instead of walking the held keys.
                    self._cursor[partition] = entries[-1].key + b"\x00"
                self._covered[partition] = horizon
                self._mark_truncated(partition, len(entries) >= room)
                if entries:
                    wanted[partition] = entries
        if wanted:
            self._fetch(wanted)

    def _hold(self, task: Task) -> None:
        """Start tracking a task read ahead (or adopted) and queue it for its due time."""
        key = task.entry.key
        self._tasks[key] = task
        self._per_partition[task.partition] += 1
        heapq.heappush(self._ready, key)

    def _fly(self, task: Task, in_flight: bool) -> None:
        """Mark a task in flight (produced, report pending) or not, keeping the counts."""
        if task.in_flight != in_flight:
            task.in_flight = in_flight
            self._flying[task.partition] += 1 if in_flight else -1
        if in_flight:
            self._unadopt(task)

    def _unadopt(self, task: Task) -> None:
        """Count an adopted task like a read one from its first produce (or its end) on."""
        if task.adopted:
            task.adopted = False
            self._adopted[task.partition] -= 1

    def _room(self, partition: int) -> int:
        """Return how many more entries of ``partition`` the read-ahead may take.

        Entries in flight or backing off do not count against the batch (the
        next batch is read while the last one is acknowledged), nor do entries
        adopted from intake and not yet sent: they were never read, and under
        steady load with short delays they alone would fill the batch and stop
        the read-ahead. The cap on all held entries keeps memory bounded.
        """
        held = self._per_partition[partition]
        active = (held - self._backing_off[partition] - self._flying[partition]
                  - self._adopted[partition])
        return min(self._config.batch_size - active, self._cap(partition))

    def _cap(self, partition: int) -> int:
        """Return how many more entries ``partition`` may hold in memory, whatever their state."""
        return MAX_HELD_BATCHES * self._config.batch_size - self._per_partition[partition]

    def _needs_scan(self, partition: int, index: PartitionIndex, now: int) -> bool:
        lowest = index.take_lowest_put()
        if lowest is not None:
            self._rewind(partition, lowest)
        covered = self._covered.get(partition)
        if covered is None or partition in self._truncated:
            return True
        if lowest is not None and codec.decode_due_key(lowest).due_ms <= covered:
            return True
        return now + self._config.lookahead_ms // 2 >= covered

    def _rewind(self, partition: int, key: bytes) -> None:
        """Move the partition's scan cursor back to ``key`` (an entry not held yet)."""
        cursor = self._cursor.get(partition)
        if cursor is not None and key < cursor:
            self._cursor[partition] = key

    def _mark_truncated(self, partition: int, truncated: bool) -> None:
        if truncated:
            self._truncated.add(partition)
        else:
            self._truncated.discard(partition)

    def _fetch(self, wanted: dict[int, list[Entry]]) -> None:
        originals = self._reader.read({p: [e.due.offset for e in es] for p, es in wanted.items()})
        for partition, entries in wanted.items():
            for entry in entries:
                found = originals.get((partition, entry.due.offset))
                if found is None:
                    self._covered.pop(partition, None)
                    self._rewind(partition, entry.key)
                    continue
                self._hold(Task(entry, found, partition))

    # -- dispatch ---------------------------------------------------------------

    def _promote_retries(self, now: int) -> None:
        while self._waiting and self._waiting[0][0] <= now:
            _, key = heapq.heappop(self._waiting)
            task = self._tasks.get(key)
            if task is not None and task.backing_off:
                task.backing_off = False
                self._backing_off[task.partition] -= 1
                heapq.heappush(self._ready, key)

    def _dispatch(self, now: int) -> None:
        ready = self._ready
        while ready:
            key = ready[0]
            task = self._waiting_to_send(key)
            if task is None:
                heapq.heappop(ready)
                continue
            if task.entry.due.due_ms > now:
                return
            try:
                self._send(key, task, now)
            except BufferError:
                self._producer.poll(0)
                self._internal.poll(0)
                return
            heapq.heappop(ready)

    def _waiting_to_send(self, key: bytes) -> Task | None:
        """Return the task a key on the ready heap stands for, if it still waits to be sent."""
        task = self._tasks.get(key)
        if task is None or task.in_flight or task.backing_off or key in self._withheld:
            return None
        return task

    def _send(self, key: bytes, task: Task, now: int) -> None:
        """Produce the task's record to its target, or to the DLQ with a reason."""
        if task.failure is None and task.routing is None:
            task.failure = self._verify(task)
        sink = Sink.TARGET if task.failure is None else Sink.DLQ
        try:
            if task.failure is not None:
                self._produce_dead_letter(key, task, *task.failure)
            elif isinstance(task.original, Message):
                self._produce_target(key, task, task.original, now)
            if self._transactional:
                self._produce_tombstone(key, task.partition)
        except KafkaException as exc:
            # Refused before anything was written: nothing in a transaction to abort.
            self._reports.refused.append((key, sink, str(exc.args[0])))
        self._fly(task, True)
        if self._transactional:
            self._sent.append(key)

    def _verify(self, task: Task) -> tuple[ErrorCode, str] | None:
        """Return why the fetched original cannot be delivered, or None if it can."""
        original = task.original
        if original is Missing.EXPIRED:
            return (ErrorCode.EXPIRED,
                    f"{self._where(task)} is below the log start offset (retention)")
        if original is Missing.ABSENT:
            return ErrorCode.MISMATCH, f"{self._where(task)} holds no record any more"
        assert isinstance(original, Message)  # noqa: S101 - Missing handled above
        expected = task.entry.value.fingerprint
        found = fingerprint_of(original)
        if found != expected:
            return (ErrorCode.MISMATCH,
                    f"{self._where(task)} fingerprint {found} differs from {expected}")
        routing = envelope.routing(original.headers())
        if routing is None:
            return ErrorCode.MISMATCH, f"{self._where(task)} no longer carries a valid schedule"
        task.routing = routing
        return None

    def _where(self, task: Task) -> str:
        """Return the request's coordinates, ``topic/partition/offset`` (``kdelay-origin``)."""
        due = task.entry.due
        return envelope.origin_of(self._config.requests_topic, due.partition, due.offset)

    def _produce_target(self, key: bytes, task: Task, original: Message, now: int) -> None:
        routing = task.routing
        assert routing is not None  # noqa: S101 - _verify set it
        missing = self._topics.missing(routing.target)
        if missing is not None:
            raise KafkaException(missing)
        due = task.entry.due
        origin = self._where(task)
        headers = [*routing.user, *envelope.delivery_tail(origin, due.due_ms)]
        self._producer.produce(
            routing.target, value=original.value(), key=original.key(),
            partition=-1 if routing.partition is None else routing.partition,
            headers=headers, timestamp=now, on_delivery=self._callback(key, Sink.TARGET),
        )
        self._lateness.append(now - due.due_ms)

    def _produce_dead_letter(self, key: bytes, task: Task, code: ErrorCode, detail: str) -> None:
        due = task.entry.due
        origin = self._where(task)
        reason = envelope.rejection_headers(envelope.Rejection(code, detail))
        tail = [*reason, *envelope.delivery_tail(origin, due.due_ms)]
        if isinstance(task.original, Message) and code is ErrorCode.UNDELIVERABLE:
            # The original's own kdelay-* headers are replaced by the target and
            # due time, so the DLQ record can be sent back as a request as is.
            original = task.original
            headers = [*envelope.user_headers(original.headers()),
                       *_routing(envelope.routing(original.headers())), *tail]
            self._internal.produce(self._config.dlq_topic, value=original.value(),
                                   key=original.key(), headers=headers,
                                   on_delivery=self._callback(key, Sink.DLQ))
        else:
            self._internal.produce(self._config.dlq_topic, value=None, key=None, headers=tail,
                                   on_delivery=self._callback(key, Sink.DLQ))

    def _callback(self, key: bytes, sink: Sink) -> Callable[[KafkaError | None, Message], None]:
        return functools.partial(self._guarded_report, key, sink)

    def _on_report(self, key: bytes, sink: Sink, error: KafkaError | None, _: Message) -> None:
        if error is None:
            self._reports.done.append((key, sink))
        else:
            self._reports.failed.append((key, sink, error.str()))

    # -- settling ---------------------------------------------------------------

    def _succeeded(self, key: bytes, sink: Sink, now: int, changes: dict[int, Changes]) -> None:
        task = self._tasks.get(key)
        if task is None:
            return
        self._drop(key)
        change = changes.get(task.partition)
        if change is None:  # not setdefault: that would build a Changes per entry
            change = changes[task.partition] = Changes()
        change.deletes.append(key)
        sid = task.entry.value.schedule_id
        if sid is not None:
            change.ids[sid] = IdState(None, now) if sink is Sink.TARGET else None
        if not self._transactional:
            self._produce_tombstone(key, task.partition)
        if sink is Sink.TARGET:
            self._delivered += 1
        else:
            code = task.failure[0] if task.failure else ErrorCode.UNDELIVERABLE
            self._metrics.dead_lettered.labels(reason=str(code)).inc()

    def _flush_metrics(self) -> None:
        """Hand the per-record counts gathered since the last call to Prometheus at once."""
        if self._delivered:
            self._metrics.delivered.inc(self._delivered)
            self._delivered = 0
        lateness, self._lateness = self._lateness, []
        for late_ms in lateness:
            self._metrics.lateness.observe(late_ms / 1000)

    def _produce_tombstone(self, key: bytes, partition: int) -> None:
        """Produce an entry's tombstone, waiting for queue room rather than giving up.

        It follows an accepted target produce, which cannot be taken back: a
        transaction must never commit a delivery without its tombstone.
        """
        while True:
            try:
                self._internal.produce(self._config.changelog_topic, value=None, key=key,
                                       partition=partition,
                                       on_delivery=self._guarded_tombstone)
                return
            except BufferError:
                self._internal.poll(0.05)

    def _on_tombstone(self, error: KafkaError | None, message: Message) -> None:
        if error is None:
            self._positions.confirm(message)
        else:
            self._reports.tombstones_failed.append(message.key() or b"")
            self._metrics.changelog_errors.inc()
            log.error("changelog tombstone for %r failed: %s", message.key(), error.str())

    def _failed(self, key: bytes, sink: Sink, reason: str, now: int) -> None:
        task = self._tasks.get(key)
        if task is None:
            return
        self._fly(task, False)
        task.attempts += 1
        task.detail = reason
        if sink is Sink.TARGET and task.attempts >= self._config.attempts:
            task.failure = (ErrorCode.UNDELIVERABLE,
                            f"{task.attempts} attempts failed; last: {reason}")
            wait = 0
        else:
            wait = backoff_ms(task.attempts, self._config.backoff_ms, self._config.backoff_max_ms)
        log.warning("delivery of %s failed (%s, attempt %d); retry in %d ms",
                    task.entry.due, reason, task.attempts, wait)
        self._metrics.retries.inc()
        task.not_before_ms = now + wait
        task.backing_off = True
        self._backing_off[task.partition] += 1
        heapq.heappush(self._waiting, (task.not_before_ms, key))

    def _drop(self, key: bytes) -> None:
        task = self._tasks.pop(key)
        self._fly(task, False)
        self._unadopt(task)
        self._per_partition[task.partition] -= 1
        if task.backing_off:
            self._backing_off[task.partition] -= 1

    def _next_wakeup_ms(self, now: int) -> int:
        candidates = [MAX_WAIT_MS]
        while self._ready and self._waiting_to_send(self._ready[0]) is None:
            heapq.heappop(self._ready)
        for key in self._ready[:1]:
            candidates.append(codec.decode_due_key(key).due_ms - now)
        if self._waiting:
            candidates.append(self._waiting[0][0] - now)
        return max(0, min(candidates))
