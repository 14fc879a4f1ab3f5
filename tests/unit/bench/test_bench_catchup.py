"""The catchup scenario's row: the release rate from the records' timestamps, checks."""

from __future__ import annotations

from kdelay_bench.catchup import _result
from kdelay_bench.options import parse_options
from kdelay_bench.report import Result


def _checks(row: Result) -> dict[str, bool | None]:
    return {check.target: check.met for check in row.checks}


def test_a_release_at_the_asked_rate_passes_every_check() -> None:
    late_ms = [2_000.0 + n for n in range(1_000)]  # one a millisecond: 1 000/s
    seen = {"count": 1_000, "duplicates": 0, "early": 0}
    row = _result(seen, [100.0 + n / 1000 for n in range(1_000)], late_ms, 1_000, 1_000, 99.0,
                  98_000)
    figures = row.figures
    assert (figures["released_per_s"], figures["while_paused"], figures["lost"]) == (1_000, 0, 0)
    assert (figures["lateness_p50_ms"], figures["lateness_max_ms"]) == (2_500.0, 2_999.0)
    assert (figures["resumed_after_due_s"], figures["after_resume_max_ms"]) == (1.0, 1_999.0)
    assert all(_checks(row).values())


def test_records_while_paused_too_fast_or_lost_fail_their_checks() -> None:
    late_ms = [2_000.0 + n / 10 for n in range(900)]  # ten a millisecond: 10 000/s
    seen = {"count": 900, "duplicates": 0, "early": 0}
    row = _result(seen, [98.0, *[100.0] * 899], late_ms, 1_000, 1_000, 99.0, 98_000)
    checks = _checks(row)
    assert checks["released at the catch-up rate (1,000/s ± 10 %)"] is False
    assert checks["nothing delivered while paused"] is False
    assert checks["0 lost"] is False


def test_the_scenario_is_chosen_by_name_with_its_sizes() -> None:
    options = parse_options(["--scenarios", "catchup", "--quick", "--catchup-rate", "500"])
    assert (options.scenarios, options.catchup_records, options.catchup_rate) == (
        ("catchup",), 5_000, 500)
