"""Rich tables of the jobs' reports, as ``kdelay audit``, ``forecast`` and ``schedule-table``
print them."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Group as Stack
from rich.table import Table

from kdelay.spark.audit import (
    DEAD_LETTERED,
    OUTCOMES,
    RESCHEDULE_OUTCOMES,
    AuditReport,
    Lateness,
)
from kdelay.spark.campaign import CampaignReport
from kdelay.spark.forecast import ForecastReport
from kdelay.spark.reconciliation import REJECTED, VERDICTS, IdsReport


def audit_tables(report: AuditReport) -> Stack:
    """The outcome counts (with DLQ reasons), the reschedules' and the lateness per target."""
    outcomes = Table("outcome", "requests", title=f"audit of {report.requests} requests")
    for outcome in OUTCOMES:
        outcomes.add_row(outcome, str(report.counts.get(outcome, 0)))
        if outcome == DEAD_LETTERED:
            for reason, count in report.reasons.items():
                outcomes.add_row(f"  {reason}", str(count))
    outcomes.add_row("extra copies", str(report.extra_copies))
    outcomes.add_row("early deliveries", str(report.early))
    lateness = Table("target", "p50 ms", "p99 ms", "max ms", title="lateness (first delivery)")
    lateness.add_row("all", *_cells(report.lateness))
    for target, stats in report.lateness_by_target.items():
        lateness.add_row(target, *_cells(stats))
    moves = Table("outcome", "reschedules", title="reschedule requests")
    for outcome in RESCHEDULE_OUTCOMES:
        moves.add_row(outcome, str(report.reschedules.get(outcome, 0)))
    parts: list[Table] = [outcomes, moves, lateness]
    if report.missing_topics:
        missing = Table("topic", title="topics named but missing (not read)")
        for topic in report.missing_topics:
            missing.add_row(topic)
        parts.append(missing)
    return Stack(*parts)


def _cells(stats: Lateness) -> list[str]:
    return ["-" if v is None else str(v) for v in (stats.p50, stats.p99, stats.max)]


def forecast_tables(report: ForecastReport) -> Stack:
    """Totals, the peaks of the due curve, targets and per-partition retention."""
    totals = Table("pending", "bytes", "overdue", "beyond horizon", "originals gone",
                   title="pending entries")
    totals.add_row(*map(str, (report.pending, report.bytes, report.overdue,
                              report.beyond_horizon, report.missing_originals)))
    peaks = Table("bucket start (UTC)", "entries", "bytes", title="busiest due buckets")
    for bucket in report.peaks:
        peaks.add_row(_utc(bucket.start_ms), str(bucket.count), str(bucket.bytes))
    targets = Table("target", "entries", "bytes", title="by target")
    for group in report.by_target:
        targets.add_row(group.name, str(group.count), str(group.bytes))
    partitions = Table("partition", "entries", "bytes", "needed retention ms", "retention.ms",
                       "covered", title="by request partition")
    for need in report.by_partition:
        partitions.add_row(str(need.partition), str(need.count), str(need.bytes),
                           str(need.needed_ms),
                           "unlimited" if need.retention_ms is None else str(need.retention_ms),
                           "yes" if need.covered else "NO")
    return Stack(totals, peaks, targets, partitions)


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def ids_tables(report: IdsReport) -> Table:
    """The rows of an ``--ids-from`` table by verdict, the rejected ones by reason."""
    verdicts = Table("verdict", "rows", title=f"audit of {report.rows} table rows by id")
    for verdict in VERDICTS:
        verdicts.add_row(verdict, str(report.counts.get(verdict, 0)))
        if verdict == REJECTED:
            for reason, count in report.reasons.items():
                verdicts.add_row(f"  {reason}", str(count))
    verdicts.add_row("early deliveries", str(report.early))
    return verdicts


def campaign_table(report: CampaignReport) -> Table:
    """Rows read, requests sent (or, in a dry run, that would be) and rejects by reason."""
    verb = "would send" if report.dry_run else "sent"
    table = Table("rows", "count", title=f"schedule-table to {report.requests_topic} "
                  f"({report.partitions} partitions){' (dry run)' if report.dry_run else ''}")
    table.add_row("read", str(report.rows))
    table.add_row(verb, str(report.sent))
    table.add_row("rejected", str(sum(report.rejected.values())))
    for reason, count in report.rejected.items():
        table.add_row(f"  {reason}", str(count))
    return table
