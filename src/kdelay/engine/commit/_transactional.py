"""The transactional producer, renewable: one that can be replaced by a fresh one with the same id.

Exactly-once keeps every produce of a step in one transaction
(:class:`kdelay.engine.commit._checkpoint.ExactlyOnce`); when Kafka ends that
producer's life (a transaction the coordinator timed out in an outage), a new
producer with the same transactional id takes over behind the same object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import TopicPartition

from kdelay.plumbing.clients import Report, Transacting
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
