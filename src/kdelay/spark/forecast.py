"""The backlog forecast: what is pending, when it comes due, and what retention it needs.

Pending entries are the changelog's live due keys (:func:`kdelay.spark.audit.pending_frame`),
joined to their request records for target, payload size and record time.
Counts and payload bytes are aggregated by due-time bucket, target and
partition; the due-rate curve covers ``[now, now + horizon)`` in buckets of
``bucket_ms`` with its busiest buckets as peaks, so a burst scheduled for
midnight shows a day ahead. Per partition, the retention an entry needs is its
due time minus its record time plus the safety margin; the largest is set
against the requests topic's configured ``retention.ms``. An entry whose
request record is already gone (retention deleted it) has no target or size
and is counted as ``missing_originals``: it will be dead-lettered ``expired``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from kdelay.plumbing import topics
from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.spark import source
from kdelay.spark.audit import pending_frame
from kdelay.spark.source import header

PEAKS = 5
UNKNOWN_TARGET = "?"


@dataclass(frozen=True, slots=True)
class ForecastWindow:
    """When the forecast runs (``now_ms``), how far it looks and in what buckets."""

    now_ms: int
    horizon_ms: int = 24 * 3_600_000
    bucket_ms: int = 60_000

    def __post_init__(self) -> None:
        """Raise ValueError unless bucket and horizon are positive."""
        if self.bucket_ms <= 0 or self.horizon_ms <= 0:
            raise ValueError("--bucket and --horizon must be positive durations")


@dataclass(frozen=True, slots=True)
class Bucket:
    """Entries coming due in ``[start_ms, start_ms + bucket)``."""

    start_ms: int
    count: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Group:
    """Pending entries and their payload bytes for one target or partition."""

    name: str
    count: int
    bytes: int


@dataclass(frozen=True, slots=True)
class PartitionNeed:
    """The retention a request partition needs against the topic's configured one.

    ``needed_ms`` is the longest (due - record time) among its pending entries
    plus the margin; ``retention_ms`` is None when retention is unlimited.
    """

    partition: int
    count: int
    bytes: int
    needed_ms: int
    retention_ms: int | None

    @property
    def covered(self) -> bool:
        """Whether the configured retention keeps every pending original until it is due."""
        return self.retention_ms is None or self.needed_ms <= self.retention_ms


@dataclass(frozen=True, slots=True)
class ForecastReport:
    """The forecast's summary; every field is an aggregate."""

    window: ForecastWindow
    pending: int
    bytes: int
    overdue: int
    beyond_horizon: int
    missing_originals: int
    curve: Sequence[Bucket]
    by_target: Sequence[Group]
    by_partition: Sequence[PartitionNeed]

    @property
    def peaks(self) -> list[Bucket]:
        """The busiest buckets of the curve, busiest first (ties: earliest first)."""
        return sorted(self.curve, key=lambda b: (-b.count, b.start_ms))[:PEAKS]

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object."""
        rate = 1_000 / self.window.bucket_ms

        def bucket(b: Bucket) -> dict[str, Any]:
            return {"start_ms": b.start_ms, "count": b.count, "bytes": b.bytes,
                    "per_second": round(b.count * rate, 3)}

        return {
            "now_ms": self.window.now_ms, "horizon_ms": self.window.horizon_ms,
            "bucket_ms": self.window.bucket_ms, "pending": self.pending, "bytes": self.bytes,
            "overdue": self.overdue, "beyond_horizon": self.beyond_horizon,
            "missing_originals": self.missing_originals,
            "curve": [bucket(b) for b in self.curve], "peaks": [bucket(b) for b in self.peaks],
            "by_target": {g.name: {"count": g.count, "bytes": g.bytes} for g in self.by_target},
            "by_partition": {str(p.partition): {
                "count": p.count, "bytes": p.bytes, "needed_retention_ms": p.needed_ms,
                "retention_ms": p.retention_ms, "covered": p.covered} for p in self.by_partition},
        }


def entries(spark: SparkSession, settings: Settings) -> DataFrame:
    """Pending entries with target, payload bytes and record time (null when gone)."""
    own = [settings.requests_topic, settings.changelog_topic]
    snap = source.snapshot(settings, own)
    pending = pending_frame(source.read(spark, settings, snap, [settings.changelog_topic]))
    requests = source.read(spark, settings, snap, [settings.requests_topic]).select(
        "partition", "offset", "ts_ms", header(envelope.TARGET).alias("target"),
        F.length("value").alias("size"))
    joined = pending.drop("value").join(requests, ["partition", "offset"], "left")
    return joined.select(
        "partition", "offset", F.col("pending_due").alias("due_ms"), "ts_ms",
        F.coalesce("target", F.lit(UNKNOWN_TARGET)).alias("target"),
        F.coalesce("size", F.lit(0)).cast("bigint").alias("bytes"),
        F.col("ts_ms").isNull().alias("gone"))


def cube(table: DataFrame, window: ForecastWindow) -> DataFrame:
    """Count and bytes by due-time bucket (start ms), target and partition, over the horizon.

    Bucket starts are ``now + k * bucket``; overdue entries are left out.
    """
    ahead = F.col("due_ms") - F.lit(window.now_ms)
    inside = table.where((ahead >= 0) & (ahead < window.horizon_ms))
    start = F.lit(window.now_ms) + F.floor(ahead / F.lit(window.bucket_ms)).cast(
        "bigint") * F.lit(window.bucket_ms)
    return inside.groupBy(start.alias("start_ms"), "target", "partition").agg(
        F.count(F.lit(1)).alias("count"), F.sum("bytes").alias("bytes"))


def summarize(table: DataFrame, window: ForecastWindow, margin_ms: int,
              retention_ms: int | None) -> ForecastReport:
    """Aggregate pending entries into the report; only aggregates reach the driver."""
    now = F.lit(window.now_ms)
    totals = table.agg(
        F.count(F.lit(1)).alias("pending"), F.coalesce(F.sum("bytes"), F.lit(0)).alias("bytes"),
        F.count_if(F.col("due_ms") < now).alias("overdue"),
        F.count_if(F.col("due_ms") >= now + window.horizon_ms).alias("beyond"),
        F.count_if("gone").alias("gone")).first()
    assert totals is not None  # noqa: S101 - a global aggregate has one row
    curve = [Bucket(r["start_ms"], r["count"], r["bytes"]) for r in cube(table, window).groupBy(
        "start_ms").agg(F.sum("count").alias("count"), F.sum("bytes").alias("bytes"))
        .orderBy("start_ms").collect()]
    targets = [Group(r["target"], r["count"], r["bytes"]) for r in table.groupBy("target").agg(
        F.count(F.lit(1)).alias("count"), F.sum("bytes").alias("bytes")).orderBy(
        "target").collect()]
    return ForecastReport(window, totals["pending"], totals["bytes"], totals["overdue"],
                          totals["beyond"], totals["gone"], curve, targets,
                          _needs(table, margin_ms, retention_ms))


def _needs(table: DataFrame, margin_ms: int, retention_ms: int | None) -> list[PartitionNeed]:
    """Per partition: entries, bytes and the retention its longest-held original needs."""
    rows = table.groupBy("partition").agg(
        F.count(F.lit(1)).alias("count"), F.sum("bytes").alias("bytes"),
        F.max(F.col("due_ms") - F.col("ts_ms")).alias("held")).orderBy("partition").collect()
    return [PartitionNeed(r["partition"], r["count"], r["bytes"],
                          max(r["held"] or 0, 0) + margin_ms, retention_ms) for r in rows]


def forecast(spark: SparkSession, settings: Settings,
             window: ForecastWindow) -> tuple[ForecastReport, DataFrame]:
    """Run the forecast; return the report and the pending entries, persisted.

    The caller unpersists the entries when done (:func:`cube` makes the Parquet
    output from them). Raises :class:`confluent_kafka.KafkaException` when the cluster cannot be
    read, and :class:`kdelay.plumbing.topics.LayoutError` when the requests topic's
    configuration cannot be described.
    """
    table = entries(spark, settings).persist()
    retention = topics.retention_ms(topics.admin_client(settings), settings.requests_topic)
    return summarize(table, window, settings.retention_margin_ms, retention), table

