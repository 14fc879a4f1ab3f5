"""Results of the scenarios: JSON lines for machines, markdown tables for people.

Each scenario yields one :class:`Result`: its figures and the targets (issues 5, 15)
checked against them. A scenario that cannot run says so in ``skipped``.
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
class Result:
    """The outcome of one scenario (one JSON object, one table row)."""

    scenario: str
    figures: dict[str, Figure] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    skipped: str | None = None

    def check(self, target: str, measured: Figure, met: bool | None) -> None:
        """Record a target check; ``met`` None means it could not be decided."""
        self.checks.append(Check(target, measured, met))

    def as_json(self) -> dict[str, object]:
        """Return the result as one JSON object."""
        body: dict[str, object] = {"scenario": self.scenario, **self.figures}
        if self.skipped is not None:
            body["skipped"] = self.skipped
        body["targets"] = [c.as_json() for c in self.checks]
        return body


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


def markdown(results: list[Result]) -> str:
    """Return two markdown tables: the figures per scenario, then the targets."""
    lines = ["| scenario | figures |", "|---|---|"]
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
