"""The outlook of the owned partitions: gauges of what is coming and what is late.

:class:`Outlook` refreshes, once per housekeeping round of the service, the
per-partition gauges that look forward: the earliest and latest pending due
time, the age of the oldest overdue entry, the number of overdue entries and
the intake lag. Every figure is bounded in cost, so none is a full scan:

- earliest due: the first key from the index's remembered head;
- latest due: one ``seek_to_last``;
- overdue entries: a key-only scan up to now, stopped at
  :data:`~kdelay.engine.metrics.OVERDUE_CAP` keys (the gauge's help says so);
- intake lag: the high watermark the broker last gave
  :class:`~kdelay.engine.health.HighWatermarks` (asked off the loop; the
  consumer's cached one stops moving when the consumer stops fetching) minus
  the position the service has taken in;
- retention headroom: how long until retention may delete the oldest
  pending original. Intake only schedules an entry due by its request's
  timestamp + retention - margin, so an entry not yet due has more than
  ``margin + (due - now)`` left: the overdue entries (read in the same capped
  scan, their request timestamps from the index values) and the first entry
  not yet due (one seek) bound it. Retention deletes whole segments once
  their newest record is older than ``retention.ms``, so an original may live
  longer, never shorter (size-based retention aside).

- pending entries, by horizon and at risk of retention: from the index's
  exact tally (:mod:`kdelay.state.tally`), kept in step with every batch it writes;
  summing it costs one step per due minute (or slack minute) with entries.

:class:`Housekeeper` runs the round itself, every few seconds of the service
clock: it refreshes these gauges and marks every owned store in step with
the changelog.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path

from confluent_kafka import KafkaException, TopicPartition
from prometheus_client import Gauge

from kdelay.engine.metrics import OVERDUE_CAP, Metrics
from kdelay.plumbing.clients import Producing, Watermarks
from kdelay.plumbing.clock import Clock
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import Layout
from kdelay.protocol import codec
from kdelay.state.index import DueSummary, PartitionIndex
from kdelay.state.statedir import free_bytes
from kdelay.state.tally import horizons


class Outlook:
    """Refreshes the forward-looking gauges of :class:`~kdelay.engine.metrics.Metrics`.

    Not thread-safe: the service loop calls :meth:`refresh`. The series of a
    partition no longer owned are removed, so a scrape never shows a partition
    another instance now serves.
    """

    def __init__(self, metrics: Metrics, settings: Settings, layout: Layout,
                 overdue_cap: int = OVERDUE_CAP) -> None:
        """Start an outlook of the requests topic ``settings`` name, laid out as ``layout``."""
        self._metrics = metrics
        self._gauges = metrics.outlook
        self._gauges.partitions.set(layout.partitions)
        self._topic = settings.requests_topic
        self._retention_ms = layout.retention_ms
        self._margin_ms = settings.retention_margin_ms
        self._cap = overdue_cap
        self._shown: set[int] = set()

    def refresh(self, now_ms: int, indexes: Mapping[int, PartitionIndex],
                consumed: Mapping[int, int], consumer: Watermarks | None) -> None:
        """Set every gauge for the partitions in ``indexes`` at service time ``now_ms``.

        ``consumed`` holds the next request offset each partition will take in;
        a partition without one, or whose high watermark ``consumer`` does not
        know yet, has no intake lag series.
        """
        m = self._gauges
        self._metrics.cluster.owned.set(len(indexes))
        for gone in self._shown - set(indexes):
            self._forget(gone)
        for partition, index in indexes.items():
            self._index_gauges(str(partition), index, now_ms)
            lag = self._lag(partition, consumed.get(partition), consumer)
            if lag is None:
                _remove(m.intake_lag, str(partition))
            else:
                m.intake_lag.labels(partition=str(partition)).set(lag)
        self._shown = set(indexes)

    def _index_gauges(self, label: str, index: PartitionIndex, now_ms: int) -> None:
        m = self._gauges
        m.pending.labels(partition=label).set(index.tally.total)
        for horizon, count in index.tally.by_horizon(now_ms).items():
            m.pending_by_horizon.labels(partition=label, horizon=horizon).set(count)
        m.at_risk.labels(partition=label).set(index.tally.at_risk(self._retention_ms))
        first, last = index.first_key(), index.last_key()
        if first is None or last is None:
            _remove(m.earliest_due, label)
            _remove(m.latest_due, label)
            _remove(m.headroom, label)
            m.oldest_overdue.labels(partition=label).set(0)
            m.overdue.labels(partition=label).set(0)
            return
        earliest = codec.decode_due_key(first).due_ms
        m.earliest_due.labels(partition=label).set(earliest / 1000)
        m.latest_due.labels(partition=label).set(codec.decode_due_key(last).due_ms / 1000)
        m.oldest_overdue.labels(partition=label).set(max(0, now_ms - earliest) / 1000)
        due = index.due_summary(now_ms, self._cap) if earliest <= now_ms else DueSummary(
            0, None, False)
        m.overdue.labels(partition=label).set(due.count)
        headroom = self._headroom_ms(index, due, now_ms)
        if headroom is None:
            _remove(m.headroom, label)
        else:
            m.headroom.labels(partition=label).set(headroom / 1000)

    def _headroom_ms(self, index: PartitionIndex, due: DueSummary, now_ms: int) -> int | None:
        """The least time before retention may delete a pending original (see the module)."""
        if self._retention_ms is None:
            return None
        bounds = []
        if due.oldest_request_ms is not None:
            bounds.append(due.oldest_request_ms + self._retention_ms - now_ms)
        following = due.count == 0 or not due.capped
        after = index.first_key_after(now_ms) if following else None
        if after is not None:
            # Intake took it only if due <= timestamp + retention - margin (0 at least).
            margin = min(self._margin_ms, self._retention_ms)
            bounds.append(codec.decode_due_key(after).due_ms - now_ms + margin)
        return min(bounds) if bounds else None

    def _lag(self, partition: int, position: int | None,
             consumer: Watermarks | None) -> int | None:
        if position is None or consumer is None:
            return None
        try:
            marks = consumer.get_watermark_offsets(TopicPartition(self._topic, partition),
                                                   cached=True)
        except KafkaException:
            return None
        if marks[1] < 0:
            return None
        return max(0, marks[1] - position)

    def _forget(self, partition: int) -> None:
        for gauge in self._gauges.partition_gauges():
            _remove(gauge, str(partition))
        for horizon in horizons():
            with contextlib.suppress(KeyError):
                self._gauges.pending_by_horizon.remove(str(partition), horizon)


def _remove(gauge: Gauge, label: str) -> None:
    """Remove one partition's series from a labelled gauge, if it has one."""
    try:
        gauge.remove(label)
    except KeyError:
        pass

log = logging.getLogger(__name__)

HOUSEKEEPING_EVERY_MS = 5_000


class Housekeeper:
    """Every few seconds (service clock): refresh the gauges and mark every owned
    store in step with the changelog.

    An owned store lacks only the effects of the changelog writes in flight,
    so the mark (:meth:`PartitionIndex.mark_synced`) is true; the next
    assignment of the partition to this state dir trusts the store only while
    the mark is younger than the changelog keeps tombstones.
    """

    def __init__(self, clock: Clock, metrics: Metrics, outlook: Outlook,
                 state_dir: Path | None = None) -> None:
        self._state_dir = state_dir
        self._clock = clock
        self._metrics = metrics
        self._outlook = outlook
        self._next_ms = 0

    def tick(self, indexes: Mapping[int, PartitionIndex], consumed: Mapping[int, int],
             consumer: Watermarks | None) -> bool:
        """Do the round if it is time; return whether it was."""
        now = self._clock.now_ms()
        if now < self._next_ms:
            return False
        self._next_ms = now + HOUSEKEEPING_EVERY_MS
        for index in indexes.values():
            index.mark_synced(now)
        self._outlook.refresh(now, indexes, consumed, consumer)
        if self._state_dir is not None:
            self._metrics.outlook.state_dir_free.set(free_bytes(self._state_dir))
        if indexes:
            self._memory(indexes)
        return True

    def _memory(self, indexes: Mapping[int, PartitionIndex]) -> None:
        """Set the RocksDB memory gauges from the stores' properties (all share one budget)."""
        memory = next(iter(indexes.values())).memory
        usage = memory.usage(family for index in indexes.values() for family in index.families())
        state = self._metrics.state
        for part, value in (("block_cache", usage.block_cache), ("pinned", usage.pinned),
                            ("memtables", usage.memtables),
                            ("table_readers", usage.table_readers)):
            state.rocksdb_memory.labels(part=part).set(value)
        state.rocksdb_budget.labels(part="block_cache").set(usage.cache_capacity)
        state.rocksdb_budget.labels(part="memtables").set(usage.write_buffer_budget)


PARTITION_CHECK_EVERY_MS = 30_000
"""How often (service clock) the requests topic's partition count is checked."""


class PartitionWatch:
    """Whether partitions were added to the requests topic, which this service cannot serve.

    The changelog has the partition count kdelay started with, so a request
    partition beyond it has no index to serve it. Those requests stay in the
    requests topic (nothing is dead-lettered or lost) until the operator
    follows the procedure the error line names.
    """

    def __init__(self, settings: Settings, metrics: Metrics, served: int) -> None:
        self._settings = settings
        self._metrics = metrics
        self._served = served
        self._seen = served
        self._next_ms = 0

    def tick(self, now: int, client: Producing) -> None:
        """Ask the cluster how many partitions the requests topic has, if it is time."""
        if now < self._next_ms:
            return
        self._next_ms = now + PARTITION_CHECK_EVERY_MS
        topic = self._settings.requests_topic
        try:
            found = client.list_topics(topic, timeout=5).topics.get(topic)
        except KafkaException:
            return  # the broker is away: the next round asks again
        if found is not None and found.error is None:
            self.added(len(found.partitions))

    def added(self, count: int) -> None:
        """Report once per new count that the requests topic has ``count`` > served partitions."""
        if count <= self._seen:
            return
        self._seen = count
        s, served = self._settings, self._served
        self._metrics.outlook.partitions.set(count)
        self._metrics.outlook.unserved.set(count - served)
        log.error("error[requests-partitions-added]: requests topic %s now has %d partitions "
                  "but changelog %s has %d: requests written to partitions %d-%d are not "
                  "served (they wait in %s). Stop every instance, run `kdelay topics grow "
                  "--partitions %d` (it moves each schedule id to its new home), then start "
                  "them again (see \"Adding request partitions\" in docs/operations/topics.md)",
                  s.requests_topic, count, s.changelog_topic, served, served, count - 1,
                  s.requests_topic, count)
