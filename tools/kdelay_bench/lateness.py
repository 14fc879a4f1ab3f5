"""Scenario ``lateness``: how late records arrive under a steady delivery rate.

``kdelay run`` runs as a subprocess on the system clock with the guarantee
under test. Once its consumer group is stable, the bench produces requests at
a fixed rate, each due a fixed delay after it is produced (a warm-up first,
tagged so it is left out of the figures). A collector process records, per
record, receive wall time minus due time, and the gaps a ``read_committed``
read leaves in the target's offsets: transaction markers, the sign that the
service really wrote the target in transactions (``transactional``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kdelay.settings import Settings
from kdelay_bench.broker import wait_group_stable
from kdelay_bench.collector import CollectorProcess
from kdelay_bench.load import Loader, request_headers, values
from kdelay_bench.progress import say
from kdelay_bench.report import Result, as_int
from kdelay_bench.throughput import Setup

START_TIMEOUT_S = 60.0
# Both bounds in milliseconds; issue 5's targets per guarantee.
TARGETS = {
    "at-least-once": {"p50": 5.0, "p99": 50.0, "max": 250.0},
    "exactly-once": {"p99": 150.0},
}


@dataclass(frozen=True, slots=True)
class Load:
    """A steady load: ``rate`` records/s for ``seconds``, each due ``delay_ms`` later;
    records still missing ``drain_seconds`` after the last due time count as lost."""

    rate: int
    seconds: float
    warmup_seconds: float
    delay_ms: int
    drain_seconds: float

    @property
    def total(self) -> int:
        """Records produced in all, warm-up included."""
        return int(self.rate * self.seconds) + int(self.rate * self.warmup_seconds)


def _command(settings: Settings, guarantee: str) -> list[str]:
    script = Path(sys.executable).with_name("kdelay")
    return [str(script), "run", "--bootstrap-servers", settings.bootstrap_servers,
            "--requests-topic", settings.requests_topic,
            "--changelog-topic", settings.changelog_topic, "--dlq-topic", settings.dlq_topic,
            "--group-id", settings.group_id, "--state-dir", str(settings.state_dir),
            "--guarantee", guarantee, "--log-level", "WARNING"]


def _steady(loader: Loader, topic: str, target: str, count: int, rate: int,
            delay_ms: int, *, warmup: bool) -> float:
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
            loader.produce(topic, f"l{sent}".encode(), pool[sent % len(pool)],
                           request_headers(target, due, warmup=warmup))
            sent += 1
        loader.poll(0.001)
    return time.monotonic() - start


def run_hop(setup: Setup, load: Load) -> Result:
    """The lateness floor: records produced straight to a topic and read by the collector.

    The same load and collector as ``lateness``, but no kdelay: each record is
    due when it is sent, by a producer with the service's target settings
    (idempotent, ``linger.ms=2``). What it measures is the producer-broker-
    consumer hop every delivered record takes after kdelay produced it.
    """
    target = setup.topics.create("hop-target", setup.partitions)
    say(f"hop: {load.rate:,}/s for {load.seconds:g}s straight to a topic, no kdelay")
    seen, _ = _drive(setup, target, target, load, delay_ms=0, linger_ms=2)
    result = Result("hop", {"rate_per_s": load.rate, "seconds": load.seconds,
                            "sent": load.total, "received": as_int(seen.get("count"))})
    late = _percentiles(seen.get("lateness_ms"))
    result.figures.update({f"{k}_ms": v for k, v in late.items()})
    return result


def _drive(setup: Setup, topic: str, target: str, load: Load, *, delay_ms: int,
           linger_ms: int) -> tuple[dict[str, object], float]:
    """Produce ``load`` to ``topic`` (records for ``target``, due ``delay_ms`` after their
    send) while a collector reads ``target``; return its summary and the seconds the
    measured part took to produce. The producer batches for ``linger_ms``."""
    collector = CollectorProcess(setup.topics.bootstrap, target, load.total,
                                 timeout_s=load.seconds + load.warmup_seconds
                                 + delay_ms / 1000 + load.drain_seconds,
                                 out=setup.work_dir / f"collect-{time.monotonic_ns()}.json")
    loader = Loader(setup.topics.bootstrap, **{"linger.ms": linger_ms})
    try:
        _steady(loader, topic, target, int(load.rate * load.warmup_seconds), load.rate,
                delay_ms, warmup=True)
        took = _steady(loader, topic, target, int(load.rate * load.seconds), load.rate,
                       delay_ms, warmup=False)
        loader.finish()
        return collector.result(), took
    finally:
        collector.kill()


def _stderr_tail(path: Path) -> str:
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return " ".join(text.splitlines()[-3:])[-400:] or "no output"


def run_lateness(setup: Setup, guarantee: str, load: Load) -> Result:
    """Run the service with ``guarantee`` under ``load``; report lateness percentiles."""
    settings = setup.deployment(f"late-{guarantee[:3]}")
    target = setup.topics.create(f"late-{guarantee[:3]}-target", setup.partitions)
    log = setup.work_dir / f"kdelay-{guarantee}-{time.monotonic_ns()}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(_command(settings, guarantee), stderr=err,
                                stdout=subprocess.DEVNULL)
    try:
        say(f"lateness[{guarantee}]: waiting for kdelay run to join its group")
        if not wait_group_stable(setup.topics.admin, settings.group_id, START_TIMEOUT_S,
                                 alive=lambda: proc.poll() is None):
            return Result("lateness", {"guarantee": guarantee},
                          skipped=f"kdelay run did not start: {_stderr_tail(log)}")
        return _measure(setup, settings, target, guarantee, load, proc, log)
    finally:
        _stop(proc)


def _measure(setup: Setup, settings: Settings, target: str, guarantee: str, load: Load,
             proc: subprocess.Popen[bytes], log: Path) -> Result:
    say(f"lateness[{guarantee}]: {load.rate:,}/s for {load.seconds:g}s "
        f"(+{load.warmup_seconds:g}s warm-up)")
    seen, took = _drive(setup, settings.requests_topic, target, load, delay_ms=load.delay_ms,
                        linger_ms=5)
    if proc.poll() is not None:
        return Result("lateness", {"guarantee": guarantee},
                      skipped=f"kdelay run exited (rc={proc.returncode}): {_stderr_tail(log)}")
    result = _result(guarantee, load, seen)
    result.figures["achieved_rate_per_s"] = round(int(load.rate * load.seconds) / took)
    return result


def _result(guarantee: str, load: Load, seen: dict[str, object]) -> Result:
    received = as_int(seen.get("count"))
    result = Result("lateness", {
        "guarantee": guarantee, "rate_per_s": load.rate, "seconds": load.seconds,
        "delay_ms": load.delay_ms, "sent": load.total, "received": received,
        "early": as_int(seen.get("early")), "duplicates": as_int(seen.get("duplicates")),
        "transactional": (as_int(seen.get("offset_gaps")) or 0) > 0})
    late = _percentiles(seen.get("lateness_ms"))
    result.figures.update({f"{k}_ms": v for k, v in late.items()})
    stamped = _percentiles(seen.get("stamp_lateness_ms"))
    result.figures.update({f"stamp_{k}_ms": v for k, v in stamped.items()})
    complete = received == load.total
    if not complete:
        result.figures["missing_after_drain"] = load.total - (received or 0)
    for name, bound in TARGETS[guarantee].items():
        value = late.get(name)
        result.check(f"{guarantee} {name} <= {bound:g} ms", value,
                     None if value is None else complete and value <= bound)
    return result


def _percentiles(raw: object) -> dict[str, float | None]:
    """Return the collector's percentile summary with values rounded to 0.1 ms."""
    if not isinstance(raw, dict):
        return {}
    return {str(k): _ms(v) for k, v in raw.items()}



def _ms(value: object) -> float | None:
    return round(float(value), 1) if isinstance(value, int | float) else None


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
