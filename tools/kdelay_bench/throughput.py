"""Scenarios ``pipe`` and ``intake``: kdelay's rates against the plain pipe.

``pipe`` and ``intake`` read the same pre-produced requests (due in an hour,
so intake only indexes them). :func:`pending_then_due` (the capacity
scenario's) pre-produces N requests all due at one instant, lets an
in-process service index them, moves its manual clock to the read-ahead
window and then to the due instant, from where the clock runs on with the
wall clock (so target timestamps say when the service produced each record),
and times the delivery of all N as seen by a target consumer in another
process. It also counts, from what that consumer read, how many records came
within 1 s and 5 s of the due instant: by the target timestamp (the
service's clock) and by the receive time (wall time since the jump). The
``burst`` scenario runs through ``kdelay run`` (:mod:`kdelay_bench.served`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kdelay.plumbing.clock import ManualClock, SystemClock
from kdelay.plumbing.settings import Settings
from kdelay_bench import phases
from kdelay_bench.broker import Topics
from kdelay_bench.collector import CollectorProcess, read_raw
from kdelay_bench.inproc import FollowingClock, InProcess
from kdelay_bench.load import produce_requests
from kdelay_bench.pipe import run_pipe
from kdelay_bench.progress import say
from kdelay_bench.report import Figure, Result, ratio_to
from kdelay_bench.stats import rss_bytes

HOUR_MS = 3_600_000
BURST_LEAD_MS = 600_000
DAY_MS = 86_400_000
MB = 1 << 20
WITHIN_S = (1.0, 5.0)
# Issue 27: service CPU per burst record at most this times the pipe's CPU per record.
BURST_CPU_TO_PIPE = 1.5


@dataclass(frozen=True, slots=True)
class Setup:
    """What every broker scenario needs: topics, sizes and where state goes."""

    topics: Topics
    work_dir: Path
    partitions: int
    value_size: int
    batch_size: int
    ids: bool = False

    def deployment(self, role: str) -> Settings:
        """Create a fresh set of kdelay topics; return the settings of a service on them."""
        state = Path(tempfile.mkdtemp(prefix=f"{role}-", dir=self.work_dir))
        return self.topics.deployment(role, self.partitions, state, self.batch_size)

    def requests(self, settings: Settings, target: str, count: int, due_ms: int) -> None:
        """Pre-produce ``count`` requests for ``target``, all due at ``due_ms``."""
        say(f"{settings.requests_topic}: producing {count:,} requests")
        produce_requests(self.topics.bootstrap, settings.requests_topic, target, count,
                         self.value_size, lambda _: due_ms, self.partitions, self.ids)


def ratio(rate: float, baseline: Result | None) -> float | None:
    """Return ``rate`` divided by the pipe's records/s, None without a pipe figure."""
    pipe_rate = baseline.figures.get("records_per_s") if baseline else None
    if not isinstance(pipe_rate, int | float) or not pipe_rate:
        return None
    return round(rate / pipe_rate, 3)


def pipe_and_intake(setup: Setup, total: int, repeats: int, run_intake: bool,
                    run_floor: bool = False) -> list[Result]:
    """Run ``pipe`` (the median of ``repeats`` runs) and, if asked, ``pipe-tombstone`` (the pipe
    plus a changelog tombstone per record) and ``intake`` (and its ``intake-phases``
    row) over the same ``total`` requests."""
    settings = setup.deployment("intake")
    target = setup.topics.create("pipe-target", setup.partitions)
    setup.requests(settings, target, total, SystemClock().now_ms() + HOUR_MS)
    runs = []
    for attempt in range(repeats):
        say(f"pipe: consume -> produce, run {attempt + 1}/{repeats}")
        runs.append(run_pipe(setup.topics.bootstrap, settings.requests_topic,
                             setup.partitions, target, total, setup.batch_size))
    pipe = median_run(runs)
    results = [pipe]
    if run_floor:
        say("pipe-tombstone: consume -> produce + tombstone, the Kafka work of a delivery")
        changelog = setup.topics.create("floor-tombstones", setup.partitions,
                                        {"cleanup.policy": "compact"})
        floor = run_pipe(setup.topics.bootstrap, settings.requests_topic, setup.partitions,
                         target, total, setup.batch_size, tombstones=changelog)
        rate = floor.figures["records_per_s"]
        floor.figures["ratio_to_pipe"] = ratio(rate, pipe) if isinstance(rate, int) else None
        for line in floor.headlines:
            line.rate_ratio_to_pipe = ratio(rate, pipe) if isinstance(rate, int) else None
        results.append(floor)
    if run_intake:
        results += intake(settings, total, pipe)
    return results


def median_run(runs: list[Result]) -> Result:
    """Return the run with the median rate, noting every run's rate in its figures."""
    ranked = sorted(runs, key=lambda r: float(r.figures.get("records_per_s") or 0))
    median = ranked[len(ranked) // 2]
    median.figures["runs_per_s"] = "/".join(str(r.figures.get("records_per_s")) for r in runs)
    median.figures["runs_cpu_us_per_record"] = "/".join(
        str(r.figures.get("cpu_us_per_record")) for r in runs)
    failed = next((r for r in runs if r.skipped), None)
    if failed is not None:
        median.skipped = failed.skipped
    return median


def intake(settings: Settings, total: int, pipe: Result | None) -> list[Result]:
    """Index ``total`` requests with an in-process service; compare with the pipe.
    Return the ``intake`` row and the ``intake-phases`` row: the loop's CPU per
    request by phase."""
    say("intake: kdelay indexes the same requests")
    service = InProcess(settings, ManualClock(SystemClock().now_ms()))
    try:
        before, phases_before = service.cpu(), service.phase_cpu()
        rate, seconds = service.intake(total, timeout_s=max(120.0, total / 1_000))
        cpu = service.cpu().per_record_us(before, total)
        by_phase = phases.cpu_per_record(phases.since(service.phase_cpu(), phases_before),
                                         total)
    finally:
        service.close()
    result = Result("intake", {"records": total, "seconds": round(seconds, 3),
                               "requests_per_s": round(rate), "ratio_to_pipe": ratio(rate, pipe),
                               **cpu, "cpu_ratio_to_pipe": cpu_ratio(cpu, pipe),
                               "rss_mb": round(rss_bytes() / MB)})
    result.headline("intake (service)", round(rate), cpu["service_cpu_us_per_record"],
                    result.figures["ratio_to_pipe"])
    measured = result.figures["ratio_to_pipe"]
    result.check("intake >= 0.9x pipe", measured,
                 None if measured is None else float(measured) >= 0.9)
    return [result, Result("intake-phases", by_phase)]


def cpu_ratio(cpu: dict[str, float | None], pipe: Result | None) -> float | None:
    """Return the service's CPU per record over the pipe's, None without both."""
    return ratio_to(cpu.get("service_cpu_us_per_record"),
                    pipe.figures.get("cpu_us_per_record") if pipe else None)


@dataclass(frozen=True, slots=True)
class DueRun:
    """What one pending-then-due run measured; ``within`` counts the records that came
    within each of :data:`WITHIN_S` of the due instant (see :func:`within`)."""

    intake_per_s: float
    deliver_s: float | None
    acked_s: float
    seen: dict[str, object]
    rss_after_intake: int
    rss_after: int
    within: dict[str, int]
    deliver_cpu: dict[str, float | None]
    intake_cpu: dict[str, float | None]
    deliver_phases: dict[str, Figure]


def within(received_s: Sequence[float], stamp_ms: Sequence[float], due_wall_s: float,
           bounds_s: Sequence[float] = WITHIN_S) -> dict[str, int]:
    """Count the records that came within each bound of the due instant: by target
    timestamp minus due (``within_<n>s_by_stamp``) and by receive wall time minus
    ``due_wall_s``, the wall time the clock reached the due instant
    (``within_<n>s_by_receive``)."""
    out = {}
    for bound in bounds_s:
        out[f"within_{bound:g}s_by_stamp"] = sum(1 for s in stamp_ms if s <= bound * 1000)
        out[f"within_{bound:g}s_by_receive"] = sum(
            1 for r in received_s if r - due_wall_s <= bound)
    return out


def pending_then_due(setup: Setup, role: str, total: int, due_count: int) -> DueRun:
    """Index ``total`` requests, of which the first ``due_count`` are due at one instant
    and the rest a day later; then deliver those ``due_count`` and time it.

    The manual clock first sits at the start of the read-ahead window for up to
    two seconds (as the system clock would pass through it), then jumps to the
    due instant; the time runs until the collector has received the last record.
    """
    settings = setup.deployment(role)
    target = setup.topics.create(f"{role}-target", setup.partitions)
    clock = FollowingClock(SystemClock().now_ms())
    due = clock.now_ms() + BURST_LEAD_MS
    say(f"{role}: producing {total:,} requests, {due_count:,} due at one instant")
    produce_requests(setup.topics.bootstrap, settings.requests_topic, target, total,
                     setup.value_size, lambda i: due if i < due_count else due + DAY_MS,
                     setup.partitions)
    # The collector starts before intake, so its deadline covers intake too.
    out = setup.work_dir / f"{role}-{time.monotonic_ns()}.json"
    raw = out.with_suffix(".raw")
    collector = CollectorProcess(setup.topics.bootstrap, target, due_count,
                                 timeout_s=300.0 + total / 5_000 + due_count / 500,
                                 out=out, raw=raw)
    service = InProcess(settings, clock)
    try:
        intake_before = service.cpu()
        intake_rate, _ = service.intake(total, timeout_s=max(120.0, total / 1_000))
        intake_cpu = service.cpu().per_record_us(intake_before, total)
        rss_after_intake = rss_bytes()
        say(f"{role}: {total:,} indexed; read-ahead window, then the due instant")
        clock.set(due - settings.lookahead_ms)
        service.step_for(min(settings.lookahead_ms / 1000, 2.0))
        clock.set(due)
        clock.follow()
        start, before, phases_before = time.time(), service.cpu(), service.phase_cpu()
        acked_s = service.deliver(due_count, timeout_s=max(300.0, due_count / 500))
        deliver_cpu = service.cpu().per_record_us(before, due_count)
        deliver_phases = phases.cpu_per_record(
            phases.since(service.phase_cpu(), phases_before), due_count)
        seen = collector.result()
    finally:
        collector.kill()
        service.close()
    last = seen.get("last_s")
    deliver_s = float(last) - start if isinstance(last, int | float) else None
    received_s, stamp_ms = read_raw(raw)
    return DueRun(intake_rate, deliver_s, acked_s, seen, rss_after_intake, rss_bytes(),
                  within(received_s, stamp_ms, start), deliver_cpu, intake_cpu,
                  deliver_phases)
