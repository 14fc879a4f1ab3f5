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

from dataclasses import dataclass

from confluent_kafka import Message

from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.protocol.envelope import ErrorCode, Headers
from kdelay.view import tails

ADDED = frozenset({envelope.ERROR, envelope.ERROR_DETAIL, envelope.ORIGIN})
"""What kdelay adds to a request when it dead-letters it."""
GONE = frozenset({ErrorCode.MISMATCH.value, ErrorCode.EXPIRED.value})
"""The codes of dead letters without the request: its original was gone."""


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


def latest(settings: Settings, *, per_partition: int = 100, code: str | None = None,
           timeout_s: float = tails.TIMEOUT_S) -> list[DeadLetter]:
    """The last ``per_partition`` records of each DLQ partition (those of ``code`` only,
    when given), newest first; none when the topic does not exist.

    Raises KafkaException for other Kafka errors; stops at each partition's end
    as it was when the read began, or after ``timeout_s`` (see :mod:`kdelay.view.tails`).
    """
    def chosen(message: Message) -> DeadLetter | None:
        letter = decode(message)
        return letter if code is None or letter.code == code else None

    read = tails.newest(settings.client_config(), [settings.dlq_topic], chosen,
                        per_partition=per_partition, timeout_s=timeout_s, purpose="dlq")
    return sorted(read.items, key=lambda d: (d.at_ms, d.partition, d.offset), reverse=True)


def at(settings: Settings, partition: int, offset: int, *,
       timeout_s: float = tails.TIMEOUT_S) -> Message | None:
    """The DLQ record at ``partition``/``offset``, None when there is none (out of range,
    deleted by retention, no such partition)."""
    return tails.one(settings.client_config(), settings.dlq_topic, partition, offset,
                     timeout_s=timeout_s, purpose="dlq")
