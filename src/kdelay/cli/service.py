"""The service's commands: ``kdelay run``, ``kdelay topics create`` and ``kdelay restore``."""

from __future__ import annotations

import functools
import sys
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

from kdelay.cli import options
from kdelay.cli.options import common_options, connected, envvar, option, reported, settings_of
from kdelay.plumbing import identity
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.logs import LogFormat
from kdelay.plumbing.logs import configure as configure_logs
from kdelay.plumbing.settings import Settings, SettingsError
from kdelay.plumbing.topics import admin_client, create_topics, tombstones_kept_ms, topic_config
from kdelay.state.changelog import Restorer, Staleness, rebuild
from kdelay.state.index import store_path

_WEEK_MS = 7 * 24 * 3_600_000


@common_options
def run(
    ctx: typer.Context,
    check: Annotated[bool, option(
        "check", "Check the settings and the topic layout, then exit.")] = False,
    workers: Annotated[int, option(
        "workers", "Service processes, one core each, under one supervising parent; each "
        "serves its share of the partitions from <state-dir>/worker-<i>, with metrics on "
        "--metrics-port + i. 1: the service runs in this process.", shown=1)] = 1,
    log_level: Annotated[str, option(
        "log-level", "Log level of the service (DEBUG, INFO, WARNING, ERROR).")] = "INFO",
    log_format: Annotated[LogFormat, option(
        "log-format", "Log lines as text, or as JSON objects (time, level, logger, message).",
        shown=LogFormat.TEXT.value)] = LogFormat.TEXT,
) -> None:
    """Run the delay service: schedule requests and deliver them when due."""
    with reported():
        settings = settings_of(ctx)
        if workers < 1:
            raise SettingsError("invalid-setting", f"workers must be at least 1, got {workers}")
        configure_logs(log_level, log_format, identity.of(settings).member_id)
        options.check_connection(settings.client_config("probe"))
    from kdelay.engine.runner import run_service, run_workers

    if workers == 1:
        with reported(value_errors=False):
            exit_code = run_service(settings, check=check)
        raise typer.Exit(exit_code)
    with reported():
        exit_code = run_workers(settings, workers,
                                functools.partial(serve_worker, log_level, log_format),
                                check=check)
    raise typer.Exit(exit_code)


def serve_worker(log_level: str, log_format: LogFormat, parent: int, settings: Settings) -> None:
    """Run one worker of ``kdelay run --workers N``: the service, in a fresh interpreter.

    Errors end the worker as they end a single ``kdelay run``: one
    ``error[...]`` line and the same exit code, which the parent reads.
    """
    from kdelay.engine.runner import run_service
    from kdelay.engine.workers import bind_to_parent

    bind_to_parent(parent)
    try:
        with reported():
            configure_logs(log_level, log_format, identity.of(settings).member_id)
        with reported(value_errors=False):
            exit_code = run_service(settings, check=False)
    except typer.Exit as exc:
        exit_code = exc.exit_code
    sys.exit(exit_code)


@common_options
def topics_create(
    ctx: typer.Context,
    partitions: Annotated[int, option(
        "partitions", "Partitions of the requests and changelog topics.", shown=3)] = 3,
    replication_factor: Annotated[int, option(
        "replication-factor", "Replication factor; -1 is the broker default.", shown=1)] = 1,
    retention_ms: Annotated[int, option(
        "retention-ms", "retention.ms of the requests topic: bounds the longest delay.",
        shown=_WEEK_MS)] = _WEEK_MS,
    target: Annotated[list[str] | None, option(
        "target", "Also create this target topic (partitions as above) if missing; "
        "repeatable.")] = None,
) -> None:
    """Create the requests, changelog and dlq topics; existing ones are checked, not changed."""
    with reported():
        settings = settings_of(ctx)
        lines = create_topics(admin_client(settings), settings, partitions=partitions,
                              replication_factor=replication_factor, retention_ms=retention_ms,
                              targets=target or ())
    for line in lines:
        typer.echo(line)


@common_options
def restore(
    ctx: typer.Context,
    partition: Annotated[list[int] | None, typer.Option(
        "--partition", envvar=envvar("partition"), show_default=False,
        help="A request partition to rebuild (repeatable); all when not given.")] = None,
    fresh: Annotated[bool, option(
        "fresh", "Delete the local stores first and rebuild them whole.")] = False,
) -> None:
    """Rebuild the local indexes under --state-dir from the changelog, with progress.

    A store out of step with the changelog for more than half its
    delete.retention.ms is rebuilt whole. Run it with the service stopped (it
    refuses a store the service holds).
    """
    with reported():
        settings = connected(ctx)
        with Progress(TextColumn("partition {task.fields[partition]}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as bar:
            tasks: dict[int, TaskID] = {}

            def progress(p: int, done: int, total: int) -> None:
                if p not in tasks:
                    tasks[p] = bar.add_task("restore", total=total, partition=p)
                bar.update(tasks[p], completed=done, total=total)

            stores = functools.partial(store_path, settings.state_dir, settings.requests_topic)
            kept = tombstones_kept_ms(topic_config(admin_client(settings),
                                                   settings.changelog_topic))
            staleness = Staleness(SystemClock().now_ms(), kept)
            with Restorer(settings.client_config("restore"), settings.changelog_topic) as restorer:
                replayed = rebuild(restorer, stores, partitions=partition, fresh=fresh,
                                   progress=progress, staleness=staleness)
    for p, count in sorted(replayed.items()):
        typer.echo(f"partition {p}: {count} changelog records replayed")
