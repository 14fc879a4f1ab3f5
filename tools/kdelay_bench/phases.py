"""Where the service loop spends its time: ``kdelay_loop_phase_seconds`` per run.

``kdelay run`` exposes one histogram, labelled ``phase`` (``consume``,
``deliver``, ``ack-wait``, ``fetch``, ``settle``, ``commit``,
``housekeeping``, ...), of how long each step of its loop took. The bench
scrapes the metrics endpoint before the first run and after each run, and
reports per run and phase the difference: how many steps, their total
seconds, how many took longer than 100 ms and than 1 s (from the cumulative
bucket counts), and the upper bound of the highest bucket that holds one.
A service that does not expose the histogram (older code) yields a note
instead of figures, never an error. ``kdelay_intake_delay_seconds`` (how late
requests reached the service) comes out the same way, as the row
``intake-delay``.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kdelay_bench.report import Figure

METRIC = "kdelay_loop_phase_seconds"
# Not a phase: how late requests reached the service (intake time minus their record
# timestamp). Reported as one more row of the same form, so a run shows at once
# whether a late delivery was held in the loop or arrived late.
INTAKE_DELAY = "kdelay_intake_delay_seconds"
INTAKE_DELAY_ROW = "intake-delay"
SLOW_S = (0.1, 1.0)
READ_TIMEOUT_S = 5.0
NO_METRIC = "no phase metric"


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase's histogram: observations, their sum, and cumulative bucket counts
    as ``(upper bound, count)`` in ascending order, ``+Inf`` last."""

    count: float
    total_s: float
    buckets: tuple[tuple[float, float], ...]

    def minus(self, before: Phase | None) -> Phase:
        """Return the observations made since ``before`` (None: since the start)."""
        if before is None:
            return self
        earlier = dict(before.buckets)
        return Phase(self.count - before.count, self.total_s - before.total_s,
                     tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets))

    def over(self, bound_s: float) -> int:
        """Return how many observations exceeded the largest bucket bound <= ``bound_s``
        (exactly ``bound_s`` when it is a bucket bound, as 0.1 and 1 are by default)."""
        below = max((n for le, n in self.buckets if le <= bound_s), default=0.0)
        return round(self.count - below)

    def highest_bound(self) -> float | None:
        """Return the upper bound of the highest bucket holding an observation (``inf``
        when one exceeded every finite bound), None without observations."""
        previous = 0.0
        highest = None
        for le, n in self.buckets:
            if n > previous:
                highest = le
            previous = n
        return highest


Phases = dict[str, Phase]


@dataclass(slots=True)
class _Samples:
    """A phase's samples as the exposition lists them."""

    count: float = 0.0
    total_s: float = 0.0
    buckets: list[tuple[float, float]] = field(default_factory=list)

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        """Take one sample of the histogram family."""
        if name.endswith("_bucket"):
            self.buckets.append((float(labels["le"]), value))
        elif name.endswith("_count"):
            self.count = value
        elif name.endswith("_sum"):
            self.total_s = value


def parse(text: str) -> Phases | None:
    """Return the phase histograms of a text exposition, None when it has none."""
    found: dict[str, _Samples] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (METRIC, INTAKE_DELAY):
            continue
        for sample in family.samples:
            row = (sample.labels.get("phase", "") if family.name == METRIC
                   else INTAKE_DELAY_ROW)
            phase = found.setdefault(row, _Samples())
            phase.add(sample.name, sample.labels, float(sample.value))
    if not found:
        return None
    return {name: Phase(p.count, p.total_s, tuple(sorted(p.buckets)))
            for name, p in found.items()}


def since(after: Phases, before: Phases | None) -> Phases:
    """Return each phase's observations made after ``before`` was read."""
    earlier = before or {}
    return {name: phase.minus(earlier.get(name)) for name, phase in after.items()}


def scrape(port: int) -> Phases | str:
    """Read the phase histograms from ``127.0.0.1:port``; a note when there are none
    (:data:`NO_METRIC`) or the endpoint does not answer."""
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=READ_TIMEOUT_S) as response:
            text = response.read().decode()
    except OSError as exc:
        return f"metrics endpoint {url} unreadable: {exc}"
    return parse(text) or NO_METRIC


def figures(phases: Phases) -> dict[str, Figure]:
    """Return per phase ``<phase>_count``, ``<phase>_s`` (total seconds),
    ``<phase>_over_100ms``, ``<phase>_over_1s`` and ``<phase>_max_le_s`` (the highest
    bucket bound reached; ``"+Inf"`` when an observation exceeded every finite one)."""
    out: dict[str, Figure] = {}
    for name in sorted(phases):
        phase = phases[name]
        highest = phase.highest_bound()
        out.update({
            f"{name}_count": round(phase.count), f"{name}_s": round(phase.total_s, 3),
            f"{name}_over_100ms": phase.over(SLOW_S[0]), f"{name}_over_1s": phase.over(SLOW_S[1]),
            f"{name}_max_le_s": "+Inf" if highest is not None and math.isinf(highest)
            else highest})
    return out


def cpu_per_record(phases: Phases, records: int) -> dict[str, Figure]:
    """Return ``<phase>_us_per_record`` for every loop phase (the intake-delay row is
    not one), largest first, and ``total_us_per_record``: the phases' seconds over
    ``records``, in µs to 0.1; then ``steps`` (the loop's steps, the most
    observations of any phase) and ``records_per_step``. With the loop's phases
    timed by its thread's CPU clock (as :class:`kdelay_bench.inproc.InProcess`
    times them) that is the loop's CPU per record split by phase; with a wall
    clock, its wall time."""
    n = max(records, 1)
    loop = {name: phase for name, phase in phases.items() if name != INTAKE_DELAY_ROW}
    out: dict[str, Figure] = {
        f"{name}_us_per_record": round(phase.total_s * 1e6 / n, 1)
        for name, phase in sorted(loop.items(), key=lambda x: -x[1].total_s)}
    out["total_us_per_record"] = round(sum(p.total_s for p in loop.values()) * 1e6 / n, 1)
    steps = round(max((p.count for p in loop.values()), default=0))
    out["steps"] = steps
    out["records_per_step"] = round(records / steps, 1) if steps else None
    return out
