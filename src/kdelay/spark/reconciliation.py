"""The audit by table: ``kdelay audit --ids-from TABLE`` answers, per row of a table of
schedule ids, what became of that row's schedule.

The audit's per-request table (:func:`kdelay.spark.audit.request_table`) is
reduced to one verdict per schedule id, taken from the id's request that got
the furthest, in this order:

``delivered``
    a request of the id was delivered (once or more; ``copies`` says how often);
``pending``
    one is pending or overdue: not yet due, or due and not yet out, which is
    where a record held by a paused target stays (never lost);
``cancelled``
    one was cancelled;
``rejected``
    one was dead-lettered: refused at intake (``bad-time``, ``missing-target``,
    ...) or failed at delivery (``expired``, ``undeliverable``); ``reason`` says which;
``lost``
    one is due longer ago than the settle time and left no trace;
``unknown``
    no request read carries the id: never sent, outside ``--since``/``--until``,
    deleted by the requests topic's retention, or only duplicates of a request
    in none of those states.

A request answered ``duplicate`` (deduplicated) never decides a verdict: the
request that holds the id does. So a campaign run twice reads exactly as one.
Every row of the table gets its id's verdict (rows sharing an id share it);
the table's own columns are kept and ``kdelay_*`` columns added
(:data:`ANSWER_COLUMNS`). Ids are matched as text, within ``--lane`` when one
is given (ids are unique per lane).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from kdelay.errors import KdelayError
from kdelay.plumbing.settings import Settings
from kdelay.spark import audit
from kdelay.spark.audit import AuditWindow
from kdelay.spark.session import SparkOptions, spark_session

DELIVERED, PENDING, CANCELLED, REJECTED, LOST, UNKNOWN = (
    "delivered", "pending", "cancelled", "rejected", "lost", "unknown")
VERDICTS = (DELIVERED, PENDING, CANCELLED, REJECTED, LOST, UNKNOWN)
_RANKED = {audit.DELIVERED_MORE: (0, DELIVERED), audit.DELIVERED_ONCE: (0, DELIVERED),
           audit.PENDING: (1, PENDING), audit.OVERDUE: (1, PENDING),
           audit.CANCELLED: (2, CANCELLED), audit.DEAD_LETTERED: (3, REJECTED),
           audit.LOST: (4, LOST)}
"""Which of an id's outcomes decides its verdict (lowest rank first); ``deduplicated``
decides nothing."""
ANSWER_COLUMNS = ("kdelay_verdict", "kdelay_outcome", "kdelay_reason", "kdelay_due_ms",
                  "kdelay_delivered_ms", "kdelay_copies", "kdelay_early", "kdelay_origin")
"""The columns added to each row: the verdict, the deciding request's audit outcome, DLQ
reason, due time, first delivery time, copies, whether it came early, and its origin."""
FORMATS = ("parquet", "csv", "json")


class TableError(KdelayError):
    """A table of ids that cannot be read; ``code`` is stable: ``ids-table-missing``,
    ``ids-table-format`` or ``ids-column-missing``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class IdsReport:
    """Rows of the table by verdict, the rejected ones by reason, and early deliveries."""

    rows: int
    counts: Mapping[str, int]
    reasons: Mapping[str, int] = field(default_factory=dict)
    early: int = 0

    def clean(self) -> bool:
        """True unless a row's schedule is lost, unknown or was delivered early."""
        return not (self.counts.get(LOST, 0) or self.counts.get(UNKNOWN, 0) or self.early)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: rows, one count per verdict, reasons, early."""
        return {"rows": self.rows, **{v: self.counts.get(v, 0) for v in VERDICTS},
                "rejected_by_reason": dict(self.reasons), "early": self.early}


def format_of(path: str, given: str | None) -> str:
    """The table's format: ``given``, else from the path's extension (default Parquet)."""
    if given is not None:
        if given not in FORMATS:
            raise TableError("ids-table-format", f"--ids-format {given!r} is not one of "
                             f"{', '.join(FORMATS)}")
        return given
    for name in FORMATS:
        if path.rstrip("/").endswith((f".{name}", f".{name}.gz", ".jsonl")):
            return "json" if path.endswith(".jsonl") else name
    return "parquet"


def read_table(spark: SparkSession, path: str, given: str | None, column: str) -> DataFrame:
    """Read the table at ``path`` (a file, a directory or a glob); check it has ``column``.

    CSV is read with a header line. Raises :class:`TableError` when nothing is
    there or the column is missing.
    """
    if not any(ch in path for ch in "*?[") and "://" not in path and not Path(path).exists():
        raise TableError("ids-table-missing", f"no table at {path}")
    fmt = format_of(path, given)
    reader = spark.read.option("header", "true") if fmt == "csv" else spark.read
    table = reader.format(fmt).load(path)
    if column not in table.columns:
        raise TableError("ids-column-missing", f"{path} has no column {column!r} (it has "
                         f"{', '.join(table.columns)}); name the ids' column with --id-column")
    return table


def verdicts(requests: DataFrame) -> DataFrame:
    """One row per schedule id of the audit's per-request table: the deciding request's
    verdict, outcome, reason, due, first delivery, copies, earliness and origin."""
    rank = F.create_map(*(F.lit(x) for k, (r, _) in _RANKED.items() for x in (k, r)))
    word = F.create_map(*(F.lit(x) for k, (_, v) in _RANKED.items() for x in (k, v)))
    deciding = requests.where(F.col("schedule_id").isNotNull() & rank[F.col("outcome")]
                              .isNotNull()).withColumn("rank", rank[F.col("outcome")])
    order = Window.partitionBy("schedule_id").orderBy("rank", "ts_ms", "origin")
    first = deciding.withColumn("n", F.row_number().over(order)).where(F.col("n") == 1)
    return first.select(
        F.col("schedule_id").alias("kdelay_id"), word[F.col("outcome")].alias("kdelay_verdict"),
        F.col("outcome").alias("kdelay_outcome"), F.col("reason").alias("kdelay_reason"),
        F.col("due_ms").alias("kdelay_due_ms"), F.col("first_ms").alias("kdelay_delivered_ms"),
        F.col("copies").alias("kdelay_copies"), F.col("early").alias("kdelay_early"),
        F.col("origin").alias("kdelay_origin"))


def answered(table: DataFrame, column: str, found: DataFrame) -> DataFrame:
    """``table`` with each row's answer (:data:`ANSWER_COLUMNS`); ``unknown`` where no
    request carries the row's id."""
    key = F.col(column).cast("string")
    joined = table.withColumn("kdelay_id", key).join(found, "kdelay_id", "left")
    return joined.withColumn("kdelay_verdict", F.coalesce("kdelay_verdict", F.lit(UNKNOWN))
                             ).withColumn("kdelay_copies", F.coalesce("kdelay_copies", F.lit(0))
                                          ).drop("kdelay_id")


def summarize(rows: DataFrame) -> IdsReport:
    """Count the answered rows by verdict and reason (aggregates only reach the driver)."""
    counts: dict[str, int] = {}
    reasons: dict[str, int] = {}
    early = total = 0
    for row in rows.groupBy("kdelay_verdict", "kdelay_reason").agg(
            F.count(F.lit(1)).alias("n"), F.count_if(F.col("kdelay_early")).alias("early")
    ).collect():
        verdict, n = row["kdelay_verdict"], row["n"]
        counts[verdict] = counts.get(verdict, 0) + n
        total, early = total + n, early + row["early"]
        if verdict == REJECTED:
            reasons[row["kdelay_reason"] or "?"] = n
    return IdsReport(total, counts, dict(sorted(reasons.items())), early)


def run_reconcile(settings: Settings, options: SparkOptions, window: AuditWindow, path: str,
                  column: str, given_format: str | None = None,
                  output: Path | None = None) -> IdsReport:
    """:func:`reconcile` in a session on ``options.master``."""
    with spark_session(options) as spark:
        return reconcile(spark, settings, window, path, column, given_format, output)


def reconcile(spark: SparkSession, settings: Settings, window: AuditWindow, path: str,
              column: str, given_format: str | None = None,
              output: Path | None = None) -> IdsReport:
    """Answer every row of ``table`` (ids in ``column``); with ``output``, write the
    answered rows to ``output/ids.parquet``. Raises :class:`TableError` for a table
    that cannot be read, and as the audit does."""
    table = read_table(spark, path, given_format, column)
    tables = audit.request_table(spark, settings, window)
    found = verdicts(tables.requests).persist()
    try:
        rows = answered(table, column, found).persist()
        try:
            if output is not None:
                rows.write.mode("overwrite").parquet(str(output / "ids.parquet"))
            return summarize(rows)
        finally:
            rows.unpersist()
    finally:
        found.unpersist()
        for frame in tables.cached:
            frame.unpersist()

