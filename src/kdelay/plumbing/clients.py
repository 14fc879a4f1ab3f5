"""Kafka client idioms, written once: the surfaces kdelay uses, and how it uses them.

- :class:`Producing`, :class:`Transacting` and :class:`Consuming` are the parts of
  confluent-kafka's ``Producer`` and ``Consumer`` that the service calls, so a
  test can hand the service a fake without a ``cast``.
- :func:`produce` waits for room in librdkafka's queue instead of failing on
  ``BufferError``; :func:`flush_until` flushes until the queue is empty or a
  deadline passes.
- :func:`explicit_start` is a partition at the offset where a group member starts
  it, so librdkafka never looks the committed offset up itself (see there).
- :func:`reader_config` is the configuration of a group-less reader: a consumer
  that is assigned partitions and positions itself, never committing.
- :func:`take` returns what is queued instead of waiting for a full batch
  (``Consumer.consume(n, timeout)`` returns only when ``n`` messages are there
  or the timeout passes, so a large batch turns every call into a full wait).
- :func:`watermarks` retries the errors a leader change causes
  (``get_watermark_offsets`` asks the partition leader; while leadership moves,
  it fails with errors that are gone a moment later).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

from confluent_kafka import (
    OFFSET_BEGINNING,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from kdelay.protocol.envelope import Headers

# Errors of a watermark query that a leader election or a reconnect clears.
# ``_DESTROY_BROKER``: the broker the query went to dropped out of the
# metadata (it died) and librdkafka destroyed its handle mid-request.
# ``OFFSET_NOT_AVAILABLE``: a leader just elected has not caught its high
# watermark up yet (seen in a cluster's rolling restart); the leader epoch
# errors: the query and the leadership crossed.
TRANSIENT = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.OFFSET_NOT_AVAILABLE, KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.BROKER_NOT_AVAILABLE, KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._TIMED_OUT_QUEUE,
    KafkaError._ALL_BROKERS_DOWN, KafkaError._DESTROY_BROKER,
})
# Errors that say the cluster does not answer (not that one leader moved):
# retrying at once is pointless, and the service should learn Kafka is away.
# (_TIMED_OUT_QUEUE: the request timed out before it could even be sent.)
AWAY = frozenset({
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._TIMED_OUT_QUEUE,
    KafkaError._ALL_BROKERS_DOWN, KafkaError._DESTROY_BROKER,
})
RETRY_PAUSE_S = 0.2
# How long :func:`produce` polls between tries while librdkafka's queue is full.
ROOM_POLL_S = 0.05

Report = Callable[[KafkaError | None, Message], None]


class Producing(Protocol):
    """What kdelay asks of a producer."""

    def produce(self, topic: str, value: bytes | None = ..., key: bytes | None = ...,
                partition: int = ..., callback: Report | None = ...,
                on_delivery: Report | None = ..., timestamp: int = ...,
                headers: Headers | None = ...) -> None:
        """Queue a record; raise ``BufferError`` when the queue is full.

        ``callback`` is confluent-kafka's other name for ``on_delivery``. The
        per-record paths pass every argument by position, the report as
        ``callback`` and ``on_delivery`` None: confluent-kafka parses keywords
        by looking each name up in a dict, and a call by position costs
        1-1.5 µs less (docs/benchmarks.md).
        """
        ...

    def poll(self, timeout: float = ...) -> int:
        """Serve delivery reports for up to ``timeout`` seconds."""
        ...

    def flush(self, timeout: float = ...) -> int:
        """Wait up to ``timeout`` seconds for every queued record; return how many remain."""
        ...

    def __len__(self) -> int:
        """Return the records queued or awaiting their report."""
        ...

    def list_topics(self, topic: str, timeout: float = ...) -> Any:
        """Return cluster metadata about ``topic``."""
        ...


class Flushing(Protocol):
    """What can be flushed: a producer, or the changelog writer around one."""

    def flush(self, timeout: float = ...) -> int:
        """Wait up to ``timeout`` seconds for every queued record; return how many remain."""
        ...


class Transacting(Producing, Protocol):
    """A transactional producer."""

    def init_transactions(self, timeout: float = ...) -> None:
        """Register the transactional id, fencing older producers with it."""
        ...

    def begin_transaction(self) -> None:
        """Start a transaction; every produce until commit or abort belongs to it."""
        ...

    def send_offsets_to_transaction(self, positions: list[TopicPartition],
                                    group_metadata: Any,
                                    timeout: float = ...) -> None:
        """Make consumer positions part of the open transaction."""
        ...

    def commit_transaction(self, timeout: float = ...) -> None:
        """Commit the open transaction (flushing it first)."""
        ...

    def abort_transaction(self, timeout: float = ...) -> None:
        """Abort the open transaction, purging what it has queued."""
        ...


Rebalance = Callable[[Any, list[TopicPartition]], None]


class Taking(Protocol):
    """A consumer as :func:`take` uses it."""

    def consume(self, num_messages: int = ..., timeout: float = ...) -> list[Message]:
        """Return up to ``num_messages`` messages, waiting up to ``timeout`` seconds."""
        ...


class Watermarks(Protocol):
    """A consumer as :func:`watermarks` (and the outlook) uses it."""

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = ...,
                              cached: bool = ...) -> tuple[int, int]:
        """Return the partition's low and high offsets."""
        ...


class Consuming(Protocol):
    """What the service asks of its group consumer."""

    def subscribe(self, topics: list[str], on_assign: Rebalance | None = ...,
                  on_revoke: Rebalance | None = ..., on_lost: Rebalance | None = ...) -> None:
        """Join the group for ``topics``; the callbacks run inside ``consume``."""
        ...

    def consume(self, num_messages: int = ..., timeout: float = ...) -> list[Message]:
        """Return up to ``num_messages`` messages, waiting up to ``timeout`` seconds."""
        ...

    def assign(self, partitions: list[TopicPartition]) -> None:
        """Start fetching ``partitions`` from their given offsets (in ``on_assign``)."""
        ...

    def committed(self, partitions: list[TopicPartition],
                  timeout: float = ...) -> list[TopicPartition]:
        """Return the group's committed offsets of ``partitions``."""
        ...

    def seek(self, partition: TopicPartition) -> None:
        """Move the fetch position of an assigned partition."""
        ...

    def pause(self, partitions: list[TopicPartition]) -> None:
        """Stop fetching assigned ``partitions`` until :meth:`resume`."""
        ...

    def resume(self, partitions: list[TopicPartition]) -> None:
        """Fetch paused ``partitions`` again, from their positions."""
        ...

    def store_offsets(self, message: Message | None = ...,
                      offsets: list[TopicPartition] | None = ...) -> None:
        """Store the offsets the next (auto-)commit commits."""
        ...

    def commit(self, *, asynchronous: Literal[False]) -> list[TopicPartition]:
        """Commit the stored offsets and wait for the answer."""
        ...

    def consumer_group_metadata(self) -> Any:
        """Return the group metadata a transaction sends offsets with."""
        ...

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = ...,
                              cached: bool = ...) -> tuple[int, int]:
        """Return the partition's low and high offsets."""
        ...

    def close(self) -> None:
        """Leave the group and close."""
        ...


def produce(producer: Producing, topic: str, *, value: bytes | None, key: bytes | None,
            on_delivery: Report, partition: int | None = None,
            headers: Headers | None = None, timestamp: int = 0) -> None:
    """Produce a record, polling for room while librdkafka's queue is full.

    For records that must go out once their cause is decided (a changelog
    record whose index change is made, a dead letter, a request a caller
    asked to send): they wait for room rather than being dropped.
    ``on_delivery`` receives the report; ``partition`` None (or -1) lets the
    partitioner choose; ``timestamp`` 0 lets the producer stamp the record.
    Other errors (``KafkaException``) are raised.
    """
    while True:
        try:
            producer.produce(topic, value, key, -1 if partition is None else partition,
                             on_delivery, None, timestamp, headers)  # see Producing.produce
            return
        except BufferError:
            producer.poll(ROOM_POLL_S)


def flush_until(producer: Flushing, deadline: float,
                monotonic: Callable[[], float] = time.monotonic,
                hopeless: Callable[[], bool] = lambda: False) -> int:
    """Flush until nothing is queued or ``monotonic()`` passes ``deadline``; return what remains.

    Flushes a second at a time, so reports are served while it waits, and
    stops early once ``hopeless()`` (Kafka is known to be unreachable).
    """
    while True:
        left = producer.flush(1.0)
        if left == 0 or monotonic() >= deadline or hopeless():
            return left


def explicit_start(tp: TopicPartition) -> TopicPartition:
    """``tp`` at an explicit start: its offset (one its group committed, or one the
    member keeps itself), else the earliest (nothing committed yet).

    A partition assigned at ``OFFSET_INVALID`` makes librdkafka look its
    committed offset up after the assignment, and a request-level
    ``NOT_COORDINATOR`` answer to that lookup (a coordinator that moved in a
    rolling restart) leaves the partition unfetched for good while the
    consumer looks healthy (librdkafka issue 5586). A group member that reads
    the committed offsets first and assigns with them never takes that path.
    """
    return TopicPartition(tp.topic, tp.partition,
                          tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)


def reader_config(config: Mapping[str, str | int | bool], group_id: str,
                  **overrides: str | int | bool) -> dict[str, str | int | bool]:
    """Return the configuration of a group-less reader built on ``config``.

    The reader is assigned partitions and seeks itself; it never commits or
    stores offsets (``group_id`` only names it in the broker's logs), reads
    only committed records, and sees the end of a partition as an event.
    """
    return {
        **config,
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "isolation.level": "read_committed",
        **overrides,
    }


def take(consumer: Taking, limit: int, timeout_s: float, gather_s: float = 0.0) -> list[Message]:
    """Return up to ``limit`` messages: what arrives within ``gather_s`` (all of it:
    only ``limit`` messages end that wait early), else the first within ``timeout_s``."""
    gather_s = max(0.0, min(gather_s, timeout_s))
    messages = consumer.consume(limit, timeout=gather_s)
    if messages or timeout_s <= gather_s:
        return messages
    messages = consumer.consume(1, timeout=timeout_s - gather_s)
    if messages and limit > 1:
        messages.extend(consumer.consume(limit - 1, timeout=0))
    return messages


def watermarks(consumer: Watermarks, partition: TopicPartition, timeout_s: float,
               pause: Callable[[float], None] = time.sleep,
               retried: frozenset[int] = TRANSIENT) -> tuple[int, int]:
    """Return the partition's ``(low, high)`` offsets, asking the leader.

    Retries the errors in ``retried`` (pausing with ``pause`` between
    tries) until ``timeout_s`` has passed, then raises the last one; any
    other error is raised at once (as ``KafkaException``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(0.1, deadline - time.monotonic())
        try:
            low, high = consumer.get_watermark_offsets(partition, timeout=left, cached=False)
            return int(low), int(high)
        except KafkaException as exc:
            if exc.args[0].code() not in retried or time.monotonic() >= deadline:
                raise
        pause(RETRY_PAUSE_S)

