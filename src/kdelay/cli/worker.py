"""``kdelay worker``: run scheduled tasks and drive recurring series."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Annotated

import typer

from kdelay.cli.options import (
    common_options,
    connected,
    failed,
    option,
    reported,
    settings_of,
)
from kdelay.plumbing.topics import admin_client
from kdelay.protocol.durations import parse_levels
from kdelay.recurring import SERIES_TOPIC


@common_options
def worker(
    ctx: typer.Context,
    registry: Annotated[str | None, option(
        "registry", "The task registry to run, as module:object; plain series only if not "
        "given.", metavar="MODULE:OBJECT")] = None,
    worker_group_id: Annotated[str, option(
        "worker-group-id", "Consumer group of the workers.", shown="kdelay-worker")]
    = "kdelay-worker",
    tasks_topic: Annotated[str, option(
        "tasks-topic", "Topic task calls are delivered to.", shown="kdelay.tasks")]
    = "kdelay.tasks",
    series_topic: Annotated[str, option(
        "series-topic", "Topic plain series occurrences are delivered to.",
        shown=SERIES_TOPIC)] = SERIES_TOPIC,
    backoff: Annotated[str | None, option(
        "backoff", "Retry steps of a failed task.", shown="10s 30s 1m ... 1h 2h")] = None,
    create_topics: Annotated[bool, option(
        "create-topics", "Create the worker's topics if missing, then exit.")] = False,
    partitions: Annotated[int, option(
        "partitions", "Partitions of the tasks and series topics (--create-topics).",
        shown=3)] = 3,
    log_level: Annotated[str, option("log-level", "Log level of the worker.")] = "INFO",
) -> None:
    """Run scheduled tasks and drive recurring series until SIGTERM or SIGINT.

    Exactly-once (--guarantee) makes each occurrence's next request, retries
    and offsets commit in one transaction. The series cancels and worker DLQ
    topics are common options: the service refuses them as targets under the
    names given there.
    """
    from kdelay import tasks

    with reported():
        settings = settings_of(ctx)
        topics = tasks.WorkerTopics(tasks_topic, series_topic, settings.series_cancels_topic,
                                    settings.worker_dlq_topic)
        try:
            loaded = tasks.load_registry(registry) if registry is not None else None
        except tasks.RegistryError as exc:
            failed(exc)
        options = tasks.WorkerOptions(worker_group_id, topics,
                                      parse_levels(backoff) if backoff else None)
        connected(ctx)  # a broker answers, else one error line
        if create_topics:
            for line in tasks.create_worker_topics(admin_client(settings), topics, partitions):
                typer.echo(line)
            return
        logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        typer.echo(f"worker: tasks {loaded.names() if loaded else 'none'}", err=True)
        tasks.run_worker(settings, loaded, options, stop.is_set)
