"""Read original request records back by offset, in sorted ranges.

One ``seek`` per record is too slow: the offsets wanted from a partition are
sorted and cut into runs (a new run starts where the gap to the previous
offset exceeds ``max_gap``), and each run is read as one sequential fetch.
Every wanted offset ends in exactly one of three states:

- found: the record at that offset;
- ``EXPIRED``: below the log start offset (retention or ``delete_records``
  removed it);
- ``ABSENT``: at or above the end of the log, or skipped over (a control
  record, a recreated topic): the record there is not the one indexed.

Offsets the reader could not resolve before its deadline (broker down, slow
fetch, a watermark query that failed with a retriable error) are left out of
the result; the caller asks again later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypeAlias

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kdelay.plumbing.callbacks import unheard
from kdelay.plumbing.clients import AWAY, TRANSIENT, reader_config, take, watermarks

log = logging.getLogger(__name__)

MAX_TAKE = 10_000
PREFETCH_RECORDS = 2_000
RANGE_ERRORS = frozenset({KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET})
# The longest a read waits for a partition's watermarks: a read that cannot have
# them leaves its offsets for a later one, so the loop is never held long.
WATERMARKS_S = 2.0


class Missing(Enum):
    """Why a wanted offset has no record."""

    EXPIRED = "expired"
    ABSENT = "absent"


Found: TypeAlias = Message | Missing


class Reading(Protocol):
    """What delivery asks of a reader of originals."""

    def read(self, wanted: Mapping[int, Iterable[int]]) -> dict[tuple[int, int], Found]:
        """Return the record (or why there is none) at each wanted ``(partition, offset)``."""
        ...

    def close(self) -> None:
        """Release the reader's consumer."""
        ...


@dataclass(slots=True)
class _Run:
    """A run of wanted offsets of one partition, read as one sequential fetch."""

    partition: int
    offsets: list[int]
    pending: set[int] = field(default_factory=set)
    cursor: int = 0

    @property
    def start(self) -> int:
        """The lowest offset still pending (the cursor skips resolved ones)."""
        while self.offsets[self.cursor] not in self.pending:
            self.cursor += 1
        return self.offsets[self.cursor]

    @property
    def end(self) -> int:
        return self.offsets[-1]


def runs(partition: int, offsets: Iterable[int], max_gap: int) -> list[_Run]:
    """Cut the sorted, distinct ``offsets`` into runs whose inner gaps are at most ``max_gap``."""
    result: list[_Run] = []
    for offset in sorted(set(offsets)):
        if result and offset - result[-1].end <= max_gap:
            result[-1].offsets.append(offset)
        else:
            result.append(_Run(partition, [offset]))
    for run in result:
        run.pending = set(run.offsets)
    return result


class OriginalReader:
    """Reads records of one topic by offset with a dedicated, group-less consumer.

    ``config`` is the base client configuration (bootstrap servers, security).
    The consumer is created on first use; :meth:`close` ends it.
    """

    def __init__(self, config: Mapping[str, str | int | bool], topic: str, *,
                 max_gap: int = 1_000, timeout_s: float = 10.0,
                 away: Callable[[str], None] = unheard) -> None:
        """``away`` is told when the cluster does not answer a watermark query, which
        then waits at most :data:`WATERMARKS_S`: the service confirms and waits it out."""
        tuning: dict[str, str | int | bool] = {
            "auto.offset.reset": "error",
            "fetch.wait.max.ms": 10,
            # librdkafka keeps up to 100 000 records per partition queued by
            # default; every read re-positions the reader and drops them, so a
            # large prefetch is fetched, and thrown away, once per read.
            "queued.min.messages": PREFETCH_RECORDS,
            # With a small queue the next fetch must not wait the default 1 s
            # for it to drain below the threshold.
            "fetch.queue.backoff.ms": 1,
        }
        self._config = reader_config(config, "kdelay-reader", **tuning)
        self._topic = topic
        self._max_gap = max_gap
        self._timeout_s = timeout_s
        self._away = away
        self._consumer: Consumer | None = None

    def close(self) -> None:
        """Close the consumer, if one was created."""
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def read(self, wanted: Mapping[int, Iterable[int]]) -> dict[tuple[int, int], Found]:
        """Return ``(partition, offset) -> record | Missing`` for the offsets wanted.

        Offsets not resolved before the reader's deadline are absent from the result.
        """
        consumer = self._consumer or self._open()
        result: dict[tuple[int, int], Found] = {}
        queues = {p: runs(p, offsets, self._max_gap) for p, offsets in wanted.items()}
        for partition, queue in queues.items():
            if not self._classify_by_watermarks(consumer, partition, queue, result):
                for rest in queues.values():  # Kafka is away: nothing more this time
                    rest.clear()
                break
        deadline = time.monotonic() + self._timeout_s
        while any(queues.values()) and time.monotonic() < deadline:
            current = {p: q[0] for p, q in queues.items() if q}
            self._read_runs(consumer, current, result, deadline)
            for partition, run in current.items():
                if not run.pending:
                    queues[partition].pop(0)
        consumer.unassign()
        return result

    def _open(self) -> Consumer:
        self._consumer = Consumer(self._config)
        return self._consumer

    def _classify_by_watermarks(self, consumer: Consumer, partition: int,
                                queue: list[_Run], result: dict[tuple[int, int], Found]) -> bool:
        """Resolve offsets below the log start or at/after the log end without fetching.

        When the watermarks cannot be had, nothing of the partition is read:
        its offsets stay unresolved, for a later read. Returns False when the
        cluster does not answer (``away`` is told).
        """
        try:
            low, high = watermarks(consumer, TopicPartition(self._topic, partition),
                                   min(self._timeout_s, WATERMARKS_S), retried=TRANSIENT - AWAY)
        except KafkaException as exc:
            if not _passing(exc):
                raise
            log.debug("watermarks of %s[%d]: %s", self._topic, partition, exc)
            queue.clear()
            if exc.args[0].code() in AWAY:
                self._away(f"originals: watermarks of {self._topic}[{partition}]: "
                           f"{exc.args[0].str()}")
                return False
            return True
        for run in queue:
            for offset in list(run.pending):
                if offset < low:
                    result[(partition, offset)] = Missing.EXPIRED
                    run.pending.discard(offset)
                elif offset >= high:
                    result[(partition, offset)] = Missing.ABSENT
                    run.pending.discard(offset)
        queue[:] = [run for run in queue if run.pending]
        return True

    def _read_runs(self, consumer: Consumer, current: dict[int, _Run],
                   result: dict[tuple[int, int], Found], deadline: float) -> None:
        """Fetch one run per partition at once until each is resolved or the deadline passes."""
        open_runs = {p for p, run in current.items() if run.pending}
        while open_runs and time.monotonic() < deadline:
            # After an out-of-range error librdkafka stops fetching the partition
            # and refuses a seek; a fresh assign of the open runs resumes it.
            consumer.assign([TopicPartition(self._topic, p, current[p].start) for p in open_runs])
            self._read_until_error(consumer, current, open_runs, result, deadline)

    def _read_until_error(self, consumer: Consumer, current: dict[int, _Run],
                          open_runs: set[int], result: dict[tuple[int, int], Found],
                          deadline: float) -> None:
        """Consume until every run is resolved, an out-of-range error, or the deadline."""
        while open_runs and time.monotonic() < deadline:
            # No more than the runs still span: records fetched past their ends
            # stay in librdkafka's queue instead of becoming Python objects.
            span = sum(current[p].end - current[p].start + 1 for p in open_runs)
            for message in take(consumer, min(span, MAX_TAKE), 0.2):
                partition = int(message.partition() or 0)
                run = current.get(partition)
                if run is None or partition not in open_runs:
                    continue
                error = message.error()
                if error is not None and error.code() in RANGE_ERRORS:
                    self._expire_below_start(consumer, run, result)
                    if not run.pending:
                        open_runs.discard(partition)
                    return
                if self._take(run, message, result):
                    open_runs.discard(partition)

    def _take(self, run: _Run, message: Message, result: dict[tuple[int, int], Found]) -> bool:
        """Apply one fetched message (or fetch event) to ``run``; return whether it is done."""
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                self._settle_skipped(run, result)
                return True
            log.warning("reading %s[%d]: %s", self._topic, run.partition, error.str())
            return False
        offset = int(message.offset() or 0)
        if offset in run.pending:
            result[(run.partition, offset)] = message
            run.pending.discard(offset)
        if offset >= run.end or not run.pending:
            self._settle_skipped(run, result)
            return True
        while run.start < offset:
            result[(run.partition, run.start)] = Missing.ABSENT
            run.pending.discard(run.start)
        return False

    def _settle_skipped(self, run: _Run, result: dict[tuple[int, int], Found]) -> None:
        """Mark every wanted offset the fetch passed over as ``ABSENT``."""
        for offset in run.pending:
            result[(run.partition, offset)] = Missing.ABSENT
        run.pending.clear()

    def _expire_below_start(self, consumer: Consumer, run: _Run,
                            result: dict[tuple[int, int], Found]) -> None:
        """Mark the run's offsets below the (moved) log start offset ``EXPIRED``."""
        try:
            low, _ = watermarks(consumer, TopicPartition(self._topic, run.partition),
                                min(self._timeout_s, WATERMARKS_S))
        except KafkaException as exc:
            if not _passing(exc):
                raise
            return
        for offset in [o for o in run.pending if o < low]:
            result[(run.partition, offset)] = Missing.EXPIRED
            run.pending.discard(offset)


def _passing(exc: KafkaException) -> bool:
    """Whether a watermark query's error can pass with time: retriable, or a partition
    unknown while metadata is missing (every broker down)."""
    error = exc.args[0]
    return bool(error.retriable()) or error.code() in TRANSIENT | {KafkaError._UNKNOWN_PARTITION}
