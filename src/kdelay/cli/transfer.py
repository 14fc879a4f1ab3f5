"""Moving pending schedules between deployments: ``kdelay export`` and ``kdelay import``.

Two formats. JSON lines (the default) read a deployment's pending entries
through the operator's view (see :mod:`kdelay.cli.view`); Parquet
(``--format parquet``, a directory) goes through Spark from the changelog and
the requests topic (:mod:`kdelay.spark.migration`, the spark extra), for any
number of schedules. ``kdelay import`` takes either: a directory is a Parquet
export. Progress goes to stderr and a summary line to stdout. A file that
cannot be read gives ``error[export-file-missing]``, ``error[bad-export-file]``,
``error[export-version-unknown]``, ``error[export-truncated]`` or
``error[export-without-values]`` and exit 2; requests not written in time give
``error[import-incomplete]`` and exit 1.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from kdelay.cli.options import (
    KAFKA_ERROR_EXIT,
    USER_ERROR_EXIT,
    common_options,
    connected,
    fail,
    failed,
    option,
    reported,
)
from kdelay.cli.spark import CacheDir, SparkConf, SparkMaster, spark_job, spark_options
from kdelay.cli.view import DEFAULT_VIEW_DIR, ViewDir, operator_view
from kdelay.client import DelayProducer
from kdelay.plumbing.clock import SystemClock
from kdelay.view.archive import ArchiveError, ArchiveReader, ArchiveWriter, Header
from kdelay.view.export import (
    ExportError,
    RetentionTooShort,
    check_room,
    cluster_id,
    export_pending,
    import_archive,
)

if TYPE_CHECKING:
    from kdelay.spark.migration import Manifest

INCOMPLETE_EXIT = 3


class ExportFormat(StrEnum):
    """The export's format: JSON lines (one file) or Parquet (a directory, through Spark)."""

    JSONL = "jsonl"
    PARQUET = "parquet"


@common_options
def export_command(
    ctx: typer.Context,
    output: Annotated[Path, option(
        "output", "File to write (gzip-compressed when its name ends in .gz); with "
        "--format parquet, the directory.", metavar="PATH")],
    format: Annotated[ExportFormat, option(
        "format", "jsonl: one file through the operator's view; parquet: a directory "
        "written by Spark, for any number of schedules.", shown="jsonl")] = ExportFormat.JSONL,
    no_values: Annotated[bool, option(
        "no-values", "Parquet only: leave the records' values out.")] = False,
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
    master: SparkMaster = "local[*]",
    conf: SparkConf = None,
    cache_dir: CacheDir = None,
) -> None:
    """Write every pending schedule, with its original record, to PATH.

    Exit status 3 when some pending entries could not be exported (their
    original expired, is absent, or does not match).
    """
    if format is ExportFormat.PARQUET:
        _export_parquet(ctx, output, not no_values, spark_options(master, conf, cache_dir))
        return
    if no_values:
        fail("invalid-argument", "--no-values needs --format parquet", USER_ERROR_EXIT)
    with operator_view(ctx, view_dir) as (settings, view, originals, now_ms):
        header = Header(settings.requests_topic, cluster_id(settings), now_ms, 0, None)
        try:
            summary = export_pending(view, originals, lambda h: ArchiveWriter(output, h),
                                     header, view_dir)
        except ExportError as exc:
            failed(exc)
        except OSError as exc:
            fail("export-write-failed", f"cannot write {output}: {exc}", USER_ERROR_EXIT)
    left = ", ".join(f"{n} {why}" for why, n in sorted(summary.unexported.items()))
    typer.echo(f"exported {summary.exported} of {summary.pending} pending schedules to "
               f"{output}" + (f"; not exported: {left}" if left else ""))
    if summary.unexported:
        raise typer.Exit(INCOMPLETE_EXIT)


def _export_parquet(ctx: typer.Context, output: Path, values: bool, options: Any) -> None:
    """``export --format parquet``: the Spark job, its progress on stderr, the summary line."""
    with reported(), spark_job():
        from kdelay.spark.migration import MigrationError, run_export

        settings = connected(ctx)
        source_cluster = cluster_id(settings)
        with Console(stderr=True).status("exporting with Spark") as status:
            try:
                manifest = run_export(settings, options, output, SystemClock().now_ms(),
                                      status.update, values=values, cluster_id=source_cluster)
            except MigrationError as exc:
                failed(exc)
    left = ", ".join(f"{n} {why}" for why, n in sorted(manifest.unexported.items()))
    typer.echo(f"exported {manifest.exported} of {manifest.pending} pending schedules to "
               f"{output}" + ("" if values else " (without values)")
               + (f"; not exported: {left}" if left else ""))
    if manifest.unexported:
        raise typer.Exit(INCOMPLETE_EXIT)


def _open(path: Path) -> ArchiveReader:
    """Open an export file, reporting a missing or unreadable one as a user error."""
    try:
        return ArchiveReader(path)
    except ArchiveError as exc:
        failed(exc)


@common_options
def import_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(
        metavar="PATH", help="A file or (Parquet) directory `kdelay export` wrote.")],
    check: Annotated[bool, option(
        "check", "Read and check PATH whole, send nothing.")] = False,
    allow_no_values: Annotated[bool, option(
        "allow-no-values", "Import a Parquet export written with --no-values: every record "
        "is scheduled with a null value.")] = False,
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
    master: SparkMaster = "local[*]",
    conf: SparkConf = None,
    cache_dir: CacheDir = None,
) -> None:
    """Schedule every entry of PATH again on this deployment, keeping due times and ids.

    A JSON-lines file: entries whose id is already pending here are skipped. A
    Parquet directory: every row is written through Spark's Kafka sink to its
    id's partition, and the service answers an id already pending
    ``duplicate``. Either way importing twice schedules nothing twice; entries
    already due are delivered at once. Refused (error[retention-too-short])
    when the requests topic here would dead-letter the latest schedule as too
    far ahead.
    """
    if file.is_dir():
        _import_parquet(ctx, file, check, allow_no_values, spark_options(master, conf, cache_dir))
        return
    with _open(file) as reader:
        if check:
            _check(reader)
            return
        with operator_view(ctx, view_dir) as (settings, view, _, now_ms), \
                DelayProducer(settings) as producer:
            try:
                check_room(settings, reader.header, now_ms)
                summary = import_archive(
                    reader, producer, lambda sid: view.find_id(sid) is not None,
                    lambda done, total: view.report("importing schedules", done, total))
            except (ArchiveError, RetentionTooShort) as exc:
                failed(exc)
            except TimeoutError as exc:
                fail("import-incomplete", f"{exc}; importing the same file again is safe: "
                     "ids still pending are skipped", KAFKA_ERROR_EXIT)
    typer.echo(f"sent {summary.sent}, skipped {summary.skipped} already pending "
               f"({summary.derived} entries without an id got a derived id)")


def _check(reader: ArchiveReader) -> None:
    """Read every entry of ``reader``; print what the file holds or its error."""
    with reported():
        try:
            count = sum(1 for _ in reader.entries())
        except ArchiveError as exc:
            failed(exc)
    typer.echo(f"{reader.path}: {count} entries from {reader.header.requests_topic} "
               f"(cluster {reader.header.cluster_id or 'unknown'}), complete")


def _manifest(directory: Path) -> Manifest:
    """The manifest of a Parquet export, reporting a missing or unreadable one."""
    from kdelay.spark.migration import MigrationError, read_manifest

    try:
        return read_manifest(directory)
    except MigrationError as exc:
        failed(exc)


def _import_parquet(ctx: typer.Context, directory: Path, check: bool, allow_no_values: bool,
                    options: Any) -> None:
    """``import`` of a Parquet export directory: the Spark job and its summary line."""
    with reported(), spark_job():
        from kdelay.spark.migration import MigrationError, run_import

        manifest = _manifest(directory)
        if check:
            typer.echo(f"{directory}: {manifest.exported} entries from "
                       f"{manifest.requests_topic} (cluster {manifest.cluster_id or 'unknown'})"
                       f"{'' if manifest.values else ', without values'}, complete")
            return
        settings = connected(ctx)
        header = Header(manifest.requests_topic, manifest.cluster_id, manifest.exported_ms,
                        manifest.pending, manifest.latest_due_ms)
        with Console(stderr=True).status("importing with Spark") as status:
            try:
                check_room(settings, header, SystemClock().now_ms())
                summary = run_import(settings, options, directory, manifest, status.update,
                                     allow_no_values=allow_no_values)
            except (MigrationError, RetentionTooShort) as exc:
                failed(exc)
    typer.echo(f"sent {summary.sent} requests, each to its id's partition ({summary.derived} "
               "entries without an id got a derived id); ids already pending here are "
               "answered duplicate and not scheduled twice")
