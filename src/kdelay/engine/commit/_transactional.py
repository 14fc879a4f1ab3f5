"""Producers that can be replaced by a fresh one behind the same object.

Exactly-once keeps every produce of a step in one transaction
(:class:`kdelay.engine.commit._checkpoint.ExactlyOnce`); when Kafka ends that
producer's life (a transaction the coordinator timed out in an outage), a new
producer with the same transactional id takes over behind the same object
(:class:`Renewable`).

At-least-once's target producers are idempotent: a target refusing writes for
longer than the produce timeout (``NOT_ENOUGH_REPLICAS`` while a follower is
out of the ISR) can leave one with a sequence it cannot repair (librdkafka:
``Unable to reconstruct MessageSet``), a fatal error. :class:`Renewing`
replaces it by a fresh producer. What the old one held is never trusted:
delivery takes every flight in the air back, whatever its reports say
(:meth:`~kdelay.engine.delivery.Delivery.take_back`), and its entries go out
again on the new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kdelay.plumbing.clients import Producing, Report, Transacting
from kdelay.protocol.envelope import Headers


class Renewable:
    """A transactional producer that can be replaced by a fresh one with the same id.

    A broker outage longer than ``transaction.timeout.ms`` leaves an open
    transaction that the coordinator aborts on its own once it is back, and
    the producer's next transactional call fails for good (librdkafka: a
    fatal error such as ``INVALID_TXN_STATE``). Nothing is wrong with the
    instance: a new producer with the same transactional id
    (``init_transactions``) takes over, and the service goes on. Everything
    that produces holds this object, so all of them use the new producer.
    """

    def __init__(self, build: Callable[[], Transacting]) -> None:
        self._build = build
        self._producer = build()
        self._starting = False

    def renew(self, timeout_s: float) -> None:
        """Drop the producer (its transaction is aborted) and start a new one.

        Raises ``KafkaException`` when the new one's ``init_transactions``
        fails; a retriable failure (Kafka away) is retried by the next call,
        with the same new producer.
        """
        if not self._starting:
            self._producer = self._build()
            self._starting = True
        self._producer.init_transactions(timeout_s)
        self._starting = False

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                partition: int = -1, callback: Report | None = None,
                on_delivery: Report | None = None, timestamp: int = 0,
                headers: Headers | None = None) -> None:
        """Produce with the current producer, by position (see ``Producing.produce``)."""
        self._producer.produce(topic, value, key, partition, on_delivery or callback, None,
                               timestamp, headers)

    def poll(self, timeout: float = -1) -> int:
        """Serve the current producer's reports."""
        return self._producer.poll(timeout)

    def flush(self, timeout: float = -1) -> int:
        """Flush the current producer."""
        return self._producer.flush(timeout)

    def __len__(self) -> int:
        """Records the current producer holds."""
        return len(self._producer)

    def list_topics(self, topic: str, timeout: float = -1) -> Any:
        """Metadata, through the current producer."""
        return self._producer.list_topics(topic, timeout=timeout)

    def init_transactions(self, timeout: float = -1) -> None:
        """Register the transactional id (see :class:`Transacting`)."""
        self._producer.init_transactions(timeout)

    def begin_transaction(self) -> None:
        """Start a transaction."""
        self._producer.begin_transaction()

    def send_offsets_to_transaction(self, positions: list[TopicPartition],
                                    group_metadata: Any, timeout: float = -1) -> None:
        """Add consumer positions to the open transaction."""
        self._producer.send_offsets_to_transaction(positions, group_metadata, timeout)

    def commit_transaction(self, timeout: float = -1) -> None:
        """Commit the open transaction."""
        self._producer.commit_transaction(timeout)

    def abort_transaction(self, timeout: float = -1) -> None:
        """Abort the open transaction."""
        self._producer.abort_transaction(timeout)


class Renewing:
    """An idempotent producer that can be replaced by a fresh one (see the module doc).

    confluent-kafka raises a producer's fatal error from the ``poll`` or ``flush``
    that serves it, instead of calling its ``error_cb``: those two catch it here
    and keep it as :attr:`failed`, and from then on serve nothing of the old
    producer (its reports would speak for records nobody trusts any more). The
    owner then renews it (:meth:`renew`). ``produce`` is the current producer's
    own bound method, not a wrapper: the bulk lane calls it once per record
    (a failed producer refuses it, ``_FATAL``). Everything that produces holds
    this object, so all of them use the new producer after :meth:`renew`.
    """

    def __init__(self, build: Callable[[], Producing]) -> None:
        self._build = build
        self._producer = build()
        self.produce = self._producer.produce
        self.failed: KafkaError | None = None
        """The fatal error that ended the current producer, until it is renewed."""

    def renew(self) -> None:
        """Replace the producer by a fresh one.

        The old one is purged (as far as librdkafka still can) and dropped without
        being polled again: none of its reports is served, so nothing it held can
        count as written. Whoever waits for its records takes them back
        (:meth:`~kdelay.engine.delivery.Delivery.take_back`).
        """
        purge = getattr(self._producer, "purge", None)  # confluent-kafka's Producer has it
        if callable(purge):
            try:
                purge()
            except (KafkaException, RuntimeError):  # a fatal producer may refuse even this
                pass
        self._producer = self._build()
        self.produce = self._producer.produce
        self.failed = None

    def poll(self, timeout: float = -1) -> int:
        """Serve the current producer's reports (none once it failed)."""
        if self.failed is not None:
            return 0
        try:
            return self._producer.poll(timeout)
        except KafkaException as exc:
            self._fail(exc)
            return 0

    def flush(self, timeout: float = -1) -> int:
        """Flush the current producer; 0 once it failed (nothing of it is awaited)."""
        if self.failed is not None:
            return 0
        try:
            return self._producer.flush(timeout)
        except KafkaException as exc:
            self._fail(exc)
            return 0

    def _fail(self, exc: KafkaException) -> None:
        """Keep a fatal error as :attr:`failed`; raise any other."""
        error = exc.args[0] if exc.args else None
        if not isinstance(error, KafkaError) or not error.fatal():
            raise exc
        self.failed = error

    def __len__(self) -> int:
        """Records the current producer holds (a failed one's included)."""
        return len(self._producer)

    def list_topics(self, topic: str, timeout: float = -1) -> Any:
        """Metadata, through the current producer."""
        return self._producer.list_topics(topic, timeout=timeout)
