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

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeAlias

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kdelay.plumbing.callbacks import unheard
from kdelay.plumbing.clients import AWAY, TRANSIENT, reader_config, take, watermarks

log = logging.getLogger(__name__)

MAX_TAKE = 10_000
PREFETCH_RECORDS = 10_000
KEPT_RECORDS = PREFETCH_RECORDS
"""Records a partition whose run is done may keep aside for the next read while the
read waits for other partitions' runs; at that many the partition is let go (its
fetching stops; the next read wanting it assigns it again). Unbounded, a partition
fetched fast while another's run lags filled the console's heap with records at
hundreds of MB a second (1.7 GB in 6 s at 10 M pending) and took the fetches the
lagging run waited for. As many as librdkafka prefetches a partition: at 1 000 (a
read's batch), one take of a burst's read filled it past its run, and the 1 M burst
let a partition go and fetched it again on most reads (584 times, 1.88 M records
fetched for 1 M read)."""
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

    def read(self, wanted: Mapping[int, Iterable[int]]) -> dict[int, dict[int, Found]]:
        """Return the record (or why there is none) at each wanted offset, by partition
        then offset; every partition wanted has its entry, maybe empty. Keyed so, a
        burst's read makes no ``(partition, offset)`` tuple a record (:func:`flat` has
        them)."""
        ...

    def close(self) -> None:
        """Release the reader's consumer."""
        ...


def flat(found: Mapping[int, Mapping[int, Found]]) -> dict[tuple[int, int], Found]:
    """What :meth:`Reading.read` returned, keyed by ``(partition, offset)``."""
    return {(partition, offset): f for partition, by_offset in found.items()
            for offset, f in by_offset.items()}


@dataclass(slots=True)
class _Run:
    """A run of wanted offsets of one partition, read as one sequential fetch.

    ``offsets`` are sorted; those before ``cursor`` are resolved. A record
    fetched at the cursor's offset is taken; one past it means the offsets
    between were skipped over (absent).
    """

    partition: int
    offsets: list[int]
    cursor: int = 0

    @property
    def pending(self) -> list[int]:
        """The offsets not resolved yet."""
        return self.offsets[self.cursor:]

    @property
    def start(self) -> int:
        """The lowest offset still pending."""
        return self.offsets[self.cursor]

    @property
    def end(self) -> int:
        return self.offsets[-1]

    @property
    def done(self) -> bool:
        """Whether every offset is resolved."""
        return self.cursor >= len(self.offsets)


def runs(partition: int, offsets: Iterable[int], max_gap: int) -> list[_Run]:
    """Cut the sorted, distinct ``offsets`` into runs whose inner gaps are at most ``max_gap``."""
    result: list[_Run] = []
    for offset in sorted(set(offsets)):
        if result and offset - result[-1].end <= max_gap:
            result[-1].offsets.append(offset)
        else:
            result.append(_Run(partition, [offset]))
    return result


class OriginalReader:
    """Reads records of one topic by offset with a dedicated, group-less consumer.

    ``config`` is the base client configuration (bootstrap servers, security).
    The consumer is created on first use; :meth:`close` ends it.

    The reader keeps the partitions of consecutive reads assigned and knows
    where each one stands: a read that starts at (or a little past) where the
    last one ended reads on, from the records the last read fetched past its
    runs (kept aside, at most :data:`KEPT_RECORDS` a partition) and from
    librdkafka's prefetched queue, with no seek; a burst of due entries is read
    as one sequential stream. A read elsewhere seeks, and the partitions a read
    does not want are unassigned. Each partition's watermarks are asked once and
    kept: an offset below the known log start is expired for good (the start only
    moves up), and the end is asked again only for an offset at or past the known
    one.
    """

    def __init__(self, config: Mapping[str, str | int | bool], topic: str, *,
                 max_gap: int = 1_000, timeout_s: float = 10.0,
                 away: Callable[[str], None] = unheard,
                 client: Callable[[dict[str, str | int | bool]], Consumer] = Consumer) -> None:
        """``away`` is told when the cluster does not answer a watermark query, which
        then waits at most :data:`WATERMARKS_S`: the service confirms and waits it out.
        ``client`` makes the consumer from its configuration (tests watch it)."""
        tuning: dict[str, str | int | bool] = {
            "auto.offset.reset": "error",
            "fetch.wait.max.ms": 10,
            # Reads go on where the last one ended: what librdkafka prefetches is
            # used, up to this many records a partition (a seek drops them).
            "queued.min.messages": PREFETCH_RECORDS,
            # The next fetch must not wait the default 1 s for the queue to
            # drain below the threshold.
            "fetch.queue.backoff.ms": 1,
        }
        self._config = reader_config(config, "kdelay-reader", **tuning)
        self._topic = topic
        self._max_gap = max_gap
        self._timeout_s = timeout_s
        self._away = away
        self._client = client
        self._consumer: Consumer | None = None
        # Per assigned partition: the offset after the last record it returned, and
        # the records it returned that no read used yet (in offset order).
        self._positions: dict[int, int] = {}
        self._kept: dict[int, list[Message]] = {}
        # Per partition: the (log start, log end) offsets last asked.
        self._marks: dict[int, tuple[int, int]] = {}

    def close(self) -> None:
        """Close the consumer, if one was created."""
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
            self._positions.clear()
            self._kept.clear()

    def read(self, wanted: Mapping[int, Iterable[int]]) -> dict[int, dict[int, Found]]:
        """Return ``partition -> offset -> record | Missing`` for the offsets wanted (every
        partition wanted has its entry; see :class:`Reading`).

        Offsets not resolved before the reader's deadline are absent from the result.
        """
        consumer = self._consumer or self._open()
        result: dict[int, dict[int, Found]] = {p: {} for p in wanted}
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
                if run.done:
                    queues[partition].pop(0)
        return result

    def _open(self) -> Consumer:
        self._consumer = self._client(self._config)
        return self._consumer

    def _classify_by_watermarks(self, consumer: Consumer, partition: int,
                                queue: list[_Run], result: dict[int, dict[int, Found]]) -> bool:
        """Resolve offsets below the log start or at/after the log end without fetching.

        The partition's watermarks are asked when none are known, or when an
        offset wanted is at or past the known end. When they cannot be had,
        nothing of the partition is read: its offsets stay unresolved, for a
        later read. Returns False when the cluster does not answer (``away``
        is told).
        """
        known = self._marks.get(partition)
        if known is None or max(run.end for run in queue) >= known[1]:
            try:
                known = self._marks[partition] = watermarks(
                    consumer, TopicPartition(self._topic, partition),
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
        low, high = known
        found = result[partition]
        for run in queue:
            offsets = run.offsets
            first = bisect.bisect_left(offsets, low)
            last = bisect.bisect_left(offsets, high)
            for offset in offsets[:first]:
                found[offset] = Missing.EXPIRED
            for offset in offsets[last:]:
                found[offset] = Missing.ABSENT
            run.offsets = offsets[first:last]
        queue[:] = [run for run in queue if run.offsets]
        return True

    def _read_runs(self, consumer: Consumer, current: dict[int, _Run],
                   result: dict[int, dict[int, Found]], deadline: float) -> None:
        """Fetch one run per partition at once until each is resolved or the deadline passes."""
        open_runs = {p for p, run in current.items() if not run.done}
        self._position_at(consumer, {p: current[p].start for p in open_runs})
        for partition in list(open_runs):
            if self._from_kept(current[partition], result[partition]):
                open_runs.discard(partition)
        kept = self._kept
        while open_runs and time.monotonic() < deadline:
            # No more than the runs still span: records fetched past their ends
            # stay in librdkafka's queue for the next read to go on from.
            span = sum(current[p].end - current[p].start + 1 for p in open_runs)
            positions = self._positions
            for message in take(consumer, min(span, MAX_TAKE), 0.2):
                partition = int(message.partition() or 0)
                error = message.error()
                if error is not None:
                    if partition in open_runs:
                        if self._failed(consumer, current[partition], message,
                                        result[partition]):
                            open_runs.discard(partition)
                    elif error.code() in RANGE_ERRORS:  # not read now: assigned anew later
                        self._let_go(consumer, partition)
                    continue
                if partition not in positions and partition not in open_runs:
                    continue  # let go: records it had queued are wanted by no read
                positions[partition] = int(message.offset() or 0) + 1
                if partition in open_runs:
                    if _take(current[partition], message, result[partition]):
                        open_runs.discard(partition)
                else:  # past its run: for the next read
                    held = kept.setdefault(partition, [])
                    held.append(message)
                    if len(held) >= KEPT_RECORDS:
                        self._let_go(consumer, partition)

    def _position_at(self, consumer: Consumer, starts: dict[int, int]) -> None:
        """Make each partition's records come from its start offset on.

        A partition whose kept records or position reach the start (or a little
        before it) reads on; one elsewhere seeks; one not assigned is assigned
        there. Partitions this read does not want are unassigned.
        """
        topic, positions, kept = self._topic, self._positions, self._kept
        fresh: list[TopicPartition] = []
        for partition, start in starts.items():
            position = positions.get(partition)
            first = kept[partition][0].offset() if kept.get(partition) else position
            if position is None:
                fresh.append(TopicPartition(topic, partition, start))
                positions[partition] = start
            elif first is None or not first <= start <= position + self._max_gap:
                consumer.seek(TopicPartition(topic, partition, start))
                positions[partition] = start
                kept.pop(partition, None)
        if fresh:
            consumer.incremental_assign(fresh)
        unwanted = [p for p in positions if p not in starts]
        if unwanted:
            consumer.incremental_unassign([TopicPartition(topic, p) for p in unwanted])
            for partition in unwanted:
                del positions[partition]
                kept.pop(partition, None)

    def _from_kept(self, run: _Run, result: dict[int, Found]) -> bool:
        """Take the run's records from those an earlier read fetched; return whether done."""
        kept = self._kept.pop(run.partition, None)
        if not kept:
            return False
        for at, message in enumerate(kept):
            if _take(run, message, result):
                rest = kept[at + 1:]
                if rest:
                    self._kept[run.partition] = rest
                return True
        return False

    def _failed(self, consumer: Consumer, run: _Run, message: Message,
                result: dict[int, Found]) -> bool:
        """Handle a fetch error (or end-of-partition event); return whether the run is done.

        The end of the partition, reached at some offset, proves the run's
        offsets below it absent (every record before it was handed out); the
        partition may have grown since (the reader stays assigned between
        reads), so offsets from there on are read on. Below the log start
        (retention moved it since the watermarks were asked) the expired
        offsets are resolved and the partition, which librdkafka stops
        fetching after such an error, is assigned again at the run's start.
        """
        error = message.error()
        assert error is not None  # noqa: S101 - the caller checks
        partition = int(message.partition() or 0)
        if error.code() == KafkaError._PARTITION_EOF:
            end = int(message.offset() or 0)
            while not run.done and run.start < end:
                result[run.start] = Missing.ABSENT
                run.cursor += 1
            return run.done
        if error.code() not in RANGE_ERRORS:
            log.warning("reading %s[%d]: %s", self._topic, partition, error.str())
            return False
        self._let_go(consumer, partition)
        self._expire_below_start(consumer, run, result)
        if run.done:
            return True
        self._position_at(consumer, {partition: run.start})
        return False

    def _let_go(self, consumer: Consumer, partition: int) -> None:
        """Unassign ``partition`` and forget all about it (librdkafka stopped fetching it)."""
        self._marks.pop(partition, None)
        self._positions.pop(partition, None)
        self._kept.pop(partition, None)
        consumer.incremental_unassign([TopicPartition(self._topic, partition)])

    def _expire_below_start(self, consumer: Consumer, run: _Run,
                            result: dict[int, Found]) -> None:
        """Mark the run's offsets below the (moved) log start offset ``EXPIRED``."""
        try:
            low, high = watermarks(consumer, TopicPartition(self._topic, run.partition),
                                   min(self._timeout_s, WATERMARKS_S))
        except KafkaException as exc:
            if not _passing(exc):
                raise
            return
        self._marks[run.partition] = low, high
        while not run.done and run.start < low:
            result[run.start] = Missing.EXPIRED
            run.cursor += 1


def _take(run: _Run, message: Message, result: dict[int, Found]) -> bool:
    """Apply one fetched record to ``run``; return whether the run is done.

    Offsets the fetch passed over (a control record, a record of an aborted
    transaction, compaction) are absent.
    """
    offset = int(message.offset() or 0)
    offsets, cursor = run.offsets, run.cursor
    while offsets[cursor] < offset:
        result[offsets[cursor]] = Missing.ABSENT
        cursor += 1
        if cursor == len(offsets):
            run.cursor = cursor
            return True
    if offsets[cursor] == offset:
        result[offset] = message
        cursor += 1
    run.cursor = cursor
    return cursor == len(offsets)


def _passing(exc: KafkaException) -> bool:
    """Whether a watermark query's error can pass with time: retriable, or a partition
    unknown while metadata is missing (every broker down)."""
    error = exc.args[0]
    return bool(error.retriable()) or error.code() in TRANSIENT | {KafkaError._UNKNOWN_PARTITION}
