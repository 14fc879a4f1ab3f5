"""The lateness suite's pure parts: phase histograms, CPU readings, targets, burst counts.

No broker and no sleep: expositions come from a real registry, ``/proc`` lines
are written out, and runs are built from collector summaries.
"""

from __future__ import annotations

import math

import pytest
from kdelay_bench import phases
from kdelay_bench.broker import left_running
from kdelay_bench.cputime import (
    TICK_S,
    Disk,
    Reading,
    Thread,
    machine_split,
    pressure_totals,
    schedstat_wait_s,
    stat_cpu_s,
    vmstat_value,
)
from kdelay_bench.lateness import TARGETS, Load, Run, Suite, Target, passed
from kdelay_bench.options import parse_options
from kdelay_bench.throughput import within
from prometheus_client import CollectorRegistry, Histogram, generate_latest

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOAD = Load(rate=100, seconds=10, warmup_seconds=0, delay_ms=500, drain_seconds=5)


def exposition(observations: dict[str, list[float]]) -> str:
    """Return the text exposition of a phase histogram holding ``observations``."""
    registry = CollectorRegistry()
    histogram = Histogram(phases.METRIC, "Loop phase durations", ["phase"], buckets=BUCKETS,
                          registry=registry)
    for phase, values in observations.items():
        for value in values:
            histogram.labels(phase=phase).observe(value)
    return generate_latest(registry).decode()


def test_phases_count_slow_steps_and_the_highest_bucket() -> None:
    parsed = phases.parse(exposition({"deliver": [0.001, 0.2, 1.5, 0.003],
                                      "ack-wait": [7.0]}))
    assert parsed is not None
    shown = phases.figures(parsed)
    assert shown["deliver_count"] == 4
    assert shown["deliver_s"] == pytest.approx(1.704)
    assert (shown["deliver_over_100ms"], shown["deliver_over_1s"]) == (2, 1)
    assert shown["deliver_max_le_s"] == 2.5
    assert shown["ack-wait_max_le_s"] == "+Inf"


def test_phases_of_a_run_are_the_difference_of_two_scrapes() -> None:
    before = phases.parse(exposition({"deliver": [2.0, 0.001]}))
    after = phases.parse(exposition({"deliver": [2.0, 0.001, 0.002, 0.003],
                                     "commit": [0.3]}))
    assert before is not None
    assert after is not None
    shown = phases.figures(phases.since(after, before))
    assert (shown["deliver_count"], shown["deliver_over_1s"]) == (2, 0)
    assert shown["deliver_max_le_s"] == 0.005
    assert (shown["commit_count"], shown["commit_over_100ms"]) == (1, 1)


def test_an_exposition_without_the_phase_metric_has_no_phases() -> None:
    registry = CollectorRegistry()
    Histogram("kdelay_lateness_seconds", "other", registry=registry).observe(1.0)
    assert phases.parse(generate_latest(registry).decode()) is None


def test_the_intake_delay_histogram_is_reported_as_one_more_row() -> None:
    registry = CollectorRegistry()
    Histogram(phases.METRIC, "Loop phase durations", ["phase"], buckets=BUCKETS,
              registry=registry).labels(phase="consume").observe(0.002)
    delay = Histogram(phases.INTAKE_DELAY, "Arrival", buckets=BUCKETS, registry=registry)
    for seconds in (0.003, 0.2, 1.2):
        delay.observe(seconds)
    parsed = phases.parse(generate_latest(registry).decode())
    assert parsed is not None
    shown = phases.figures(parsed)
    assert shown["consume_count"] == 1
    assert (shown["intake-delay_count"], shown["intake-delay_over_100ms"],
            shown["intake-delay_over_1s"]) == (3, 2, 1)


def test_a_phase_without_observations_has_no_highest_bucket() -> None:
    phase = phases.Phase(0.0, 0.0, ((0.1, 0.0), (math.inf, 0.0)))
    assert phase.highest_bound() is None
    assert phase.over(0.1) == 0


def test_cpu_seconds_come_from_utime_and_stime_past_an_odd_command_name() -> None:
    fields = ["S", *["0"] * 10, "250", "50", *["0"] * 30]
    line = "1234 (kdelay (run) x) " + " ".join(fields)
    assert stat_cpu_s(line) == pytest.approx(300 * TICK_S)


def test_run_queue_wait_and_the_busiest_thread_count_threads_born_since() -> None:
    assert schedstat_wait_s("1000 2500000000 7\n") == 2.5
    before = Reading(1.0, {"1": Thread("main", 0.5, 0.5), "2": Thread("gone", 0.5, 1.0)})
    after = Reading(5.0, {"1": Thread("main", 1.0, 1.5), "3": Thread("rdk:broker1", 3.0, 0.25)})
    usage = after.since(before)
    assert (usage.cpu_s, usage.wait_s) == (4.0, 1.25)
    assert usage.busiest == "rdk:broker1 3.00s"


def test_the_machine_split_keeps_steal_out_of_busy() -> None:
    split = machine_split("cpu  100 0 50 300 20 0 10 40 0 0")
    assert split.busy_s == pytest.approx(160 * TICK_S)
    assert split.idle_s == pytest.approx(320 * TICK_S)
    assert split.steal_s == pytest.approx(40 * TICK_S)


def test_io_stalls_and_disk_writes_come_from_pressure_and_vmstat() -> None:
    pressure = ("some avg10=0.00 avg60=0.03 avg300=0.32 total=2500000\n"
                "full avg10=0.00 avg60=0.03 avg300=0.29 total=1250000\n")
    assert pressure_totals(pressure) == (2.5, 1.25)
    assert vmstat_value("pgpgin 10\npgpgout 2048\nnr_dirty 5\n", "pgpgout") == 2048
    assert vmstat_value("pgpgin 10\n", "pgpgout") == 0
    spent = Disk(4.0, 2.0, 3072).minus(Disk(2.5, 1.25, 1024))
    assert (spent.io_some_s, spent.io_full_s, spent.written_kb) == (1.5, 0.75, 2048)


def run(number: int, *, p99: float, stamp_p99: float, stamp_max: float,
        count: int = 1_000, early: int = 0) -> Run:
    """Return a run whose collector saw ``count`` records with these percentiles."""
    seen: dict[str, object] = {
        "count": count, "duplicates": 0, "early": early, "offset_gaps": 0,
        "lateness_ms": {"p50": 3.0, "p99": p99, "p999": p99, "max": p99 + 1},
        "stamp_lateness_ms": {"p50": 0.0, "p99": stamp_p99, "p999": stamp_max,
                              "max": stamp_max}}
    return Run(number, LOAD, seen, 10.0, {}, phases.NO_METRIC)


def test_a_target_over_the_hop_needs_the_hop() -> None:
    target = Target("p99_ms", 20.0, over_hop=True)
    assert target.met({"p99_ms": 30.0}, 10.0) is True
    assert target.met({"p99_ms": 30.1}, 10.0) is False
    assert target.met({"p99_ms": 30.0}, None) is None
    assert "hop p99 (10) + 20 ms" in target.describe("at-least-once", 10.0)


def test_a_run_passes_only_with_nothing_lost_or_early() -> None:
    good = run(1, p99=10.0, stamp_p99=5.0, stamp_max=50.0).figures()
    assert passed(good, TARGETS["at-least-once"], 5.0) is True
    late = run(1, p99=10.0, stamp_p99=5.0, stamp_max=50.0, count=999).figures()
    assert late["lost"] == 1
    assert passed(late, TARGETS["at-least-once"], 5.0) is False


def test_the_worst_run_decides_every_target() -> None:
    suite = Suite("at-least-once", 2, {}, [run(1, p99=10.0, stamp_p99=5.0, stamp_max=50.0),
                                           run(2, p99=12.0, stamp_p99=25.0, stamp_max=90.0)])
    worst = suite.worst(5.0)
    assert worst.figures["worst_stamp_p99_ms"] == 25.0
    assert worst.figures["worst_stamp_p99_ms_run"] == 2
    assert worst.figures["runs_passed"] == 1
    verdicts = {c.target.split(",")[0]: c.met for c in worst.checks}
    assert verdicts == {"at-least-once service side p99 <= 20 ms": False,
                        "at-least-once service side max <= 100 ms": True,
                        "at-least-once end to end p99 <= hop p99 (5) + 20 ms": True,
                        "at-least-once: 0 lost": True}


def test_a_suite_that_stopped_early_meets_no_target() -> None:
    suite = Suite("exactly-once", 5, {}, [run(1, p99=10.0, stamp_p99=5.0, stamp_max=9.0)],
                  skipped="kdelay run exited")
    worst = suite.worst(None)
    assert [c.met for c in worst.checks] == [None, False]
    assert worst.skipped == "kdelay run exited"


def test_burst_arrivals_are_counted_from_the_due_instant() -> None:
    counts = within([100.2, 100.9, 101.5, 106.0], [50.0, 999.0, 1_000.0, 5_001.0], 100.0)
    assert counts == {"within_1s_by_stamp": 3, "within_1s_by_receive": 2,
                      "within_5s_by_stamp": 3, "within_5s_by_receive": 3}


def test_the_suite_runs_five_times_by_default_and_once_when_quick() -> None:
    full, quick = parse_options(["--fresh-broker"]), parse_options(["--quick"])
    assert (full.lateness_runs, full.lateness_seconds, full.fresh_broker) == (5, 60, True)
    assert full.fresh_broker_wait == 60.0
    assert (quick.lateness_runs, quick.lateness_seconds, quick.fresh_broker) == (1, 10, False)


def test_the_bench_says_how_to_stop_the_broker_it_leaves_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KDELAY_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("KDELAY_CACHE_DIR", "/srv/bench-cache")
    hint = left_running(None, "127.0.0.1:40000")
    assert hint is not None
    assert "127.0.0.1:40000" in hint
    assert hint.endswith("KDELAY_CACHE_DIR=/srv/bench-cache tools/kafka stop")
    monkeypatch.delenv("KDELAY_CACHE_DIR")
    assert left_running(None, "127.0.0.1:40000") == (
        "the broker on 127.0.0.1:40000 stays up for the next run; stop it: tools/kafka stop")


def test_a_broker_named_by_the_user_is_left_alone_without_a_word(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KDELAY_BOOTSTRAP_SERVERS", raising=False)
    assert left_running("broker:9092", "broker:9092") is None
    monkeypatch.setenv("KDELAY_BOOTSTRAP_SERVERS", "broker:9092")
    assert left_running(None, "broker:9092") is None
