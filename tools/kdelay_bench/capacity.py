"""Scenario ``capacity`` (opt-in, or ``--long``): one instance with N pending entries.

Run once with ``capacity_base`` (1 M) and once with ``capacity_pending`` (100 M
by default) pending entries. Each run, in order, so that a long run that is
cut short has still measured the first figures (each is printed as it comes):

1. **load**: N requests with small originals (``CAPACITY_VALUE`` bytes) are
   produced round-robin over the partitions, due over the day after
   ``FIRST_DUE_MS`` (past any index time, and within half the changelog's
   ``delete.retention.ms``, so a restarted store is still trusted); the disk
   and time it needs are stated first;
2. **index**: an in-process service (``kdelay run``'s loop and defaults)
   indexes them: the time to index, the bench process's RSS, the state dir's
   bytes per entry and RocksDB's memory by part;
3. **lateness**: with the N pending, ``LATE_COUNT`` requests due over the next
   ``LATE_SPAN_MS`` are produced and delivered; their lateness (target
   timestamp minus due) p99, to compare with the base run's;
4. **restart**: two slices of ``SLICE`` requests are indexed, due in
   ``SLICE_LEAD_MS`` and twice that (a broker refuses record timestamps more
   than an hour ahead of its clock, so the N entries themselves cannot be
   brought due); the service is stopped and started again on its state dir
   with its clock at the first slice's due time: seconds from start to the
   first delivered record;
5. **operator**: ``kdelay due --within 1m``, ``backlog`` and ``show ID`` as
   subprocesses, once cold (the view replays the changelog) and then warm
   (before the restore: a 100 M run cut short has the commands' figures);
6. **restore**: stopped again, its state dir deleted, started again with its
   clock at the second slice's due time (or now, if that has passed): seconds
   until every partition is restored, changelog records per second, and the
   first delivery.

The RSS is read at the end of each phase, never while the bench's own
producer holds a million records queued.
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay_bench.collector import CollectorProcess, read_raw
from kdelay_bench.inproc import FollowingClock, InProcess
from kdelay_bench.load import produce_requests
from kdelay_bench.operator_view import timed
from kdelay_bench.progress import say
from kdelay_bench.report import Figure, Result, as_int
from kdelay_bench.stats import dir_bytes, percentile, rss_bytes
from kdelay_bench.throughput import DAY_MS, HOUR_MS, MB, Setup

RSS_LIMIT = 1 << 30
BYTES_PER_ENTRY = 25
COMMAND_S = 2.0
RESTART_S = 5.0
RESTORE_PER_S = 1_000_000
CAPACITY_VALUE = 20  # original value bytes: "tens of bytes"
LATE_COUNT = 20_000
LATE_LEAD_MS = 5_000
LATE_SPAN_MS = 20_000
# What the disk needs per entry, measured at 10 M on Kafka 4.1: the broker's requests
# topic (a 20-B value, a key, two headers and the record's overhead: 117 B) and
# changelog before compaction (a 20-B key, a ~40-B value and overhead: 82 B), and
# the service's and a view's stores (14 B each).
BROKER_PER_ENTRY = 117 + 82
DISK_PER_ENTRY = BROKER_PER_ENTRY + 2 * 15
INDEX_PER_S = 60_000  # for the time stated up front: intake on a loaded machine
RESTORE_GUESS_PER_S = 150_000
RESTORED: tuple[str, dict[str, str]] = ("kdelay_restored_changelog_records_total", {})
FIRST_DUE_MS = 6 * HOUR_MS
SLICE = 1_000
SLICE_LEAD_MS = 60_000


@dataclass(slots=True)
class Run:
    """The figures of one size, filled in phase by phase."""

    pending: int
    figures: dict[str, Figure] = field(default_factory=dict)

    def note(self, **figures: Figure) -> None:
        """Keep ``figures`` and print them at once (a long run may be cut short)."""
        self.figures.update(figures)
        say(f"capacity {self.pending:,}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def _rss_mb() -> int:
    return round(rss_bytes() / MB)


def _step_until(service: InProcess, done: Callable[[], bool], timeout_s: float) -> float:
    """Step ``service`` until ``done()``; return the seconds it took."""
    start = time.monotonic()
    service.step_until(done, timeout_s)
    return time.monotonic() - start


def _load(setup: Setup, settings: Settings, target: str, count: int, base_ms: int) -> float:
    """Produce ``count`` requests due over the day after ``base_ms + FIRST_DUE_MS``; return
    the seconds it took."""
    say(f"capacity {count:,}: needs about {count * DISK_PER_ENTRY / 1e9:.1f} GB of disk "
        f"({count * BROKER_PER_ENTRY / 1e9:.1f} GB of it in the broker's log directory: "
        "requests and changelog; a broker that keeps its logs in memory, as tools/kafka's "
        "does on /dev/shm, needs that much RAM free; the rest under --work-dir: stores) and "
        f"about {2 * count / INDEX_PER_S / 60:.0f} min to "
        f"load and index (at {INDEX_PER_S:,}/s each) plus "
        f"{count / RESTORE_GUESS_PER_S / 60:.0f} min for each of the restore and the cold "
        f"view (at {RESTORE_GUESS_PER_S:,}/s)")
    start = time.monotonic()
    first = base_ms + FIRST_DUE_MS
    produce_requests(setup.topics.bootstrap, settings.requests_topic, target, count,
                     CAPACITY_VALUE, lambda i: first + i * DAY_MS // count, setup.partitions)
    return time.monotonic() - start


def _memory(service: InProcess) -> dict[str, Figure]:
    """RocksDB's memory by part, in MB, from the service's gauges."""
    registry = service.service.metrics.registry
    parts = ("block_cache", "pinned", "memtables", "table_readers")
    return {f"rocksdb_{part}_mb": round((registry.get_sample_value(
        "kdelay_rocksdb_memory_bytes", {"part": part}) or 0) / MB, 1) for part in parts}


def _lateness(setup: Setup, settings: Settings, service: InProcess, run: Run) -> None:
    """Deliver ``LATE_COUNT`` requests due soon while the rest stays pending."""
    target = setup.topics.create(f"cap{run.pending}-late", setup.partitions)
    work = setup.work_dir
    out = work / f"late-{time.monotonic_ns()}.json"
    raw = out.with_suffix(".raw")
    collector = CollectorProcess(setup.topics.bootstrap, target, LATE_COUNT, 600.0, out, raw=raw)
    try:
        first = SystemClock().now_ms() + LATE_LEAD_MS
        produce_requests(setup.topics.bootstrap, settings.requests_topic, target, LATE_COUNT,
                         CAPACITY_VALUE, lambda i: first + i * LATE_SPAN_MS // LATE_COUNT,
                         setup.partitions)
        before = service.delivered()
        _step_until(service, lambda: service.delivered() >= before + LATE_COUNT, 600.0)
        seen = collector.result()
    finally:
        collector.kill()
    _, stamps = read_raw(raw)
    ordered = sorted(stamps)
    run.note(late_p50_ms=percentile(ordered, 0.5), late_p99_ms=percentile(ordered, 0.99),
             late_max_ms=ordered[-1] if ordered else None, late_early=as_int(seen.get("early")),
             late_received=as_int(seen.get("count")))


def _slices(setup: Setup, settings: Settings, service: InProcess, run: Run) -> int:
    """Index two slices of :data:`SLICE` requests, due in :data:`SLICE_LEAD_MS` and twice
    that; return the first slice's due time."""
    target = setup.topics.create(f"cap{run.pending}-slices", setup.partitions)
    first = SystemClock().now_ms() + SLICE_LEAD_MS
    before = service.scheduled()
    produce_requests(setup.topics.bootstrap, settings.requests_topic, target, 2 * SLICE,
                     CAPACITY_VALUE, lambda i: first + (i // SLICE) * SLICE_LEAD_MS,
                     setup.partitions)
    _step_until(service, lambda: service.scheduled() >= before + 2 * SLICE, 600.0)
    return first


def _clock_at(due_ms: int) -> FollowingClock:
    """A clock at ``due_ms`` or the system time, whichever is later, running on."""
    clock = FollowingClock(max(due_ms, SystemClock().now_ms()))
    clock.follow()
    return clock


def _restart(settings: Settings, due_ms: int, run: Run) -> None:
    """Start the service again on its state dir, its clock at ``due_ms``: time the first
    delivered record."""
    clock = _clock_at(due_ms)
    start = time.monotonic()
    service = InProcess(settings, clock)
    try:
        _step_until(service, lambda: service.delivered() >= 1, 600.0)
        run.note(restart_first_delivery_s=round(time.monotonic() - start, 3),
                 rss_after_restart_mb=_rss_mb())
    finally:
        service.close()


def _restore(settings: Settings, partitions: int, due_ms: int, run: Run) -> None:
    """Delete the state dir and start again: time the restore of all ``partitions`` (each
    serves once its own is done) and the first delivery."""
    shutil.rmtree(settings.state_dir, ignore_errors=True)
    clock = _clock_at(due_ms)
    start, cpu_start = time.monotonic(), _cpu_s()
    service = InProcess(settings, clock)
    try:
        registry = service.service.metrics.registry
        first_s: float | None = None

        def restored_all() -> bool:
            nonlocal first_s
            if first_s is None and service.delivered():
                first_s = round(time.monotonic() - start, 3)
            return len(service.service.owned()) == partitions

        owned = _step_until(service, restored_all, 7_200.0)
        restored = int(registry.get_sample_value(*RESTORED) or 0)
        # The bench process's CPU (and its children's): on a loaded machine the rate
        # says how much of a core it got, the CPU an entry what it costs.
        cpu_s = _cpu_s() - cpu_start
        run.note(restore_s=round(owned, 1), restored_records=restored,
                 restore_per_s=round(restored / max(owned, 1e-9)),
                 restore_cpu_us=round(cpu_s / max(restored, 1) * 1e6, 2),
                 # Deliveries start with the first partition restored: before the last.
                 restore_first_delivery_s=first_s,
                 rss_after_restore_mb=_rss_mb())
    finally:
        service.close()


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime + _children_cpu_s()


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _operator(setup: Setup, settings: Settings, run: Run) -> None:
    """Time ``due --within 1m``, ``backlog`` and ``show`` on a view, cold then warm."""
    view = Path(tempfile.mkdtemp(prefix="cap-view-", dir=setup.work_dir))
    cold, _ = timed(settings, view, "due", "--within", "1m")
    run.note(view_cold_s=round(cold, 1))
    offset = run.pending // 7 // setup.partitions
    for name, command in (("due", ("due", "--within", "1m")), ("backlog", ("backlog",)),
                          ("show", ("show", f"{settings.requests_topic}/0/{offset}"))):
        before = _children_cpu_s()
        seconds, _ = timed(settings, view, *command)
        # The CPU it used too: on a loaded machine the wall time is mostly waiting.
        run.note(**{f"{name}_s": round(seconds, 3),
                    f"{name}_cpu_s": round(_children_cpu_s() - before, 3)})
    shutil.rmtree(view, ignore_errors=True)


def measure(setup: Setup, count: int) -> Run:
    """Run every phase at ``count`` pending; return what was measured (see the module)."""
    run = Run(count)
    settings = setup.deployment(f"cap{count}")
    target = setup.topics.create(f"cap{count}-target", setup.partitions)
    base_ms = SystemClock().now_ms()
    run.note(load_s=round(_load(setup, settings, target, count, base_ms), 1))
    clock = _clock_at(0)  # the system time: the load took a while
    service = InProcess(settings, clock)
    try:
        rate, seconds = service.intake(count, timeout_s=max(600.0, count / 2_000))
        state = dir_bytes(settings.state_dir)
        run.note(index_s=round(seconds, 1), index_per_s=round(rate), rss_mb=_rss_mb(),
                 state_dir_mb=round(state / MB), state_bytes_per_entry=round(state / count, 2))
        service.step_for(6.0)  # a housekeeping round: the memory gauges
        run.note(**_memory(service))
        _lateness(setup, settings, service, run)
        run.note(rss_after_lateness_mb=_rss_mb())
        slice_ms = _slices(setup, settings, service, run)
    finally:
        service.close()
    run.note(state_bytes_per_entry_closed=round(dir_bytes(settings.state_dir) / count, 2))
    _restart(settings, slice_ms + 1_000, run)
    _operator(setup, settings, run)
    _restore(settings, setup.partitions, slice_ms + SLICE_LEAD_MS + 1_000, run)
    return run


def run_capacity(setup: Setup, base: int, large: int) -> Result:
    """Measure ``base`` and then ``large`` pending; check the targets at ``large``."""
    small = measure(setup, base) if base else None
    big = measure(setup, large)
    figures: dict[str, Figure] = {f"base_{k}": v for k, v in (small.figures if small else {}
                                                               ).items()}
    figures.update({f"large_{k}": v for k, v in big.figures.items()})
    result = Result("capacity", {"base_pending": base, "large_pending": large, **figures})
    f = big.figures
    _check(result, f"{large:,} pending: RSS <= 1 GB (MB)", max(
        _num(f.get(k)) for k in ("rss_mb", "rss_after_lateness_mb", "rss_after_restart_mb",
                                 "rss_after_restore_mb")), RSS_LIMIT / MB, above=False)
    _check(result, f"state dir <= {BYTES_PER_ENTRY} B/entry", f.get("state_bytes_per_entry"),
           BYTES_PER_ENTRY, above=False)
    for name in ("due", "backlog", "show"):
        _check(result, f"{name} < {COMMAND_S:.0f} s", f.get(f"{name}_s"), COMMAND_S,
               above=False)
    _check(result, f"first delivery after a restart <= {RESTART_S:.0f} s",
           f.get("restart_first_delivery_s"), RESTART_S, above=False)
    _check(result, f"restore >= {RESTORE_PER_S:,}/s", f.get("restore_per_s"), RESTORE_PER_S,
           above=True)
    base_p99 = small.figures.get("late_p99_ms") if small else None
    late = f.get("late_p99_ms")
    result.check("lateness p99 as at base (ms, within 1.5x + 50 ms)", late,
                 None if not isinstance(late, int | float) or not isinstance(base_p99, int | float)
                 else late <= 1.5 * base_p99 + 50)
    result.check("0 early", f.get("late_early"), f.get("late_early") == 0)
    return result


def _num(value: Figure) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _check(result: Result, label: str, measured: Figure, bound: float, *, above: bool) -> None:
    """Check ``measured`` against ``bound`` (at least it when ``above``, else at most)."""
    if not isinstance(measured, int | float):
        result.check(label, measured, None)
        return
    result.check(label, measured, measured >= bound if above else measured <= bound)
