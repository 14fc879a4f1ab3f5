"""Bar charts of a bench run, drawn as SVG from its JSON lines (``tools/bench --json``).

The benchmarks page shows the latest run as charts; they are drawn from the run's
own JSON, never typed in: :func:`cpu_bars` reads every scenario's ``cpu_per_record``
headlines, :func:`svg_bars` draws any labelled figures as horizontal bars. A
scenario that was skipped, or a headline without a figure, draws no bar.

    PYTHONPATH=tools python -m kdelay_bench.chart full.jsonl docs/assets/benchmarks
"""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

import orjson

_BAR_HEIGHT = 22
_LABEL_WIDTH = 260
_PLOT_WIDTH = 360
_MARGIN = 8


def read_results(path: Path) -> list[dict[str, object]]:
    """Return the JSON objects of a run, one per non-blank line.

    Raises ValueError naming the line when one is not a JSON object."""
    results: list[dict[str, object]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        value = orjson.loads(line)
        if not isinstance(value, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        results.append(value)
    return results


def cpu_bars(results: list[dict[str, object]]) -> list[tuple[str, float]]:
    """Return (scenario: label, CPU µs per record) for every headline with a figure."""
    bars: list[tuple[str, float]] = []
    for result in results:
        if result.get("skipped") is not None:
            continue
        headlines = result.get("cpu_per_record")
        if not isinstance(headlines, list):
            continue
        for line in headlines:
            if not isinstance(line, dict):
                continue
            cpu = line.get("cpu_us_per_record")
            if isinstance(cpu, int | float) and not isinstance(cpu, bool):
                bars.append((f"{result.get('scenario')}: {line.get('label')}", float(cpu)))
    return bars


def svg_bars(title: str, unit: str, bars: list[tuple[str, float]]) -> str:
    """Return an SVG document with one horizontal bar per (label, value), scaled to
    the largest value, each bar labelled with its figure and ``unit``."""
    top = max((value for _, value in bars), default=0.0) or 1.0
    height = _MARGIN * 2 + 24 + _BAR_HEIGHT * len(bars)
    width = _LABEL_WIDTH + _PLOT_WIDTH + 90
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12" role="img">',
             f'<title>{escape(title)}</title>',
             f'<text x="{_MARGIN}" y="{_MARGIN + 12}" font-weight="bold">{escape(title)}</text>']
    for row, (label, value) in enumerate(bars):
        y = _MARGIN + 24 + row * _BAR_HEIGHT
        length = max(1.0, _PLOT_WIDTH * value / top)
        parts.append(f'<text x="{_LABEL_WIDTH - 6}" y="{y + 14}" text-anchor="end">'
                     f'{escape(label)}</text>')
        parts.append(f'<rect x="{_LABEL_WIDTH}" y="{y + 3}" width="{length:.1f}" '
                     f'height="{_BAR_HEIGHT - 6}" fill="#3f51b5"/>')
        parts.append(f'<text x="{_LABEL_WIDTH + length + 4:.1f}" y="{y + 14}">'
                     f'{value:g} {escape(unit)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def draw(jsonl: Path, out_dir: Path) -> list[Path]:
    """Draw the run in ``jsonl`` into ``out_dir``; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "cpu-per-record.svg"
    target.write_text(svg_bars("CPU per record, by scenario", "µs",
                               cpu_bars(read_results(jsonl))))
    return [target]


def main(argv: list[str]) -> int:
    """``python -m kdelay_bench.chart RUN.jsonl OUT_DIR``: draw the charts, list them."""
    if len(argv) != 2:
        print("usage: python -m kdelay_bench.chart RUN.jsonl OUT_DIR", file=sys.stderr)
        return 2
    for path in draw(Path(argv[0]), Path(argv[1])):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
