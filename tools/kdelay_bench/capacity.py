"""Scenario ``capacity`` (``--long``): does a large pending set cost memory or speed?

Two pending-then-due runs, one with ``capacity_base`` pending entries (1 M)
and one with ``capacity_pending`` (10 M): each indexes all of them, then
delivers the same-sized slice that comes due at one instant while the rest
stays pending. Reported: intake and delivery rates of both, their ratios, and
the resident memory of the bench process (which hosts the service) with the
large set pending.
"""

from __future__ import annotations

from kdelay_bench.report import Result, as_int
from kdelay_bench.throughput import MB, DueRun, Setup, pending_then_due

RSS_LIMIT = 1 << 30
WITHIN = 0.9


def _rates(run: DueRun, due_count: int) -> tuple[float, float]:
    """Return ``(intake/s, delivery/s)`` of a run."""
    return run.intake_per_s, due_count / run.deliver_s if run.deliver_s else 0.0


def run_capacity(setup: Setup, base: int, large: int, due_count: int) -> Result:
    """Compare ``large`` pending entries with ``base``; check memory and rate targets."""
    small_run = pending_then_due(setup, "cap-base", base, due_count)
    large_run = pending_then_due(setup, "cap-large", large, due_count)
    small_in, small_out = _rates(small_run, due_count)
    large_in, large_out = _rates(large_run, due_count)
    intake_ratio = round(large_in / small_in, 3) if small_in else 0.0
    deliver_ratio = round(large_out / small_out, 3) if small_out else 0.0
    result = Result("capacity", {
        "base_pending": base, "large_pending": large, "due_slice": due_count,
        "base_intake_per_s": round(small_in), "large_intake_per_s": round(large_in),
        "base_delivery_per_s": round(small_out), "large_delivery_per_s": round(large_out),
        "base_rss_mb": round(small_run.rss_after_intake / MB),
        "large_rss_mb": round(large_run.rss_after_intake / MB),
        "large_rss_after_delivery_mb": round(large_run.rss_after / MB),
        "intake_ratio": intake_ratio, "delivery_ratio": deliver_ratio,
        "early": as_int(large_run.seen.get("early"))})
    for label, run, rates in (("base", small_run, (small_in, small_out)),
                              ("large", large_run, (large_in, large_out))):
        result.headline(f"capacity {label}: intake (service)", round(rates[0]),
                        run.intake_cpu["service_cpu_us_per_record"])
        result.headline(f"capacity {label}: delivery (service)", round(rates[1]),
                        run.deliver_cpu["service_cpu_us_per_record"])
    rss = max(large_run.rss_after_intake, large_run.rss_after)
    result.check(f"{large:,} pending RSS <= 1 GB (MB)", round(rss / MB), rss <= RSS_LIMIT)
    result.check("intake within 10% of base", intake_ratio, intake_ratio >= WITHIN)
    result.check("delivery within 10% of base", deliver_ratio, deliver_ratio >= WITHIN)
    return result
