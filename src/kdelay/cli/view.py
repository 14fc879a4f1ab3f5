"""The operator's view: ``kdelay due``, ``backlog``, ``show``, ``tail`` and ``stats``.

``due``, ``backlog`` and ``show`` (and ``retention check``) read the whole
cluster's pending entries through :func:`operator_view`, from a local copy of
the changelog under ``--view-dir`` (never the service's ``--state-dir``), with
progress on stderr.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kdelay import controls
from kdelay.cli.options import (
    USER_ERROR_EXIT,
    common_options,
    connected,
    envvar,
    fail,
    failed,
    option,
    reported,
    settings_of,
)
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay.protocol.controls import Scope, Subject
from kdelay.protocol.durations import parse_duration_ms
from kdelay.view.backlog import DueQuery, backlog, due
from kdelay.view.display import (
    Held,
    backlog_json,
    backlog_tables,
    due_json,
    due_table,
    show_json,
    show_renderable,
)
from kdelay.view.lookup import NotARequest, lookup
from kdelay.view.pending import Originals, PendingView, ViewBusy
from kdelay.view.tail import follow

DEFAULT_VIEW_DIR = Path.home() / ".cache" / "kdelay" / "view"
ViewDir = Annotated[Path, option(
    "view-dir", "Where the operator commands keep their local copy of the changelog "
    "(never the service's --state-dir).", shown="~/.cache/kdelay/view")]
JsonOutput = Annotated[bool, option("json", "Print JSON instead of tables.")]
_BUCKETS = {"1m": 60_000, "1h": 3_600_000, "1d": 86_400_000}


@contextmanager
def operator_view(ctx: typer.Context, view_dir: Path) -> Iterator[
        tuple[Settings, PendingView, Originals, int]]:
    """Settings, the synced view, an original reader and "now", with errors reported.

    Progress of the changelog replay and of long reads goes to stderr.
    """
    with reported():
        settings = connected(ctx)
        now_ms = SystemClock().now_ms()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True),
                      transient=True) as bar:
            tasks: dict[str, TaskID] = {}

            def progress(what: str, done: int, total: int) -> None:
                if what not in tasks:
                    tasks[what] = bar.add_task(what, total=total)
                bar.update(tasks[what], completed=done, total=total)

            try:
                with PendingView(settings, view_dir, now_ms, progress) as view, \
                        Originals(settings, progress) as originals:
                    yield settings, view, originals, now_ms
            except (ViewBusy, NotARequest) as exc:
                failed(exc)


@common_options
def tail(
    ctx: typer.Context,
    topic: Annotated[str, typer.Argument(help="Topic to print records of.")],
    from_beginning: Annotated[bool, option(
        "from-beginning", "Start at the oldest record instead of the newest.")] = False,
    count: Annotated[int | None, option("count", "Exit after this many records.")] = None,
) -> None:
    """Print records arriving on TOPIC, one line each, until Ctrl-C (or --count records).

    A line: topic/partition/offset, timestamp (UTC), key, value and headers.
    Reads without a consumer group: commits nothing, disturbs nobody.
    """
    with reported(), contextlib.suppress(KeyboardInterrupt):
        follow(settings_of(ctx), topic, typer.echo, from_beginning=from_beginning, count=count,
               ready=functools.partial(typer.echo, err=True))


@common_options
def due_command(
    ctx: typer.Context,
    within: Annotated[str, option("within", "Window ahead of now: 30s, 1m, 2h.")] = "1m",
    overdue: Annotated[bool, option("overdue", "Only entries already due.")] = False,
    target: Annotated[str | None, option("target", "Only entries for this target.")] = None,
    partition: Annotated[int | None, option("partition", "Only this request partition.")]
    = None,
    lane: Annotated[str | None, option(
        "lane", "Only entries whose request names this lane (kdelay-lane).")] = None,
    limit: Annotated[int, option("limit", "Most entries listed; 0 for all.", shown=100)] = 100,
    as_json: JsonOutput = False,
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
) -> None:
    """List pending entries that are overdue or due within --within, in due order."""
    with reported():
        query = DueQuery(parse_duration_ms(within), overdue, target, partition, limit or None,
                         lane)
    with operator_view(ctx, view_dir) as (settings, view, originals, now_ms):
        listed = due(view, originals, query, now_ms)
        held = _held(settings)
    if as_json:
        for line in due_json(listed, settings.requests_topic, held):
            typer.echo(line)
    else:
        Console().print(due_table(listed, settings.requests_topic, now_ms, held))


def _routing_of(subject: Subject) -> tuple[str | None, str | None]:
    """The (target, lane) a record has for ``subject``'s control to apply to it."""
    if subject.scope is Scope.LANE:
        return None, subject.name
    return subject.name, None


def _held(settings: Settings) -> Held:
    """What the target controls in force say of a record to a target (of a lane)."""
    found = controls.read_controls_or_none(settings)
    return functools.partial(controls.holding, found)


@common_options
def backlog_command(
    ctx: typer.Context,
    bucket: Annotated[str, option("bucket", "Due-time bucket: 1m, 1h or 1d.", shown="1h")]
    = "1h",
    by: Annotated[str, option(
        "by", "Count per partition, or per target (reads every pending original).",
        shown="partition")] = "partition",
    lane: Annotated[str | None, option(
        "lane", "Only entries whose request names this lane (kdelay-lane); reads every "
        "pending original, and counts by target too.")] = None,
    as_json: JsonOutput = False,
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
) -> None:
    """How much is pending and when it comes due: totals, buckets, per partition or target."""
    if bucket not in _BUCKETS or by not in ("partition", "target"):
        fail("invalid-argument", "--bucket is one of 1m, 1h, 1d and --by one of "
             "partition, target", USER_ERROR_EXIT)
    with operator_view(ctx, view_dir) as (settings, view, originals, now_ms):
        reads = by == "target" or lane is not None
        result = backlog(view, now_ms, _BUCKETS[bucket], originals if reads else None, lane)
        found = controls.read_controls_or_none(settings)
    notes = [note for subject in sorted(found, key=str)
             if (note := controls.holding(found, *_routing_of(subject))) is not None]
    if as_json:
        typer.echo(backlog_json(result, notes))
    else:
        Console().print(backlog_tables(result, notes))


@common_options
def show_command(
    ctx: typer.Context,
    reference: Annotated[str, typer.Argument(
        metavar="ID_OR_COORDINATES", help="A schedule id, or topic/partition/offset.")],
    lane: Annotated[str | None, option(
        "lane", "The lane whose schedule id it is (kdelay-lane): an id is unique within "
        "its lane. Without it: the id of no lane, else of the first of --lanes that "
        "holds it.")] = None,
    as_json: JsonOutput = False,
    view_dir: ViewDir = DEFAULT_VIEW_DIR,
) -> None:
    """Show one request: whether it is pending, when and where it goes, and its original."""
    with operator_view(ctx, view_dir) as (settings, view, originals, now_ms):
        lanes = [lane] if lane is not None else [None, *settings.lanes]
        found = lookup(view, originals, reference, settings.requests_topic, now_ms, lanes,
                       settings.levels)
        held = _held(settings)
    if as_json:
        typer.echo(show_json(found, settings.requests_topic, held))
    else:
        Console().print(show_renderable(found, settings.requests_topic, now_ms, held))


@common_options
def stats(
    ctx: typer.Context,
    url: Annotated[list[str] | None, typer.Option(
        "--url", envvar=envvar("url"), show_default=False,
        help="A metrics endpoint (host:port or URL), repeatable; this host's --metrics-port "
             "when not given.")] = None,
    watch: Annotated[bool, option("watch", "Refresh until Ctrl-C.")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", envvar=envvar("json"), help="Print JSON (one line per refresh).")] = False,
    interval: Annotated[float, option(
        "interval", "Seconds between the readings rates are taken from.", shown=2.0)] = 2.0,
) -> None:
    """Summarise running instances from their metrics: rates, lateness, backlog, DLQ, skew."""
    from kdelay.view.stats import endpoints, show

    with reported():
        settings = settings_of(ctx)
        urls = endpoints(url or [], settings.metrics_port)
    raise typer.Exit(show(urls, console=Console(), watch=watch, as_json=as_json,
                          interval_s=interval))
