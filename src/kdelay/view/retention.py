"""Retention safety: will the requests topic keep every pending original until it is due?

The payload lives only in the requests topic. Kafka deletes a record no
earlier than its timestamp + ``retention.ms`` (whole segments go at once, so
usually later), and at any time when ``retention.bytes`` caps the partition's
size. :func:`check` compares every pending entry of a :class:`PendingView`
with the topic's retention and log start offsets:

- *expired*: the entry's offset is already below the log start offset; its
  delivery will dead-letter it as ``expired``;
- *at risk*: expired, or due later than its record time + ``retention.ms``
  (retention may delete it first), or any entry at all while
  ``retention.bytes`` is not -1;
- *headroom* of a partition: how long until retention may delete its oldest
  pending original (by offset), next to how long until that entry is due.

It recommends a ``retention.ms`` that covers the longest delay actually
pending (and the longest delay level) plus the safety margin, rounded up to
a whole hour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from confluent_kafka import Consumer, TopicPartition

# confluent_kafka.admin re-exports these without listing them, which strict mypy rejects.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import admin_client, topic_config
from kdelay.view.pending import QUIET, Columns, PendingView

HOUR_MS = 3_600_000
RISK_EXIT = 3
AT_RISK_LISTED = 100
"""How many at-risk records a report names one by one (the soonest due first)."""


@dataclass(frozen=True, slots=True)
class AtRisk:
    """One pending record whose original may be (or is) deleted before it is due.

    ``why`` is ``expired`` (below the log start offset: already gone),
    ``retention`` (due after its record time + ``retention.ms``: ``expires_ms``)
    or ``size`` (``retention.bytes`` may delete any record at any time).
    """

    partition: int
    offset: int
    due_ms: int
    record_ms: int
    expires_ms: int | None
    why: str


@dataclass(slots=True)
class PartitionRetention:
    """Retention figures of one request partition; times in ms, None where not defined."""

    partition: int
    log_start_offset: int
    pending: int = 0
    oldest_pending_offset: int | None = None
    oldest_record_ms: int | None = None
    oldest_due_ms: int | None = None
    headroom_ms: int | None = None
    due_in_ms: int | None = None
    at_risk: int = 0
    expired: int = 0


@dataclass(slots=True)
class RetentionReport:
    """What ``kdelay retention check`` reports; ``problems`` are sentences for the operator."""

    topic: str
    now_ms: int
    retention_ms: int | None
    retention_bytes: int
    segment_ms: int | None
    segment_bytes: int | None
    local_retention_ms: int | None
    longest_pending_delay_ms: int | None
    recommended_retention_ms: int
    partitions: list[PartitionRetention] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    listed: list[AtRisk] = field(default_factory=list)
    """The first :data:`AT_RISK_LISTED` at-risk records by due time."""

    @property
    def at_risk(self) -> int:
        """Pending entries that may be (or are) deleted before they are due."""
        return sum(p.at_risk for p in self.partitions)

    @property
    def expired(self) -> int:
        """Pending entries whose original is already gone."""
        return sum(p.expired for p in self.partitions)

    @property
    def exit_code(self) -> int:
        """0 when nothing is at risk, :data:`RISK_EXIT` (3) when something is."""
        return RISK_EXIT if self.at_risk or self.problems else 0


def _int(config: Mapping[str, str], name: str) -> int | None:
    value = config.get(name)
    return None if value is None else int(value)


def _unlimited(value: int | None) -> int | None:
    """Kafka's -1 (or any negative value) means unlimited: None."""
    return None if value is None or value < 0 else value


def log_starts(settings: Settings, partitions: list[int]) -> dict[int, int]:
    """The log start offset of each request partition (fresh, not cached)."""
    consumer = Consumer(settings.client_config(**{"group.id": "kdelay-retention"}))
    try:
        return {p: int(consumer.get_watermark_offsets(
            TopicPartition(settings.requests_topic, p), timeout=30, cached=False)[0])
            for p in partitions}
    finally:
        consumer.close()


def recommend(longest_delay_ms: int | None, settings: Settings) -> int:
    """A ``retention.ms`` for the longest pending delay (or level) plus the margin.

    The service rejects a request due later than record time + retention -
    margin (``delay-too-long``), so this is the least retention that accepts
    what is pending now, rounded up to a whole hour.
    """
    longest = max(longest_delay_ms or 0, max(settings.levels))
    needed = longest + settings.retention_margin_ms
    return -(-needed // HOUR_MS) * HOUR_MS


def count(figures: PartitionRetention, columns: Columns, retention_ms: int | None,
          size_limited: bool, listed: list[AtRisk] | None = None) -> int | None:
    """Count one partition's pending entries into ``figures``; return its longest delay.

    An entry is expired below the log start offset, and at risk when expired,
    due after its record time + ``retention_ms``, or whenever the partition
    is ``size_limited``. With ``listed``, the partition's first
    :data:`AT_RISK_LISTED` at-risk entries by due time are added to it.
    """
    dues, offsets, stamps = columns
    low = figures.log_start_offset
    figures.pending = len(offsets)
    if not offsets:
        return None
    figures.expired = sum(1 for offset in offsets if offset < low)
    if size_limited:
        figures.at_risk = figures.pending
    elif retention_ms is None:
        figures.at_risk = figures.expired
    else:
        figures.at_risk = sum(1 for due_ms, record_ms, offset in zip(dues, stamps, offsets,
                                                                      strict=True)
                              if offset < low or due_ms > record_ms + retention_ms)
    if listed is not None and figures.at_risk:
        listed += _at_risk(figures.partition, columns, low, retention_ms, size_limited)
    oldest = offsets.index(min(offsets))
    figures.oldest_pending_offset = offsets[oldest]
    figures.oldest_record_ms = stamps[oldest]
    figures.oldest_due_ms = dues[oldest]
    return max(due_ms - record_ms for due_ms, record_ms in zip(dues, stamps, strict=True))


def _at_risk(partition: int, columns: Columns, low: int, retention_ms: int | None,
             size_limited: bool) -> list[AtRisk]:
    """The first :data:`AT_RISK_LISTED` at-risk entries of one partition, by due time."""
    found: list[AtRisk] = []
    for due_ms, offset, record_ms in sorted(zip(*columns, strict=True)):
        expires = None if retention_ms is None else record_ms + retention_ms
        if offset < low:
            why = "expired"
        elif expires is not None and due_ms > expires:
            why = "retention"
        elif size_limited:
            why = "size"
        else:
            continue
        found.append(AtRisk(partition, offset, due_ms, record_ms, expires, why))
        if len(found) >= AT_RISK_LISTED:
            break
    return found


def _headroom(figures: PartitionRetention, retention_ms: int | None, now_ms: int) -> None:
    """Set the headroom and due-in of the partition's oldest pending entry (by offset)."""
    if figures.oldest_record_ms is None or figures.oldest_due_ms is None:
        return
    figures.due_in_ms = figures.oldest_due_ms - now_ms
    oldest = figures.oldest_pending_offset
    if oldest is not None and oldest < figures.log_start_offset:
        figures.headroom_ms = 0  # already deleted: no time left at all
    elif retention_ms is not None:
        figures.headroom_ms = figures.oldest_record_ms + retention_ms - now_ms


def check(settings: Settings, view: PendingView, now_ms: int) -> RetentionReport:
    """Check every pending entry of ``view`` against the requests topic's retention.

    Raises :class:`~kdelay.plumbing.topics.LayoutError` ``topic-missing`` when the
    requests topic does not exist; Kafka errors propagate as KafkaException.
    """
    config = topic_config(admin_client(settings, log_level=QUIET), settings.requests_topic)
    retention_ms = _unlimited(_int(config, "retention.ms"))
    retention_bytes = _int(config, "retention.bytes")
    retention_bytes = -1 if retention_bytes is None else retention_bytes
    size_limited = retention_bytes >= 0
    # An index may hold entries whose originals lie on another request partition
    # (schedules forwarded to their id's partition): each counts where it lies.
    by_origin: dict[int, Columns] = {p: Columns([], [], []) for p in view.partitions}
    for number, partition in enumerate(view.partitions, start=1):
        view.report("checking pending entries (partitions)", number, len(view.partitions))
        for origin, found in view.columns(partition).items():
            merged = by_origin.setdefault(origin, Columns([], [], []))
            for column, more in zip(merged, found, strict=True):
                column.extend(more)
    starts = log_starts(settings, sorted(by_origin))
    figures = {p: PartitionRetention(p, starts[p]) for p in by_origin}
    delays: list[int] = []
    listed: list[AtRisk] = []
    for partition, columns in by_origin.items():
        delay = count(figures[partition], columns, retention_ms, size_limited, listed)
        delays += [] if delay is None else [delay]
    longest = max(delays, default=None)
    for counted in figures.values():
        _headroom(counted, retention_ms, now_ms)
    report = RetentionReport(
        settings.requests_topic, now_ms, retention_ms, retention_bytes,
        _int(config, "segment.ms"), _int(config, "segment.bytes"),
        _unlimited(_int(config, "local.retention.ms")), longest,
        recommend(longest, settings), sorted(figures.values(), key=lambda f: f.partition))
    report.problems = problems(report, config)
    report.listed = sorted(listed, key=lambda r: (r.due_ms, r.partition, r.offset))[
        :AT_RISK_LISTED]
    return report


def problems(report: RetentionReport, config: Mapping[str, str]) -> list[str]:
    """Sentences naming each risk in ``report``, with what to do."""
    found = []
    if report.retention_bytes >= 0:
        found.append(f"retention.bytes is {report.retention_bytes}: size-based deletion can "
                     "drop pending originals at any time; set it to -1")
    if "compact" in config.get("cleanup.policy", "delete"):
        found.append("cleanup.policy includes compact: compaction drops pending originals; "
                     "set it to delete")
    if report.expired:
        found.append(f"{report.expired} pending entries lost their original already; they "
                     "will be dead-lettered as expired")
    late = report.at_risk - report.expired
    if late and report.retention_bytes < 0:
        found.append(f"{late} pending entries are due after retention.ms may delete their "
                     f"original; raise retention.ms to {report.recommended_retention_ms}")
    return found


def set_retention(settings: Settings, retention_ms: int, *, timeout: float = 30) -> int | None:
    """Set the requests topic's ``retention.ms`` (and ``retention.bytes=-1``); return the old one.

    Refuses (ValueError) a retention below the longest delay level plus the
    safety margin, as ``topics create`` does; -1 (unlimited) is accepted.
    Running instances read retention at start: restart them to accept longer
    delays. Kafka errors propagate as KafkaException.
    """
    needed = max(settings.levels) + settings.retention_margin_ms
    if retention_ms != -1 and retention_ms < needed:
        raise ValueError(f"retention.ms {retention_ms} is shorter than the longest delay level "
                         f"plus the safety margin; use at least {needed} or -1")
    admin = admin_client(settings, log_level=QUIET)
    old = _unlimited(_int(topic_config(admin, settings.requests_topic), "retention.ms"))
    resource = ConfigResource(ResourceType.TOPIC, settings.requests_topic, incremental_configs=[
        ConfigEntry("retention.ms", str(retention_ms),
                    incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("retention.bytes", "-1", incremental_operation=AlterConfigOpType.SET)])
    for future in admin.incremental_alter_configs([resource], request_timeout=timeout).values():
        future.result(timeout=timeout)
    return old
