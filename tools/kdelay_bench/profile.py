"""Where a profiled loop's CPU goes: function tables from py-spy's collapsed stacks.

``py-spy record --format raw`` writes one line per distinct stack:
``frame;frame;...;frame COUNT``, outermost first, each frame
``function (file:line)``. This module keeps the samples whose stack passes
through a chosen frame (``--under``, e.g. ``InProcess.deliver`` for a burst's
delivery), drops line numbers, and tabulates per function its inclusive share
(samples with it anywhere on the stack, counted once per sample) and its self
share (samples with it on top). Given the loop's CPU per record, each share
becomes microseconds per record. Run as::

    python -m kdelay_bench.profile STACKS.raw --under InProcess.deliver \\
        --us-per-record 21.0 --top 30

(``STACKS.raw`` may be gzipped.) py-spy samples only Python threads: the
shares are of the loop thread, not of librdkafka's threads.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


@dataclass(frozen=True, slots=True)
class Row:
    """One function's share of the kept samples, as fractions of them."""

    function: str
    inclusive: float
    own: float


def frame_name(frame: str) -> str:
    """Return ``function (file)``: the frame without its line number."""
    return _LINE.sub(")", frame.strip())


def parse(lines: Iterable[str]) -> Iterator[tuple[list[str], int]]:
    """Yield ``(frames, samples)`` per collapsed-stack line, frames outermost first
    and without line numbers; blank or malformed lines are skipped."""
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        yield [frame_name(f) for f in stack.split(";")], int(count)


def table(stacks: Iterable[tuple[list[str], int]], under: str | None = None) -> tuple[
        list[Row], int]:
    """Return every function's share of the samples whose stack has a frame containing
    ``under`` (all samples when None), largest inclusive share first, and how many
    samples were kept. Frames outside ``under`` (its callers) are left out."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    kept = 0
    for frames, count in stacks:
        if under is not None:
            at = next((i for i, f in enumerate(frames) if under in f), None)
            if at is None:
                continue
            frames = frames[at:]
        kept += count
        for name in set(frames):
            inclusive[name] += count
        own[frames[-1]] += count
    if not kept:
        return [], 0
    rows = [Row(name, n / kept, own[name] / kept) for name, n in inclusive.items()]
    rows.sort(key=lambda r: (-r.inclusive, -r.own, r.function))
    return rows, kept


def markdown(rows: list[Row], kept: int, us_per_record: float | None, top: int) -> str:
    """Return the ``top`` rows as a markdown table; with ``us_per_record`` (the loop's
    CPU per record) each share also in µs per record."""
    head = "| function | inclusive | self |"
    rule = "|---|---|---|"
    if us_per_record is not None:
        head += " inclusive µs/record | self µs/record |"
        rule += "---|---|"
    lines = [f"{kept:,} samples", "", head, rule]
    for row in rows[:top]:
        line = f"| `{row.function}` | {row.inclusive:.1%} | {row.own:.1%} |"
        if us_per_record is not None:
            line += (f" {row.inclusive * us_per_record:.2f} |"
                     f" {row.own * us_per_record:.2f} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def _read(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as text:
        return list(text)


def main(argv: list[str] | None = None) -> int:
    """Print the function table of one collapsed-stack file."""
    p = argparse.ArgumentParser(prog="python -m kdelay_bench.profile",
                                description="Function table of py-spy collapsed stacks.")
    p.add_argument("stacks", type=Path, help="py-spy --format raw output (may be .gz)")
    p.add_argument("--under", help="keep samples whose stack has a frame containing this")
    p.add_argument("--us-per-record", type=float, help="the loop's CPU µs per record")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    rows, kept = table(parse(_read(args.stacks)), args.under)
    print(markdown(rows, kept, args.us_per_record, args.top), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
