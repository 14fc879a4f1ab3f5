"""Moving pending schedules between deployments: ``kdelay export`` and ``kdelay import``.

Both read a deployment's pending entries through the operator's view (see
:mod:`kdelay.cli.view`), with progress on stderr and a summary line on stdout.
A file that cannot be read gives ``error[export-file-missing]``,
``error[bad-export-file]``, ``error[export-version-unknown]`` or
``error[export-truncated]`` and exit 2; requests not written in time give
``error[import-incomplete]`` and exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kdelay.cli.options import (
    KAFKA_ERROR_EXIT,
    USER_ERROR_EXIT,
    common_options,
    fail,
    failed,
    option,
    reported,
)
from kdelay.cli.view import DEFAULT_VIEW_DIR, ViewDir, operator_view
from kdelay.client import DelayProducer
from kdelay.view.archive import ArchiveError, ArchiveReader, ArchiveWriter, Header
from kdelay.view.export import (
    ExportError,
    RetentionTooShort,
    check_room,
    cluster_id,
    export_pending,
    import_archive,
)

INCOMPLETE_EXIT = 3


@common_options
def export_command(
    ctx: typer.Context,
    output: Annotated[Path, option(
        "output", "File to write; gzip-compressed when its name ends in .gz.",
        metavar="FILE")],
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
) -> None:
    """Write every pending schedule, with its original record, to FILE (JSON lines).

    Exit status 3 when some pending entries could not be exported (their
    original expired, is absent, or does not match).
    """
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


def _open(path: Path) -> ArchiveReader:
    """Open an export file, reporting a missing or unreadable one as a user error."""
    try:
        return ArchiveReader(path)
    except ArchiveError as exc:
        failed(exc)


@common_options
def import_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A file `kdelay export` wrote.")],
    check: Annotated[bool, option(
        "check", "Read and check FILE whole, send nothing.")] = False,
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
) -> None:
    """Schedule every entry of FILE again on this deployment, keeping due times and ids.

    Entries whose id is already pending here are skipped, so importing a file
    twice schedules nothing twice; entries already due are delivered at once.
    Refused (error[retention-too-short]) when the requests topic here would
    dead-letter the file's latest schedule as too far ahead.
    """
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
