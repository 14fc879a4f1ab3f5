"""The jobs end to end, as the CLI runs them: session, job, outputs.

``--output DIR`` writes, for the audit, ``requests.parquet`` (one row per
request) with ``lateness.png`` (per target) and ``outcomes.png`` (per hour);
for the forecast, ``due.parquet`` (count and bytes by due bucket, target and
partition) with ``due-curve.png``, ``targets.png`` and ``retention.png``.
Charts are drawn from aggregates collected to the driver, never from the
per-request rows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from pathlib import Path

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from kdelay.plumbing.settings import Settings
from kdelay.spark import audit, campaign, charts, forecast
from kdelay.spark.audit import AuditReport, AuditWindow
from kdelay.spark.campaign import CampaignReport, Columns, Rejects, Rules, Table
from kdelay.spark.forecast import ForecastReport, ForecastWindow
from kdelay.spark.progress import JobProgress
from kdelay.spark.session import SparkOptions, spark_session

LATENESS_EDGES = (-60_000, -1_000, 0, 10, 50, 100, 250, 500, 1_000, 5_000, 30_000, 60_000,
                  300_000, 3_600_000)
"""Bin edges (ms) of the lateness charts; the first and last bins take everything beyond."""
_HOUR_MS = 3_600_000


def run_audit(settings: Settings, options: SparkOptions, window: AuditWindow,
              output: Path | None = None) -> AuditReport:
    """Audit the deployment; with ``output``, also write the table and charts there.

    Raises :class:`~kdelay.spark.jars.JarsError` when the connector's jars are
    unavailable and :class:`confluent_kafka.KafkaException` when the cluster
    cannot be read.
    """
    with spark_session(options) as spark:
        report, table = audit.audit(spark, settings, window)
        try:
            if output is not None:
                write_audit(table, output)
            return report
        finally:
            table.unpersist()


def write_audit(table: DataFrame, output: Path) -> None:
    """Write the per-request Parquet table and the two audit charts under ``output``."""
    table.write.mode("overwrite").parquet(str(output / "requests.parquet"))
    bins = table.where(F.col("lateness_ms").isNotNull()).groupBy(
        "target", _bin(F.col("lateness_ms")).alias("bin")).count().collect()
    counts: dict[str, list[int]] = {}
    for row in bins:
        counts.setdefault(row["target"], [0] * (len(LATENESS_EDGES) - 1))[row["bin"]] = row["count"]
    charts.lateness_histograms(output / "lateness.png", LATENESS_EDGES, counts)
    hour = F.floor(F.coalesce("ts_ms", "due_ms") / _HOUR_MS).cast("bigint") * _HOUR_MS
    per_hour = table.groupBy(hour.alias("hour"), "outcome").count().collect()
    charts.outcomes_per_hour(output / "outcomes.png",
                             [(r["hour"], r["outcome"], r["count"]) for r in per_hour])


def _bin(lateness: Column) -> Column:
    """The lateness bin of each row: the last edge at or below it, clamped to the bins."""
    above = reduce(lambda a, b: a + b,
                   [F.when(lateness >= edge, 1).otherwise(0) for edge in LATENESS_EDGES])
    return F.greatest(F.lit(0), F.least(F.lit(len(LATENESS_EDGES) - 2), above - 1))


def run_forecast(settings: Settings, options: SparkOptions, window: ForecastWindow,
                 output: Path | None = None) -> ForecastReport:
    """Forecast the backlog; with ``output``, also write the cube and charts there.

    Raises as :func:`run_audit` does, and :class:`kdelay.plumbing.topics.LayoutError`
    when the requests topic is missing.
    """
    with spark_session(options) as spark:
        report, table = forecast.forecast(spark, settings, window)
        try:
            if output is not None:
                write_forecast(report, forecast.cube(table, window), output)
            return report
        finally:
            table.unpersist()


def write_forecast(report: ForecastReport, cube: DataFrame, output: Path) -> None:
    """Write the due cube as Parquet and the three forecast charts under ``output``."""
    cube.write.mode("overwrite").parquet(str(output / "due.parquet"))
    charts.due_curve(output / "due-curve.png", [b.start_ms for b in report.curve],
                     [b.count for b in report.curve], report.window.now_ms)
    charts.bars(output / "targets.png", "pending entries per target",
                [g.name for g in report.by_target], [g.count for g in report.by_target])
    needs = report.by_partition
    limit = None if not needs or needs[0].retention_ms is None else needs[0].retention_ms / 3.6e6
    charts.bars(output / "retention.png", "retention needed per partition (hours)",
                [str(n.partition) for n in needs], [n.needed_ms / 3.6e6 for n in needs], limit)



def run_schedule_table(settings: Settings, options: SparkOptions, table: Table,
                       columns: Columns, rules: Rules, rejects: Rejects, *,
                       dry_run: bool = False,
                       show: Callable[[str], None] = lambda _: None) -> CampaignReport:
    """Schedule every valid row of ``table`` (see :func:`kdelay.spark.campaign.schedule`),
    telling ``show`` the job's progress.

    Raises :class:`~kdelay.spark.campaign.CampaignError` for a table or mapping
    the job cannot use, and as :func:`run_audit` does.
    """
    with spark_session(options) as spark, JobProgress(spark, show) as progress:
        return campaign.schedule(spark, settings, table, columns, rules, rejects,
                                 dry_run=dry_run, phase=progress.phase)
