"""``kdelay retention check`` and ``kdelay retention set``: is every pending original kept
until it is due, and the requests topic's ``retention.ms``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from kdelay.cli.options import common_options, connected, reported
from kdelay.cli.view import DEFAULT_VIEW_DIR, JsonOutput, ViewDir, operator_view
from kdelay.protocol.durations import parse_duration_ms
from kdelay.view.display import retention_json, retention_tables
from kdelay.view.retention import check as check_retention
from kdelay.view.retention import set_retention


@common_options
def retention_check(
    ctx: typer.Context,
    as_json: JsonOutput = False,
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
) -> None:
    """Check that retention keeps every pending original until it is due.

    Exit status 0 when nothing is at risk, 3 when something is.
    """
    with operator_view(ctx, view_dir) as (settings, view, _, now_ms):
        report = check_retention(settings, view, now_ms)
    if as_json:
        typer.echo(retention_json(report))
    else:
        Console().print(retention_tables(report))
    raise typer.Exit(report.exit_code)


@common_options
def retention_set(
    ctx: typer.Context,
    retention: Annotated[str, typer.Argument(
        metavar="RETENTION", help="New retention.ms of the requests topic: ms, 30d, 72h, or -1.")],
) -> None:
    """Set the requests topic's retention.ms (and retention.bytes=-1).

    Restart the kdelay instances afterwards: they read retention at start.
    """
    with reported():
        new_ms = -1 if retention == "-1" else parse_duration_ms(retention)
        settings = connected(ctx)
        old = set_retention(settings, new_ms)
    typer.echo(f"{settings.requests_topic}: retention.ms {-1 if old is None else old} -> "
               f"{new_ms}, retention.bytes -1")
