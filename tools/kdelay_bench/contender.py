"""A scheduler under test as a process of its own: ``kdelay run`` or the peer.

Both run the same way, so their figures compare: a backlog of the same
records (same keys, values, partitions; each in its scheduler's protocol) is
written first, then the process starts with its defaults and its logging
quiet. Intake is timed from the moment its consumer group is stable (both
join one; start-up and the join are left out, for both) to the moment its
own metrics say every record is taken in: kdelay's scheduled requests, the
peer's planned and missed schedules. For a burst, the records are all due at
one whole second, far enough ahead for the intake to finish first (the
``indexed_before_due`` figure says whether it did); a collector process reads
the target, and the drain is timed from the due instant to the last record
received. CPU is the process's (user + system, all threads, from
``/proc``), over the intake and over the drain; RSS is its peak (``VmHWM``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kafka_broker import free_port
from prometheus_client.parser import text_string_to_metric_families

from kdelay.plumbing.settings import Settings
from kdelay_bench import peer, phases
from kdelay_bench.broker import wait_group_stable
from kdelay_bench.collector import CollectorProcess, read_raw
from kdelay_bench.cputime import Reading, read_process
from kdelay_bench.load import Loader, produce_requests, values
from kdelay_bench.process import SchedulerProcess
from kdelay_bench.progress import Progress, say
from kdelay_bench.report import Figure, as_int, per_record_us
from kdelay_bench.stats import process_memory
from kdelay_bench.throughput import MB, Setup, within

START_TIMEOUT_S = 60.0
SCHEDULED = "kdelay_intake_records_total"
POLL_S = 0.05
# A burst whose records stopped coming this long ago is over: what is missing is lost.
IDLE_S = 120.0


class Contender(Protocol):
    """A running scheduler process the bench drives."""

    @property
    def pid(self) -> int:
        """Its process id."""
        ...

    def alive(self) -> bool:
        """Whether it still runs."""
        ...

    def taken_in(self) -> int | None:
        """How many records it has taken in; None while its metrics do not answer."""
        ...

    def tail(self) -> str:
        """The last lines it logged."""
        ...

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL)."""
        ...


def scheduled(exposition: str) -> int:
    """Return kdelay's scheduled requests from its metrics text."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == SCHEDULED and sample.labels.get("outcome") == "scheduled":
                return int(sample.value)
    return 0


def kdelay_command(settings: Settings, metrics_port: int) -> list[str]:
    """``kdelay run`` with its defaults (guarantee, batch size, read-ahead), logging at
    WARNING, on the topics of ``settings``."""
    return [str(Path(sys.executable).with_name("kdelay")), "run",
            "--bootstrap-servers", settings.bootstrap_servers,
            "--requests-topic", settings.requests_topic,
            "--changelog-topic", settings.changelog_topic, "--dlq-topic", settings.dlq_topic,
            "--group-id", settings.group_id, "--state-dir", str(settings.state_dir),
            "--log-level", "WARNING", "--metrics-port", str(metrics_port)]


@dataclass(frozen=True, slots=True)
class Side:
    """One contender's part of a run: its group, the topic its requests go to, how to
    write a backlog there and how to start it (and kdelay's metrics port)."""

    name: str
    group: str
    requests: str
    produce: Callable[[int, Callable[[int], int]], None]
    start: Callable[[], Contender]
    metrics_port: int | None = None


def kdelay_side(setup: Setup, role: str) -> tuple[Side, str]:
    """Return the kdelay side of a run (fresh topics) and its target topic."""
    settings = setup.deployment(role)
    port = free_port()
    log = setup.work_dir / f"{role}-{time.monotonic_ns()}.log"
    target = setup.topics.create(f"{role}-target", setup.partitions)

    def produce(count: int, due_of: Callable[[int], int]) -> None:
        say(f"{role}: producing {count:,} requests")
        produce_requests(setup.topics.bootstrap, settings.requests_topic, target, count,
                         setup.value_size, due_of, setup.partitions)

    def start() -> Contender:
        return SchedulerProcess(kdelay_command(settings, port), log, port, scheduled,
                                metric=SCHEDULED)

    return Side("kdelay", settings.group_id, settings.requests_topic, produce, start,
                port), target


def peer_side(setup: Setup, role: str, binary: Path) -> tuple[Side, str]:
    """Return the peer's side of a run (fresh topics) and its target topic."""
    topics = peer.PeerTopics(setup.topics.create(f"{role}-schedules", setup.partitions),
                             setup.topics.create(f"{role}-history", setup.partitions),
                             setup.topics.name(f"{role}-group"))
    target = setup.topics.create(f"{role}-target", setup.partitions)
    log = setup.work_dir / f"{role}-{time.monotonic_ns()}.log"

    def produce(count: int, due_of: Callable[[int], int]) -> None:
        say(f"{role}: producing {count:,} schedules")
        produce_schedules(setup, topics.schedules, target, count, due_of)

    def start() -> Contender:
        return peer.PeerProcess(binary, setup.topics.bootstrap, topics, log)

    return Side("peer", topics.group, topics.schedules, produce, start), target


def produce_schedules(setup: Setup, topic: str, target: str, count: int,
                      due_of: Callable[[int], int]) -> None:
    """Produce the records :func:`~kdelay_bench.load.produce_requests` would (same keys,
    values and partitions) in the peer's protocol. Raises ``LoadError`` if any is not
    acknowledged."""
    loader = Loader(setup.topics.bootstrap)
    pool = values(setup.value_size)
    progress = Progress(f"producing schedules to {topic}", count)
    for i in range(count):
        key = f"k{i}".encode()
        loader.produce(topic, key, pool[i % len(pool)],
                       peer.schedule_headers(target, due_of(i), key),
                       partition=i % setup.partitions)
        if i % 1_000 == 0:
            loader.poll()
            progress.update(i)
    loader.finish()


def _cpu_s(after: Reading | None, before: Reading | None) -> float | None:
    return None if after is None or before is None else after.cpu_s - before.cpu_s


def wait_taken_in(contender: Contender, total: int, timeout_s: float) -> float | None:
    """Wait until ``contender`` has taken in ``total`` records; return the monotonic
    time it had, None if it died or ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    progress = Progress("intake", total)
    while time.monotonic() < deadline and contender.alive():
        taken = contender.taken_in()
        if taken is not None:
            progress.update(taken)
            if taken >= total:
                return time.monotonic()
        time.sleep(POLL_S)
    return None


@dataclass(frozen=True, slots=True)
class Joined:
    """A started contender whose group is stable: when, and its CPU reading then."""

    contender: Contender
    started: float
    joined: float
    reading: Reading | None


def join(setup: Setup, side: Side) -> Joined:
    """Start ``side``'s process and wait until its group is stable. Raises
    ``RuntimeError`` (the process's last lines) if it does not join in time."""
    contender = side.start()
    started = time.monotonic()
    if not wait_group_stable(setup.topics.admin, side.group, START_TIMEOUT_S,
                             alive=contender.alive):
        contender.stop()
        raise RuntimeError(f"{side.name} did not join its group: {contender.tail()}")
    return Joined(contender, started, time.monotonic(), read_process(contender.pid))


def intake_figures(joined: Joined, total: int, indexed_at: float | None,
                   reading: Reading | None) -> dict[str, Figure]:
    """Return the intake figures: rate from the group's join, seconds from the process's
    start, CPU per record over the intake, RSS once all were taken in."""
    if indexed_at is None:
        raise RuntimeError(f"not all {total:,} taken in: {joined.contender.tail()}")
    seconds = indexed_at - joined.joined
    rss, _ = process_memory(joined.contender.pid)
    return {"records": total, "seconds": round(seconds, 3),
            "from_start_s": round(indexed_at - joined.started, 3),
            "requests_per_s": round(total / max(seconds, 1e-9)),
            "service_cpu_us_per_record": per_record_us(_cpu_s(reading, joined.reading), total),
            "rss_mb": round(rss / MB)}


def run_intake(setup: Setup, side: Side, total: int, due_ms: int) -> dict[str, Figure]:
    """Write ``total`` records due at ``due_ms``, start ``side`` and time its intake."""
    side.produce(total, lambda _: due_ms)
    joined = join(setup, side)
    try:
        indexed_at = wait_taken_in(joined.contender, total, max(120.0, total / 2_000))
        return intake_figures(joined, total, indexed_at, read_process(joined.contender.pid))
    finally:
        joined.contender.stop()


def burst_lead_s(total: int) -> float:
    """Seconds from the start of the backlog's write to its due instant: enough to write
    ``total`` records at 50 k/s and take them in at 20 k/s, plus 15 s for start-up."""
    return 15.0 + total / 50_000 + total / 20_000


@dataclass(frozen=True, slots=True)
class Burst:
    """What a burst run measured: the drain, the intake before it, and the loop's CPU
    per record by phase over the drain (empty without a phase metric)."""

    figures: dict[str, Figure]
    intake: dict[str, Figure]
    phases: dict[str, Figure]


def run_burst(setup: Setup, side: Side, target: str, total: int, port: int | None = None,
              lead_s: float | None = None) -> Burst:
    """Write ``total`` records due at one whole second ``lead_s`` ahead (default
    :func:`burst_lead_s`), let ``side`` take them in, and time their delivery.
    ``port`` is kdelay's metrics port, for the loop's phases."""
    lead_s = burst_lead_s(total) if lead_s is None else lead_s
    due_ms = -(-int((time.time() + lead_s) * 1000) // 1000) * 1000
    side.produce(total, lambda _: due_ms)
    out = setup.work_dir / f"{side.name}-burst-{time.monotonic_ns()}.json"
    raw = out.with_suffix(".raw")
    collector = CollectorProcess(setup.topics.bootstrap, target, total,
                                 timeout_s=lead_s + 300 + total / 500,
                                 out=out, raw=raw, idle_s=IDLE_S)
    joined: Joined | None = None
    try:
        joined = join(setup, side)
        indexed_at = wait_taken_in(joined.contender, total, max(120.0, total / 2_000))
        intake = intake_figures(joined, total, indexed_at, read_process(joined.contender.pid))
        due_s = due_ms / 1000
        ahead = due_s - time.time()
        say(f"{side.name} burst: all taken in, {ahead:.1f}s before the due instant")
        time.sleep(max(0.0, ahead - 0.05))
        before, phases_before = read_process(joined.contender.pid), _phases(port)
        seen = collector.result()
        after, phases_after = read_process(joined.contender.pid), _phases(port)
        _, peak = process_memory(joined.contender.pid)
    finally:
        collector.kill()
        if joined is not None:
            joined.contender.stop()
    received, stamps = read_raw(raw)
    figures = burst_figures(seen, total, due_s, within(received, stamps, due_s),
                            ready_s=due_s - min(ahead, 0.0))
    delivered = total - (as_int(figures["lost"]) or 0)  # CPU per record that came
    figures.update({"indexed_before_due": ahead > 0, "taken_in_ahead_s": round(ahead, 1),
                    "service_cpu_us_per_record": per_record_us(_cpu_s(after, before),
                                                               delivered),
                    "rss_mb": round(peak / MB)})
    by_phase: dict[str, Figure] = {}
    if isinstance(phases_after, dict):
        by_phase = phases.cpu_per_record(phases.since(
            phases_after, phases_before if isinstance(phases_before, dict) else None), total)
    return Burst(figures, intake, by_phase)


def _phases(port: int | None) -> phases.Phases | str | None:
    return None if port is None else phases.scrape(port)


def burst_figures(seen: dict[str, object], total: int, due_s: float,
                  counted: dict[str, int], ready_s: float | None = None) -> dict[str, Figure]:
    """Return a burst's rate (distinct records received over the seconds from the due
    instant to the last one), what was lost, early or duplicated, and the ``within``
    counts. When the service had taken the records in only at ``ready_s``, after the
    due instant, the drain from then is added (``..._after_intake``): the rate from
    the due instant then holds the intake's lag too."""
    last = seen.get("last_s")
    seconds = float(last) - due_s if isinstance(last, int | float) else None
    received = as_int(seen.get("count")) or 0
    duplicates = as_int(seen.get("duplicates")) or 0
    early = as_int(seen.get("early"))
    return {"records": total, "seconds": seconds and round(seconds, 3),
            "records_per_s": round((received - duplicates) / seconds)
            if seconds and seconds > 0 else None,
            "received": received, "lost": total - (received - duplicates),
            "early": early,
            "duplicates": duplicates, **counted, **_after_intake(
                last, received - duplicates, due_s, ready_s)}


def _after_intake(last: object, distinct: int, due_s: float,
                  ready_s: float | None) -> dict[str, Figure]:
    """The drain's seconds and rate from ``ready_s``, if that is after the due instant."""
    if ready_s is None or ready_s <= due_s or not isinstance(last, int | float):
        return {}
    seconds = float(last) - ready_s
    return {"drain_s_after_intake": round(seconds, 3),
            "records_per_s_after_intake": round(distinct / seconds) if seconds > 0 else None}
