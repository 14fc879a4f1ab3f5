"""The sweeper: tombstones for the puts a watermark covers, written off the delivery path.

A watermark record tells a restore that the entries it covers are done, but
compaction keeps a put until a newer record of its own key arrives. Each
covered key waits in its index's sweep list (see
:class:`~kdelay.state.index.PartitionIndex`) until the sweeper writes its
tombstone: a batch of a few milliseconds' work a step when nothing is due
(the loop keeps stepping while there is sweeping to do), with a producer of its own
that reports failures only, so a tombstone that lands costs no Python call.
While deliveries are due (a burst), nothing is swept, unless a partition's
sweep list has grown past :data:`BACKLOG_LIMIT` (a load that never lets up):
then a small batch a step keeps it bounded. A key leaves the sweep
list once its batch has landed; a batch with a failure is swept again later.
A key put again since it was covered (a request read again) is pending, and
gets no tombstone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from confluent_kafka import KafkaError, Message

from kdelay.engine.metrics import Metrics
from kdelay.plumbing.callbacks import latch
from kdelay.plumbing.clients import Producing, produce
from kdelay.state.changes import Changes
from kdelay.state.index import PartitionIndex

log = logging.getLogger(__name__)

SWEEP_BATCH = 1_000
"""Keys swept at once (in all partitions, whole chunks) while nothing is due: a few
milliseconds of the loop's step, so that a sweep never makes a delivery late."""
SWEEP_TRICKLE = 200
"""Keys swept at once while deliveries go on, where a backlog is past its limit."""
BACKLOG_LIMIT = 1_000_000
"""Keys a partition's sweep list may hold before it is swept while deliveries go on."""
DRAIN_POLL_S = 0.01


class Sweeper:
    """Writes the tombstones of covered puts, a batch at a time, with ``producer``."""

    def __init__(self, producer: Producing, topic: str, metrics: Metrics) -> None:
        self._producer = producer
        self._topic = topic
        self._metrics = metrics
        # The sweep chunks whose tombstones are in the air (their ids), by partition.
        self._sweeping: dict[int, list[bytes]] = {}
        self._counted = 0
        self._failures = 0
        self._failure = ""

    def step(self, indexes: Mapping[int, PartitionIndex], busy: bool) -> None:
        """Finish the batch in the air if it landed, else start one (``busy``: deliveries are
        due, so only where the backlog is past its limit, and a small one)."""
        self._producer.poll(0)
        if self._sweeping:
            if len(self._producer):
                return
            self._landed(indexes)
            return
        left = SWEEP_TRICKLE if busy else SWEEP_BATCH
        for partition, index in indexes.items():
            if left <= 0:
                break
            if not index.sweep_backlog or (busy and index.sweep_backlog <= BACKLOG_LIMIT):
                continue
            chunks = index.unswept(left)
            if chunks:
                left -= self._sweep(partition, index, chunks)

    def waiting(self, indexes: Mapping[int, PartitionIndex]) -> bool:
        """Whether there is sweeping to do: a batch in the air, or keys to sweep (the loop
        then steps, at its cadence, rather than wait for requests)."""
        return bool(self._sweeping) or any(index.sweep_backlog for index in indexes.values())

    def drain(self, indexes: Mapping[int, PartitionIndex], timeout_s: float) -> bool:
        """Sweep until nothing is left to sweep or ``timeout_s`` passed (a clean stop);
        return whether everything was swept. What is left, the next owner sweeps."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.step(indexes, busy=False)
            if not self._sweeping:
                return True
            self._producer.poll(DRAIN_POLL_S)
        return False

    def drop_partition(self, partition: int) -> None:
        """Forget the batch of a partition no longer owned (its next owner sweeps it)."""
        self._sweeping.pop(partition, None)

    def close(self, timeout_s: float) -> None:
        """Let the batch in the air land (briefly)."""
        self._producer.flush(timeout_s)

    def _sweep(self, partition: int, index: PartitionIndex,
               chunks: list[tuple[bytes, list[bytes]]]) -> int:
        """Produce the tombstones of the chunks' keys but those pending again; return
        how many keys the chunks hold."""
        producer, topic, report = self._producer, self._topic, self._report
        keys = [key for _, chunk in chunks for key in chunk]
        for key, raw in zip(keys, index.raw_values(keys), strict=True):
            if raw is None:
                produce(producer, topic, key=key, value=None, partition=partition,
                        on_delivery=report)
        self._sweeping[partition] = [chunk_id for chunk_id, _ in chunks]
        self._counted += len(keys)
        return len(keys)

    def _landed(self, indexes: Mapping[int, PartitionIndex]) -> None:
        """Take the swept keys out of their sweep lists, or sweep them again after a failure."""
        sweeping, self._sweeping = self._sweeping, {}
        if self._failures:
            log.warning("%d changelog tombstone(s) of delivered entries failed (%s); they are "
                        "written again later", self._failures, self._failure)
            self._metrics.state.changelog_errors.inc(self._failures)
            self._failures = self._counted = 0
            for partition in sweeping:
                if partition in indexes:
                    indexes[partition].rewind_sweep()
            return
        for partition, chunk_ids in sweeping.items():
            index = indexes.get(partition)
            if index is not None:
                index.apply(Changes(unswept=chunk_ids))
        self._metrics.state.swept.inc(self._counted)
        self._counted = 0

    def _report(self, error: KafkaError | None, _: Message) -> None:
        # Only failures are reported (delivery.report.only.error): guarded here.
        try:
            if error is not None:
                self._failures += 1
                self._failure = error.str()
        except BaseException as exc:
            latch(exc)
            raise
