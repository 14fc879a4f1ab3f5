"""Results of the scenarios: JSON lines for machines, markdown tables for people.

Each scenario yields one :class:`Result`: its figures and the targets (issues 5, 15)
checked against them. A scenario that cannot run says so in ``skipped``.

Beside every rate a scenario reports it names the CPU that rate cost: a
:class:`Headline`, the rate and the CPU microseconds per record (user + system
time of the process doing the work, all threads, over the same window). On a
shared machine rates swing between runs while CPU per record holds, so the
markdown leads with these lines, each with its CPU relative to the pipe's
(:func:`relate_to_pipe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TextIO

import orjson

Figure = int | float | str | bool | None


@dataclass(frozen=True, slots=True)
class Check:
    """One target (issues 5 and 15): what is measured, the bound, and whether it holds."""

    target: str
    measured: Figure
    met: bool | None

    def as_json(self) -> dict[str, Figure]:
        """Return the check as a JSON object."""
        return {"target": self.target, "measured": self.measured, "met": self.met}


@dataclass(slots=True)
class Headline:
    """One rate and the CPU it cost: ``cpu_us_per_record`` is the user + system time of
    the process doing the work (the service's, or the pipe's) divided by the records it
    handled. ``cpu_ratio_to_pipe`` is that over the pipe's own figure (None until
    :func:`relate_to_pipe`, or when there is no pipe figure); ``rate_ratio_to_pipe`` the
    rate over the pipe's rate, where a scenario compares the two."""

    label: str
    rate_per_s: float | None
    cpu_us_per_record: float | None
    cpu_ratio_to_pipe: float | None = None
    rate_ratio_to_pipe: float | None = None

    def as_json(self) -> dict[str, Figure]:
        """Return the headline as a JSON object."""
        return {"label": self.label, "rate_per_s": self.rate_per_s,
                "cpu_us_per_record": self.cpu_us_per_record,
                "cpu_ratio_to_pipe": self.cpu_ratio_to_pipe,
                "rate_ratio_to_pipe": self.rate_ratio_to_pipe}


def per_record_us(cpu_s: float | None, records: int | None) -> float | None:
    """Return ``cpu_s`` as microseconds per record, to 0.1 µs; None without records."""
    if cpu_s is None or not records or records <= 0:
        return None
    return round(cpu_s * 1e6 / records, 1)


def ratio_to(value: Figure, baseline: Figure) -> float | None:
    """Return ``value / baseline`` to three places; None unless both are positive
    numbers."""
    if isinstance(value, bool) or isinstance(baseline, bool):
        return None
    if not isinstance(value, int | float) or not isinstance(baseline, int | float):
        return None
    return round(value / baseline, 3) if baseline > 0 and value >= 0 else None


@dataclass(slots=True)
class Result:
    """The outcome of one scenario (one JSON object, one table row)."""

    scenario: str
    figures: dict[str, Figure] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    skipped: str | None = None
    headlines: list[Headline] = field(default_factory=list)

    def headline(self, label: str, rate_per_s: Figure, cpu_us_per_record: Figure,
                 rate_ratio_to_pipe: Figure = None) -> Headline:
        """Name a rate of this scenario and the CPU per record it cost; return it."""
        line = Headline(label, _number(rate_per_s), _number(cpu_us_per_record),
                        rate_ratio_to_pipe=_number(rate_ratio_to_pipe))
        self.headlines.append(line)
        return line

    def check(self, target: str, measured: Figure, met: bool | None) -> None:
        """Record a target check; ``met`` None means it could not be decided."""
        self.checks.append(Check(target, measured, met))

    def as_json(self) -> dict[str, object]:
        """Return the result as one JSON object."""
        body: dict[str, object] = {"scenario": self.scenario, **self.figures}
        if self.skipped is not None:
            body["skipped"] = self.skipped
        if self.headlines:
            body["cpu_per_record"] = [h.as_json() for h in self.headlines]
        body["targets"] = [c.as_json() for c in self.checks]
        return body


def _number(value: Figure) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def pipe_cpu_us(results: Iterable[Result]) -> float | None:
    """Return the pipe's CPU microseconds per record, None when it did not run."""
    for result in results:
        if result.scenario == "pipe" and not result.skipped:
            return next((h.cpu_us_per_record for h in result.headlines), None)
    return None


def relate_to_pipe(results: list[Result]) -> None:
    """Fill every headline's ``cpu_ratio_to_pipe`` from the pipe's CPU per record."""
    baseline = pipe_cpu_us(results)
    for result in results:
        for line in result.headlines:
            line.cpu_ratio_to_pipe = ratio_to(line.cpu_us_per_record, baseline)


def as_int(value: object) -> int | None:
    """Return ``value`` as an int if it is a number (a figure read back from JSON)."""
    return int(value) if isinstance(value, int | float) else None


def write_json(results: Iterable[Result], out: TextIO) -> None:
    """Write one JSON object per line."""
    for result in results:
        out.write(orjson.dumps(result.as_json()).decode() + "\n")


def _show(value: Figure) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "n/a"}[met]


def _cell(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def headlines(results: list[Result]) -> list[str]:
    """Return the markdown table of every rate beside the CPU per record it cost."""
    lines = ["| scenario | rate (records/s) | CPU µs per record | CPU / pipe's CPU "
             "| rate / pipe's rate |", "|---|---|---|---|---|"]
    for r in results:
        for h in r.headlines:
            lines.append(f"| {h.label} | {_cell(h.rate_per_s, ',.0f')} | "
                         f"{_cell(h.cpu_us_per_record, ',.1f')} | "
                         f"{_cell(h.cpu_ratio_to_pipe, '.2f', 'x')} | "
                         f"{_cell(h.rate_ratio_to_pipe, '.2f', 'x')} |")
    return lines


RATES = ("records_per_s", "requests_per_s", "achieved_rate_per_s")


def _rate(result: Result) -> float | None:
    """The rate a row reports, whichever its scenario calls it."""
    return next((v for v in (_number(result.figures.get(k)) for k in RATES) if v is not None),
                None)


def _side(result: Result | None) -> tuple[float | None, float | None, float | None]:
    """A row's (rate, service CPU µs per record, RSS MB); Nones for a missing row."""
    if result is None or result.skipped:
        return None, None, None
    return (_rate(result), _number(result.figures.get("service_cpu_us_per_record")),
            _number(result.figures.get("rss_mb")))


def _p99s(ours: Result | None, theirs: Result) -> str:
    """The end-to-end p99 of both rows ("kdelay / peer"), empty when neither has one."""
    pair = [None if r is None or r.skipped else _number(r.figures.get("p99_ms"))
            for r in (ours, theirs)]
    return "" if pair == [None, None] else " / ".join(_cell(v, ",.1f") for v in pair)


def side_by_side(results: list[Result]) -> list[str]:
    """Return the table of kdelay beside the peer: one line per peer row, against the
    kdelay row it names in ``versus`` (the first of that scenario): rate, CPU µs per
    record and RSS of each process, kdelay's over the peer's, and for a steady load
    (rows with ``p99_ms``) the end-to-end lateness p99 of each. Empty without a peer
    row."""
    lines = ["| scenario | kdelay rate/s | kdelay CPU µs/record | kdelay RSS MB "
             "| peer rate/s | peer CPU µs/record | peer RSS MB "
             "| rate kdelay/peer | CPU kdelay/peer | RSS kdelay/peer | p99 ms kdelay / peer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for theirs in results:
        versus = theirs.figures.get("versus")
        if not isinstance(versus, str):
            continue
        ours = next((r for r in results if r.scenario == versus), None)
        a, b = _side(ours), _side(theirs)
        if theirs.skipped:
            lines.append(f"| {versus} | " + " | ".join(["n/a"] * 10) + " |")
            continue
        cells = [_cell(a[0], ",.0f"), _cell(a[1], ",.1f"), _cell(a[2], ",.0f"),
                 _cell(b[0], ",.0f"), _cell(b[1], ",.1f"), _cell(b[2], ",.0f"),
                 *(_cell(ratio_to(x, y), ".2f", "x") for x, y in zip(a, b, strict=True)),
                 _p99s(ours, theirs)]
        lines.append(f"| {versus} | " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def markdown(results: list[Result]) -> str:
    """Return the markdown tables: kdelay beside the peer (when a peer ran), every
    rate beside its CPU per record, the figures per scenario, then the targets."""
    versus, rates = side_by_side(results), headlines(results)
    lines = [*versus, ""] if versus else []
    if len(rates) > 2:
        lines += [*rates, ""]
    lines += ["| scenario | figures |", "|---|---|"]
    for r in results:
        shown = (f"skipped: {r.skipped}" if r.skipped else
                 ", ".join(f"{k}={_show(v)}" for k, v in r.figures.items()))
        lines.append(f"| {r.scenario} | {shown} |")
    lines += ["", "| scenario | target | measured | status |", "|---|---|---|---|"]
    for r in results:
        for c in r.checks:
            lines.append(f"| {r.scenario} | {c.target} | {_show(c.measured)} | "
                         f"{_verdict(c.met)} |")
    return "\n".join(lines) + "\n"
