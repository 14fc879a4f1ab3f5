"""Flights: records delivery produced together, settled as a whole.

A :class:`Flight` is one slice of a run (or a set of the book's jobs) in the
air: every record of it reports to the flight's one callback, which counts it
and remembers only the failures, by the due key the record's own headers name
(:func:`delivered_key`). What a flight's landing means, and where the seals of
what it delivered are written, is the :class:`Durability`'s to say (see
:mod:`kdelay.engine.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import KafkaError, Message

from kdelay.engine.book import Job, Sink
from kdelay.engine.runs import Run
from kdelay.plumbing.callbacks import latch
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import IdRecord, Watermark

_ORIGIN = envelope.ORIGIN
_DUE_MS = envelope.DUE_MS


@dataclass(slots=True, eq=False)
class Flight:
    """Records produced together: a slice of a run, or a set of the book's jobs.

    Every record reports to the flight's shared callback (:meth:`report`,
    :meth:`dead_letter_report`), which counts it and remembers the failed
    ones by key; the flight has landed when every record it produced has
    reported (:attr:`complete`). Under transactions a flight lands with its
    transaction instead. ``since`` is when it was produced (monotonic seconds).
    """

    run: Run | None
    start: int = 0
    end: int = 0
    jobs: list[tuple[Job, Sink]] = field(default_factory=list)
    produced: int = 0
    reported: int = 0
    dead_letters: int = 0
    failed: dict[bytes, tuple[Sink, str]] = field(default_factory=dict)
    refusals: dict[bytes, tuple[Sink, str]] = field(default_factory=dict)
    lanes: dict[str, int] = field(default_factory=dict)
    since: float = 0.0

    def failures(self) -> list[tuple[bytes, Sink, str]]:
        """Every record that failed or was refused, with where it went and why."""
        return [(key, sink, reason) for key, (sink, reason)
                in (*self.refusals.items(), *self.failed.items())]

    @property
    def complete(self) -> bool:
        """Whether every record produced has reported."""
        return self.reported >= self.produced and self.dead_letters <= 0

    def report(self, error: KafkaError | None, message: Message) -> None:
        """The delivery callback of every target record of the flight.

        Served once per record: guarded here rather than by a wrapper (see
        :func:`latch`), and as short as can be for a record that succeeds.
        """
        try:
            self.reported += 1
            if error is not None:
                self.failed[delivered_key(message.headers())] = (Sink.TARGET, error.str())
        except BaseException as exc:
            latch(exc)
            raise

    def dead_letter_report(self, error: KafkaError | None, message: Message) -> None:
        """The delivery callback of every dead letter of the flight."""
        try:
            self.dead_letters -= 1
            if error is not None:
                self.failed[delivered_key(message.headers())] = (Sink.DLQ, error.str())
        except BaseException as exc:
            latch(exc)
            raise

    def refused(self, key: bytes, sink: Sink, reason: str) -> None:
        """A produce was refused before anything was written: nothing to abort, but it
        backs off like a record that failed."""
        self.refusals[key] = (sink, reason)


def delivered_key(headers: envelope.AnyHeaders) -> bytes:
    """Return the due key of a record delivery produced, from its ``kdelay-origin`` and
    ``kdelay-due-ms`` headers; ValueError when they are missing or unreadable."""
    pairs = dict(headers.items() if isinstance(headers, Mapping) else headers or [])
    origin, due = pairs.get(_ORIGIN), pairs.get(_DUE_MS)
    if not isinstance(origin, bytes) or not isinstance(due, bytes):
        raise ValueError(f"a delivered record without its {_ORIGIN} and {_DUE_MS} headers")
    _, partition, offset = origin.decode().rsplit("/", 2)
    return codec.encode_due_key(int(due), int(partition), int(offset))


class Durability(Protocol):
    """How delivery's work becomes durable: when a flight has landed, and where a seal's
    records are written (see :mod:`kdelay.engine.checkpoint`)."""

    def landed(self, flight: Flight) -> bool:
        """Whether every record of ``flight`` is written (or reported failed), as far as
        delivery may act on it."""
        ...

    def seal(self, partition: int, mark: Watermark | None, tombstones: list[bytes],
             ended: list[IdRecord]) -> None:
        """Write a seal of ``partition``: the ids' end records, the tombstones, then the
        watermark (which confirms the position of all of them)."""
        ...

    def position(self, partition: int) -> int | None:
        """Return the changelog position the index may record for ``partition``."""
        ...

    def has_failures(self) -> bool:
        """Return whether a changelog write failed since the failures were last taken."""
        ...
