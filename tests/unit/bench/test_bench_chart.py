"""The benchmarks page's charts are drawn from a run's JSON lines."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from kdelay_bench.chart import cpu_bars, draw, read_results
from kdelay_bench.report import Result, write_json


def _run(tmp_path: Path) -> Path:
    pipe = Result("pipe")
    pipe.headline("pipe", 150_000.0, 4.4)
    burst = Result("burst")
    burst.headline("burst", 152_600.0, 5.8)
    skipped = Result("capacity", skipped="not asked for")
    path = tmp_path / "run.jsonl"
    with path.open("w") as out:
        write_json([pipe, burst, skipped], out)
    return path


def test_every_headline_with_a_figure_is_a_bar(tmp_path: Path) -> None:
    assert cpu_bars(read_results(_run(tmp_path))) == [("pipe: pipe", 4.4),
                                                       ("burst: burst", 5.8)]


def test_the_drawing_is_an_svg_with_one_bar_per_headline(tmp_path: Path) -> None:
    [svg] = draw(_run(tmp_path), tmp_path / "assets")
    root = ET.fromstring(svg.read_text())  # noqa: S314 -- our own file
    bars = root.findall("{http://www.w3.org/2000/svg}rect")
    widths = [float(bar.attrib["width"]) for bar in bars]
    assert len(bars) == 2
    assert widths[1] == 360.0
    assert widths[0] < widths[1]
    assert "5.8 µs" in svg.read_text()
