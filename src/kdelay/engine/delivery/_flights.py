"""Flights: records delivery produced together, settled as a whole.

A :class:`Flight` is one slice of a run (or a set of the book's jobs) in the
air: every record of it reports to the flight's one callback, which counts it
and keeps only the failures, as librdkafka reports them: topic, key and value
(a delivery report carries no headers). Delivery finds out which entries
failed from those only once the flight has landed (:func:`failed_entries`).
What a flight's landing means, which producer it goes out on (its
:class:`Channel`), and where the seals of what it delivered are written, is the
:class:`Durability`'s to say (see :mod:`kdelay.engine.commit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from confluent_kafka import KafkaError, Message

from kdelay.engine.delivery._book import Job, Sink
from kdelay.engine.delivery._runs import Run
from kdelay.plumbing.callbacks import latch
from kdelay.plumbing.clients import Producing
from kdelay.protocol.codec import IdRecord, Watermark

STALL_S = 5.0
"""A flight not landed after this long (a target partition without a leader, say)
is stalled: its entries are taken off their run, and a bulk lane stops being used."""
FEW = 1_000
"""A dispatch of at most this many due entries need not wait for the bulk lane: it may
go out on a producer that reports each record while a bulk generation is in the air
(what a steady rate dispatches per step; a burst's dispatches are larger)."""


class Channel(NamedTuple):
    """The producer a flight goes out on, and whether it is the bulk lane: a producer
    that reports failures only, so that a flight on it has landed when it holds no
    record any more (one generation of flights is in the air at a time)."""

    producer: Producing
    bulk: bool


class Reported(NamedTuple):
    """A record a delivery report said failed: what the report tells of it."""

    sink: Sink
    topic: str | None
    key: bytes | None
    value: bytes | None
    reason: str


@dataclass(slots=True, eq=False)
class Flight:
    """Records produced together: a slice of a run, or a set of the book's jobs.

    Every record reports to the flight's shared callback (:meth:`report`,
    :meth:`dead_letter_report`), which counts it and keeps the failed ones in
    :attr:`errors`; the flight has landed when every record it produced has
    reported (:attr:`complete`). Under transactions a flight lands with its
    transaction instead. ``refusals`` are produces refused before anything
    was written, by entry key. ``since`` is when it was produced (monotonic seconds).
    """

    run: Run | None
    start: int = 0
    end: int = 0
    channel: Channel | None = None
    jobs: list[tuple[Job, Sink]] = field(default_factory=list)
    produced: int = 0
    reported: int = 0
    dead_letters: int = 0
    errors: list[Reported] = field(default_factory=list)
    refusals: dict[bytes, tuple[Sink, str]] = field(default_factory=dict)
    lanes: dict[str, int] = field(default_factory=dict)
    since: float = 0.0

    @property
    def producer(self) -> Producing | None:
        """The producer the flight went out on (its channel's), None without a channel."""
        return None if self.channel is None else self.channel.producer

    @property
    def bulk(self) -> bool:
        """Whether the flight went out on a bulk lane (see :class:`Channel`)."""
        return self.channel is not None and self.channel.bulk

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
                self.errors.append(Reported(Sink.TARGET, message.topic(), message.key(),
                                            message.value(), error.str()))
        except BaseException as exc:
            latch(exc)
            raise

    def dead_letter_report(self, error: KafkaError | None, message: Message) -> None:
        """The delivery callback of every dead letter of the flight."""
        try:
            self.dead_letters -= 1
            if error is not None:
                self.errors.append(Reported(Sink.DLQ, message.topic(), message.key(),
                                            message.value(), error.str()))
        except BaseException as exc:
            latch(exc)
            raise

    def refused(self, key: bytes, sink: Sink, reason: str) -> None:
        """A produce was refused before anything was written: nothing to abort, but it
        backs off like a record that failed."""
        self.refusals[key] = (sink, reason)


Produced = tuple[Sink, str | None, bytes | None, bytes | None]
"""What identifies a produced record in its delivery report: sink, topic, key and value."""


def failed_entries(errors: list[Reported],
                   produced: Iterable[tuple[bytes, Produced]]) -> dict[bytes, tuple[Sink, str]]:
    """Which entries failed, from the ``errors`` a flight kept and what it ``produced``
    (each entry's key and its record's sink, topic, key and value).

    Records of several entries can look alike (the same key and value to the same
    topic): when one of them fails, every one of them is taken as failed, and those
    that were in fact written go out again. At-least-once allows that; nothing
    is lost.
    """
    wanted: dict[Produced, str] = {
        (error.sink, error.topic, error.key, error.value): error.reason for error in errors}
    return {key: (record[0], reason) for key, record in produced
            if (reason := wanted.get(record)) is not None}


class Durability(Protocol):
    """How delivery's work becomes durable: which producer a flight goes out on, when it
    has landed, and where a seal's records are written (see :mod:`kdelay.engine.commit`)."""

    def channel(self, airborne: Sequence[Flight], now_s: float, few: bool) -> Channel | None:
        """The channel of the next flights, given those in the ``airborne`` (monotonic
        ``now_s``) and whether they are ``few`` (see :data:`FEW`); None: none may go
        before those land."""
        ...

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
