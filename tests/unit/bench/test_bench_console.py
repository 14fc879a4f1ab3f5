"""The console scenario's pure parts: its options, the /proc reading, the screens, the report.

No broker and no console: the report is built from given timings.
"""

from __future__ import annotations

import pytest
from kdelay_bench.console import Memory, parse_status, report, screens
from kdelay_bench.options import parse_options

STATUS = """Name:\tpython
VmPeak:\t 1200000 kB
VmHWM:\t  262144 kB
VmRSS:\t  204800 kB
Threads:\t12
"""


def test_console_runs_only_when_named_at_its_own_size() -> None:
    assert "console" not in parse_options([]).scenarios
    assert "console" not in parse_options(["--long"]).scenarios
    chosen = parse_options(["--scenarios", "console", "--console-pending", "10000000"])
    assert chosen.scenarios == ("console",)
    assert chosen.console_pending == 10_000_000
    assert parse_options(["--quick", "--scenarios", "console"]).console_pending == 100_000


def test_the_status_gives_the_current_and_peak_rss_in_mb() -> None:
    assert parse_status(STATUS) == Memory(200.0, 256.0)
    with pytest.raises(ValueError, match="VmRSS"):
        parse_status("Name:\tpython\n")


def test_the_screens_are_the_overview_the_timeline_and_a_filtered_page() -> None:
    asked = screens(1_800_000_000_000)
    assert asked["overview"] == "/"
    assert asked["timeline"] == "/timeline?bucket=1m"
    assert asked["pending_filtered"] == (
        "/pending?target=bench-target&due_from=2027-01-15T09:00:00Z"
        "&due_to=2027-01-15T21:00:00Z&limit=100")


def test_the_report_judges_the_slowest_answer_and_the_peak_rss() -> None:
    seconds = {"overview": [0.2, 0.3, 0.25], "timeline": [0.4, 1.2, 0.5]}
    found = report(10_000_000, 312.04, seconds, Memory(210.0, 320.5), (6.0, 5.5, 4.0))
    body = found.as_json()
    assert body["first_summary_s"] == 312.0
    assert body["overview_max_s"] == 0.3
    assert body["overview_median_s"] == 0.25
    assert body["timeline_max_s"] == 1.2
    assert body["load_avg_1_5_15"] == "6.0 5.5 4.0"
    assert [(c.target, c.met) for c in found.checks] == [
        ("overview < 1 s", True), ("timeline < 1 s", False), ("console RSS < 300 MB", False)]
