"""Scenario ``lateness``: how late records arrive under a steady delivery rate.

For each guarantee, one ``kdelay run`` subprocess on the system clock serves
``--lateness-runs`` consecutive runs (5 by default), each with its own target
topic. In each run the bench produces requests at a fixed rate, each due a
fixed delay after it is produced (the first run starts with a warm-up, tagged
so it is left out of the figures), and a collector process records per
record the receive wall time minus the due time (end to end) and the target
timestamp minus the due time (the service side: when kdelay called
``produce``). One process for all runs lets a stall that grows with the
process's age (compactions, garbage, changelog segments) show in the later
runs, while only the first carries the start-up.

This module holds the targets and turns the runs into results: one row per
run (lateness, loop phases, CPU per process, the broker's own figures) and
one ``lateness-worst`` row per guarantee with the pass/fail of issue 15's
targets, which must hold in every run. How the runs are driven is in
:mod:`kdelay_bench.steady`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdelay_bench import phases
from kdelay_bench.report import Figure, Result, as_int, per_record_us

HOP_FIGURE = "p99_ms"


@dataclass(frozen=True, slots=True)
class Target:
    """A bound on one figure of a run, in ms; ``over_hop`` adds the hop's p99 to it."""

    figure: str
    bound_ms: float
    over_hop: bool = False

    def limit(self, hop_p99_ms: float | None) -> float | None:
        """Return the bound in ms; None when it needs the hop and there is none."""
        if not self.over_hop:
            return self.bound_ms
        return None if hop_p99_ms is None else hop_p99_ms + self.bound_ms

    def describe(self, guarantee: str, hop_p99_ms: float | None) -> str:
        """Return the target as the report states it."""
        side = "service side" if self.figure.startswith("stamp_") else "end to end"
        stat = self.figure.removeprefix("stamp_").removesuffix("_ms")
        if not self.over_hop:
            return f"{guarantee} {side} {stat} <= {self.bound_ms:g} ms"
        hop = "n/a" if hop_p99_ms is None else f"{hop_p99_ms:g}"
        return f"{guarantee} {side} {stat} <= hop p99 ({hop}) + {self.bound_ms:g} ms"

    def met(self, figures: dict[str, Figure], hop_p99_ms: float | None) -> bool | None:
        """Return whether a run's ``figures`` meet the target; None if undecidable."""
        value, limit = figures.get(self.figure), self.limit(hop_p99_ms)
        if not isinstance(value, int | float) or limit is None:
            return None
        return value <= limit


# Issue 15: what must hold in every run, per guarantee.
TARGETS: dict[str, tuple[Target, ...]] = {
    "at-least-once": (Target("stamp_p99_ms", 20.0), Target("stamp_max_ms", 100.0),
                      Target("p99_ms", 20.0, over_hop=True)),
    "exactly-once": (Target("p99_ms", 150.0),),
}
LATENESS_KEYS = ("p50", "p99", "p999", "max")
WORST_KEYS = (*(f"{k}_ms" for k in LATENESS_KEYS), *(f"stamp_{k}_ms" for k in LATENESS_KEYS))


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


def percentiles(raw: object, prefix: str = "") -> dict[str, Figure]:
    """Return the collector's percentile summary as ``<prefix><p>_ms`` figures, to 0.1 ms."""
    if not isinstance(raw, dict):
        return {}
    return {f"{prefix}{k}_ms": round(float(v), 1) if isinstance(v, int | float) else None
            for k, v in raw.items()}


@dataclass(frozen=True, slots=True)
class Run:
    """What one run measured: the collector's summary, the seconds the measured part
    took to produce, CPU per process, the loop phases (or a note why none) and the
    broker's own figures (:mod:`kdelay_bench.broker_metrics`, or a note)."""

    number: int
    load: Load
    seen: dict[str, object]
    took_s: float
    cpu: dict[str, Figure]
    phases: phases.Phases | str
    broker: dict[str, Figure] = field(default_factory=dict)
    rss_mb: int | None = None

    def figures(self) -> dict[str, Figure]:
        """Return the run's lateness figures (the warm-up left out)."""
        count = as_int(self.seen.get("count")) or 0
        duplicates = as_int(self.seen.get("duplicates")) or 0
        out: dict[str, Figure] = {
            "rate_per_s": self.load.rate, "seconds": self.load.seconds,
            "delay_ms": self.load.delay_ms, "sent": self.load.total, "received": count,
            "lost": self.load.total - (count - duplicates),
            "early": as_int(self.seen.get("early")), "duplicates": duplicates,
            "transactional": (as_int(self.seen.get("offset_gaps")) or 0) > 0}
        out.update(percentiles(self.seen.get("lateness_ms")))
        out.update(percentiles(self.seen.get("stamp_lateness_ms"), "stamp_"))
        measured = int(self.load.rate * self.load.seconds)
        out["achieved_rate_per_s"] = round(measured / self.took_s) if self.took_s else None
        out["service_cpu_us_per_record"] = self.service_cpu_us(count)
        if self.rss_mb is not None:
            out["rss_mb"] = self.rss_mb  # the service's peak resident set so far
        return out

    def service_cpu_us(self, received: int) -> float | None:
        """Return the service's CPU (user + system, all threads, from the first request
        produced to the collector's end) per record received: intake and delivery of
        one request together. None when the service was not measured."""
        cpu = self.cpu.get("service_cpu_s")
        return per_record_us(float(cpu), received) if isinstance(cpu, int | float) else None


def passed(figures: dict[str, Figure], targets: tuple[Target, ...],
           hop_p99_ms: float | None) -> bool | None:
    """Return whether a run meets every target with nothing lost or early; None when a
    target cannot be decided and none failed."""
    verdicts = [t.met(figures, hop_p99_ms) for t in targets]
    verdicts.append(figures.get("lost") == 0 and figures.get("early") == 0)
    if False in verdicts:
        return False
    return None if None in verdicts else True


@dataclass(slots=True)
class Suite:
    """The runs of one guarantee and how they were driven; ``skipped`` says why the
    suite stopped early, if it did."""

    guarantee: str
    planned: int
    setting: dict[str, Figure]
    runs: list[Run] = field(default_factory=list)
    skipped: str | None = None

    def results(self, hop_p99_ms: float | None) -> list[Result]:
        """Return per run a ``lateness``, ``lateness-phases``, ``lateness-cpu`` and
        ``lateness-broker`` row, then the ``lateness-worst`` row with the targets checked
        over every run."""
        targets = TARGETS[self.guarantee]
        out = []
        for run in self.runs:
            label: dict[str, Figure] = {"guarantee": self.guarantee,
                                        "run": f"{run.number}/{self.planned}"}
            figures = {**label, **run.figures(), "hop_p99_ms": hop_p99_ms}
            figures["pass"] = passed(figures, targets, hop_p99_ms)
            shown = (phases.figures(run.phases) if isinstance(run.phases, dict)
                     else {"note": run.phases})
            row = Result("lateness", figures)
            row.headline(f"lateness {self.guarantee} {label['run']} (service: intake and "
                         "delivery)", figures["achieved_rate_per_s"],
                         figures["service_cpu_us_per_record"])
            out += [row, Result("lateness-phases", {**label, **shown}),
                    Result("lateness-cpu", {**label, **run.cpu}),
                    Result("lateness-broker", {**label, **run.broker})]
        out.append(self.worst(hop_p99_ms))
        return out

    def worst(self, hop_p99_ms: float | None) -> Result:
        """Return the worst figure of every run and the targets checked in every run."""
        figures = [{**run.figures(), "run": run.number} for run in self.runs]
        result = Result("lateness-worst", {"guarantee": self.guarantee,
                                           "runs": f"{len(self.runs)}/{self.planned}",
                                           **self.setting, "hop_p99_ms": hop_p99_ms},
                        skipped=self.skipped)
        for key in WORST_KEYS:
            values = [(f[key], f["run"]) for f in figures if isinstance(f.get(key), int | float)]
            top = max(values, key=lambda v: float(v[0] or 0), default=(None, None))
            result.figures[f"worst_{key}"] = top[0]
            if key in ("p99_ms", "stamp_p99_ms"):
                result.figures[f"worst_{key}_run"] = top[1]
        lost = sum(as_int(f.get("lost")) or 0 for f in figures)
        early = sum(as_int(f.get("early")) or 0 for f in figures)
        result.figures.update({"lost": lost, "early": early, "runs_passed": sum(
            passed(f, TARGETS[self.guarantee], hop_p99_ms) is True for f in figures)})
        self._check(result, figures, hop_p99_ms)
        return result

    def _check(self, result: Result, figures: list[dict[str, Figure]],
               hop_p99_ms: float | None) -> None:
        complete = bool(figures) and len(figures) == self.planned
        for target in TARGETS[self.guarantee]:
            verdicts = [target.met(f, hop_p99_ms) for f in figures]
            met = (False if False in verdicts else
                   None if None in verdicts or not complete else True)
            result.check(target.describe(self.guarantee, hop_p99_ms) + ", every run",
                         result.figures.get(f"worst_{target.figure}"), met)
        lost, early = result.figures["lost"], result.figures["early"]
        result.check(f"{self.guarantee}: 0 lost, 0 early", f"{lost} lost, {early} early",
                     lost == 0 and early == 0 and complete)
