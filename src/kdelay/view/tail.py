"""The tail of a topic: records printed one line each as they arrive.

``kdelay tail TOPIC`` shows a delayed record reaching its target (with the
``kdelay-origin`` and ``kdelay-due-ms`` headers delivery adds) without a Kafka
tool at hand. It reads by assignment, not in a consumer group: it joins no
group, commits and stores no offset, and disturbs no other reader. Records of
aborted transactions are never shown (``read_committed``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from kdelay.plumbing.clients import reader_config
from kdelay.plumbing.connection import check_connection
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import LayoutError

POLL_S = 0.5
METADATA_TIMEOUT_S = 10.0


def follow(
    settings: Settings,
    topic: str,
    emit: Callable[[str], None],
    *,
    from_beginning: bool = False,
    count: int | None = None,
    ready: Callable[[str], None] | None = None,
) -> int:
    """Hand each record arriving on ``topic`` to ``emit`` as one line (see :func:`describe`).

    Starts at the end of every partition (records produced from now on), or
    at the beginning with ``from_beginning``. Returns after ``count`` records;
    without ``count`` it runs until interrupted. Once positioned, it hands
    ``ready`` one sentence saying where it reads from. Returns how many
    records it emitted. Raises :class:`~kdelay.plumbing.connection.ConnectionFailure` when no
    broker answers, :class:`LayoutError` ``topic-missing`` for an unknown
    topic, KafkaException for a failed fetch.
    """
    config = reader_config(settings.client_config("tail"), f"kdelay-tail-{uuid.uuid4().hex}",
                           **{"enable.partition.eof": False})
    check_connection(config)
    consumer = Consumer(config)
    try:
        positions = _start_positions(consumer, topic, from_beginning)
        consumer.assign(positions)
        if ready is not None:
            start = "the beginning" if from_beginning else "the end"
            ready(f"following {topic} ({len(positions)} partitions) from {start}")
        emitted = 0
        while count is None or emitted < count:
            message = consumer.poll(POLL_S)
            if message is None:
                continue
            if message.error() is not None:
                raise KafkaException(message.error())
            emit(describe(message))
            emitted += 1
        return emitted
    finally:
        consumer.close()


def _start_positions(consumer: Consumer, topic: str, from_beginning: bool) -> list[TopicPartition]:
    """Every partition of ``topic`` at its low or high watermark."""
    metadata = consumer.list_topics(topic, timeout=METADATA_TIMEOUT_S).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        raise LayoutError("topic-missing", f"topic {topic} does not exist")
    positions = []
    for partition in sorted(metadata.partitions):
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=METADATA_TIMEOUT_S)
        positions.append(TopicPartition(topic, partition, low if from_beginning else high))
    return positions


def describe(message: Message) -> str:
    """One line: ``topic/partition/offset time key=... value=... header=value ...``.

    Keys, values and header values are shown as UTF-8 (undecodable bytes and
    control characters as escapes, so a record is always one line); an absent
    key or value as ``null``; the time is the record's timestamp in UTC.
    """
    stamp: int = message.timestamp()[1]
    when = datetime.fromtimestamp(stamp / 1000, UTC).isoformat(timespec="milliseconds")
    found = message.headers() or []
    pairs = found.items() if isinstance(found, dict) else found
    headers = " ".join(f"{name}={_text(value)}" for name, value in pairs)
    line = (f"{message.topic()}/{message.partition()}/{message.offset()} "
            f"{when.replace('+00:00', 'Z')} key={_text(message.key())} "
            f"value={_text(message.value())}")
    return f"{line} {headers}" if headers else line


def _text(data: str | bytes | None) -> str:
    """Bytes as UTF-8 text on one line: undecodable bytes and control characters
    escaped (``\\xff``, ``\\n``); ``None`` as ``null``."""
    if data is None:
        return "null"
    text = data.decode("utf-8", "backslashreplace") if isinstance(data, bytes) else data
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
