"""The one writer of the changelog, and the positions its acknowledged records confirm.

Intake writes puts (and a cancel's tombstones) and the consumed-offset marker;
delivery writes a seal for every batch it is done with: the end records of its
schedule ids, tombstones for the entries a watermark cannot cover, and the
partition's watermark (see :mod:`kdelay.engine.delivery._sealing`). All of it goes
through :class:`ChangelogWriter`, which produces with back-off on a full queue,
collects the records that failed for good, counts and logs them, and records
the changelog position each confirming record's acknowledgement proves.

Every changelog record this instance writes reflects a change already made
(or, for intake, made right after the flush that confirms it) to the local
index, so the position after the latest confirmed record is a safe place for
the next restore to start from. Puts do not confirm: the marker that follows
a plan's puts on the same partition does (the marker's offset is the highest
of the plan's).

The writer's producer is *gapless*: idempotent with
``enable.gapless.guarantee`` (at-least-once, a producer of its own) or
transactional (exactly-once). On one partition a record is then acknowledged
only if every record written before it was, and a record that fails for good
either stops the producer (a fatal error: the service ends) or fails the
transaction. So only the last of a plan's puts asks for a delivery report
(:meth:`ChangelogWriter.puts`): its acknowledgement proves the others, and a
put costs no Python call when it is acknowledged.

Intake's records are written on behalf of one step's :class:`Receipts`, which
counts the acknowledgements they still wait for: a step's plans reach the
indexes once its count is zero, while later steps go on (see
:mod:`kdelay.engine.commit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, Message

from kdelay.engine.metrics import Metrics
from kdelay.plumbing.callbacks import latch
from kdelay.plumbing.clients import ROOM_POLL_S, Producing
from kdelay.protocol import codec
from kdelay.protocol.codec import IdRecord, Watermark

log = logging.getLogger("kdelay.engine.commit")  # the wing, not its private module


@dataclass(frozen=True, slots=True)
class Failure:
    """A record that could not be written, and why."""

    topic: str
    key: bytes | None
    error: KafkaError


def confirmed_offset(message: Message) -> int:
    """Return the changelog position a successfully produced changelog record confirms."""
    return int(message.offset() or 0) + 1


def _ignore(_: Message) -> None:
    """Observe nothing."""


class Receipts:
    """The records of one intake step, and how many of them still await their report.

    Changelog records count here and fail in the writer (which collects and
    counts them; a marker's acknowledgement confirms its position there);
    dead letters count here and fail here, in :attr:`dead_letter_failures`;
    forwards (to the requests topic) count here and fail here, in
    :attr:`forward_failures`: unlike a dead letter, a lost forward loses its
    schedule, so its failure must keep the step from becoming durable.
    One callback per kind serves every record of the step: a bound method
    that guards itself (served once per record, see :func:`latch`).
    """

    def __init__(self, changelog_failed: Callable[[KafkaError, Message], None],
                 marker_written: Callable[[Message], None]) -> None:
        self.waiting = 0
        self.dead_letter_failures: list[Failure] = []
        self.forward_failures: list[Failure] = []
        self._changelog_failed = changelog_failed
        self._marker_written = marker_written

    @property
    def done(self) -> bool:
        """Whether every record of the step has been reported on."""
        return self.waiting == 0

    def forward(self) -> Callable[[KafkaError | None, Message], None]:
        """Count a forward record about to be produced; return its delivery callback."""
        self.waiting += 1
        return self.on_forward

    def dead_letter(self) -> Callable[[KafkaError | None, Message], None]:
        """Count a dead letter about to be produced; return its delivery callback."""
        self.waiting += 1
        return self.on_dead_letter

    def refused(self, exc: KafkaException, topic: str, key: bytes | None) -> None:
        """A dead letter, forward or answer that ``produce`` refused: with ``_STATE`` (a
        record of the step's transaction failed, so it must be aborted) a failure that
        keeps the step from committing, as a failed forward does (then the transaction
        is aborted and the step's requests are read again); any other error is raised
        again. Its report never comes, so the step stays undurable."""
        error: KafkaError = exc.args[0]
        if error.code() != KafkaError._STATE:
            raise exc
        self.forward_failures.append(Failure(topic, key, error))

    def on_changelog(self, error: KafkaError | None, message: Message) -> None:
        """The delivery callback of the step's puts and cancel tombstones."""
        try:
            self.waiting -= 1
            if error is not None:
                self._changelog_failed(error, message)
        except BaseException as exc:
            latch(exc)
            raise

    def on_marker(self, error: KafkaError | None, message: Message) -> None:
        """The delivery callback of the step's consumed-offset markers."""
        try:
            self.waiting -= 1
            if error is None:
                self._marker_written(message)
            else:
                self._changelog_failed(error, message)
        except BaseException as exc:
            latch(exc)
            raise

    def on_forward(self, error: KafkaError | None, message: Message) -> None:
        """The delivery callback of the step's forward records."""
        try:
            self.waiting -= 1
            if error is not None:
                self.forward_failures.append(Failure(str(message.topic()), message.key(), error))
        except BaseException as exc:
            latch(exc)
            raise

    def on_dead_letter(self, error: KafkaError | None, message: Message) -> None:
        """The delivery callback of the step's dead letters."""
        try:
            self.waiting -= 1
            if error is not None:
                self.dead_letter_failures.append(
                    Failure(str(message.topic()), message.key(), error))
        except BaseException as exc:
            latch(exc)
            raise


GAPLESS: dict[str, str | int | bool] = {
    "enable.idempotence": True, "enable.gapless.guarantee": True, "linger.ms": 2,
    "message.timeout.ms": 0}
"""The settings of the at-least-once changelog producer: its records never time out, and
one that fails for good is a fatal error rather than a gap before later records."""


class ChangelogWriter:
    """Writes the changelog through one producer; owns the positions it confirms.

    ``observe`` sees every acknowledged consumed-offset marker (the service
    measures clock skew with them, when the topic stamps LogAppendTime).
    """

    def __init__(self, producer: Producing, topic: str, metrics: Metrics,
                 observe: Callable[[Message], None] = _ignore, *, gapless: bool = False) -> None:
        """``gapless``: ``producer`` has the :data:`GAPLESS` settings (at-least-once);
        else it is transactional."""
        self._producer = producer
        self._gapless = gapless
        self._fatal_logged = False
        self._topic = topic
        self._metrics = metrics
        self._observe = observe
        self._next: dict[int, int] = {}
        self._failures: list[Failure] = []

    @property
    def topic(self) -> str:
        """The changelog topic."""
        return self._topic

    def acks(self) -> Receipts:
        """Return the tally of a new intake step's records."""
        return Receipts(self._failed, self._marker_written)

    @property
    def producer(self) -> Producing:
        """The producer the changelog is written with (served by the checkpoint's polls)."""
        return self._producer

    def puts(self, partition: int, keys: list[bytes], values: list[bytes | None],
             acks: Receipts) -> None:
        """Write a plan's intake records, ``keys[i]`` with ``values[i]`` (puts; a cancel's
        tombstone has the value None).

        Only the last asks for a report: on the gapless producer its
        acknowledgement proves the others (see the module's text).
        """
        last = len(keys) - 1
        if last < 0:
            return
        write = self._write
        for at in range(last):
            if not write(partition, keys[at], values[at], None):
                acks.waiting += 1  # never reported: the step stays undurable
                return
        acks.waiting += 1
        write(partition, keys[last], values[last], acks.on_changelog)

    def seal(self, partition: int, mark: Watermark | None, tombstones: Iterable[bytes],
             ended: Iterable[IdRecord]) -> None:
        """Write what delivery is done with in ``partition``; each record confirms its position.

        First how each schedule id ended (kept for the id window), then a
        tombstone for each entry the watermark cannot cover, then the watermark
        itself, which covers the rest. It waits for queue room rather than
        giving up: it follows accepted target produces, which cannot be taken
        back, and a transaction must never commit a delivery without its seal.
        """
        write, report = self._write, self._confirming_reported
        for key, value in ended:
            write(partition, key, value, report)
        for key in tombstones:
            write(partition, key, None, report)
        if mark is not None:
            write(partition, codec.WATERMARK_MARKER, codec.encode_watermark(mark), report)

    def mark_consumed(self, partition: int, offset: int, acks: Receipts) -> None:
        """Write how far intake has read ``partition`` (after the plan's own records)."""
        acks.waiting += 1
        self._write(partition, codec.CONSUMED_MARKER, codec.encode_offset(offset),
                    acks.on_marker)

    def _write(self, partition: int, key: bytes | None, value: bytes | None,
               report: Callable[[KafkaError | None, Message], None] | None) -> bool:
        """Produce one changelog record (``report`` None: no report asked), waiting for
        queue room rather than dropping it; False when the producer refused it for
        good (see :meth:`_refused`).

        Once per request taken in: the producer's call alone; the reports are
        served through :meth:`serve` only while the queue refuses the record.
        """
        while True:
            try:
                self._producer.produce(self._topic, value, key, partition, report)  # by position
                return True
            except BufferError:
                self.serve(ROOM_POLL_S)
            except KafkaException as exc:
                self._refused(exc, key)
                return False

    def serve(self, timeout_s: float = 0) -> None:
        """Serve the producer's reports for up to ``timeout_s`` seconds.

        A gapless producer that lost a record for good raises its fatal error
        from ``poll`` (not through ``error_cb``): that is a failed write, kept
        for :meth:`take_failures` like any other.
        """
        try:
            self._producer.poll(timeout_s)
        except KafkaException as exc:
            self._refused(exc, None)

    def flush(self, timeout: float = -1) -> int:
        """Flush the producer for up to ``timeout`` seconds; return what remains queued.
        A fatal error is kept as a failed write, as in :meth:`serve`."""
        try:
            return self._producer.flush(timeout)
        except KafkaException as exc:
            self._refused(exc, None)
            return len(self._producer)

    def _refused(self, exc: KafkaException, key: bytes | None) -> None:
        """Keep a refused write as a failed one, or raise ``exc`` again.

        On the gapless producer, a fatal error (raised by ``poll``, or ``_FATAL``
        by ``produce`` once it is fatal) is a failed write, counted and logged
        once. On the transactional producer, ``produce`` refuses with ``_STATE``
        once a record of the open transaction failed (the broker refused it:
        the transaction must be aborted); that is a failed write too, so that
        the commit aborts it and delivery takes all of it back (nothing lost,
        nothing to count). Any other error is raised again.
        """
        error: KafkaError = exc.args[0]
        if self._gapless and (error.fatal() or error.code() == KafkaError._FATAL):
            if not self._fatal_logged:
                log.error("changelog producer failed for good: %s", error.str())
                self._fatal_logged = True
            self._metrics.state.changelog_errors.inc()
        elif self._gapless or error.code() != KafkaError._STATE:
            raise exc
        self._failures.append(Failure(self._topic, key, error))

    def position(self, partition: int) -> int | None:
        """Return the confirmed position of ``partition``, or None if nothing was confirmed."""
        return self._next.get(partition)

    def take_failures(self) -> list[Failure]:
        """Return and forget the records that failed since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def has_failures(self) -> bool:
        """Return whether a record failed since the failures were last taken."""
        return bool(self._failures)

    def _confirm(self, message: Message) -> None:
        partition = int(message.partition() or 0)
        self._next[partition] = max(self._next.get(partition, 0), confirmed_offset(message))

    def _failed(self, error: KafkaError, message: Message) -> None:
        self._failures.append(Failure(self._topic, message.key(), error))
        self._metrics.state.changelog_errors.inc()
        log.error("changelog record for %r failed: %s", message.key(), error.str())

    def _confirming_reported(self, error: KafkaError | None, message: Message) -> None:
        # Served once per delivered entry: guarded here rather than by a wrapper (see latch).
        try:
            if error is None:
                self._confirm(message)
            else:
                self._failed(error, message)
        except BaseException as exc:
            latch(exc)
            raise

    def _marker_written(self, message: Message) -> None:
        self._confirm(message)
        self._observe(message)
