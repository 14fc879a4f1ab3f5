"""The Spark jobs: ``kdelay audit``, ``kdelay forecast`` and ``kdelay schedule-table``.

They need the ``spark`` extra; :mod:`kdelay.spark` is imported only inside
them, so the rest of the command line works without PySpark.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import orjson
import typer
from rich.console import Console

from kdelay.cli.options import (
    KAFKA_ERROR_EXIT,
    USER_ERROR_EXIT,
    common_options,
    connected,
    envvar,
    fail,
    failed,
    option,
    reported,
)
from kdelay.client import parse_due
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Guarantee
from kdelay.protocol.durations import parse_duration_ms

SPARK_MODULES = frozenset({"pyspark", "py4j", "matplotlib", "pandas", "pyarrow"})
AUDIT_FAILED_EXIT = 4
REJECTED_EXIT = 4

SparkMaster = Annotated[str, option(
    "master", "Spark master URL: local[*], spark://HOST:7077, yarn, k8s://...",
    shown="local[*]")]
SparkConf = Annotated[list[str] | None, typer.Option(
    "--conf", envvar=envvar("conf"), show_default=False, metavar="KEY=VALUE",
    help="A Spark setting (repeatable), as spark-submit's --conf.")]
CacheDir = Annotated[Path | None, option(
    "cache-dir", "Where the Kafka connector's jars are kept (fetched with Maven once); "
    "the clone's .cache by default.")]
JsonFlag = Annotated[bool, option("json", "Print one JSON object instead of tables.")]
OutputDir = Annotated[Path | None, option(
    "output", "Directory for the Parquet table and PNG charts.", metavar="DIR")]


@contextmanager
def spark_job() -> Iterator[None]:
    """Report a missing spark extra, unavailable jars and failed Spark jobs as one line."""
    try:
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import PySparkException

        from kdelay.spark.campaign import CampaignError
        from kdelay.spark.jars import JarsError
    except ModuleNotFoundError as exc:
        fail("spark-missing", f"the Spark jobs need the spark extra ({exc.name} is not "
             "installed): pip install 'kdelay[spark]'", USER_ERROR_EXIT)
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SPARK_MODULES:
            raise
        fail("spark-missing", f"the Spark jobs need the spark extra ({exc.name} is not "
             "installed): pip install 'kdelay[spark]'", USER_ERROR_EXIT)
    except (JarsError, CampaignError) as exc:
        failed(exc)
    except PySparkException as exc:
        fail("spark", str(exc).strip().splitlines()[0], KAFKA_ERROR_EXIT)
    except Py4JJavaError as exc:  # Spark's JVM refused (a bad --conf, a missing directory)
        fail("spark", java_message(exc), KAFKA_ERROR_EXIT)


def java_message(exc: Any) -> str:
    """The Java exception behind a Py4J error, as one line (``java.io.X: what``)."""
    try:
        return str(exc.java_exception.toString()).strip().splitlines()[0]
    except Exception:  # the JVM may be gone: the Python side's own text
        lines = [line.strip(": ") for line in str(exc).splitlines() if line.strip(": ")]
        return lines[-1] if lines else type(exc).__name__


def spark_options(master: str, conf: list[str] | None, cache_dir: Path | None) -> Any:
    """The session options of a Spark command (a ``kdelay.spark.session.SparkOptions``)."""
    from kdelay.spark.session import SparkOptions, parse_conf

    given = {"cache_dir": cache_dir} if cache_dir is not None else {}
    return SparkOptions(master=master, conf=parse_conf(conf or []), **given)


def _show(report_json: dict[str, Any] | None, tables: Any) -> None:
    """Print a job's report: JSON when given, else its rich tables."""
    if report_json is not None:
        typer.echo(orjson.dumps(report_json, option=orjson.OPT_INDENT_2).decode())
    else:
        Console().print(tables)


@common_options
def audit(
    ctx: typer.Context,
    settle: Annotated[str, option(
        "settle", "A request due longer ago than this with no trace at all is lost.",
        shown="60s")] = "60s",
    since: Annotated[str | None, option(
        "since", "Only requests with record time at or after this (epoch ms or ISO-8601).")]
    = None,
    until: Annotated[str | None, option(
        "until", "Only requests with record time before this (epoch ms or ISO-8601).")] = None,
    targets: Annotated[list[str] | None, typer.Option(
        "--targets", envvar=envvar("targets"), show_default=False,
        help="Target topics to read (repeatable); those the requests name when not given.")]
    = None,
    lane: Annotated[str | None, option(
        "lane", "Only requests that name this lane (kdelay-lane).")] = None,
    expect: Annotated[Guarantee, option(
        "expect", "With exactly-once, a request delivered more than once fails the audit.",
        shown="at-least-once")] = Guarantee.AT_LEAST_ONCE,
    ids_from: Annotated[str | None, option(
        "ids-from", "A table of schedule ids (Parquet, CSV or JSON; a path or a glob): "
        "answer per row whether its schedule was delivered, is pending, was rejected or "
        "is lost; with --output, the rows with their answers go to DIR/ids.parquet.",
        metavar="TABLE")] = None,
    id_column: Annotated[str, option(
        "id-column", "The column of --ids-from that holds the ids.", shown="id")] = "id",
    ids_format: Annotated[str | None, option(
        "ids-format", "parquet, csv or json; from TABLE's extension when not given.")] = None,
    json: JsonFlag = False,
    output: OutputDir = None,
    master: SparkMaster = "local[*]",
    conf: SparkConf = None,
    cache_dir: CacheDir = None,
) -> None:
    """Reconcile every schedule request with its deliveries, DLQ record or pending entry.

    Exit status 4 when a request is lost or delivered early (or, with
    --expect exactly-once, delivered more than once); 0 when clean. With
    --ids-from, exit status 4 when a row's schedule is lost, unknown or came early.
    """
    with reported(), spark_job():
        from kdelay.spark.audit import AuditWindow
        from kdelay.spark.jobs import run_audit
        from kdelay.spark.tables import audit_tables

        window = AuditWindow(
            now_ms=SystemClock().now_ms(), settle_ms=parse_duration_ms(settle),
            since_ms=parse_due(since) if since is not None else None,
            until_ms=parse_due(until) if until is not None else None,
            targets=tuple(targets) if targets else None, lane=lane)
        settings = connected(ctx)
        if ids_from is not None:
            _audit_ids(settings, window, ids_from, id_column, ids_format, json, output,
                       spark_options(master, conf, cache_dir))
        with Console(stderr=True).status("auditing with Spark"):
            report = run_audit(settings, spark_options(master, conf, cache_dir), window, output)
    _show(report.to_json() if json else None, audit_tables(report))
    clean = report.clean(exactly_once=expect is Guarantee.EXACTLY_ONCE)
    raise typer.Exit(0 if clean else AUDIT_FAILED_EXIT)


def _audit_ids(settings: Any, window: Any, path: str, column: str, given_format: str | None,
               json: bool, output: Path | None, options: Any) -> NoReturn:
    """``audit --ids-from``: answer the table's rows, print the counts, exit 0 or 4."""
    from kdelay.spark.reconciliation import TableError, run_reconcile
    from kdelay.spark.tables import ids_tables

    with Console(stderr=True).status("auditing the table's ids with Spark"):
        try:
            report = run_reconcile(settings, options, window, path, column, given_format,
                                   output)
        except TableError as exc:
            failed(exc)
    _show(report.to_json() if json else None, ids_tables(report))
    raise typer.Exit(0 if report.clean() else AUDIT_FAILED_EXIT)


@common_options
def forecast(
    ctx: typer.Context,
    horizon: Annotated[str, option("horizon", "How far ahead the due curve looks.",
                                   shown="24h")] = "24h",
    bucket: Annotated[str, option("bucket", "Width of one due-time bucket.", shown="1m")]
    = "1m",
    json: JsonFlag = False,
    output: OutputDir = None,
    master: SparkMaster = "local[*]",
    conf: SparkConf = None,
    cache_dir: CacheDir = None,
) -> None:
    """Forecast the pending backlog: due curve and peaks, targets, retention per partition."""
    with reported(), spark_job():
        from kdelay.spark.forecast import ForecastWindow
        from kdelay.spark.jobs import run_forecast
        from kdelay.spark.tables import forecast_tables

        window = ForecastWindow(now_ms=SystemClock().now_ms(),
                                horizon_ms=parse_duration_ms(horizon),
                                bucket_ms=parse_duration_ms(bucket))
        settings = connected(ctx)
        with Console(stderr=True).status("forecasting with Spark"):
            report = run_forecast(settings, spark_options(master, conf, cache_dir), window,
                                  output)
    _show(report.to_json() if json else None, forecast_tables(report))


def _header_columns(pairs: list[str] | None) -> dict[str, str]:
    """``NAME=COLUMN`` options as a mapping; ValueError for one without ``=``."""
    found: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, column = pair.partition("=")
        if not sep or not name or not column:
            raise ValueError(f"--header {pair!r} is not NAME=COLUMN")
        found[name] = column
    return found


def _column(name: str, help: str) -> Any:
    return option(name, help, metavar="COLUMN")


@common_options
def schedule_table(
    ctx: typer.Context,
    table: Annotated[str, typer.Argument(
        metavar="TABLE", help="A Parquet, CSV or JSON table: a file, a directory or a glob, "
        "local or any URI Spark reads.", show_default=False)],
    table_format: Annotated[str | None, typer.Option(
        "--table-format", envvar=envvar("table-format"), show_default=False,
        help="parquet, csv or json; from the path's extension when not given.")] = None,
    target: Annotated[str | None, option(
        "target", "The target topic of every row (else --target-column).")] = None,
    target_column: Annotated[str | None, _column(
        "target-column", "The column naming each row's target topic (default: target).")]
    = None,
    due_column: Annotated[str | None, _column(
        "due-column", "The due time's column: a timestamp, epoch ms or ISO-8601 with a zone "
        "(default: due).")] = None,
    delay_column: Annotated[str | None, _column(
        "delay-column", "The delay's column instead: ms, or such as 90s, 2h.")] = None,
    id_column: Annotated[str | None, _column(
        "id-column", "The schedule id's column (default: id, when the table has one).")]
    = None,
    id_from: Annotated[str | None, option(
        "id-from", "Derive each id from these columns (comma-separated; default: every "
        "column when there is no id column).", metavar="COLUMN,...")] = None,
    id_prefix: Annotated[str, option(
        "id-prefix", "Put this before every derived id.")] = "",
    key_column: Annotated[str | None, _column("key-column", "The record key's column.")]
    = None,
    value_column: Annotated[str | None, _column(
        "value-column", "The record value's column (default: the whole row as JSON).")]
    = None,
    header: Annotated[list[str] | None, typer.Option(
        "--header", envvar=envvar("header"), show_default=False, metavar="NAME=COLUMN",
        help="A header NAME carrying the column's text (repeatable).")] = None,
    lane: Annotated[str | None, option("lane", "The lane of every row (kdelay-lane).")]
    = None,
    lane_column: Annotated[str | None, _column("lane-column", "The column naming each "
                                               "row's lane.")] = None,
    past_tolerance: Annotated[str, option(
        "past-tolerance", "Reject (bad-time) a due time further than this before the job "
        "started.", shown="10m")] = "10m",
    rejects: Annotated[str, option(
        "rejects", "Directory for the rejected rows (overwritten every run).",
        shown="kdelay-rejects", metavar="DIR")] = "kdelay-rejects",
    rejects_format: Annotated[str, option(
        "rejects-format", "parquet or json.", shown="parquet")] = "parquet",
    dry_run: Annotated[bool, option(
        "dry-run", "Validate and count every row, write the rejects, send nothing.")] = False,
    json: JsonFlag = False,
    master: SparkMaster = "local[*]",
    conf: SparkConf = None,
    cache_dir: CacheDir = None,
) -> None:
    """Schedule one request per row of a table, each on its id's partition.

    A re-run schedules nothing twice: every row has an id, and kdelay answers
    a second request with the same id as a duplicate. Rows that cannot become
    a valid request go to --rejects with a protocol error code. Exit status 4
    when any row was rejected; 0 when every row was sent (or, with --dry-run,
    would be).
    """
    with reported(), spark_job():
        from kdelay.spark.campaign import Columns, Rejects, Table, deployment_rules
        from kdelay.spark.jobs import run_schedule_table
        from kdelay.spark.tables import campaign_table

        columns = Columns(
            target=target, target_column=target_column, due=due_column, delay=delay_column,
            id_column=id_column,
            id_from=tuple(c.strip() for c in id_from.split(",") if c.strip()) if id_from else (),
            id_prefix=id_prefix, key=key_column, value=value_column,
            headers=_header_columns(header), lane=lane, lane_column=lane_column)
        where = Rejects(rejects, rejects_format)
        tolerance = parse_duration_ms(past_tolerance)
        settings = connected(ctx)
        rules = deployment_rules(settings, SystemClock().now_ms(), tolerance)
        with Console(stderr=True).status("scheduling with Spark") as status:
            report = run_schedule_table(
                settings, spark_options(master, conf, cache_dir), Table(table, table_format),
                columns, rules, where, dry_run=dry_run, show=status.update)
    _show(report.to_json() if json else None, campaign_table(report))
    raise typer.Exit(REJECTED_EXIT if report.rejected else 0)
