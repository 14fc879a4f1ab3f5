"""Consumer idioms: taking what is queued, and watermarks that survive a leader change.

``Consumer.consume(n, timeout)`` returns only when ``n`` messages are there or
the timeout passes, so asking for a large batch turns every call into a full
wait whenever fewer records are available. :func:`take` waits only for the
first message and then takes whatever else is already queued.

``Consumer.get_watermark_offsets`` asks the partition leader; while leadership
moves (a broker restarts) it fails with errors that a moment later are gone.
:func:`watermarks` retries those until its timeout instead of failing the
caller (a restore, a read of originals) on the first one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

# Errors of a watermark query that a leader election or a reconnect clears.
TRANSIENT = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.BROKER_NOT_AVAILABLE, KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN,
})
RETRY_PAUSE_S = 0.2


def take(consumer: Consumer, limit: int, timeout_s: float) -> list[Message]:
    """Return up to ``limit`` messages: what is queued now, else the first within ``timeout_s``."""
    messages = consumer.consume(limit, timeout=0)
    if messages or timeout_s <= 0:
        return messages
    messages = consumer.consume(1, timeout=timeout_s)
    if messages and limit > 1:
        messages.extend(consumer.consume(limit - 1, timeout=0))
    return messages


def watermarks(consumer: Consumer, partition: TopicPartition, timeout_s: float,
               pause: Callable[[float], None] = time.sleep) -> tuple[int, int]:
    """Return the partition's ``(low, high)`` offsets, asking the leader.

    Retries the errors in :data:`TRANSIENT` (pausing with ``pause`` between
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
            if exc.args[0].code() not in TRANSIENT or time.monotonic() >= deadline:
                raise
        pause(RETRY_PAUSE_S)
