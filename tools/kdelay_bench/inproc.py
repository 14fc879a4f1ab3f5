"""A kdelay :class:`~kdelay.engine.service.Service` run inside the bench process.

The bench steps it exactly as ``Service.run`` does (``step()`` with no wait
cap) on a :class:`~kdelay.plumbing.clock.ManualClock`, and reads progress from the
service's own Prometheus counters: requests scheduled, records delivered. The
loop's phases (``kdelay_loop_phase_seconds``) are timed by the stepping
thread's CPU clock, so :meth:`InProcess.phases` splits the loop's CPU by phase.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka.admin import AdminClient
from prometheus_client import generate_latest

from kdelay.engine.runner import tune_gc
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import check_layout
from kdelay_bench import phases
from kdelay_bench.cputime import own_cpu_s
from kdelay_bench.progress import Progress
from kdelay_bench.report import per_record_us

Sample = tuple[str, dict[str, str]]
SCHEDULED: Sample = ("kdelay_intake_records_total", {"outcome": "scheduled"})
DELIVERED: Sample = ("kdelay_delivered_records_total", {})
# Reading a Prometheus sample walks the whole registry: at most this often.
CHECK_EVERY_S = 0.002


class FollowingClock(ManualClock):
    """A manual clock that, once told to :meth:`follow`, runs on with the monotonic
    clock from the time last set: the bench jumps it to a due instant, and from there
    the service stamps its deliveries as a system clock would."""

    def __init__(self, start_ms: int) -> None:
        super().__init__(start_ms)
        self._since_ns: int | None = None

    def now_ms(self) -> int:
        """Return the time last set, plus the time since :meth:`follow` if called."""
        base = super().now_ms()
        if self._since_ns is None:
            return base
        return base + (time.monotonic_ns() - self._since_ns) // 1_000_000

    def monotonic(self) -> float:
        """Return the system's monotonic clock: the service paces its steps, seals and
        sweeps in real time, whatever the bench does to the time it shows."""
        return time.monotonic()

    def follow(self) -> None:
        """Run on from the time last set. Do not :meth:`set` it afterwards: that moves
        the base, not the time it shows."""
        self._since_ns = time.monotonic_ns()


@dataclass(frozen=True, slots=True)
class Cpu:
    """CPU seconds used: by the thread that steps the service, and by the whole process
    (user + system: the service's loop plus librdkafka's threads; the bench's producer
    and collector run in processes of their own, so this is the service's CPU)."""

    loop_s: float
    process_s: float

    def per_record_us(self, since: Cpu, records: int) -> dict[str, float | None]:
        """The CPU microseconds per record from ``since`` to this reading:
        ``service_cpu_us_per_record`` (the process) and ``loop_cpu_us_per_record``."""
        return {"service_cpu_us_per_record": per_record_us(self.process_s - since.process_s,
                                                           records),
                "loop_cpu_us_per_record": per_record_us(self.loop_s - since.loop_s, records)}


class Stalled(Exception):
    """The service made no progress towards the goal before the timeout."""


class InProcess:
    """One service on a manual clock, started on creation; :meth:`close` ends it."""

    def __init__(self, settings: Settings, clock: ManualClock) -> None:
        admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
        self.clock = clock
        # The bench jumps its clock to due instants ahead of the broker's clock, so the
        # broker-clock guard (which would hold those deliveries) is off.
        self.service = Service(settings, clock, check_layout(admin, settings),
                               broker_tolerance_ms=None, phase_clock=time.thread_time)
        self.service.start()
        tune_gc()  # as `kdelay run` does

    def close(self) -> None:
        """Finish the work in flight and close the service."""
        self.service.close()

    def _count(self, sample: Sample) -> int:
        value = self.service.metrics.registry.get_sample_value(*sample)
        return int(value or 0)

    def scheduled(self) -> int:
        """Return how many requests the service has scheduled (indexed and logged)."""
        return self._count(SCHEDULED)

    def delivered(self) -> int:
        """Return how many records the service has delivered (acknowledged by targets)."""
        return self._count(DELIVERED)

    def phase_cpu(self) -> phases.Phases:
        """Return the loop's phase histograms so far (CPU seconds of the stepping
        thread); empty before the first step."""
        return phases.parse(generate_latest(self.service.metrics.registry).decode()) or {}

    def cpu(self) -> Cpu:
        """Return the CPU time used so far by this thread (the service's loop) and process."""
        return Cpu(time.thread_time(), own_cpu_s())

    def step_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Step the service until ``done()``; raise :class:`Stalled` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        next_check = 0.0
        while True:
            now = time.monotonic()
            if now >= next_check:
                if done():
                    return
                if now > deadline:
                    raise Stalled(f"no completion within {timeout_s:.0f}s")
                next_check = now + CHECK_EVERY_S
            self.service.step()

    def step_for(self, seconds: float) -> None:
        """Step the service for ``seconds`` of wall time."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.service.step()

    def intake(self, total: int, timeout_s: float) -> tuple[float, float]:
        """Step until ``total`` requests are scheduled; return ``(requests/s, seconds)``.

        The clock starts once the service owns its partitions (group joined,
        indexes open): what it had scheduled by then is left out of the rate.
        """
        self.step_until(lambda: bool(self.service.owned()), timeout_s)
        start, already = time.monotonic(), self.scheduled()
        progress = Progress("intake", total)

        def done() -> bool:
            scheduled = self.scheduled()
            progress.update(scheduled)
            return scheduled >= total

        self.step_until(done, timeout_s)
        elapsed = time.monotonic() - start
        return (total - already) / max(elapsed, 1e-9), elapsed

    def deliver(self, total: int, timeout_s: float) -> float:
        """Step until ``total`` deliveries are acknowledged; return the seconds taken."""
        start = time.monotonic()
        progress = Progress("delivery", total)

        def done() -> bool:
            delivered = self.delivered()
            progress.update(delivered)
            return delivered >= total

        self.step_until(done, timeout_s)
        return time.monotonic() - start
