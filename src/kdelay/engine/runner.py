"""``kdelay run``: check the topics, start the service, stop it on a signal, exit with a code.

:func:`run_service` runs the service in this process; :func:`run_workers`
runs N of them as supervised worker processes (:mod:`kdelay.engine.workers`).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from types import FrameType

from confluent_kafka.admin import AdminClient

from kdelay.engine import health
from kdelay.engine.service import Service
from kdelay.engine.workers import Child, Supervisor, worker_settings
from kdelay.errors import ServiceError
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import Layout, check_layout
from kdelay.state.index import PartitionIndex
from kdelay.state.statedir import StateDirFull, StateDirLock, store_path

log = logging.getLogger(__name__)

# Collect the youngest generation once 500 000 more containers were allocated than
# freed, instead of 700, and the older ones far more rarely. See :func:`tune_gc`.
GC_THRESHOLDS = (500_000, 50, 100)


def tune_gc() -> None:
    """Keep the cyclic garbage collector from pausing delivery.

    Every request and delivery allocates a few containers that live for the
    length of a delay, so with CPython's default thresholds full collections
    walk tens of thousands of live objects: 19 full collections of up to
    170 ms in 20 s at 5 k/s (docs/benchmarks.md). The hot path creates no
    reference cycles; objects alive at start-up are frozen out of every
    collection, and the thresholds make collections rare.

    The youngest generation's threshold is above what delivery holds in memory
    with its defaults (``MAX_HELD_BATCHES`` batches a partition, each original a
    message and its list of headers): at 50 000, the originals of a burst were
    walked by a collection of 20-45 ms every 45 000 records or so, 0.7 µs of
    CPU a record delivered (docs/benchmarks.md).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_service(settings: Settings, *, check: bool) -> int:
    """Run the service until SIGTERM or SIGINT; with ``check``, only verify and exit.

    Raises :class:`kdelay.plumbing.topics.LayoutError` when the topics are missing or
    not co-partitioned, with a message that says how to fix it.
    """
    admin = AdminClient(settings.client_config("admin"))
    layout = check_layout(admin, settings)
    if check:
        print(f"ok: {settings.bootstrap_servers} reachable; {settings.requests_topic}, "
              f"{settings.changelog_topic} ({layout.partitions} partitions, co-partitioned) "
              f"and {settings.dlq_topic} are in place")
        print(optional_topics(settings, layout))
        return 0
    service = Service(settings, SystemClock(), layout)
    if settings.metrics_port is not None:
        health.serve(settings.metrics_port, service.metrics.registry, service.health)

    def on_signal(signum: int, _: FrameType | None) -> None:
        log.info("signal %d: finishing the batch in flight", signum)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tune_gc()
    try:
        service.run()
    except ServiceError as exc:
        log.error("error[%s]: %s", exc.code, exc)
        return 1
    except StateDirFull as exc:
        discard_stores(settings, layout.partitions)
        log.error("error[state-dir-full]: %s; every index of this instance was deleted and is "
                  "rebuilt from the changelog at the restart", exc)
        return 1
    return 0


def optional_topics(settings: Settings, layout: Layout) -> str:
    """One line for ``run --check``: which of the optional topics (outcomes, status) are
    missing, and what the service does without them."""
    missing = [f"{settings.outcomes_topic} (no outcome records)"] if layout.outcomes is None \
        else []
    if not layout.status:
        missing.append(f"{settings.status_topic} (no instance status: the console shows "
                       "partitions as unknown)")
    if not missing:
        return f"ok: {settings.outcomes_topic} and {settings.status_topic} are in place"
    return f"warning: missing {'; '.join(missing)}: run `kdelay topics create`"


def discard_stores(settings: Settings, partitions: int) -> None:
    """Delete every partition's store under the state dir, after a write found no room.

    No store the service had open is trusted then, not only the one whose
    write failed. A store records, with each applied plan, the changelog
    position its writer had confirmed, and that may cover the records of plans
    acknowledged but not applied yet. The failed write ends the applying
    midway: every owned partition may hold such a plan, and closing drains
    the producers (its later records, consumed markers included, land after
    that position). Caught up from it after a restart, the store can skip
    the unapplied plans' entries while the markers carry its consumed offset
    past their requests: they would never be delivered (the likely cause of
    the requests a kept store was seen to miss). Rebuilt whole from the
    changelog, every store has them all (and the deletion frees room).
    """
    for partition in range(partitions):
        PartitionIndex.destroy(store_path(settings.state_dir, settings.requests_topic, partition))


WorkerMain = Callable[[int, Settings], None]


def run_workers(settings: Settings, workers: int, main: WorkerMain, *, check: bool) -> int:
    """Run ``workers`` service processes under a supervising parent until SIGTERM or SIGINT.

    See :mod:`kdelay.engine.workers`. The parent checks the topic layout once
    (raising :class:`~kdelay.plumbing.topics.LayoutError` as
    :func:`run_service` does), locks the whole state dir (raising
    :class:`~kdelay.state.index.IndexLocked`), then starts worker ``i`` as a
    fresh interpreter running ``main(parent_pid, settings_of_worker_i)``.
    Returns the parent's exit code.
    """
    admin = AdminClient(settings.client_config("admin"))
    layout = check_layout(admin, settings)
    hostname = socket.gethostname()
    plans = [worker_settings(settings, i, hostname) for i in range(workers)]
    if check:
        print(f"ok: {settings.bootstrap_servers} reachable; {settings.requests_topic} "
              f"({layout.partitions} partitions) and its topics are in place; "
              f"{workers} workers under {settings.state_dir}")
        print(optional_topics(settings, layout))
        return 0
    if workers > layout.partitions:
        log.warning("%d workers for %d partitions: %d will serve nothing but stand by",
                    workers, layout.partitions, workers - layout.partitions)
    lock = StateDirLock(settings.state_dir)
    context = multiprocessing.get_context("spawn")
    parent = os.getpid()

    def spawn(index: int) -> Child:
        process = context.Process(target=main, args=(parent, plans[index]),
                                  name=f"kdelay-worker-{index}", daemon=False)
        process.start()
        return process

    supervisor = Supervisor(workers, spawn, wait, time.monotonic)

    def on_signal(signum: int, _: FrameType | None) -> None:
        log.info("signal %d: stopping the workers", signum)
        supervisor.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("running %d workers under %s", workers, settings.state_dir)
    try:
        return supervisor.run()
    finally:
        lock.release()
