"""``kdelay run``: check the topics, start the service, stop it on a signal, exit with a code."""

from __future__ import annotations

import gc
import logging
import signal
from types import FrameType

from confluent_kafka.admin import AdminClient

from kdelay.engine.checkpoint import ServiceError
from kdelay.engine.service import Service
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import check_layout
from kdelay.state.index import StateDirFull

log = logging.getLogger(__name__)

# Collect the youngest generation every 50 000 container allocations instead of
# 700, and the older ones far more rarely. See :func:`tune_gc`.
GC_THRESHOLDS = (50_000, 50, 100)


def tune_gc() -> None:
    """Keep the cyclic garbage collector from pausing delivery.

    Every request and delivery allocates a few containers that live for the
    length of a delay, so with CPython's default thresholds full collections
    walk tens of thousands of live objects: 19 full collections of up to
    170 ms in 20 s at 5 k/s (docs/benchmarks.md). The hot path creates no
    reference cycles; objects alive at start-up are frozen out of every
    collection, and the thresholds make collections rare.
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
        return 0
    service = Service(settings, SystemClock(), layout)
    if settings.metrics_port is not None:
        service.metrics.serve(settings.metrics_port)

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
        log.error("error[state-dir-full]: %s", exc)
        return 1
    return 0
