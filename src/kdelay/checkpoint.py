"""Checkpoints: how one step's writes become durable. The one module that knows the guarantee.

:meth:`kdelay.service.Service.step` keeps the order of the loop:

1. take a batch of requests and plan it;
2. ``begin`` (exactly-once: open a transaction, only when there is work);
3. produce what is due (delivery), then the plans' changelog and DLQ records;
4. ``commit``: make the plans' records durable and say whether they are
   (exactly-once: and settle the transaction's deliveries, before step 5);
5. apply the plans to the indexes when they are, else release and rewind them;
6. ``settle``: turn delivery reports into index deletes and retries
   (at-least-once: after producing what intake adopted and came due).

What each step means differs by guarantee, and only here:

- :class:`AtLeastOnce` has two idempotent producers (targets, and internal
  topics). ``commit`` waits until every internal record is acknowledged,
  producing what comes due meanwhile; the consumed offset is stored for the
  next auto-commit after the index write. An entry's tombstone is written
  once its record is acknowledged (:class:`ReportedTombstones`), so a crash
  in between delivers it again.
- :class:`ExactlyOnce` has one transactional producer. ``commit`` flushes the
  transaction, aborts it when any of its records failed, else sends the
  consumed offsets with it and commits. An entry's tombstone goes into the
  same transaction as its record (:class:`TransactedTombstones`), so both or
  neither are visible to ``read_committed`` readers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from kdelay.clients import Consuming, Producing, Transacting, flush_until
from kdelay.clock import Clock
from kdelay.delivery import Delivery, Durability
from kdelay.index import PartitionIndex
from kdelay.metrics import Metrics
from kdelay.settings import Guarantee, Settings
from kdelay.writer import ChangelogWriter, Failure

log = logging.getLogger(__name__)

TXN_MARGIN_MS = 10_000
ACK_POLL_S = 0.001
CLOSE_FLUSH_S = 10.0
TXN_CALL_S = 30.0

ProducerFactory = Callable[..., Transacting]
"""Builds a producer: ``(client_name, **librdkafka_overrides)``."""


class ServiceError(Exception):
    """The service cannot go on (its own topics refuse writes); ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ReportedTombstones:
    """At-least-once: an entry's tombstone is written once its record is acknowledged."""

    def __init__(self, writer: ChangelogWriter) -> None:
        self._writer = writer

    def sent(self, key: bytes, partition: int) -> None:
        """Nothing yet: the record may still fail."""

    def delivered(self, key: bytes, partition: int) -> None:
        """Write the entry's tombstone."""
        self._writer.tombstone(partition, key)

    def position(self, partition: int) -> int | None:
        """The writer's confirmed changelog position."""
        return self._writer.position(partition)

    def has_failures(self) -> bool:
        """Whether a changelog write failed since the failures were last taken."""
        return self._writer.has_failures()


class TransactedTombstones(ReportedTombstones):
    """Exactly-once: an entry's tombstone goes into the transaction of its record."""

    def sent(self, key: bytes, partition: int) -> None:
        """Write the entry's tombstone, in the open transaction."""
        self._writer.tombstone(partition, key)

    def delivered(self, key: bytes, partition: int) -> None:
        """Nothing: the tombstone was committed with the record."""


class Checkpoint(Protocol):
    """Makes a step's writes durable, the way one guarantee needs."""

    auto_commit: bool
    """Whether the group consumer commits stored offsets on its own."""
    targets: Producing
    """The producer of records to targets."""
    internal: Producing
    """The producer of changelog and DLQ records (the same one, under transactions)."""
    writer: ChangelogWriter
    """The changelog writer on this checkpoint's internal producer."""
    durability: Durability
    """What delivery tells of its sends and deliveries."""

    def begin(self, work: bool) -> bool:
        """Start a step; return whether it produces anything (``work``: it has something to)."""
        ...

    def commit(self, wrote: bool, failures: list[Failure], offsets: list[TopicPartition],
               consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> bool:
        """Make the step's writes durable; return whether its plans may be applied.

        ``wrote`` says whether intake wrote records this step, ``failures``
        collects its dead letters that failed, ``offsets`` are the consumed
        positions once the plans are applied. Whatever of delivery's work
        this makes final is settled here, before the plans reach the indexes.
        """
        ...

    def consumed(self, consumer: Consuming, partition: int, offset: int) -> None:
        """Record that intake applied ``partition`` up to ``offset``."""
        ...

    def settle(self, delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> None:
        """End the step: apply the delivery reports that arrived to the indexes."""
        ...

    def revoke(self, consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> None:
        """Finish the work of partitions about to be revoked."""
        ...

    def close(self) -> None:
        """Flush what is still queued."""
        ...


class AtLeastOnce:
    """Every record is durable on its own acknowledgement; offsets are auto-committed."""

    auto_commit = True

    def __init__(self, settings: Settings, targets: Producing, internal: Producing,
                 writer: ChangelogWriter, clock: Clock, metrics: Metrics,
                 stopping: Callable[[], bool]) -> None:
        self.targets = targets
        self.internal = internal
        self.writer = writer
        self.durability: Durability = ReportedTombstones(writer)
        self._requests_topic = settings.requests_topic
        self._drain_s = settings.delivery_timeout_ms / 1000 + 5
        self._clock = clock
        self._metrics = metrics
        self._stopping = stopping

    def begin(self, work: bool) -> bool:
        """Every step produces: what is due, and the tombstones of what was delivered."""
        return True

    def commit(self, wrote: bool, failures: list[Failure], offsets: list[TopicPartition],
               consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> bool:
        """Wait for every internal record's acknowledgement, producing what comes due meanwhile.

        Returns False when the service is asked to stop first (the batch is
        then re-read by whoever owns it next). Raises :class:`ServiceError`
        when a changelog write failed for good; a dead letter that failed for
        good is logged (the request stays readable at its origin).
        """
        if not wrote:
            return True
        while len(self.internal) > 0:
            if self._stopping():
                return False
            self.internal.poll(ACK_POLL_S)
            delivery.dispatch()
        for failure in self.writer.take_failures():
            raise ServiceError("changelog-write-failed",
                               f"cannot write to {failure.topic}: {failure.error.str()}")
        for failure in failures:
            log.error("dead-letter write to %s failed for good (%s); the request stays "
                      "readable at its origin in the requests topic", failure.topic,
                      failure.error.str())
            self._metrics.changelog_errors.inc()
        return True

    def consumed(self, consumer: Consuming, partition: int, offset: int) -> None:
        """Store the offset; the consumer's auto-commit commits it."""
        consumer.store_offsets(offsets=[TopicPartition(self._requests_topic, partition, offset)])

    def settle(self, delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> None:
        """Produce what intake adopted and came due, then apply the reports that arrived."""
        delivery.tick(indexes)
        self.targets.poll(0)
        self.internal.poll(0)
        delivery.settle(indexes)

    def revoke(self, consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> None:
        """Wait for the produces in flight, settle them, and commit the stored offsets."""
        deadline = self._clock.monotonic() + self._drain_s
        flush_until(self.targets, deadline, self._clock.monotonic)
        flush_until(self.internal, deadline, self._clock.monotonic)
        delivery.settle(indexes)
        try:
            consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                log.warning("offset commit failed: %s", exc)

    def close(self) -> None:
        """Flush both producers (briefly)."""
        self.targets.flush(CLOSE_FLUSH_S)
        self.internal.flush(CLOSE_FLUSH_S)


class ExactlyOnce:
    """Each step that has work is one transaction: intake writes, deliveries, offsets."""

    auto_commit = False

    def __init__(self, settings: Settings, producer: Transacting, writer: ChangelogWriter,
                 clock: Clock, metrics: Metrics, stopping: Callable[[], bool]) -> None:
        self.producer = producer
        self.targets: Producing = producer
        self.internal: Producing = producer
        self.writer = writer
        self.durability: Durability = TransactedTombstones(writer)
        self._flush_s = settings.delivery_timeout_ms / 1000
        self._clock = clock
        self._metrics = metrics
        self._stopping = stopping

    def begin(self, work: bool) -> bool:
        """Open a transaction when the step has work; a step without produces nothing."""
        if work:
            self.producer.begin_transaction()
        return work

    def commit(self, wrote: bool, failures: list[Failure], offsets: list[TopicPartition],
               consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> bool:
        """Commit the open transaction, or abort it when any of its records failed, and
        settle what it carried; return whether it committed.

        Delivery is settled here, before the step's plans are written to the
        indexes: the tombstones in the transaction confirm changelog
        positions, and an index may record such a position only with the
        deletes those tombstones stand for (a crash in between would
        otherwise restore past them and deliver the entries again).
        Committed: delivered entries leave the index. Aborted: every entry
        goes out again. Raises :class:`ServiceError` on a fatal transaction
        error, such as being fenced by a newer instance.
        """
        committed = self._commit(failures, offsets, consumer, delivery)
        if committed:
            delivery.settle(indexes)
        else:
            delivery.abandon()
        return committed

    def _commit(self, failures: list[Failure], offsets: list[TopicPartition],
                consumer: Consuming, delivery: Delivery) -> bool:
        producer = self.producer
        try:
            flush_until(producer, self._clock.monotonic() + self._flush_s, self._clock.monotonic)
            failed = [*failures, *self.writer.take_failures()]
            if failed or delivery.has_failures() or len(producer) or self._stopping():
                producer.abort_transaction(TXN_CALL_S)
                return False
            if offsets:
                producer.send_offsets_to_transaction(
                    offsets, consumer.consumer_group_metadata(), TXN_CALL_S)
            with self._metrics.commit_duration.time():
                producer.commit_transaction(TXN_CALL_S)
            return True
        except KafkaException as exc:
            error = exc.args[0]
            if error.txn_requires_abort():
                log.warning("transaction aborted: %s", error.str())
                producer.abort_transaction(TXN_CALL_S)
                return False
            raise ServiceError("transaction-failed", f"transaction failed: {error.str()}") from exc

    def consumed(self, consumer: Consuming, partition: int, offset: int) -> None:
        """Nothing: the offsets went with the transaction."""

    def settle(self, delivery: Delivery, indexes: Mapping[int, PartitionIndex]) -> None:
        """Nothing: :meth:`commit` settled the transaction's work."""

    def revoke(self, consumer: Consuming, delivery: Delivery,
               indexes: Mapping[int, PartitionIndex]) -> None:
        """Nothing: no transaction is open between steps, where rebalances happen."""

    def close(self) -> None:
        """Flush the producer (briefly)."""
        self.producer.flush(CLOSE_FLUSH_S)


def for_settings(settings: Settings, producers: ProducerFactory, transactional_id: str,
                 clock: Clock, metrics: Metrics, stopping: Callable[[], bool],
                 observe: Callable[[Message], None]) -> Checkpoint:
    """Build the checkpoint of ``settings.guarantee``, with its producers and changelog writer.

    ``observe`` sees every acknowledged consumed-offset marker (clock skew).
    """
    s = settings
    if s.guarantee is Guarantee.EXACTLY_ONCE:
        producer = producers("transactions", **{
            "transactional.id": transactional_id, "linger.ms": 2,
            "partitioner": s.partitioner, "message.timeout.ms": s.delivery_timeout_ms,
            "transaction.timeout.ms": s.delivery_timeout_ms + TXN_MARGIN_MS})
        producer.init_transactions(TXN_CALL_S)
        writer = ChangelogWriter(producer, s.changelog_topic, metrics, observe)
        return ExactlyOnce(s, producer, writer, clock, metrics, stopping)
    targets = producers("targets", **{
        "enable.idempotence": True, "linger.ms": 2, "partitioner": s.partitioner,
        "message.timeout.ms": s.delivery_timeout_ms})
    internal = producers("internal", **{
        "enable.idempotence": True, "linger.ms": 2, "message.timeout.ms": 0})
    writer = ChangelogWriter(internal, s.changelog_topic, metrics, observe)
    return AtLeastOnce(s, targets, internal, writer, clock, metrics, stopping)
