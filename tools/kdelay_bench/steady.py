"""Driving a steady load: the ``hop`` baseline and the ``lateness`` runs of a guarantee.

Every run has the same shape: a collector process reads the target from the
start, the bench process produces requests at a fixed rate (its Loader is
"the producer" in the CPU figures), and a :class:`~kdelay_bench.cputime.CpuMeter`
measures the producer, the service and the broker from the first record to
the collector's end (the collector measures itself). See
:mod:`kdelay_bench.lateness` for what is reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kafka_broker import free_port

from kdelay.plumbing.settings import Settings
from kdelay.protocol.envelope import Headers
from kdelay_bench import broker_metrics, phases
from kdelay_bench.broker import broker_pid, restart_broker, wait_group_stable
from kdelay_bench.collector import CollectorProcess
from kdelay_bench.cputime import CpuMeter, Usage
from kdelay_bench.lateness import Load, Run, Suite, percentiles
from kdelay_bench.load import Loader, request_headers, values
from kdelay_bench.progress import say
from kdelay_bench.report import Figure, Result, as_int
from kdelay_bench.stats import process_memory
from kdelay_bench.throughput import Setup

START_TIMEOUT_S = 60.0
Config = dict[str, str | int | bool]
# The requests come from a client with librdkafka's defaults (linger.ms 5, not
# idempotent). An idempotent producer whose 5 requests in flight wait on a slow
# broker (its first minute after a start) busy-loops its broker thread: the
# bench's own producer then took 0.7 of a core at 1,000 records/s and starved
# the broker and the service on two cores.
REQUEST_PRODUCER: Config = {"linger.ms": 5, "enable.idempotence": False}
TARGET_PRODUCER: Config = {"linger.ms": 2}  # kdelay's target producer (idempotent)


@dataclass(frozen=True, slots=True)
class Plan:
    """How many runs per guarantee, and the seconds between a broker restart and the
    first run (None: no restart, the broker as found)."""

    runs: int
    fresh_broker_wait_s: float | None


@dataclass(frozen=True, slots=True)
class Driven:
    """What one steady run gave: the collector's summary, the seconds the measured part
    took to produce, and CPU figures per process."""

    seen: dict[str, object]
    took_s: float
    cpu: dict[str, Figure]


Headering = Callable[[str, int, bytes, bool], Headers]


def kdelay_headers(target: str, due_ms: int, _key: bytes, warmup: bool) -> Headers:
    """The headers of a steady request to kdelay (its envelope)."""
    return request_headers(target, due_ms, warmup=warmup)


def _steady(loader: Loader, topic: str, target: str, count: int, rate: int,
            delay_ms: int, *, warmup: bool, headers: Headering = kdelay_headers) -> float:
    """Produce ``count`` requests to ``topic`` at ``rate``/s, each due ``delay_ms`` after
    its send; return the seconds it took (longer than ``count / rate`` if the bench fell
    behind)."""
    pool = values(100)
    start = time.monotonic()
    sent = 0
    while sent < count:
        wanted = min(count, int((time.monotonic() - start) * rate) + 1)
        while sent < wanted:
            due = time.time_ns() // 1_000_000 + delay_ms
            key = f"{'w' if warmup else 'l'}{sent}".encode()  # ids unique over a run
            loader.produce(topic, key, pool[sent % len(pool)],
                           headers(target, due, key, warmup))
            sent += 1
        loader.poll(0.001)
    return time.monotonic() - start


def drive(setup: Setup, topic: str, target: str, load: Load, *, delay_ms: int,
          producer: Config, pids: dict[str, int | None],
          headers: Headering = kdelay_headers) -> Driven:
    """Produce ``load`` to ``topic`` (records for ``target``, due ``delay_ms`` after their
    send) while a collector reads ``target``. ``producer`` overrides the
    :class:`~kdelay_bench.load.Loader`'s client settings; ``pids`` names the other
    processes whose CPU is measured; ``headers`` makes a request's headers (the peer's
    protocol differs from kdelay's)."""
    collector = CollectorProcess(setup.topics.bootstrap, target, load.total,
                                 timeout_s=load.seconds + load.warmup_seconds
                                 + delay_ms / 1000 + load.drain_seconds,
                                 out=setup.work_dir / f"collect-{time.monotonic_ns()}.json")
    try:
        loader = Loader(setup.topics.bootstrap, **producer)
        meter = CpuMeter({"producer": os.getpid(), **pids})
        started = time.monotonic()
        _steady(loader, topic, target, int(load.rate * load.warmup_seconds), load.rate,
                delay_ms, warmup=True, headers=headers)
        took = _steady(loader, topic, target, int(load.rate * load.seconds), load.rate,
                       delay_ms, warmup=False, headers=headers)
        loader.finish()
        seen = collector.result()
    finally:
        collector.kill()
    own = Usage(_seconds(seen.get("cpu_s")), _seconds(seen.get("wait_s")),
                str(seen.get("busiest") or ""))
    cpu = meter.figures(time.monotonic() - started, {"collector": own})
    return Driven(seen, took, cpu)


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def run_hop(setup: Setup, load: Load) -> list[Result]:
    """The lateness floor: records produced straight to a topic and read by the collector.

    The same load and collector as ``lateness``, but no kdelay: each record is
    due when it is sent, by a producer with the service's target settings
    (idempotent, ``linger.ms=2``). What it measures is the producer-broker-
    consumer hop every delivered record takes after kdelay produced it.
    Returns the ``hop`` row, its ``hop-cpu`` row and its ``hop-broker`` row (the
    broker's own figures, :mod:`kdelay_bench.broker_metrics`).
    """
    target = setup.topics.create("hop-target", setup.partitions)
    say(f"hop: {load.rate:,}/s for {load.seconds:g}s straight to a topic, no kdelay")
    reader = broker_metrics.Reader(broker_pid(setup.topics.bootstrap))
    try:
        before = reader.read()
        driven = drive(setup, target, target, load, delay_ms=0, producer=TARGET_PRODUCER,
                       pids={"broker": reader.pid})
        broker = broker_metrics.between(reader.read(), before)
    finally:
        reader.close()
    received = as_int(driven.seen.get("count"))
    result = Result("hop", {"rate_per_s": load.rate, "seconds": load.seconds,
                            "sent": load.total, "received": received,
                            **percentiles(driven.seen.get("lateness_ms"))})
    return [result, Result("hop-cpu", driven.cpu), Result("hop-broker", broker)]


def hop_p99(results: list[Result]) -> float | None:
    """Return the hop's end-to-end p99 in ms, None when it did not run."""
    hop = next((r for r in results if r.scenario == "hop" and not r.skipped), None)
    value = hop.figures.get("p99_ms") if hop else None
    return float(value) if isinstance(value, int | float) else None


def _command(settings: Settings, guarantee: str, metrics_port: int) -> list[str]:
    script = Path(sys.executable).with_name("kdelay")
    return [str(script), "run", "--bootstrap-servers", settings.bootstrap_servers,
            "--requests-topic", settings.requests_topic,
            "--changelog-topic", settings.changelog_topic, "--dlq-topic", settings.dlq_topic,
            "--group-id", settings.group_id, "--state-dir", str(settings.state_dir),
            "--guarantee", guarantee, "--log-level", "WARNING",
            "--metrics-port", str(metrics_port)]


def _stderr_tail(path: Path) -> str:
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return " ".join(text.splitlines()[-3:])[-400:] or "no output"


def _fresh_broker(setup: Setup, plan: Plan) -> float | None:
    """Restart the broker when the plan asks; return when it was ready (monotonic)."""
    if plan.fresh_broker_wait_s is None:
        return None
    say("restarting the broker (tools/kafka stop, start) for a fresh start")
    restart_broker(setup.topics.bootstrap)
    return time.monotonic()


def run_suite(setup: Setup, guarantee: str, load: Load, plan: Plan) -> Suite:
    """Run ``plan.runs`` consecutive runs of ``load`` against one ``kdelay run`` with
    ``guarantee``; with a fresh-broker plan, restart the broker first and start the first
    run that many seconds after it is ready (the service starts in between)."""
    wait = plan.fresh_broker_wait_s
    suite = Suite(guarantee, plan.runs, {
        "service": "one kdelay run for all runs",
        "broker": "as found" if wait is None else f"restarted, first run {wait:g}s after"})
    ready_at = _fresh_broker(setup, plan)
    role = f"late-{guarantee[:3]}"
    settings = setup.deployment(role)
    targets = [setup.topics.create(f"{role}-run{n}", setup.partitions)
               for n in range(1, plan.runs + 1)]
    port = free_port()
    log = setup.work_dir / f"kdelay-{guarantee}-{time.monotonic_ns()}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(_command(settings, guarantee, port), stderr=err,
                                stdout=subprocess.DEVNULL)
    # Started (and read once: the program compiles and attaches) before the wait.
    reader = broker_metrics.Reader(broker_pid(setup.topics.bootstrap))
    try:
        reader.read()
        say(f"lateness[{guarantee}]: waiting for kdelay run to join its group")
        if not wait_group_stable(setup.topics.admin, settings.group_id, START_TIMEOUT_S,
                                 alive=lambda: proc.poll() is None):
            suite.skipped = f"kdelay run did not start: {_stderr_tail(log)}"
            return suite
        if ready_at is not None and wait is not None:
            pause = ready_at + wait - time.monotonic()
            say(f"lateness[{guarantee}]: first run in {max(pause, 0):.0f}s")
            time.sleep(max(pause, 0.0))
        _runs(setup, settings, suite, load, targets, proc, (port, reader), log)
    finally:
        reader.close()
        _stop(proc)
    return suite


def _runs(setup: Setup, settings: Settings, suite: Suite, load: Load, targets: list[str],
          proc: subprocess.Popen[bytes], meters: tuple[int, broker_metrics.Reader],
          log: Path) -> None:
    """Drive one run per target topic back to back; only the first has a warm-up.
    ``meters`` are the service's metrics port and the broker's metrics reader."""
    port, reader = meters
    pids = {"service": proc.pid, "broker": reader.pid}
    before = phases.scrape(port)
    broker_before = reader.read()
    for number, target in enumerate(targets, 1):
        run_load = load if number == 1 else replace(load, warmup_seconds=0.0)
        say(f"lateness[{suite.guarantee}] run {number}/{len(targets)}: {load.rate:,}/s for "
            f"{load.seconds:g}s (+{run_load.warmup_seconds:g}s warm-up)")
        driven = drive(setup, settings.requests_topic, target, run_load,
                       delay_ms=load.delay_ms, producer=REQUEST_PRODUCER, pids=pids)
        if proc.poll() is not None:
            suite.skipped = (f"kdelay run exited (rc={proc.returncode}) in run {number}: "
                             f"{_stderr_tail(log)}")
            return
        after = phases.scrape(port)
        broker_after = reader.read()
        suite.runs.append(Run(number, run_load, driven.seen, driven.took_s, driven.cpu,
                              _phase_delta(after, before),
                              broker_metrics.between(broker_after, broker_before),
                              round(process_memory(proc.pid)[1] / (1 << 20))))
        before, broker_before = after, broker_after


def _phase_delta(after: phases.Phases | str, before: phases.Phases | str) -> phases.Phases | str:
    """Return the phases observed between two scrapes, or the note of the later one."""
    if isinstance(after, str):
        return after
    return phases.since(after, before if isinstance(before, dict) else None)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Ask ``kdelay run`` to finish (SIGTERM); kill it if it does not within 30 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
