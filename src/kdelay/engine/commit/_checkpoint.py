"""Checkpoints: how one step's writes become durable. The one module that knows the guarantee.

:meth:`kdelay.engine.service.Service.step` keeps the order of the loop:

1. take a batch of requests and plan it;
2. ``begin`` (exactly-once: open a transaction, only when there is work);
3. produce what is due (delivery), then the plans' changelog and DLQ records
   (a :class:`Batch`; delivery adopts the new entries due soon);
4. ``commit``: hand over the batch, get back the batches whose fate is known,
   oldest first, and whether each is durable (exactly-once: ``seal`` delivery's
   landed work into the transaction, commit it, then ``settle`` those seals or
   ``abandon`` them, before step 5);
5. apply the durable batches' plans to the indexes, release and rewind the others;
6. ``settle``: turn delivery reports into index deletes and retries
   (at-least-once: after producing what intake adopted and came due, ``seal``
   what landed and ``settle`` the seals it returns).

What each step means differs by guarantee, and only here:

- :class:`AtLeastOnce` has three idempotent producers (targets, the
  changelog's, gapless, see :mod:`kdelay.engine.commit._writer`, and the other
  internal topics'). ``commit`` does not wait: a batch is durable once every one of
  its records is acknowledged, and batches are applied in the order they
  were written, in whichever later step that is. Meanwhile the service keeps
  consuming and dispatching, so a broker slow to acknowledge the changelog
  delays no delivery: an adopted entry may go out before its plan is
  applied (it leaves the index only after, see :meth:`Delivery.adopt`), and
  a crash in between re-reads the request and delivers it again. Only when
  ``MAX_UNACKED_RECORDS`` records await acknowledgements does ``commit``
  wait, dispatching meanwhile. The consumed offset is stored for the next
  auto-commit after the index write. The seal of a delivered batch (a
  watermark, see :mod:`kdelay.engine.delivery._sealing`) is written once every
  record of it is acknowledged (:class:`Acknowledged`), so a crash in between
  delivers it again.
- :class:`ExactlyOnce` has one transactional producer. ``commit`` seals what
  delivery produced in the transaction, into it (:class:`Transacted`), flushes
  the transaction, aborts it when any of its records failed, else sends the
  consumed offsets with it and commits: a delivery and its seal are both or
  neither visible to ``read_committed`` readers.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from kdelay.engine.commit._durability import Acknowledged, Transacted
from kdelay.engine.commit._takeover import owned, positioned
from kdelay.engine.commit._transactional import Renewable, Renewing
from kdelay.engine.commit._writer import GAPLESS, ChangelogWriter, Failure, Receipts
from kdelay.engine.delivery import Delivery, Durability
from kdelay.engine.intake import Plan
from kdelay.engine.metrics import Metrics
from kdelay.errors import ServiceError
from kdelay.plumbing.callbacks import fatal_code, unheard
from kdelay.plumbing.clients import Consuming, Flushing, Producing, Transacting, flush_until
from kdelay.plumbing.clock import Clock
from kdelay.plumbing.settings import Guarantee, Settings
from kdelay.state.index import PartitionIndex

log = logging.getLogger("kdelay.engine.commit")  # the wing, not its private module

TXN_MARGIN_MS: Final = 10_000
ACK_POLL_S: Final = 0.001
CLOSE_FLUSH_S: Final = 10.0
# The longest one transactional call waits. A call that times out is retried
# (commit) or ends the transaction (the others), so this bounds how long the
# loop is held when Kafka goes away, not how long Kafka may take.
TXN_CALL_S: Final = 10.0
# How often a call that may ignore its own timeout is looked at (ExactlyOnce._send_offsets).
ANSWER_POLL_S = 0.5
# How long a step waits for an unfinished abort (Kafka away); the next step tries again.
ABORT_RETRY_S: Final = 1.0
# At-least-once: how many intake records may await their acknowledgements
# before a step waits for them (memory, and how much a crash re-reads).
MAX_UNACKED_RECORDS: Final = 20_000
# At-least-once: how often a partition's deliveries are sealed (a watermark, index
# deletes) while fewer than a batch landed. Exactly-once seals with each transaction.
SEAL_EVERY_S: Final = 0.05
# At-least-once: the renewals of the target producers are said at most once per this long.
RENEWAL_LOG_EVERY_S: Final = 300.0

ProducerFactory = Callable[..., Transacting]
"""Builds a producer: ``(client_name, **librdkafka_overrides)``."""


@dataclass(slots=True)
class Batch:
    """What one step's intake wrote: its plans, the index each was planned against,
    and the acknowledgements its records await."""

    plans: list[Plan]
    indexes: dict[int, PartitionIndex]
    acks: Receipts
    # Per partition of its plans, the changelog writer's confirmed position before the
    # batch's records were produced: their offsets lie at or above it.
    floors: dict[int, int | None] = field(default_factory=dict)


Fate = tuple[Batch, bool]
"""A batch whose fate is known, and whether it is durable (else: give it back)."""


class Checkpoint(Protocol):
    """Makes a step's writes durable, the way one guarantee needs."""

    auto_commit: bool
    """Whether the group consumer commits stored offsets on its own."""
    @property
    def targets(self) -> Producing:
        """The producer of records to targets."""
        ...

    @property
    def internal(self) -> Producing:
        """The producer of DLQ records, forwards and answers (under transactions, every record)."""
        ...

    writer: ChangelogWriter
    """The changelog writer: on a gapless producer of its own, or the transactional one."""
    durability: Durability
    """What delivery tells of its sends and deliveries."""

    def begin(self, work: bool) -> bool:
        """Start a step; return whether it produces anything (``work``: it has something to)."""
        ...

    def commit(self, batch: Batch, offsets: list[TopicPartition], consumer: Consuming,
               delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> list[Fate]:
        """Make the step's writes durable; return the batches whose fate is now known.

        ``batch`` is what intake wrote this step (maybe no plans), ``offsets``
        the consumed positions once its plans are applied. The batches come
        back oldest first; a durable one's plans may be applied. Whatever of
        delivery's work this makes final is settled here, before plans reach
        the indexes.
        """
        ...

    def awaiting(self) -> bool:
        """Return whether written batches still await their acknowledgements."""
        ...

    def position(self, partition: int) -> int | None:
        """The changelog position an index of ``partition`` may record now."""
        ...

    def drain(self) -> list[Batch]:
        """Wait (bounded) for the batches in flight; return those now durable, oldest first."""
        ...

    def mark(self, plan: Plan, acks: Receipts) -> None:
        """Write the consumed-offset marker of ``plan``, being written with ``acks``."""
        ...

    def consumed(self, consumer: Consuming, partition: int, offset: int) -> None:
        """Record that intake applied ``partition`` up to ``offset``."""
        ...

    def settle(self, delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> None:
        """End the step: apply the delivery reports that arrived to the indexes."""
        ...

    def claim(self, consumer: Consuming, partitions: list[TopicPartition]) -> None:
        """Take up newly assigned ``partitions``, each at its offset (negative: none yet)."""
        ...

    def revoke(self, consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> None:
        """Finish the work of partitions about to be revoked."""
        ...

    def close(self) -> None:
        """Flush what is still queued."""
        ...


def _report_lost(failures: list[Failure]) -> None:
    """Log the dead letters and outcome records a batch lost for good: one line per topic."""
    by_topic: dict[str, list[Failure]] = {}
    for failure in failures:
        by_topic.setdefault(failure.topic, []).append(failure)
    for topic, lost in by_topic.items():
        log.error("%d write(s) to %s failed for good (%s); the requests stay readable at "
                  "their origin in the requests topic", len(lost), topic, lost[0].error.str())


class Renewals:
    """Says that the target producers were renewed: a warning the first time, and at
    most once per :data:`RENEWAL_LOG_EVERY_S` after (with how many renewals since)."""

    def __init__(self) -> None:
        self._since = 0
        self._logged = float("-inf")

    def renewed(self, error: KafkaError, again: int, now_s: float) -> None:
        """The target producers were renewed after ``error`` at monotonic ``now_s``;
        ``again`` entries go out again."""
        self._since += 1
        if now_s < self._logged + RENEWAL_LOG_EVERY_S:
            log.info("target producers renewed again (%s); %d deliveries go out again",
                     error.str(), again)
            return
        log.warning("a target producer failed for good (%s; a target refused writes for "
                    "longer than --delivery-timeout-ms?): fresh target producers replace "
                    "both, and the %d deliveries in the air go out again (perhaps twice); "
                    "%d renewal(s) since the last such line", error.str(), again, self._since)
        self._logged, self._since = now_s, 0


class AtLeastOnce:
    """Every record is durable on its own acknowledgement; offsets are auto-committed."""

    auto_commit = True

    def __init__(self, settings: Settings, targets: Renewing, internal: Producing,
                 writer: ChangelogWriter, clock: Clock, metrics: Metrics,
                 stopping: Callable[[], bool], each: Renewing | None = None) -> None:
        """``targets`` is the bulk lane (failures reported only), ``each`` the producer
        that reports every record, for while the bulk lane is stalled; both are
        renewed together when one fails for good (:meth:`_renew_failed`)."""
        self.targets = targets
        self.internal = internal
        self.writer = writer
        # Not "each or targets": a producer with a length and an empty queue may be falsy.
        self._each = targets if each is None else each
        self.durability: Durability = Acknowledged(writer, targets, self._each,
                                                   failed=self._target_failed,
                                                   position=self.position)
        self._renewals = Renewals()
        self._requests_topic = settings.requests_topic
        self._drain_s = settings.delivery_timeout_ms / 1000 + 5
        self._clock = clock
        self._metrics = metrics
        self._stopping = stopping
        self._unacked: deque[tuple[Batch, int]] = deque()
        self._records = 0

    def begin(self, work: bool) -> bool:
        """Every step produces: what is due, and the tombstones of what was delivered."""
        return True

    def commit(self, batch: Batch, offsets: list[TopicPartition], consumer: Consuming,
               delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> list[Fate]:
        """Queue the batch; return the batches acknowledged in full, in the order written.

        Waits only while ``MAX_UNACKED_RECORDS`` records await acknowledgements
        (producing what comes due meanwhile), or until the service is asked to
        stop. Raises :class:`ServiceError` when a changelog write failed for
        good; a dead letter that failed for good is logged (the request stays
        readable at its origin).
        """
        if batch.acks.waiting:
            self._unacked.append((batch, batch.acks.waiting))
            self._records += batch.acks.waiting
        self.internal.poll(0)
        self.writer.serve()
        durable = self._take_acknowledged()
        while self._records > MAX_UNACKED_RECORDS and not self._stopping():
            self.writer.serve(ACK_POLL_S)  # most of what a step waits for: puts' markers
            self.internal.poll(0)
            delivery.dispatch()
            durable += self._take_acknowledged()
        return [(done, True) for done in durable]

    def awaiting(self) -> bool:
        """Whether written batches still await their acknowledgements."""
        return bool(self._unacked)

    def position(self, partition: int) -> int | None:
        """The changelog position an index of ``partition`` may record now.

        The writer's confirmed position, but never past the records of a plan
        written and not yet applied: its records may be acknowledged while its
        batch waits for others (a forward, an outcome on a partition without a
        leader). An index that recorded a position past them, caught up from the
        changelog after a lost assignment, would skip its puts, while a later
        plan's marker moved intake past its requests: lost entries. None: no
        position may be recorded yet.
        """
        confirmed = self.writer.position(partition)
        for batch, _ in self._unacked:  # oldest first: the first floor is the lowest
            if partition in batch.floors:
                floor = batch.floors[partition]
                return None if floor is None or confirmed is None else min(confirmed, floor)
        return confirmed

    def drain(self) -> list[Batch]:
        """Flush the internal producers (bounded); return the batches now acknowledged."""
        deadline = self._clock.monotonic() + self._drain_s
        for producer in self._internals():
            flush_until(producer, deadline, self._clock.monotonic)
        return self._take_acknowledged()

    def _internals(self) -> list[Flushing]:
        """The producers of the internal topics: the other one, and the changelog's (its
        fatal errors kept by the writer as failed writes, see :meth:`ChangelogWriter.flush`)."""
        return [self.internal, self.writer]

    def _take_acknowledged(self) -> list[Batch]:
        """Return the batches at the head of the queue whose records are all acknowledged."""
        for failure in self.writer.take_failures():
            raise ServiceError("changelog-write-failed",
                               f"cannot write to {failure.topic}: {failure.error.str()}")
        unacked = self._unacked
        durable: list[Batch] = []
        while unacked and unacked[0][0].acks.done:
            for failure in unacked[0][0].acks.forward_failures:
                # The batch is not applied: its requests are read again after a restart.
                raise ServiceError("forward-write-failed", (
                    f"cannot forward a request to its id's partition of {failure.topic}: "
                    f"{failure.error.str()}; kdelay needs Write on the requests topic"))
            batch, records = unacked.popleft()
            self._records -= records
            _report_lost(batch.acks.dead_letter_failures)
            self._metrics.state.changelog_errors.inc(len(batch.acks.dead_letter_failures))
            durable.append(batch)
        return durable

    def mark(self, plan: Plan, acks: Receipts) -> None:
        """Write the plan's marker, never past a request whose forward is not acknowledged.

        The marker may be acknowledged before a forward (another partition of
        the requests topic), and a restore from it after a crash would skip
        the request: it names instead the first request of this plan, or of a
        plan still awaiting its acknowledgements, that was forwarded (read
        again, it is forwarded again: the same schedule at the id's partition).
        """
        assert plan.changes.consumed is not None  # noqa: S101 - the service checks
        floors = [p.first_forward for batch, _ in self._unacked for p in batch.plans
                  if p.partition == plan.partition and p.first_forward is not None]
        if plan.first_forward is not None:
            floors.append(plan.first_forward)
        self.writer.mark_consumed(plan.partition, min([plan.changes.consumed, *floors]), acks)

    def consumed(self, consumer: Consuming, partition: int, offset: int) -> None:
        """Store the offset; the consumer's auto-commit commits it."""
        consumer.store_offsets(offsets=[TopicPartition(self._requests_topic, partition, offset)])

    def settle(self, delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> None:
        """Produce what intake adopted and came due, then apply the reports that arrived
        (after renewing a target producer that failed for good)."""
        delivery.tick(indexes)
        self.targets.poll(0)
        self._each.poll(0)
        self.internal.poll(0)
        self.writer.serve()
        self._renew_failed(delivery)
        delivery.settle(indexes, delivery.seal(indexes, SEAL_EVERY_S))

    def _target_failed(self) -> bool:
        """Whether a target producer failed for good and awaits its renewal."""
        return self.targets.failed is not None or self._each.failed is not None

    def _renew_failed(self, delivery: Delivery) -> None:
        """Replace both target producers if one failed for good, and take every flight in
        the air back: its entries go out again on the new ones, whatever the old ones
        reported (at-least-once: perhaps twice, never lost)."""
        error = self.targets.failed or self._each.failed
        if error is None:
            return
        self.targets.renew()
        if self._each is not self.targets:
            self._each.renew()
        self._renewals.renewed(error, delivery.take_back(), self._clock.monotonic())

    def claim(self, consumer: Consuming, partitions: list[TopicPartition]) -> None:
        """Nothing: no transaction holds this group's offsets."""

    def revoke(self, consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> None:
        """Wait for the produces in flight, settle them, and commit the stored offsets."""
        deadline = self._clock.monotonic() + self._drain_s
        for producer in (self.targets, self._each, *self._internals()):
            flush_until(producer, deadline, self._clock.monotonic)
        self._renew_failed(delivery)
        delivery.settle(indexes, delivery.seal(indexes))
        try:
            consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                log.warning("offset commit failed: %s", exc)

    def close(self) -> None:
        """Flush the producers (briefly)."""
        self.targets.flush(CLOSE_FLUSH_S)
        self._each.flush(CLOSE_FLUSH_S)
        for producer in self._internals():
            producer.flush(CLOSE_FLUSH_S)


class ExactlyOnce:
    """Each step that has work is one transaction: intake writes, deliveries, offsets."""

    auto_commit = False

    def __init__(self, settings: Settings, producer: Renewable, writer: ChangelogWriter,
                 clock: Clock, metrics: Metrics, stopping: Callable[[], bool],
                 waiting: Callable[[str], None] = unheard,
                 unreachable: Callable[[], bool] = lambda: False, owner: str = "") -> None:
        """``waiting`` is told, on every retry, why a commit waits for Kafka;
        ``unreachable`` tells whether Kafka is known to be away (no flush waits then);
        ``owner`` is the metadata of the offsets committed (see
        :mod:`~kdelay.engine.commit._takeover`)."""
        self.producer = producer
        self._owner = owner
        self._tell_waiting = waiting
        self._unreachable = unreachable
        # Whether Kafka was away since the last transaction ended: the
        # coordinator may have timed the open one out meanwhile (see _fenced).
        self._away = False
        self.writer = writer
        self.durability: Durability = Transacted(writer, producer)
        self._flush_s = settings.delivery_timeout_ms / 1000
        self._clock = clock
        self._metrics = metrics
        self._stopping = stopping
        self._ending = False
        self._renewing = False
        self._retrying_commit = False

    @property
    def targets(self) -> Producing:
        """The transactional producer: targets are written in the step's transaction."""
        return self.producer

    @property
    def internal(self) -> Producing:
        """The transactional producer: every record is, under transactions."""
        return self.producer

    def begin(self, work: bool) -> bool:
        """Open a transaction when the step has work; a step without produces nothing.

        An abort that could not finish (Kafka away) is finished first; until it
        is, no step produces.
        """
        if self._ending and not self._end(ABORT_RETRY_S, renew=False):
            return False
        if work:
            try:
                self.producer.begin_transaction()
            except KafkaException as exc:
                self._failed(exc)
                return False
        return work

    def commit(self, batch: Batch, offsets: list[TopicPartition], consumer: Consuming,
               delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> list[Fate]:
        """Commit the open transaction, or abort it when any of its records failed, and
        settle what it carried; return the batch, and whether it committed.

        Delivery is settled here, before the step's plans are written to the
        indexes: the tombstones in the transaction confirm changelog
        positions, and an index may record such a position only with the
        deletes those tombstones stand for (a crash in between would
        otherwise restore past them and deliver the entries again). Nor only
        with those: the plans' puts come before the seals in the changelog, so
        the index of a partition with a plan records its position when the
        plan is applied, after both (a crash in between then restores both).
        Committed: delivered entries leave the index. Aborted: every entry
        goes out again. Raises :class:`ServiceError` on a fatal transaction
        error, such as being fenced by a newer instance.
        """
        sealed = delivery.seal(indexes)
        committed = self._commit(batch.acks, offsets, consumer, delivery)
        if committed:
            sealed.behind = frozenset(plan.partition for plan in batch.plans)
            delivery.settle(indexes, sealed)
        else:
            delivery.abandon()
        return [(batch, committed)]

    def awaiting(self) -> bool:
        """Never: a step's transaction is over when the step is."""
        return False

    def position(self, partition: int) -> int | None:
        """The writer's confirmed position: a step's plans are applied with its commit."""
        return self.writer.position(partition)

    def drain(self) -> list[Batch]:
        """Nothing: no transaction is open between steps, where rebalances happen."""
        return []

    def _commit(self, acks: Receipts, offsets: list[TopicPartition],
                consumer: Consuming, delivery: Delivery) -> bool:
        producer = self.producer
        try:
            # What the flush left: len(producer) read again would count a log or error
            # event arriving meanwhile (librdkafka's out queue holds them) as a record.
            left = flush_until(producer, self._clock.monotonic() + self._flush_s,
                               self._clock.monotonic, self._unreachable)
            # Read after the flush: the reports of this step's records arrive in it.
            failed = [*acks.dead_letter_failures, *acks.forward_failures,
                      *self.writer.take_failures()]
            if failed or delivery.has_failures() or left:
                # Records still queued or timed out mean Kafka is away, most
                # likely: the producer's sequence numbers may be off, so a new
                # producer ends the transaction rather than an abort; while Kafka
                # is away that is left to the steps that follow (see begin).
                timed_out = any(f.error.code() == KafkaError._MSG_TIMED_OUT for f in failed)
                self._away = self._away or self._unreachable()
                renew = timed_out or bool(left) or self._away
                self._end(ABORT_RETRY_S if renew else TXN_CALL_S, renew=renew)
                return False
            if self._stopping():
                self._end(TXN_CALL_S, renew=False)
                return False
            if offsets:
                self._send_offsets(owned(offsets, self._owner) if self._owner else offsets,
                                   consumer.consumer_group_metadata())
        except KafkaException as exc:
            self._failed(exc)
            return False
        return self._commit_transaction()

    def _send_offsets(self, offsets: list[TopicPartition], group_metadata: Any) -> None:
        """Add the consumed offsets to the transaction; raise ``KafkaException`` as the call does.

        librdkafka can ignore this call's timeout: when the group coordinator
        dies during the call, it may wait until a broker comes back, and after
        an outage that replaced the consumer it may never answer at all, with
        Kafka answering everything else (librdkafka issues 5456 and 5511, open
        in 2.16). So the call runs on a thread of its own and the step looks at
        it every :data:`ANSWER_POLL_S`. Without an answer after
        :data:`TXN_CALL_S` the transaction is abandoned: this raises, and a
        new producer with the same transactional id ends it (nothing was
        committed, so the step's work is simply done again; the stuck call's
        thread and producer are left to end on their own). Raises
        :class:`ServiceError` ``kafka-unreachable`` when asked to stop
        meanwhile (the coordinator aborts the open transaction).
        """
        answer: list[BaseException | None] = []
        done = threading.Event()

        def call() -> None:
            try:
                self.producer.send_offsets_to_transaction(offsets, group_metadata, TXN_CALL_S)
                answer.append(None)
            except BaseException as exc:  # handed to the step's thread
                answer.append(exc)
            finally:
                done.set()

        late_at = self._clock.monotonic() + TXN_CALL_S
        threading.Thread(target=call, name="kdelay-send-offsets", daemon=True).start()
        while not done.wait(ANSWER_POLL_S):
            if self._clock.monotonic() < late_at:
                continue
            if self._stopping():
                raise ServiceError("kafka-unreachable", (
                    "stopped while the transaction's offsets waited for Kafka; the transaction "
                    "coordinator aborts the open transaction"))
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, (
                f"send_offsets_to_transaction has no answer after {TXN_CALL_S:.0f} s"),
                retriable=False))
        if answer[0] is not None:
            raise answer[0]

    def _failed(self, exc: KafkaException) -> None:
        """End a transaction whose call raised ``exc``, with a new producer.

        Raises :class:`ServiceError` ``fenced`` when another process took this
        instance's transactional id.
        """
        error = exc.args[0]
        if self._fenced(error):
            raise ServiceError("fenced", (
                f"transactions: {error.str()}; another process runs with this instance's "
                "transactional id: give every instance its own --state-dir, or its own "
                "--instance-id")) from exc
        log.warning("transaction aborted: %s", error.str())
        if error.retriable():
            self._waiting(f"transactions: {error.str()}")
        self._end(ABORT_RETRY_S, renew=True)

    def _commit_transaction(self) -> bool:
        """Commit the open transaction; return False if it had to be aborted.

        A commit that timed out (Kafka away) is retried until Kafka answers,
        each call bounded by :data:`TXN_CALL_S`: its outcome decides what the
        step applies, so it must be known. Raises :class:`ServiceError` when
        fenced by a newer instance.
        """
        while True:
            try:
                with self._metrics.loop.commit_duration.time():
                    self.producer.commit_transaction(TXN_CALL_S)
            except KafkaException as exc:
                error = exc.args[0]
                if not error.retriable() or error.txn_requires_abort():
                    self._failed(exc)
                    return False
                if self._stopping():
                    raise ServiceError("kafka-unreachable", (
                        f"stopped while a transaction commit waited for Kafka ({error.str()});"
                        " the transaction coordinator finishes it")) from exc
                if not self._retrying_commit:
                    log.warning("transaction commit waits for Kafka: %s", error.str())
                    self._retrying_commit = True
                self._waiting(f"transactions: commit: {error.str()}")
                continue
            if self._retrying_commit:
                log.warning("transaction committed once Kafka answered again")
                self._retrying_commit = False
            self._away = False
            return True

    def _end(self, timeout_s: float, *, renew: bool) -> bool:
        """End the open transaction without committing it; return whether it is over.

        With ``renew`` (or once an abort failed) a new producer with the same
        transactional id takes over (``init_transactions`` aborts what the old
        one left open); else the transaction is aborted. When Kafka does not
        answer within ``timeout_s``, the end is left for :meth:`begin` to
        finish, a little at a time: no step produces until it is done.
        Raises :class:`ServiceError` when fenced, or when a new producer
        fails for good.
        """
        if renew and not self._renewing:
            log.warning("the transaction is abandoned: a new transactional producer with the "
                        "same id ends it, once Kafka answers")
        self._renewing = self._renewing or renew
        try:
            if self._renewing:
                self.producer.renew(timeout_s)
            else:
                self.producer.abort_transaction(timeout_s)
        except KafkaException as exc:
            error = exc.args[0]
            if self._fenced(error) or (self._renewing and not error.retriable()):
                raise ServiceError(fatal_code(error) if error.fatal() else "transaction-failed",
                                   f"transactions: cannot end the transaction: {error.str()}"
                                   ) from exc
            self._renewing = True
            self._ending = True
            return False
        if self._renewing:
            log.warning("a new transactional producer took over")
        self._ending = self._renewing = self._away = False
        return True

    def _waiting(self, why: str) -> None:
        """A transaction call waits for Kafka: say so (once) and remember it."""
        self._away = True
        self._tell_waiting(why)

    def _fenced(self, error: KafkaError) -> bool:
        """Whether ``error`` means another process took this instance's transactional id.

        A fence that follows an outage is the coordinator's own doing: it
        aborts a transaction open longer than ``transaction.timeout.ms`` and
        bumps the producer's epoch, which fences the producer that waited
        for Kafka. That one is ended by a new producer, like any transaction
        an outage left open; only a fence with Kafka answering all along
        means a second process.

        Only a fatal error fences the producer. A group member's fence on the
        transaction's offsets (``FENCED_INSTANCE_ID``, abortable) says the
        consumer rejoined since the group metadata was taken (its coordinator
        moved: a broker killed in a rolling restart); the transaction is ended
        and the next one carries the new metadata. A second process under this
        instance's ids fences the consumer itself, which reports it fatally.
        """
        return (fatal_code(error) == "fenced" and error.fatal()
                and not (self._away or self._unreachable()))

    def mark(self, plan: Plan, acks: Receipts) -> None:
        """Write the marker in the open transaction, with the plan's records and offsets."""
        assert plan.changes.consumed is not None  # noqa: S101 - the service checks
        self.writer.mark_consumed(plan.partition, plan.changes.consumed, acks)

    def consumed(self, consumer: Consuming, partition: int, offset: int) -> None:
        """Nothing: the offsets went with the transaction."""

    def settle(self, delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> None:
        """Nothing: :meth:`commit` settled the transaction's work."""

    def claim(self, consumer: Consuming, partitions: list[TopicPartition]) -> None:
        """Commit the offsets of ``partitions`` in a transaction of their own, naming this
        instance as their owner (see :func:`~kdelay.engine.commit._takeover.positioned`)."""
        claimed = positioned(consumer, partitions) if self._owner else []
        if not claimed or not self.begin(True):
            return
        try:
            self._send_offsets(owned(claimed, self._owner), consumer.consumer_group_metadata())
        except KafkaException as exc:
            self._failed(exc)
            return
        self._commit_transaction()

    def revoke(self, consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> None:
        """Nothing: no transaction is open between steps, where rebalances happen."""

    def close(self) -> None:
        """Flush the producer (briefly)."""
        self.producer.flush(CLOSE_FLUSH_S)


def for_settings(settings: Settings, producers: ProducerFactory, transactional_id: str,
                 clock: Clock, metrics: Metrics, stopping: Callable[[], bool],
                 observe: Callable[[Message], None],
                 waiting: Callable[[str], None] = unheard,
                 unreachable: Callable[[], bool] = lambda: False, owner: str = "") -> Checkpoint:
    """Build the checkpoint of ``settings.guarantee``, with its producers and changelog writer.

    ``observe`` sees every acknowledged consumed-offset marker (clock skew);
    ``waiting`` learns why a transaction commit waits for Kafka, ``unreachable``
    tells whether Kafka is known to be away, and ``owner`` names this instance
    in the offsets it commits (exactly-once).
    """
    s = settings
    if s.guarantee is Guarantee.EXACTLY_ONCE:
        producer = Renewable(lambda: producers("transactions", **{
            "transactional.id": transactional_id, "linger.ms": 2,
            "partitioner": s.partitioner, "message.timeout.ms": s.delivery_timeout_ms,
            "transaction.timeout.ms": s.delivery_timeout_ms + TXN_MARGIN_MS}))
        producer.init_transactions(TXN_CALL_S)
        writer = ChangelogWriter(producer, s.changelog_topic, metrics, observe)
        return ExactlyOnce(s, producer, writer, clock, metrics, stopping, waiting, unreachable,
                           owner)
    lane: dict[str, str | int | bool] = {
        "enable.idempotence": True, "linger.ms": 2, "partitioner": s.partitioner,
        "message.timeout.ms": s.delivery_timeout_ms}
    targets = Renewing(lambda: producers("targets", **lane,
                                         **{"delivery.report.only.error": True}))
    each = Renewing(lambda: producers("targets-each", **lane))
    internal = producers("internal", **{
        "enable.idempotence": True, "linger.ms": 2, "message.timeout.ms": 0})
    writer = ChangelogWriter(producers("changelog", **GAPLESS), s.changelog_topic, metrics,
                             observe, gapless=True)
    return AtLeastOnce(s, targets, internal, writer, clock, metrics, stopping, each)
