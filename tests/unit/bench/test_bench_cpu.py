"""CPU per record, the bench's headline figure: the pure parts.

Per-record microseconds, ratios to the pipe, the headline table, the figures
of ``/usr/bin/time -v`` and of the process's own ``os.times``. No broker.
"""

from __future__ import annotations

import os

import pytest
from kdelay_bench import phases
from kdelay_bench.cputime import own_cpu_s
from kdelay_bench.inproc import Cpu
from kdelay_bench.lateness import Load, Run, Suite
from kdelay_bench.report import (
    Result,
    markdown,
    per_record_us,
    pipe_cpu_us,
    ratio_to,
    relate_to_pipe,
)
from kdelay_bench.transfer import cpu_seconds

LOAD = Load(rate=100, seconds=10, warmup_seconds=0, delay_ms=500, drain_seconds=5)
TIME_V = """\tCommand being timed: "python -m kdelay export"
\tUser time (seconds): 12.50
\tSystem time (seconds): 1.25
\tPercent of CPU this job got: 97%
"""


def test_cpu_per_record_is_microseconds_to_a_tenth() -> None:
    assert per_record_us(1.5, 100_000) == 15.0
    assert per_record_us(0.123456, 1_000) == 123.5


def test_cpu_per_record_needs_records_and_a_reading() -> None:
    assert per_record_us(1.0, 0) is None
    assert per_record_us(1.0, None) is None
    assert per_record_us(None, 10) is None


def test_a_ratio_needs_two_positive_numbers() -> None:
    assert ratio_to(30.0, 12.0) == 2.5
    assert ratio_to(30, 0) is None
    assert ratio_to(None, 12.0) is None
    assert ratio_to("n/a", 12.0) is None
    assert ratio_to(True, 1.0) is None


def test_the_service_cpu_is_the_process_and_the_loop_is_its_thread() -> None:
    before, after = Cpu(loop_s=1.0, process_s=2.0), Cpu(loop_s=2.0, process_s=5.0)
    assert after.per_record_us(before, 100_000) == {
        "service_cpu_us_per_record": 30.0, "loop_cpu_us_per_record": 10.0}


def test_own_cpu_counts_user_and_system_time_of_every_thread() -> None:
    times = os.times()  # clock ticks: never ahead of the process CPU clock
    start = own_cpu_s()
    assert start >= times.user + times.system - 0.02
    sum(i * i for i in range(200_000))  # burn a little CPU
    assert own_cpu_s() > start


def pipe_and_burst() -> list[Result]:
    """Return a pipe at 10 µs and a burst at 25 µs a record, as the runner has them."""
    pipe = Result("pipe", {"records_per_s": 80_000, "cpu_us_per_record": 10.0})
    pipe.headline("pipe", 80_000, 10.0)
    burst = Result("burst", {"records_per_s": 20_000})
    burst.headline("burst delivery (service)", 20_000, 25.0, 0.25)
    return [pipe, burst]


def test_every_headline_is_related_to_the_pipes_cpu() -> None:
    results = pipe_and_burst()
    relate_to_pipe(results)
    assert [h.cpu_ratio_to_pipe for r in results for h in r.headlines] == [1.0, 2.5]
    assert results[1].as_json()["cpu_per_record"] == [{
        "label": "burst delivery (service)", "rate_per_s": 20_000.0,
        "cpu_us_per_record": 25.0, "cpu_ratio_to_pipe": 2.5, "rate_ratio_to_pipe": 0.25}]


def test_without_a_pipe_the_ratios_stay_unknown() -> None:
    results = pipe_and_burst()
    results[0].skipped = "no broker"
    assert pipe_cpu_us(results) is None
    relate_to_pipe(results)
    assert results[1].headlines[0].cpu_ratio_to_pipe is None


def test_the_markdown_leads_with_cpu_per_record_beside_each_rate() -> None:
    results = pipe_and_burst()
    relate_to_pipe(results)
    lines = markdown(results).splitlines()
    assert lines[0].startswith("| scenario | rate (records/s) | CPU µs per record |")
    assert lines[2] == "| pipe | 80,000 | 10.0 | 1.00x | n/a |"
    assert lines[3] == "| burst delivery (service) | 20,000 | 25.0 | 2.50x | 0.25x |"
    assert "| scenario | figures |" in lines


def test_the_markdown_has_no_headline_table_without_headlines() -> None:
    lines = markdown([Result("footprint", {"entries": 10})]).splitlines()
    assert lines[0] == "| scenario | figures |"


def test_user_and_system_seconds_come_from_time_v() -> None:
    assert cpu_seconds(TIME_V) == pytest.approx(13.75)
    assert cpu_seconds("\tUser time (seconds): 1.0\n") is None


def test_a_lateness_run_reports_the_service_cpu_per_record_received() -> None:
    seen: dict[str, object] = {"count": 1_000, "duplicates": 0, "early": 0}
    measured = Run(1, LOAD, seen, 10.0, {"service_cpu_s": 0.15}, phases.NO_METRIC)
    unmeasured = Run(2, LOAD, seen, 10.0, {}, phases.NO_METRIC)
    assert measured.figures()["service_cpu_us_per_record"] == 150.0
    assert unmeasured.figures()["service_cpu_us_per_record"] is None
    rows = Suite("at-least-once", 2, {}, [measured, unmeasured]).results(None)
    lines = [h for r in rows for h in r.headlines]
    assert [(h.rate_per_s, h.cpu_us_per_record) for h in lines] == [(100.0, 150.0),
                                                                    (100.0, None)]
    assert "at-least-once 1/2" in lines[0].label


def test_the_loop_cpu_per_record_is_split_by_phase_largest_first() -> None:
    loop = {"consume": phases.Phase(10, 0.5, ()), "dispatch": phases.Phase(10, 1.5, ()),
            phases.INTAKE_DELAY_ROW: phases.Phase(5, 99.0, ())}
    assert list(phases.cpu_per_record(loop, 100_000).items()) == [
        ("dispatch_us_per_record", 15.0), ("consume_us_per_record", 5.0),
        ("total_us_per_record", 20.0), ("steps", 10), ("records_per_step", 10_000.0)]
    assert phases.cpu_per_record({}, 10)["records_per_step"] is None
