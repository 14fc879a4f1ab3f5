"""Consumer retries through kdelay: back off on a table of steps, then dead-letter.

A :class:`RetryingConsumer` wraps a record handler. When the handler raises,
the record (key, value, user headers) is sent back through kdelay to its topic
(or :attr:`RetryPolicy.retry_topic`) after the next step of the backoff table,
with the ``kdelay.attempts`` header counting the failures so far. After the
last step, or at once for an exception listed in
:attr:`RetryPolicy.non_retryable`, it goes to the dead-letter topic with
``kdelay.error-type``, ``kdelay.error-message`` and ``kdelay.attempts``.

Commit order: the consumer's offsets are committed only after every record the
batch produced (retry requests, dead letters, the handler's own records) is
acknowledged. With ``transactional=True`` those records and the offsets commit
in one Kafka transaction, so a crash between the two leaves neither. Without
it a crash between them re-reads the batch: a record may be retried twice,
never lost. A failed produce stops the consumer with :class:`DeliveryError`;
nothing of the batch is committed.

A :class:`RetryingShareConsumer` does the same for a share group (KIP-932),
where a failed record could otherwise only be released for immediate
redelivery: the retry request (or dead letter) is acknowledged by Kafka first,
then the record is rejected in the share group, so the group never hands it
out again and kdelay brings it back after the backoff.

Helper headers use the ``kdelay.`` prefix (a dot): kdelay delivers them like
any user header, unlike its own ``kdelay-`` request envelope.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import confluent_kafka
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from kdelay import client
from kdelay.client import DeliveryError
from kdelay.plumbing.callbacks import guarded
from kdelay.plumbing.clients import explicit_start, produce, take
from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.protocol.durations import parse_levels
from kdelay.protocol.envelope import Headers

if TYPE_CHECKING:  # confluent-kafka 2.15+: imported when a share consumer is made
    from confluent_kafka import AcknowledgeType, ShareConsumer

log = logging.getLogger(__name__)

COMMITTED_TIMEOUT_S = 10.0
"""How long an assignment waits for the group's committed offsets before it leaves the
lookup to librdkafka."""

DEFAULT_BACKOFF = "10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
"""RocketMQ's consumer retry steps: 16 retries from 10 s to 2 h."""

ATTEMPTS = "kdelay.attempts"
ERROR_TYPE = "kdelay.error-type"
ERROR_MESSAGE = "kdelay.error-message"
ERROR_CODE = "kdelay.error-code"
FAILED_AT = "kdelay.failed-at"
SERIES = envelope.SERIES
"""The series header (see :mod:`kdelay.recurring`); a retry copy never carries it."""

_MESSAGE_LIMIT = 1_000
_DROPPED = frozenset({ATTEMPTS, SERIES, ERROR_TYPE, ERROR_MESSAGE, ERROR_CODE, FAILED_AT})


class Outgoing(NamedTuple):
    """A record a batch produces before it commits; ``partition`` -1 lets the partitioner choose."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    partition: int = -1


Handler: TypeAlias = Callable[[Message], Iterable[Outgoing] | None]
"""Handles one record; may return records to produce with the batch, before its commit."""

Settle: TypeAlias = Callable[[], Iterable[Outgoing]]
"""Runs once a batch's records are acknowledged, before the commit; may add more records."""


class Failed(Exception):
    """Raised by a handler that failed but still has records to send with the batch.

    The record is retried or dead-lettered for ``cause``; ``outgoing`` is
    produced as if the handler had returned it (the task worker uses it for
    the next occurrence of a series, which must not wait for a failed run).
    """

    def __init__(self, cause: Exception, outgoing: Iterable[Outgoing]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.outgoing = list(outgoing)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Where and when a failed record goes.

    ``backoff`` holds the delays (ms) of the retries, first retry first; a
    record that has failed ``len(backoff) + 1`` times is dead-lettered.
    ``retry_topic`` is where retries are delivered (None: the record's own
    topic and partition). ``non_retryable`` exception types go to
    ``dead_letter_topic`` at their first failure.
    """

    dead_letter_topic: str
    backoff: tuple[int, ...] = field(default_factory=lambda: parse_levels(DEFAULT_BACKOFF))
    retry_topic: str | None = None
    non_retryable: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        """Raise ValueError for a negative step; an empty table means no retries."""
        if any(step < 0 for step in self.backoff):
            raise ValueError(f"backoff steps must not be negative, got {self.backoff}")


class Retry(NamedTuple):
    """Send the record back through kdelay after ``delay_ms``, as attempt ``attempts + 1``."""

    delay_ms: int
    attempts: int


class DeadLetter(NamedTuple):
    """Give up: the record has failed ``attempts`` times."""

    attempts: int


def attempts_of(headers: envelope.AnyHeaders) -> int:
    """How many times the record has failed before (its ``kdelay.attempts``; 0 when absent).

    An unreadable value counts as 0: the record is retried from the start,
    never dropped.
    """
    for name, value in reversed(list(envelope.user_headers(headers))):
        if name == ATTEMPTS:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            return int(text) if text is not None and text.isdigit() else 0
    return 0


def decide(attempts: int, error: BaseException, policy: RetryPolicy) -> Retry | DeadLetter:
    """What to do with a record that has failed ``attempts`` times before, and now ``error``."""
    failures = attempts + 1
    if isinstance(error, policy.non_retryable) or attempts >= len(policy.backoff):
        return DeadLetter(failures)
    return Retry(policy.backoff[attempts], failures)


def carried_headers(headers: envelope.AnyHeaders) -> Headers:
    """The user headers a retry or dead letter keeps: no ``kdelay-*``, no helper headers."""
    return [(n, v) for n, v in envelope.user_headers(headers) if n not in _DROPPED]


def retry_request(message: Message, retry: Retry, policy: RetryPolicy,
                  requests_topic: str) -> Outgoing:
    """The kdelay request that delivers ``message`` again after ``retry.delay_ms``."""
    target = policy.retry_topic or str(message.topic())
    partition = None if policy.retry_topic else message.partition()
    headers = [*carried_headers(message.headers()), (ATTEMPTS, str(retry.attempts).encode())]
    request = client.request_headers(target, headers, delay=retry.delay_ms, partition=partition)
    return Outgoing(requests_topic, message.key(), message.value(), request)


def dead_letter(message: Message, error: BaseException, attempts: int,
                topic: str) -> Outgoing:
    """The dead-letter copy of ``message``: the record intact plus why and how often it failed."""
    text = str(error)[:_MESSAGE_LIMIT]
    reasons: Headers = [
        (ERROR_TYPE, type(error).__name__.encode()),
        (ERROR_MESSAGE, text.encode("utf-8", "replace")),
        (ATTEMPTS, str(attempts).encode()),
        (FAILED_AT, envelope.origin_of(str(message.topic()), message.partition() or 0,
                                        message.offset() or 0).encode()),
    ]
    code = getattr(error, "code", None)
    if isinstance(code, str):
        reasons.append((ERROR_CODE, code.encode()))
    return Outgoing(topic, message.key(), message.value(),
                    [*carried_headers(message.headers()), *reasons])


def failure_record(message: Message, error: BaseException, policy: RetryPolicy,
                   requests_topic: str) -> Outgoing:
    """The one record a failure produces: a retry request or a dead letter."""
    decision = decide(attempts_of(message.headers()), error, policy)
    if isinstance(decision, Retry):
        return retry_request(message, decision, policy, requests_topic)
    return dead_letter(message, error, decision.attempts, policy.dead_letter_topic)


def handle_all(messages: Sequence[Message], handler: Handler, policy: RetryPolicy,
               requests_topic: str) -> tuple[list[Outgoing], set[int]]:
    """Run ``handler`` on each record, in order.

    Return what the batch produces (the handler's records, then each failure's
    retry request or dead letter, in record order) and the indexes of the
    records that failed.
    """
    outgoing: list[Outgoing] = []
    failed: set[int] = set()
    for index, message in enumerate(messages):
        try:
            outgoing.extend(handler(message) or ())
        except Failed as failure:
            outgoing.extend(failure.outgoing)
            outgoing.append(failure_record(message, failure.cause, policy, requests_topic))
            failed.add(index)
        except Exception as error:
            outgoing.append(failure_record(message, error, policy, requests_topic))
            failed.add(index)
    return outgoing, failed


def send_all(producer: Producer, records: Sequence[Outgoing], timeout_s: float) -> None:
    """Produce ``records`` and wait until every one is acknowledged.

    Raises :class:`DeliveryError` for the first record Kafka refused, and
    TimeoutError when records are still unacknowledged after ``timeout_s``.
    """
    if not records:
        return
    acks = Acks()
    on_delivery = guarded(acks.on_delivery)
    for record in records:
        produce(producer, record.topic, value=record.value, key=record.key,
                partition=record.partition, headers=record.headers, on_delivery=on_delivery)
    remaining = producer.flush(timeout_s)
    acks.check()
    if remaining:
        raise TimeoutError(f"{remaining} records not acknowledged in {timeout_s} s")


def next_offsets(messages: Sequence[Message]) -> list[TopicPartition]:
    """The offsets to commit after ``messages``: one past the last of each partition."""
    last: dict[tuple[str, int], int] = {}
    for message in messages:
        last[(str(message.topic()), message.partition() or 0)] = (message.offset() or 0) + 1
    return [TopicPartition(topic, partition, offset)
            for (topic, partition), offset in last.items()]


def _assign_explicitly(consumer: Consumer, partitions: list[TopicPartition]) -> None:
    """Assign ``partitions`` at their committed offsets, read here first
    (see :func:`~kdelay.plumbing.clients.explicit_start`).

    When Kafka does not answer the read within :data:`COMMITTED_TIMEOUT_S`,
    the partitions are assigned as they came and librdkafka looks the offsets
    up itself, as any consumer does.
    """
    try:
        committed = consumer.committed(partitions, timeout=COMMITTED_TIMEOUT_S)
    except KafkaException as exc:
        log.warning("reading the committed offsets of %d partitions: %s; librdkafka looks "
                    "them up itself", len(partitions), exc)
        consumer.assign(partitions)
        return
    consumer.assign([explicit_start(tp) for tp in committed])


class Acks:
    """Delivery reports of one batch: the first error is kept and raised by :meth:`check`."""

    def __init__(self) -> None:
        self.error: DeliveryError | None = None

    def on_delivery(self, error: KafkaError | None, message: Message) -> None:
        """Record the first failed delivery."""
        if error is not None and self.error is None:
            self.error = DeliveryError(error, str(message.topic()))

    def check(self) -> None:
        """Raise the first delivery error of the batch, if any."""
        if self.error is not None:
            raise self.error


class RetryingConsumer:
    """Consume ``topics`` in ``group_id``, handle each record, retry or dead-letter failures.

    ``step`` handles one batch: consume, run the handler on each record,
    produce what the batch yields, wait for the acknowledgements, run
    ``settle``, and only then commit (see the module docstring). Offsets are
    stored explicitly; nothing is auto-committed. Not thread-safe: one thread
    steps it.
    """

    def __init__(
        self,
        settings: Settings,
        topics: Sequence[str],
        handler: Handler,
        policy: RetryPolicy,
        *,
        group_id: str,
        transactional: bool = False,
        settle: Settle | None = None,
        batch_size: int = 100,
        flush_timeout_s: float = 30.0,
    ) -> None:
        """Subscribe at once; the producer is transactional when ``transactional``."""
        self._handler = handler
        self._policy = policy
        self._settle = settle
        self._requests = settings.requests_topic
        self._transactional = transactional
        self._batch_size = batch_size
        self._flush_timeout_s = flush_timeout_s
        consumer: dict[str, str | int | bool] = {
            "group.id": group_id, "enable.auto.commit": False,
            "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
            "isolation.level": "read_committed"}
        self.consumer = Consumer(settings.client_config(**consumer))
        extra: dict[str, str | int | bool] = {"enable.idempotence": True,
                                              "partitioner": "murmur2_random"}
        if transactional:
            extra["transactional.id"] = f"{group_id}.retry.{uuid.uuid4().hex}"
        self._producer = Producer(settings.client_config(**extra))
        if transactional:
            self._producer.init_transactions(flush_timeout_s)
        self.consumer.subscribe(list(topics), on_assign=_assign_explicitly)

    def step(self, timeout_s: float = 0.5) -> int:
        """Handle one batch (waiting up to ``timeout_s`` for it); return how many records.

        Raises :class:`DeliveryError` when a record of the batch was not
        written; the batch is then not committed (and its transaction aborted).
        """
        messages = [m for m in take(self.consumer, self._batch_size, timeout_s)
                    if _record(m)]
        if not messages:
            return 0
        if self._transactional:
            self._producer.begin_transaction()
        try:
            self._send(self._handle_all(messages))
            if self._settle is not None:
                self._send(list(self._settle()))
            self._commit(messages)
        except BaseException:
            if self._transactional:
                self._producer.abort_transaction(self._flush_timeout_s)
            raise
        return len(messages)

    def run(self, stopped: Callable[[], bool], timeout_s: float = 0.5) -> None:
        """Step until ``stopped()`` is true."""
        while not stopped():
            self.step(timeout_s)

    def close(self) -> None:
        """Leave the group (committing nothing more); TimeoutError if records stay unsent.

        Every batch waits for its records, so none is outstanding here unless a
        step was interrupted.
        """
        self.consumer.close()
        remaining = self._producer.flush(self._flush_timeout_s)
        if remaining:
            raise TimeoutError(f"{remaining} records unsent when the consumer closed")

    def _handle_all(self, messages: Sequence[Message]) -> list[Outgoing]:
        """Run the handler on each record; collect what it yields and what failures yield."""
        outgoing, _ = handle_all(messages, self._handler, self._policy, self._requests)
        return outgoing

    def _send(self, records: Sequence[Outgoing]) -> None:
        """Produce ``records`` and wait until every one is acknowledged."""
        send_all(self._producer, records, self._flush_timeout_s)

    def _commit(self, messages: Sequence[Message]) -> None:
        """Commit the batch's offsets: in the transaction, or synchronously after the acks."""
        offsets = next_offsets(messages)
        if self._transactional:
            self._producer.send_offsets_to_transaction(
                offsets, self.consumer.consumer_group_metadata(), self._flush_timeout_s)
            self._producer.commit_transaction(self._flush_timeout_s)
        else:
            self.consumer.commit(offsets=offsets, asynchronous=False)


SHARE_GROUPS_SINCE = "2.15"
"""The confluent-kafka release that brought ``ShareConsumer``; the rest of kdelay runs on
the floor pyproject.toml declares."""


class ShareGroupsUnsupported(RuntimeError):
    """The installed confluent-kafka has no share consumer: install ``kdelay[share]``."""

    code = "share-groups-unsupported"


def share_client() -> tuple[type[ShareConsumer], type[AcknowledgeType]]:
    """confluent-kafka's ``ShareConsumer`` and ``AcknowledgeType``, imported on first use.

    Raises :class:`ShareGroupsUnsupported` on a confluent-kafka older than
    :data:`SHARE_GROUPS_SINCE`, which has neither; nothing else in kdelay needs them.
    """
    try:
        from confluent_kafka import AcknowledgeType, ShareConsumer
    except ImportError as exc:
        raise ShareGroupsUnsupported(
            f"share groups need confluent-kafka {SHARE_GROUPS_SINCE} or newer (ShareConsumer), "
            f"this is {confluent_kafka.version()[0]}: pip install 'kdelay[share]'") from exc
    return ShareConsumer, AcknowledgeType


class RetryingShareConsumer:
    """Consume ``topics`` in the share group ``group_id``; retry or dead-letter failures.

    ``step`` handles one batch: poll (explicit acknowledgement), run the
    handler on each record, produce what the batch yields and wait for every
    acknowledgement, then acknowledge each record in the share group
    (``ACCEPT`` when handled, ``REJECT`` when it failed: its retry request or
    dead letter is safely in Kafka, and the group must not hand it out again
    at once) and commit the acknowledgements.

    At-least-once: a crash before that commit leaves the batch acquired until
    the group's record lock expires; the group then delivers it again, and a
    failed record may be retried twice, never lost. When a produce fails the
    batch is released for redelivery and :class:`DeliveryError` is raised.
    Share groups have no transactions, so there is no exactly-once form.
    Not thread-safe: one thread steps it. Needs confluent-kafka 2.15 or newer
    (:class:`ShareGroupsUnsupported` otherwise, from the constructor).
    """

    def __init__(
        self,
        settings: Settings,
        topics: Sequence[str],
        handler: Handler,
        policy: RetryPolicy,
        *,
        group_id: str,
        flush_timeout_s: float = 30.0,
    ) -> None:
        """Subscribe at once (the share group starts where its ``share.auto.offset.reset``
        says: the latest offset unless the group is configured otherwise)."""
        self._handler = handler
        self._policy = policy
        self._requests = settings.requests_topic
        self._flush_timeout_s = flush_timeout_s
        share: dict[str, str | int | bool] = {"group.id": group_id,
                                              "share.acknowledgement.mode": "explicit"}
        producer: dict[str, str | int | bool] = {"enable.idempotence": True,
                                                 "partitioner": "murmur2_random"}
        consumer, self._kinds = share_client()
        self.consumer = consumer(settings.client_config("share-retry", **share))
        self._producer = Producer(settings.client_config("retry", **producer))
        self.consumer.subscribe(list(topics))

    def step(self, timeout_s: float = 0.5) -> int:
        """Handle one batch (waiting up to ``timeout_s`` for it); return how many records.

        Raises :class:`DeliveryError` when a record of the batch was not
        written (the batch is released for redelivery), and KafkaException
        when the share group refused the acknowledgements (the batch comes
        back once its lock expires).
        """
        messages = [m for m in self.consumer.poll(timeout_s) if _record(m)]
        if not messages:
            return 0
        outgoing, failed = handle_all(messages, self._handler, self._policy, self._requests)
        try:
            send_all(self._producer, outgoing, self._flush_timeout_s)
        except BaseException:
            self._acknowledge(messages, lambda _: self._kinds.RELEASE)
            raise
        self._acknowledge(messages, lambda index: self._kinds.REJECT if index in failed
                          else self._kinds.ACCEPT)
        return len(messages)

    def run(self, stopped: Callable[[], bool], timeout_s: float = 0.5) -> None:
        """Step until ``stopped()`` is true."""
        while not stopped():
            self.step(timeout_s)

    def close(self) -> None:
        """Leave the share group; TimeoutError if records stay unsent."""
        self.consumer.close()
        remaining = self._producer.flush(self._flush_timeout_s)
        if remaining:
            raise TimeoutError(f"{remaining} records unsent when the consumer closed")

    def _acknowledge(self, messages: Sequence[Message],
                     kind: Callable[[int], AcknowledgeType]) -> None:
        """Acknowledge every record of the batch as ``kind(index)`` says, and commit."""
        for index, message in enumerate(messages):
            self.consumer.acknowledge(message, kind(index))
        refused = [e for e in self.consumer.commit_sync(self._flush_timeout_s).values() if e]
        if refused:
            raise refused[0]


def _record(message: Message) -> bool:
    """Whether a polled message is a record: skip partition-EOF events, raise any other
    consumer error (as :class:`DeliveryError`)."""
    error = message.error()
    if error is None:
        return True
    if error.code() == KafkaError._PARTITION_EOF:
        return False
    raise DeliveryError(error, str(message.topic()))


def retrying(
    settings: Settings, topics: Sequence[str], policy: RetryPolicy, *, group_id: str,
    transactional: bool = False,
) -> Callable[[Callable[[Message], object]], RetryingConsumer]:
    """Decorator: turn a plain record handler into a :class:`RetryingConsumer`.

    The handler's return value is ignored; raising is what retries.
    """

    def wrap(handler: Callable[[Message], object]) -> RetryingConsumer:
        @functools.wraps(handler)
        def handle(message: Message) -> None:
            handler(message)

        return RetryingConsumer(settings, topics, handle, policy, group_id=group_id,
                                transactional=transactional)

    return wrap
