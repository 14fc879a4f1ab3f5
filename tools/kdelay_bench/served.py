"""Scenarios served by a scheduler process: the burst through ``kdelay run``, and with
``--peer`` the burst, intake and steady scenarios against the peer as well.

``burst`` writes N requests all due at one whole second, starts ``kdelay
run`` with its defaults, and times the drain as the collector sees it (see
:mod:`kdelay_bench.contender`). With a peer binary the same records, in the
peer's protocol, go through the peer in the same way (``peer-burst``), the
intake scenario's backlog is taken in by both processes (``intake-run``,
``peer-intake``) and the steady load of ``lateness`` is driven through the peer
once (``peer-lateness``). Every peer row names the kdelay row it stands beside
(``versus``); :func:`kdelay_bench.report.side_by_side` makes the table.
"""

from __future__ import annotations

from pathlib import Path

from kdelay.plumbing.clock import SystemClock
from kdelay_bench import contender, peer, phases
from kdelay_bench.broker import wait_group_stable
from kdelay_bench.lateness import Load, Run
from kdelay_bench.report import Figure, Result
from kdelay_bench.stats import process_memory
from kdelay_bench.steady import REQUEST_PRODUCER, drive
from kdelay_bench.throughput import BURST_CPU_TO_PIPE, HOUR_MS, MB, Setup, cpu_ratio, ratio

# Issue 47: the burst's targets through `kdelay run`.
BURST_RATE = 200_000
BURST_WITHIN_5S = 0.9
BURST_CPU_US = 5.0


def burst(setup: Setup, total: int, pipe: Result | None,
          lead_s: float | None = None) -> list[Result]:
    """Deliver ``total`` requests due at one instant through ``kdelay run``; return the
    ``burst`` row (rate, counts within 1 s and 5 s, CPU per record, the targets) and the
    ``burst-phases`` row (the loop's time per record by phase over the drain)."""
    side, target = contender.kdelay_side(setup, "burst")
    run = contender.run_burst(setup, side, target, total, side.metrics_port, lead_s)
    result = Result("burst", {**run.figures, "service": "kdelay run"})
    rate = run.figures.get("records_per_s")
    result.figures.update({
        "ratio_to_pipe": ratio(float(rate), pipe) if isinstance(rate, int) else None,
        "cpu_ratio_to_pipe": cpu_ratio({"service_cpu_us_per_record": _float(
            run.figures.get("service_cpu_us_per_record"))}, pipe),
        "intake_per_s": run.intake.get("requests_per_s")})
    result.headline("burst delivery (kdelay run)", rate,
                    run.figures.get("service_cpu_us_per_record"),
                    result.figures["ratio_to_pipe"])
    result.headline("burst: its intake (kdelay run)", run.intake.get("requests_per_s"),
                    run.intake.get("service_cpu_us_per_record"))
    burst_checks(result, total)
    phase_row: dict[str, Figure] = (
        {"timed_by": "kdelay run's loop clock (wall)", **run.phases} if run.phases
        else {"note": phases.NO_METRIC})
    return [result, Result("burst-phases", phase_row)]


def _float(value: Figure) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def burst_checks(result: Result, total: int) -> None:
    """Check a ``burst`` row against issues 27 and 47: rate, arrivals within 5 s, CPU
    per record (absolute and to the pipe's), 0 early, 0 lost, intake done before due."""
    figures = result.figures
    rate, cpu = figures.get("records_per_s"), figures.get("service_cpu_us_per_record")
    within5 = figures.get("within_5s_by_receive")
    result.check(f"burst >= {BURST_RATE:,}/s", rate,
                 None if not isinstance(rate, int | float) else rate >= BURST_RATE)
    result.check(f">= {BURST_WITHIN_5S:.0%} received within 5 s of due", within5,
                 None if not isinstance(within5, int) else within5 >= BURST_WITHIN_5S * total)
    result.check(f"burst service CPU per record <= {BURST_CPU_US:g} µs", cpu,
                 None if not isinstance(cpu, int | float) else cpu <= BURST_CPU_US)
    measured = figures.get("ratio_to_pipe")
    result.check("burst >= 0.7x pipe", measured,
                 None if not isinstance(measured, int | float) else measured >= 0.7)
    to_pipe = figures.get("cpu_ratio_to_pipe")
    result.check(f"burst service CPU per record <= {BURST_CPU_TO_PIPE}x pipe's", to_pipe,
                 None if not isinstance(to_pipe, int | float) else to_pipe <= BURST_CPU_TO_PIPE)
    result.check("0 early", figures.get("early"), figures.get("early") == 0)
    result.check("0 lost", figures.get("lost"), figures.get("lost") == 0)
    result.check("all taken in before the due instant", figures.get("indexed_before_due"),
                 figures.get("indexed_before_due") is True)


def peer_burst(setup: Setup, binary: Path, total: int,
               lead_s: float | None = None) -> list[Result]:
    """The burst through the peer: the ``peer-burst`` row, beside ``burst``."""
    side, target = contender.peer_side(setup, "peer-burst", binary)
    run = contender.run_burst(setup, side, target, total, lead_s=lead_s)
    result = Result("peer-burst", {**run.figures, "versus": "burst",
                                   "intake_per_s": run.intake.get("requests_per_s")})
    result.headline("burst delivery (peer)", run.figures.get("records_per_s"),
                    run.figures.get("service_cpu_us_per_record"))
    result.headline("burst: its intake (peer)", run.intake.get("requests_per_s"),
                    run.intake.get("service_cpu_us_per_record"))
    result.check("0 early", run.figures.get("early"), run.figures.get("early") == 0)
    result.check("0 lost", run.figures.get("lost"), run.figures.get("lost") == 0)
    return [result]


def intake_pair(setup: Setup, binary: Path, total: int) -> list[Result]:
    """The intake scenario's backlog (``total`` requests due in an hour) taken in by
    ``kdelay run`` (``intake-run``) and by the peer (``peer-intake``)."""
    due_ms = SystemClock().now_ms() + HOUR_MS
    due_ms -= due_ms % 1000  # a whole second, as the peer's protocol has it
    side, _ = contender.kdelay_side(setup, "intake-run")
    ours = Result("intake-run", {**contender.run_intake(setup, side, total, due_ms),
                                 "service": "kdelay run"})
    ours.headline("intake (kdelay run)", ours.figures["requests_per_s"],
                  ours.figures["service_cpu_us_per_record"])
    if not peer.due_today(due_ms):
        return [ours, Result("peer-intake", skipped="due after midnight: the peer plans "
                             "only schedules due today")]
    peer_side, _ = contender.peer_side(setup, "peer-intake", binary)
    theirs = Result("peer-intake", {**contender.run_intake(setup, peer_side, total, due_ms),
                                    "versus": "intake-run"})
    theirs.headline("intake (peer)", theirs.figures["requests_per_s"],
                    theirs.figures["service_cpu_us_per_record"])
    return [ours, theirs]


def peer_steady(setup: Setup, binary: Path, load: Load) -> list[Result]:
    """The steady load of ``lateness`` through the peer, once: the ``peer-lateness`` row,
    beside kdelay's first ``lateness`` run."""
    side, target = contender.peer_side(setup, "peer-late", binary)
    started = side.start()
    try:
        if not wait_group_stable(setup.topics.admin, side.group, contender.START_TIMEOUT_S,
                                 alive=started.alive):
            raise RuntimeError(f"peer did not join its group: {started.tail()}")
        driven = drive(setup, side.requests, target, load, delay_ms=load.delay_ms,
                       producer=REQUEST_PRODUCER, pids={"service": started.pid},
                       headers=peer.steady_headers)
        _, peak = process_memory(started.pid)
    finally:
        started.stop()
    run = Run(1, load, driven.seen, driven.took_s, driven.cpu, "peer: no phase metric",
              rss_mb=round(peak / MB))
    result = Result("peer-lateness", {**run.figures(), "versus": "lateness"})
    result.headline("lateness (peer: intake and delivery)", result.figures[
        "achieved_rate_per_s"], result.figures["service_cpu_us_per_record"])
    return [result, Result("peer-lateness-cpu", driven.cpu)]
