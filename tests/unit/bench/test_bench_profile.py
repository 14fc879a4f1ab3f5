"""Function tables from py-spy's collapsed stacks: filtering, shares, the table."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from kdelay_bench.profile import frame_name, main, markdown, parse, table

STACKS = """\
main (b/runner.py:10);intake (b/inproc.py:20);Service.step (k/service.py:30);plan (k/intake.py:4) 3
main (b/runner.py:10);deliver (b/inproc.py:40);Service.step (k/service.py:30);plan (k/intake.py:4) 1
main (b/runner.py:10);deliver (b/inproc.py:40);Service.step (k/service.py:31) 2
main (b/runner.py:10);deliver (b/inproc.py:41);Service.step (k/service.py:30);settle (k/c.py:9) 4
main (b/runner.py:10);run_pipe (b/pipe.py:3) 5
not a stack line
"""


def test_a_frame_loses_its_line_number_only() -> None:
    frame = " Book.sent (kdelay/engine/book.py:120)"
    assert frame_name(frame) == "Book.sent (kdelay/engine/book.py)"
    assert frame_name("<module> (x.py)") == "<module> (x.py)"


def test_samples_are_kept_under_a_frame_and_shared_by_function() -> None:
    rows, kept = table(parse(STACKS.splitlines()), under="deliver (")
    assert kept == 7
    shares = {r.function: (r.inclusive * 7, r.own * 7) for r in rows}
    assert shares["Service.step (k/service.py)"] == pytest.approx((7, 2))
    assert shares["settle (k/c.py)"] == pytest.approx((4, 4))
    assert shares["plan (k/intake.py)"] == pytest.approx((1, 1))
    assert "main (b/runner.py)" not in shares  # a caller of the frame kept under
    assert rows[0].function in ("deliver (b/inproc.py)", "Service.step (k/service.py)")


def test_a_function_twice_on_one_stack_counts_once() -> None:
    rows, kept = table(parse(["f (a.py:1);g (a.py:2);f (a.py:3) 4"]))
    assert kept == 4
    assert {r.function: r.inclusive for r in rows} == {"f (a.py)": 1.0, "g (a.py)": 1.0}


def test_nothing_under_an_absent_frame() -> None:
    assert table(parse(STACKS.splitlines()), under="nowhere") == ([], 0)


def test_the_table_turns_shares_into_microseconds_per_record() -> None:
    rows, kept = table(parse(STACKS.splitlines()), under="deliver (")
    text = markdown(rows, kept, 14.0, top=10)
    assert text.startswith("7 samples\n")
    assert "| `settle (k/c.py)` | 57.1% | 57.1% | 8.00 | 8.00 |" in text
    assert "µs/record" not in markdown(rows, kept, None, top=10)


def test_the_command_reads_gzipped_stacks(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.raw.gz"
    with gzip.open(path, "wt") as out:
        out.write(STACKS)
    assert main([str(path), "--under", "intake (", "--top", "2"]) == 0
    assert capsys.readouterr().out.startswith("3 samples\n")
