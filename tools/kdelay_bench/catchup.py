"""The ``catchup`` scenario: a paused target's backlog released at its catch-up rate.

Issue 46 asks for a measured catch-up: N held-back records released at the cap,
with the lateness that results. The scenario pauses a fresh target, writes N
requests due at one instant, starts ``kdelay run`` with its defaults and waits
until every request is taken in and due (so every one is held back: about a
thousand in memory, the rest shelved in the index). Then it resumes the target
with ``--catch-up-rate`` R, as ``kdelay target resume`` does, and the collector
reads the target. It reports:

- ``released_per_s``: N over the span of the delivered records' timestamps (the
  service's clock as each went out), against the rate asked for;
- the lateness of each record (its timestamp minus its due time): p50, p99, max,
  and the same from the resume on (what the catch-up rate itself costs);
- what came while the target was paused (must be 0), early, lost, duplicates.

The rate is per instance; one instance runs here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kdelay import controls
from kdelay.plumbing.settings import Settings
from kdelay.protocol.controls import Control, Scope, Subject
from kdelay_bench import contender
from kdelay_bench.collector import CollectorProcess, read_raw
from kdelay_bench.progress import say
from kdelay_bench.report import Figure, Result, as_int
from kdelay_bench.throughput import Setup

HELD_S = 2.0
"""How long past the due instant the records stay held before the resume."""
RATE_TOLERANCE = 0.1
"""How far the release rate may stray from the rate asked for (the bucket's burst)."""


def run_catchup(setup: Setup, total: int, rate_per_s: int) -> Result:
    """Hold ``total`` records of a paused target, release them at ``rate_per_s``."""
    side, target = contender.kdelay_side(setup, "catchup")
    writer = Settings(bootstrap_servers=setup.topics.bootstrap)
    subject = Subject(Scope.TARGET, target)
    controls.pause(writer, subject, "bench", "the catchup scenario", _now_ms())
    lead_s = contender.burst_lead_s(total)
    due_ms = int((time.time() + lead_s) * 1000)
    side.produce(total, lambda _: due_ms)
    out = setup.work_dir / f"catchup-{time.monotonic_ns()}.json"
    raw = out.with_suffix(".raw")
    collector = CollectorProcess(setup.topics.bootstrap, target, total,
                                 timeout_s=lead_s + 300 + 2 * total / rate_per_s,
                                 out=out, raw=raw, idle_s=contender.IDLE_S)
    joined: contender.Joined | None = None
    try:
        joined = contender.join(setup, side)
        if contender.wait_taken_in(joined.contender, total, max(120.0, total / 2_000)) is None:
            raise RuntimeError(f"not all {total:,} taken in: {joined.contender.tail()}")
        time.sleep(max(0.0, due_ms / 1000 + HELD_S - time.time()))
        say(f"catchup: {total:,} held; resuming at {rate_per_s:,}/s")
        controls.resume(writer, subject, "bench", _now_ms(), float(rate_per_s))
        resumed_s = time.time()  # the resume is in the controls topic from here
        seen = collector.result()
    finally:
        collector.kill()
        if joined is not None:
            joined.contender.stop()
        controls.write_control(writer, subject, Control())  # leave nothing in force
    received, stamps = read_raw(raw)
    return _result(seen, list(received), list(stamps), total, rate_per_s, resumed_s, due_ms)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _result(seen: Mapping[str, object], received_s: list[float], late_ms: list[float],
            total: int, rate_per_s: int, resumed_s: float, due_ms: int) -> Result:
    """The ``catchup`` row from the collector's summary and its raw columns (``late_ms``:
    each record's timestamp minus ``due_ms``, the one due time of them all)."""
    duplicates = as_int(seen.get("duplicates")) or 0
    came = (as_int(seen.get("count")) or 0) - duplicates
    span_s = (max(late_ms) - min(late_ms)) / 1000 if len(late_ms) > 1 else None
    released = round((len(late_ms) - 1) / span_s) if span_s else None
    ordered = sorted(late_ms)
    gap_ms = resumed_s * 1000 - due_ms  # lateness the pause itself made
    figures: dict[str, Figure] = {
        "records": total, "rate_asked_per_s": rate_per_s, "released_per_s": released,
        "release_seconds": span_s and round(span_s, 2),
        "expected_seconds": round(total / rate_per_s, 2),
        "while_paused": sum(1 for at in received_s if at < resumed_s),
        "lateness_p50_ms": _at(ordered, 0.50), "lateness_p99_ms": _at(ordered, 0.99),
        "lateness_max_ms": ordered[-1] if ordered else None,
        "resumed_after_due_s": round(resumed_s - due_ms / 1000, 2),
        **{f"after_resume_{name}_ms": None if at is None else round(at - gap_ms, 1)
           for name, at in (("p50", _at(ordered, 0.50)), ("p99", _at(ordered, 0.99)),
                            ("max", ordered[-1] if ordered else None))},
        "early": as_int(seen.get("early")), "lost": total - came, "duplicates": duplicates,
        "service": "kdelay run, one instance"}
    result = Result("catchup", figures)
    result.headline("catch-up release (kdelay run)", released, None)
    low, high = rate_per_s * (1 - RATE_TOLERANCE), rate_per_s * (1 + RATE_TOLERANCE)
    result.check(f"released at the catch-up rate ({rate_per_s:,}/s ± 10 %)", released,
                 None if released is None else low <= released <= high)
    result.check("nothing delivered while paused", figures["while_paused"],
                 figures["while_paused"] == 0)
    result.check("0 early", figures["early"], figures["early"] == 0)
    result.check("0 lost", figures["lost"], figures["lost"] == 0)
    result.check("0 duplicates", duplicates, duplicates == 0)
    return result


def _at(ordered: list[float], share: float) -> float | None:
    """The ``share`` quantile of sorted values (nearest rank), None when empty."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]
