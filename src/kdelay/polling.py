"""Taking messages from a consumer without waiting longer than needed.

``Consumer.consume(n, timeout)`` returns only when ``n`` messages are there or
the timeout passes, so asking for a large batch turns every call into a full
wait whenever fewer records are available. :func:`take` waits only for the
first message and then takes whatever else is already queued.
"""

from __future__ import annotations

from confluent_kafka import Consumer, Message


def take(consumer: Consumer, limit: int, timeout_s: float) -> list[Message]:
    """Return up to ``limit`` messages: what is queued now, else the first within ``timeout_s``."""
    messages = consumer.consume(limit, timeout=0)
    if messages or timeout_s <= 0:
        return messages
    messages = consumer.consume(1, timeout=timeout_s)
    if messages and limit > 1:
        messages.extend(consumer.consume(limit - 1, timeout=0))
    return messages
