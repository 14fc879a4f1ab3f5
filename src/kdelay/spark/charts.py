"""PNG charts of the jobs' aggregates (matplotlib, drawn off-screen).

Each chart is drawn from rows already aggregated by Spark: a few hundred at
most, never the per-request table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

_HOUR_MS = 3_600_000


def lateness_histograms(path: Path, edges: Sequence[int],
                        counts: Mapping[str, Sequence[int]]) -> Path:
    """Draw one lateness histogram per target: bin ``i`` counts ``[edges[i], edges[i+1])``."""
    targets = sorted(counts) or ["(none)"]
    figure, axes = plt.subplots(len(targets), 1, figsize=(8, 2.5 * len(targets)), squeeze=False)
    labels = [_short_ms(edge) for edge in edges[:-1]]
    for axis, target in zip(axes[:, 0], targets, strict=True):
        axis.bar(range(len(labels)), counts.get(target, [0] * len(labels)))
        axis.set_xticks(range(len(labels)), labels, rotation=45, fontsize=7)
        axis.set_title(f"lateness on {target} (first delivery - due, per bin start)")
        axis.set_ylabel("requests")
    return _save(figure, path)


def outcomes_per_hour(path: Path, rows: Sequence[tuple[int, str, int]]) -> Path:
    """Draw stacked bars of outcomes per hour of request time; rows are (hour ms, outcome, n)."""
    hours = sorted({hour for hour, _, _ in rows})
    outcomes = sorted({outcome for _, outcome, _ in rows})
    figure, axis = plt.subplots(figsize=(10, 4))
    bottom = [0] * len(hours)
    for outcome in outcomes:
        values = [sum(n for h, o, n in rows if h == hour and o == outcome) for hour in hours]
        axis.bar([h / _HOUR_MS for h in hours], values, bottom=bottom, label=outcome, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.set_xlabel("request hour (hours since the epoch, UTC)")
    axis.set_ylabel("requests")
    axis.legend(fontsize=7)
    return _save(figure, path)


def due_curve(path: Path, starts_ms: Sequence[int], counts: Sequence[int], now_ms: int) -> Path:
    """Draw pending entries per due-time bucket over the horizon."""
    figure, axis = plt.subplots(figsize=(10, 4))
    axis.step([(s - now_ms) / _HOUR_MS for s in starts_ms], counts, where="post")
    axis.set_xlabel("hours from now")
    axis.set_ylabel("entries coming due per bucket")
    return _save(figure, path)


def bars(path: Path, title: str, names: Sequence[str], values: Sequence[float],
         limit: float | None = None) -> Path:
    """Draw one bar per name, with an optional horizontal limit line."""
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.bar(range(len(names)), values)
    axis.set_xticks(range(len(names)), names, rotation=45, fontsize=7)
    if limit is not None:
        axis.axhline(limit, color="red", linestyle="--", label="configured")
        axis.legend()
    axis.set_title(title)
    return _save(figure, path)


def _save(figure: object, path: Path) -> Path:
    """Write the figure as PNG and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.tight_layout()
    figure.savefig(path, dpi=100)  # type: ignore[attr-defined]
    plt.close(figure)  # type: ignore[arg-type]
    return path


def _short_ms(ms: int) -> str:
    """A bin edge as a short duration: ``-5s``, ``250ms``, ``2m``."""
    sign, ms = ("-", -ms) if ms < 0 else ("", ms)
    for unit, size in (("h", _HOUR_MS), ("m", 60_000), ("s", 1_000)):
        if ms >= size and ms % size == 0:
            return f"{sign}{ms // size}{unit}"
    return f"{sign}{ms}ms"
