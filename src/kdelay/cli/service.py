"""The service's commands: ``kdelay run``, ``kdelay topics create|grow`` and ``kdelay restore``."""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
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
from kdelay.plumbing.topics import (
    LayoutError,
    add_partitions,
    admin_client,
    create_topics,
    group_members,
    partition_counts,
    tombstones_kept_ms,
    topic_config,
)
from kdelay.state import homes
from kdelay.state.changelog import Restorer, Staleness, open_restored, rebuild
from kdelay.state.statedir import store_path

_WEEK_MS = 7 * 24 * 3_600_000
# How long past one session timeout `topics grow` waits for stopped instances to leave.
_GROUP_GRACE_S = 5.0


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
        "replication-factor", "Replication factor of new topics; 0 picks min(3, brokers) "
        "(with min.insync.replicas=2 from 3), -1 is the broker default.", shown=0)] = 0,
    retention_ms: Annotated[int, option(
        "retention-ms", "retention.ms of the requests topic: bounds the longest delay.",
        shown=_WEEK_MS)] = _WEEK_MS,
    target: Annotated[list[str] | None, option(
        "target", "Also create this target topic (partitions as above) if missing; "
        "repeatable.")] = None,
) -> None:
    """Create kdelay's topics (requests, changelog, dlq, outcomes, controls, status); existing
    ones are checked, not changed."""
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
        with _restore_progress() as progress:
            stores = functools.partial(store_path, settings.state_dir, settings.requests_topic)
            kept = tombstones_kept_ms(topic_config(admin_client(settings),
                                                   settings.changelog_topic))
            staleness = Staleness(SystemClock().now_ms(), kept)
            with Restorer(settings.client_config("restore"), settings.changelog_topic) as restorer:
                replayed = rebuild(restorer, stores, partitions=partition, fresh=fresh,
                                   progress=progress, staleness=staleness)
    for p, count in sorted(replayed.items()):
        typer.echo(f"partition {p}: {count} changelog records replayed")


@contextmanager
def _restore_progress() -> Iterator[Callable[[int, int, int], None]]:
    """A progress bar per changelog partition, on stderr; yields the callback that moves it."""
    with Progress(TextColumn("partition {task.fields[partition]}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        tasks: dict[int, TaskID] = {}

        def progress(p: int, done: int, total: int) -> None:
            if p not in tasks:
                tasks[p] = bar.add_task("restore", total=total, partition=p)
            bar.update(tasks[p], completed=done, total=total)

        yield progress


@common_options
def topics_grow(
    ctx: typer.Context,
    partitions: Annotated[int, typer.Option(
        "--partitions", envvar=envvar("partitions"), show_default=False,
        help="The new partition count of the requests and changelog topics.")],
) -> None:
    """More request partitions, each schedule id moved to its new home (instances stopped).

    Stop every instance first; start them again after.

    An id lives on murmur2(id) mod the partition count, so growing moves most
    ids. With the service stopped, this reads every changelog partition, writes
    each pending schedule and ended id whose home moved to its new home's
    changelog partition, tombstones it where it was, and grows the requests
    topic last (until then, `kdelay run` refuses to start). Payloads never
    move. Safe to run again if it stopped half way.
    """
    with reported():
        settings = connected(ctx)
        admin = admin_client(settings)
        lines = _grow(settings, admin, partitions)
    for line in lines:
        typer.echo(line)


def _grow(settings: Settings, admin: AdminClient, count: int) -> list[str]:
    requests, changelog = settings.requests_topic, settings.changelog_topic
    found = partition_counts(admin, [requests, changelog])
    for name, role in ((requests, "requests"), (changelog, "changelog")):
        if name not in found:
            raise LayoutError(f"{role}-missing", f"{role} topic {name} does not exist: run "
                              "`kdelay topics create` first")
    now = max(found.values())
    if count < now:
        raise LayoutError("cannot-shrink", (
            f"requests topic {requests} has {found[requests]} partitions and changelog "
            f"{changelog} {found[changelog]}: a Kafka topic cannot lose partitions; give "
            f"--partitions {now} or more"))
    members = _stopped_group(admin, settings)
    if members:
        raise LayoutError("instances-running", (
            f"group {settings.group_id} has {len(members)} running members "
            f"({', '.join(members[:5])}): stop every kdelay instance first, so that no "
            "schedule is served while its id moves"))
    lines = []
    if found[changelog] < count:
        add_partitions(admin, changelog, count)
        lines.append(f"changelog {changelog}: {found[changelog]} -> {count} partitions")
    moved = _move_ids(settings, count, lines)
    if found[requests] < count:
        add_partitions(admin, requests, count)
        lines.append(f"requests {requests}: {found[requests]} -> {count} partitions")
    lines.append(f"done: {count} partitions, {moved} ids moved to their new homes; "
                 "start the instances again")
    return lines


def _stopped_group(admin: AdminClient, settings: Settings) -> list[str]:
    """The group's members once it is empty, or after waiting one session timeout for it.

    An instance stopped a moment ago stays a member of the group (a static
    one) until its session times out; such a wait is said once, on stderr.
    """
    deadline = time.monotonic() + settings.session_timeout_ms / 1000 + _GROUP_GRACE_S
    members = group_members(admin, settings.group_id)
    if members:
        typer.echo(f"waiting up to {settings.session_timeout_ms / 1000:.0f} s for the "
                   f"{len(members)} members of group {settings.group_id} to leave", err=True)
    while members and time.monotonic() < deadline:
        time.sleep(1)
        members = group_members(admin, settings.group_id)
    return members


def _move_ids(settings: Settings, count: int, lines: list[str]) -> int:
    """Rebuild every changelog partition in a scratch dir and move the ids that live
    elsewhere under ``count``; return how many moved (one line per partition that had any)."""
    moved = 0
    producer = Producer(settings.client_config("grow", **{
        "enable.idempotence": True, "linger.ms": 20}))
    with (tempfile.TemporaryDirectory(prefix="kdelay-grow-") as scratch,
          _restore_progress() as progress,
          Restorer(settings.client_config("restore"), settings.changelog_topic) as restorer):
        for partition in range(count):
            index, _ = open_restored(Path(scratch) / str(partition), partition, restorer,
                                     functools.partial(progress, partition))
            try:
                moves = homes.moves_of(index, count)
            finally:
                index.close()
            if moves:
                homes.write_moves(producer, settings.changelog_topic, moves)
                moved += len(moves)
                lines.append(f"partition {partition}: moved {len(moves.pending)} pending "
                             f"schedules and {len(moves.ended)} ended ids to their new homes")
    return moved
