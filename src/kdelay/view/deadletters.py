"""The dead-letter topic as an operator reads it: the latest dead letters, and one sent again.

:func:`latest` reads at most ``per_partition`` records from the end of each
DLQ partition (a bounded read, whatever the topic's size) and returns them
newest first, each decoded into a :class:`DeadLetter`: its code, detail and
the request it came from. :func:`at` reads one record back by its
coordinates. A dead letter that carries the whole request (every code but
``mismatch`` and ``expired``, whose original is gone) can be sent again to
the requests topic: :func:`request_headers` gives the headers it goes with,
the protocol's own without what kdelay added when it dead-lettered it
(``kdelay-error``, ``kdelay-error-detail``, ``kdelay-origin``). An id whose
schedule went to the DLQ takes a new request (docs/protocol.md), so a dead
letter sent again after its cause is fixed is scheduled.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, Message, TopicPartition

from kdelay.plumbing.clients import reader_config, take, watermarks
from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.protocol.envelope import ErrorCode, Headers

ADDED = frozenset({envelope.ERROR, envelope.ERROR_DETAIL, envelope.ORIGIN})
"""What kdelay adds to a request when it dead-letters it."""
GONE = frozenset({ErrorCode.MISMATCH.value, ErrorCode.EXPIRED.value})
"""The codes of dead letters without the request: its original was gone."""
TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One DLQ record: where it lies, when it was written, why, and what it was for."""

    partition: int
    offset: int
    at_ms: int
    code: str
    detail: str
    origin: str | None
    schedule_id: str | None
    lane: str | None
    target: str | None
    due_ms: int | None
    value_bytes: int | None

    @property
    def resendable(self) -> bool:
        """Whether it carries the whole request, and can be sent again as one."""
        return self.code not in GONE


def _text(value: str | bytes | None) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def decode(message: Message) -> DeadLetter:
    """The :class:`DeadLetter` a DLQ record says (absent headers read as None or empty)."""
    found: dict[str, str | None] = {}
    headers = message.headers() or []
    for name, raw in headers.items() if isinstance(headers, dict) else headers:
        found.setdefault(name, _text(raw))
    due = found.get(envelope.DUE_MS)
    value = message.value()
    _, stamp = message.timestamp()
    return DeadLetter(
        partition=message.partition() or 0, offset=message.offset() or 0, at_ms=stamp,
        code=found.get(envelope.ERROR) or "", detail=found.get(envelope.ERROR_DETAIL) or "",
        origin=found.get(envelope.ORIGIN), schedule_id=found.get(envelope.SCHEDULE_ID),
        lane=found.get(envelope.LANE),
        target=found.get(envelope.TARGET) or found.get(envelope.SCHEDULED_TARGET),
        due_ms=int(due) if due is not None and due.isdigit() else None,
        value_bytes=None if value is None else len(value))


def request_headers(message: Message) -> Headers:
    """The headers a dead letter goes with when it is sent again: its own, without
    what kdelay added when it dead-lettered it (:data:`ADDED`)."""
    headers = message.headers() or []
    pairs = headers.items() if isinstance(headers, dict) else headers
    return [(name, value.encode("utf-8") if isinstance(value, str) else value)
            for name, value in pairs if name not in ADDED]


def _reader(settings: Settings) -> Consumer:
    return Consumer(reader_config(settings.client_config(), f"kdelay-dlq-{uuid.uuid4().hex}",
                                  **{"enable.partition.eof": False}))


def latest(settings: Settings, *, per_partition: int = 100, code: str | None = None,
           timeout_s: float = TIMEOUT_S) -> list[DeadLetter]:
    """The last ``per_partition`` records of each DLQ partition (those of ``code`` only,
    when given), newest first; none when the topic does not exist.

    Raises KafkaException for other Kafka errors; stops at each partition's end
    as it was when the read began, or after ``timeout_s``.
    """
    consumer = _reader(settings)
    try:
        topic = settings.dlq_topic
        found = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            return []
        ends: dict[int, int] = {}
        starts: list[TopicPartition] = []
        for partition in sorted(found.partitions):
            low, high = watermarks(consumer, TopicPartition(topic, partition), timeout_s)
            if high > low:
                ends[partition] = high
                starts.append(TopicPartition(topic, partition, max(low, high - per_partition)))
        letters = _read_to(consumer, starts, ends, timeout_s)
    finally:
        consumer.close()
    chosen = [letter for letter in letters if code is None or letter.code == code]
    return sorted(chosen, key=lambda d: (d.at_ms, d.partition, d.offset), reverse=True)


def _read_to(consumer: Consumer, starts: list[TopicPartition], ends: dict[int, int],
             timeout_s: float) -> list[DeadLetter]:
    """Read each assigned partition from its start to ``ends`` (exclusive)."""
    if not starts:
        return []
    consumer.assign(starts)
    positions = {tp.partition: tp.offset for tp in starts}
    return [decode(message) for message in _until(consumer, positions, ends, timeout_s)]


def _until(consumer: Consumer, positions: dict[int, int], ends: dict[int, int],
           timeout_s: float) -> list[Message]:
    """The records of the assigned partitions from ``positions`` up to ``ends``
    (exclusive), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    got: list[Message] = []
    while any(positions[p] < ends[p] for p in ends) and time.monotonic() < deadline:
        for message in take(consumer, 500, max(0.1, deadline - time.monotonic()), 0.05):
            if message.error() is not None:
                continue
            partition, offset = message.partition() or 0, message.offset() or 0
            positions[partition] = offset + 1
            if offset < ends.get(partition, 0):
                got.append(message)
    return got


def at(settings: Settings, partition: int, offset: int, *,
       timeout_s: float = TIMEOUT_S) -> Message | None:
    """The DLQ record at ``partition``/``offset``, None when there is none (out of range,
    deleted by retention, no such partition)."""
    consumer = _reader(settings)
    try:
        topic = settings.dlq_topic
        found = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if found is None or found.error is not None or partition not in found.partitions:
            return None
        low, high = watermarks(consumer, TopicPartition(topic, partition), timeout_s)
        if not low <= offset < high:
            return None
        consumer.assign([TopicPartition(topic, partition, offset)])
        found = _until(consumer, {partition: offset}, {partition: offset + 1}, timeout_s)
    finally:
        consumer.close()
    return next((message for message in found if message.offset() == offset), None)
