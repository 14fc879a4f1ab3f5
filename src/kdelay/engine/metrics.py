"""Prometheus metrics of one kdelay process.

Each :class:`Metrics` owns its registry, so two services in one process (as in
tests) never clash; :func:`kdelay.engine.health.serve` exposes it over HTTP on
``--metrics-port``.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kdelay.protocol import envelope
from kdelay.protocol.envelope import ErrorCode

LATENESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COMMIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A step at least this long is logged with its phases (PhaseTimer), one line at most
# every SLOW_LOG_EVERY_S; the slow steps between are summed up in the next line.
SLOW_STEP_S = 1.0
SLOW_LOG_EVERY_S = 60.0
log = logging.getLogger(__name__)
# Most overdue keys one partition's housekeeping counts; see kdelay.engine.outlook.
OVERDUE_CAP = 10_000
_LANE_REFUSALS = frozenset({ErrorCode.WRONG_LANE.value.encode(),
                            ErrorCode.MISSING_LANE.value.encode(),
                            ErrorCode.UNKNOWN_LANE.value.encode()})
NO_LANE = "(none)"
"""The ``lane`` label of a refused request that named no lane."""
OTHER_LANE = "(unknown)"
"""The ``lane`` label of a refused request that named a lane not configured."""


class OutlookGauges:
    """The forward-looking gauges :mod:`kdelay.engine.outlook` refreshes each housekeeping round."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.pending = Gauge("kdelay_pending_entries", "Pending entries (exact), by partition",
                             ["partition"], registry=r)
        self.pending_by_horizon = Gauge(
            "kdelay_pending_by_horizon_entries", "Pending entries by partition and due horizon "
            "(overdue, 1m, 10m, 1h, 1d, beyond), counted by due minute", ["partition", "horizon"],
            registry=r)
        self.at_risk = Gauge(
            "kdelay_retention_at_risk_entries", "Pending entries whose original the requests "
            "topic's retention may delete before they are due, by partition", ["partition"],
            registry=r)
        self.unserved = Gauge(
            "kdelay_unserved_request_partitions", "Partitions added to the requests topic "
            "while kdelay ran, beyond the changelog's: nobody serves their requests",
            registry=r)
        self.state_dir_free = Gauge(
            "kdelay_state_dir_free_bytes", "Bytes free on the volume of --state-dir; the "
            "service stops with error[state-dir-full] when a write finds none", registry=r)
        self.partitions = Gauge("kdelay_request_partitions",
                                "Partitions of the requests topic (each must be owned by "
                                "one instance)", registry=r)
        self.earliest_due = Gauge(
            "kdelay_pending_earliest_due_timestamp_seconds", "Due time (Unix seconds) of the "
            "earliest pending entry, by partition; absent when nothing is pending",
            ["partition"], registry=r)
        self.latest_due = Gauge(
            "kdelay_pending_latest_due_timestamp_seconds", "Due time (Unix seconds) of the "
            "latest pending entry, by partition; absent when nothing is pending",
            ["partition"], registry=r)
        self.oldest_overdue = Gauge(
            "kdelay_overdue_oldest_age_seconds", "Service clock minus the due time of the "
            "earliest pending entry when it is due, else 0, by partition", ["partition"],
            registry=r)
        self.overdue = Gauge(
            "kdelay_overdue_entries", "Pending entries already due (in flight included), by "
            f"partition; capped: counting stops at {OVERDUE_CAP}", ["partition"], registry=r)
        self.intake_lag = Gauge(
            "kdelay_intake_lag_records", "Request records not yet taken in: the broker's high "
            "watermark (asked every 10 s, off the loop) minus the consumed position, by "
            "partition", ["partition"], registry=r)
        self.headroom = Gauge(
            "kdelay_retention_headroom_seconds", "Least time before the requests topic's "
            "retention may delete a pending original, by partition: exact over the overdue "
            f"entries counted (capped at {OVERDUE_CAP}), a lower bound for the rest; absent "
            "when nothing is pending or retention is unlimited", ["partition"], registry=r)

    def partition_gauges(self) -> tuple[Gauge, ...]:
        """The gauges labelled by partition, whose series go when a partition goes."""
        return (self.pending, self.earliest_due, self.latest_due, self.oldest_overdue,
                self.overdue, self.intake_lag, self.headroom, self.at_risk)


@dataclass(frozen=True, slots=True)
class ControlRow:
    """One controlled target or lane as this instance applies it, for :class:`ControlGauges`."""

    scope: str
    name: str
    held: int
    oldest_held_ms: int | None
    rate_per_s: float | None
    paused_since_ms: int | None


class ControlGauges:
    """The target controls in force and what they hold back in this instance, refreshed
    each housekeeping round (see :mod:`kdelay.engine.controlfeed`)."""

    def __init__(self, r: CollectorRegistry) -> None:
        labels = ["scope", "name"]
        self.held = Gauge("kdelay_control_held_entries", "Due records a target control holds "
                          "back in this instance (pending, not failed), by scope (target or "
                          "lane) and name", labels, registry=r)
        self.oldest_held = Gauge(
            "kdelay_control_oldest_held_due_timestamp_seconds", "Due time of the oldest "
            "record a control holds back in this instance; absent when none is held", labels,
            registry=r)
        self.rate = Gauge("kdelay_control_rate_per_second", "The delivery rate a control "
                          "applies now, per instance: 0 while paused, the catch-up rate after "
                          "a resume, then the cap; absent without a limit", labels, registry=r)
        self.paused_since = Gauge(
            "kdelay_control_paused_since_timestamp_seconds", "When a paused target or lane "
            "was paused; absent when not paused", labels, registry=r)
        self._shown: set[tuple[str, str]] = set()

    def show(self, rows: Iterable[ControlRow]) -> None:
        """Set the gauges to ``rows``; the series of subjects no longer controlled go."""
        shown: set[tuple[str, str]] = set()
        for row in rows:
            labels = (row.scope, row.name)
            shown.add(labels)
            self.held.labels(*labels).set(row.held)
            for gauge, value in ((self.oldest_held, _seconds(row.oldest_held_ms)),
                                 (self.paused_since, _seconds(row.paused_since_ms)),
                                 (self.rate, row.rate_per_s)):
                if value is None:
                    _forget(gauge, labels)
                else:
                    gauge.labels(*labels).set(value)
        for labels in self._shown - shown:
            for gauge in (self.held, self.oldest_held, self.rate, self.paused_since):
                _forget(gauge, labels)
        self._shown = shown


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def _forget(gauge: Gauge, labels: tuple[str, str]) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


def _last_ms_within(bound_s: float) -> float:
    """The largest whole millisecond count ``v`` with ``v / 1000 <= bound_s`` (the
    comparison ``Histogram.observe`` makes), infinity for an infinite bound."""
    if math.isinf(bound_s):
        return bound_s
    last = math.floor(bound_s * 1000)
    while (last + 1) / 1000 <= bound_s:
        last += 1
    while last / 1000 > bound_s:
        last -= 1
    return last


class BatchHistogram:
    """A histogram that takes a batch of observations at a time, with optional labels.

    ``prometheus_client``'s ``Histogram.observe`` takes a lock and walks the
    buckets in Python for every value (about 1.3 µs here). Delivery observes
    the lateness of every record it produces, and intake the delay of every
    request it takes in, so each hands over a step's figures in one call
    instead; they are exposed exactly as a ``Histogram`` of the same name and
    labels would expose them. ``labelnames`` name the labels every batch gives
    values for (none by default); a label set is exposed once observed.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry, labelnames: tuple[str, ...] = ()) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = labelnames
        self._bounds = [*buckets, float("inf")]
        self._bounds_ms = [_last_ms_within(bound) for bound in self._bounds]
        # Per label set: the count of each bucket (not cumulative), then the sum.
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def observe_ms(self, values_ms: list[int], *labels: str) -> None:
        """Observe every value of ``values_ms``, given in milliseconds, in seconds, under
        ``labels`` (one value per label name, in order)."""
        if not values_ms:
            return
        if len(labels) != len(self._labelnames):
            raise ValueError(f"{self._name} takes labels {self._labelnames}, got {labels}")
        ordered = sorted(values_ms)
        # The values a bucket holds are a run of the sorted ones: a step's thousand
        # values cost one sort and a bisection per bound, not a Python step each.
        below = [bisect.bisect_right(ordered, bound) for bound in self._bounds_ms]
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                series = self._series[labels] = ([0] * len(self._bounds), [0.0])
            counts, total = series
            taken = 0
            for slot, held in enumerate(below):
                counts[slot] += held - taken
                taken = held
            total[0] += sum(values_ms) / 1000

    def describe(self) -> Iterator[Metric]:
        """The metric's name and type, for the registry's clash check."""
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        """The cumulative buckets, count and sum of each label set, as a ``Histogram``
        exposes them (one without labels shows zeros before its first observation)."""
        with self._lock:
            taken = {labels: (list(counts), total[0])
                     for labels, (counts, total) in self._series.items()}
        if not self._labelnames and not taken:
            taken[()] = ([0] * len(self._bounds), 0.0)
        family = HistogramMetricFamily(self._name, self._documentation,
                                       labels=self._labelnames)
        for labels, (counts, total) in sorted(taken.items()):
            cumulative: list[tuple[str, float]] = []
            running = 0
            for bound, count in zip(self._bounds, counts, strict=True):
                running += count
                label = floatToGoString(bound)  # type: ignore[no-untyped-call]
                cumulative.append((label, running))
            family.add_metric(list(labels), cumulative, total)
        yield family


class IntakeMetrics:
    """What intake counts: requests by outcome, how late they arrive, ids and lanes."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.records = Counter("kdelay_intake_records", "Request records read, by outcome",
                               ["outcome"], registry=r)
        self.delay = BatchHistogram(
            "kdelay_intake_delay_seconds", "Service clock when a request was taken in minus "
            "its record timestamp: how late requests reach the service", LATENESS_BUCKETS, r)
        self.ids_expired = Counter(
            "kdelay_schedule_ids_expired", "Ended-id markers dropped after the id window "
            "(the requests topic's retention)", registry=r)
        self.id_conflicts = Counter(
            "kdelay_duplicate_conflicts", "Requests whose id was taken by a first request with "
            "another payload or due time (dropped; the first is kept)", registry=r)
        self.lane_refused = Counter(
            "kdelay_lane_refused_records", "Requests refused at intake by the lane check, by "
            f"the lane they named ({NO_LANE}: none, {OTHER_LANE}: one not configured) and "
            "reason", ["lane", "reason"], registry=r)

    def count_lane_refusals(self, dead_letters: Iterable[envelope.Headers | None],
                            lanes: Container[str]) -> None:
        """Count the lane refusals among an intake batch's DLQ records (given by headers).

        The ``lane`` label takes only configured lanes and the two markers, so
        its values are bounded by ``--lanes`` whatever requests name.
        """
        for headers in dead_letters:
            reason = lane = None
            for name, value in headers or ():  # the reason kdelay appended comes last
                if name == envelope.ERROR:
                    reason = value
                elif name == envelope.LANE:
                    lane = value
            if not isinstance(reason, bytes) or reason not in _LANE_REFUSALS:
                continue
            named = lane.decode("utf-8", "replace") if isinstance(lane, bytes) else lane
            label = NO_LANE if named is None else named if named in lanes else OTHER_LANE
            self.lane_refused.labels(lane=label, reason=reason.decode()).inc()


class DeliveryMetrics:
    """What delivery counts: records republished (by lane), retried, and how late they
    went out (dead letters are counted by :class:`Metrics`, as intake's are)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.delivered = Counter("kdelay_delivered_records",
                                 "Records republished to their target", registry=r)
        self.lane_delivered = Counter(
            "kdelay_lane_delivered_records", "Records republished to their target, by the lane "
            "their request named (only configured lanes; lane-less records are not counted "
            "here)", ["lane"], registry=r)
        self.retries = Counter("kdelay_delivery_retries", "Failed produce attempts retried",
                               registry=r)
        self.lateness = BatchHistogram("kdelay_lateness_seconds",
                                       "Produce time minus due time, by the service clock, "
                                       "by target topic", LATENESS_BUCKETS, r, ("target",))


class StateMetrics:
    """The local state and its changelog: writes that failed, tombstones swept, and restores."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.changelog_errors = Counter("kdelay_changelog_errors",
                                        "Changelog writes that failed", registry=r)
        self.swept = Counter(
            "kdelay_swept_records", "Changelog tombstones written, off the delivery path, "
            "for the puts of entries a watermark covers (so that compaction drops them)",
            registry=r)
        self.restored = Counter("kdelay_restored_changelog_records",
                                "Changelog records replayed into local indexes", registry=r)
        self.restoring = Gauge("kdelay_restoring_partitions",
                               "Partitions being restored from the changelog", registry=r)
        self.restore_remaining = Gauge(
            "kdelay_restore_remaining_records", "Changelog offsets a restore still has to "
            "replay, by partition being restored (gone when it is done)", ["partition"],
            registry=r)
        self.restore_total = Gauge(
            "kdelay_restore_total_records", "Changelog offsets the running restore of a "
            "partition replays in all (gone when it is done)", ["partition"], registry=r)
        self.rocksdb_memory = Gauge(
            "kdelay_rocksdb_memory_bytes", "RocksDB memory of the local stores, by part: "
            "block_cache (data, index and filter blocks), pinned (of the cache, not "
            "evictable), memtables, table_readers (index and filter blocks outside the cache)",
            ["part"], registry=r)
        self.rocksdb_budget = Gauge(
            "kdelay_rocksdb_memory_budget_bytes", "The RocksDB budgets set: block_cache "
            "(--rocksdb-cache-mb) and memtables (--rocksdb-write-buffer-mb)", ["part"],
            registry=r)


class ClusterMetrics:
    """This instance among the others and Kafka: partitions served, rebalances, whether
    Kafka answers, and how far the broker's clock is."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.owned = Gauge("kdelay_owned_partitions",
                           "Request partitions this instance serves", registry=r)
        self.rebalances = Counter(
            "kdelay_rebalances", "Partition assignments, revocations and losses, by kind",
            ["kind"], registry=r)
        self.kafka_available = Gauge(
            "kdelay_kafka_available",
            "1 while Kafka answers, 0 from the moment every broker is down until one "
            "answers again; meanwhile the service waits", registry=r)
        self.kafka_available.set(1)
        self.clock_skew = Gauge(
            "kdelay_clock_skew_seconds", "Broker clock minus service clock, from the "
            "LogAppendTime of changelog acknowledgements", registry=r)


class LoopMetrics:
    """The service loop: when it last stepped, its phases, and its transaction commits."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.last_step = Gauge(
            "kdelay_last_step_timestamp_seconds",
            "Unix time the service loop last finished a step; it steps at least every "
            "100 ms while it runs, with or without traffic, so a loop stuck in a call "
            "stops it", registry=r)
        self.phases = Histogram(
            "kdelay_loop_phase_seconds", "Time one service step spends in each phase (consume, "
            "read-ahead, dispatch, write, commit, apply, settle, sweep, housekeeping)", ["phase"],
            buckets=PHASE_BUCKETS, registry=r)
        self.commit_duration = Histogram(
            "kdelay_transaction_commit_seconds", "Time to commit one transaction "
            "(exactly-once only)", buckets=COMMIT_BUCKETS, registry=r)


class Metrics:
    """The counters, gauges and histograms the service updates, one group per concern,
    all in one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Intake and delivery both dead-letter.
        self.dead_lettered = Counter("kdelay_dead_lettered_records",
                                     "Records sent to the DLQ, by reason", ["reason"], registry=r)
        self.intake = IntakeMetrics(r)
        self.delivery = DeliveryMetrics(r)
        self.state = StateMetrics(r)
        self.cluster = ClusterMetrics(r)
        self.loop = LoopMetrics(r)
        # Refreshed by kdelay.engine.outlook every housekeeping round.
        self.outlook = OutlookGauges(r)
        self.controls = ControlGauges(r)


@dataclass(slots=True)
class DeliveryCounts:
    """Per-record figures delivery gathers between two settles, handed to Prometheus at once."""

    delivered: int = 0
    by_lane: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)

    def flush(self, metrics: Metrics, lateness_ms: dict[str, list[int]]) -> None:
        """Add the counts, and observe the lateness of each record produced (by target),
        at once."""
        counted = metrics.delivery
        if self.delivered:
            counted.delivered.inc(self.delivered)
        for lane, count in self.by_lane.items():
            counted.lane_delivered.labels(lane=lane).inc(count)
        for reason, count in self.dead_lettered.items():
            metrics.dead_lettered.labels(reason=reason).inc(count)
        for target, values in lateness_ms.items():
            counted.lateness.observe_ms(values, target)


class PhaseTimer:
    """Times the phases of one service step into ``kdelay_loop_phase_seconds``.

    :meth:`start` begins a step, :meth:`lap` closes the phase running since the
    last lap (or the start) under its name. A step longer than ``slow_s`` is
    logged with its phases, so a stall names the phase that held it; at most
    one line every ``log_every_s``: the slow steps meanwhile are counted, and
    the next line (at the next step past that time) gives their number and
    the slowest of them. A machine that stays overloaded logs a line a
    minute, not one a step. ``monotonic`` is the service clock's.
    """

    def __init__(self, histogram: Histogram, monotonic: Callable[[], float],
                 slow_s: float = SLOW_STEP_S, log_every_s: float = SLOW_LOG_EVERY_S) -> None:
        self._histogram = histogram
        self._children: dict[str, Histogram] = {}
        self._monotonic = monotonic
        self._slow_s = slow_s
        self._log_every_s = log_every_s
        self._quiet_until = float("-inf")  # no slow-step line before this
        self._held = 0  # slow steps not logged since the last line
        self._slowest: tuple[float, str] = (0.0, "")  # the slowest of them, its phases
        self._begun = 0.0
        self._last = 0.0
        self._laps: list[tuple[str, float]] = []

    def start(self) -> None:
        """Begin timing a step."""
        self._begun = self._last = self._monotonic()
        self._laps.clear()

    def lap(self, phase: str) -> None:
        """Record the time since the last lap as ``phase``."""
        now = self._monotonic()
        spent = now - self._last
        self._last = now
        child = self._children.get(phase)
        if child is None:
            child = self._children[phase] = self._histogram.labels(phase=phase)
        child.observe(spent)
        self._laps.append((phase, spent))

    def finish(self) -> None:
        """End the step; log it when it was slow (see the class)."""
        total = self._last - self._begun
        slow = total >= self._slow_s
        if not slow and not self._held:
            return
        phases = ", ".join(f"{name} {spent:.3f}" for name, spent in self._laps) if slow else ""
        if self._last < self._quiet_until:
            if slow:
                self._held += 1
                self._slowest = max(self._slowest, (total, phases))
            return
        held, (slowest, its_phases) = self._held, self._slowest
        self._held, self._slowest = 0, (0.0, "")
        self._quiet_until = self._last + self._log_every_s
        since = (f"{held} more slow step{'s' if held > 1 else ''} since the last line, "
                 f"the slowest {slowest:.3f} s ({its_phases})") if held else ""
        if slow:
            log.warning("slow step: %.3f s (%s)%s", total, phases, f"; {since}" if since else "")
        else:
            log.warning("%s", since)
