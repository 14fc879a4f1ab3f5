"""PhaseTimer: per-phase step times into a histogram, and slow steps logged by phase."""

from __future__ import annotations

import logging

import pytest

from kdelay.engine.metrics import Metrics, PhaseTimer


class Ticks:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def count(metrics: Metrics, phase: str, le: str) -> float:
    return metrics.registry.get_sample_value(
        "kdelay_loop_phase_seconds_bucket", {"phase": phase, "le": le}) or 0.0


def test_each_lap_lands_in_its_phase() -> None:
    metrics, ticks = Metrics(), Ticks()
    timer = PhaseTimer(metrics.loop.phases, ticks)
    timer.start()
    ticks.now += 0.002
    timer.lap("consume")
    ticks.now += 0.3
    timer.lap("commit")
    timer.finish()
    assert count(metrics, "consume", "0.001") == 0
    assert count(metrics, "consume", "0.0025") == 1
    assert count(metrics, "commit", "0.25") == 0
    assert count(metrics, "commit", "0.5") == 1
    total = metrics.registry.get_sample_value("kdelay_loop_phase_seconds_sum",
                                              {"phase": "commit"})
    assert total == pytest.approx(0.3)


def test_a_slow_step_is_logged_with_its_phases(caplog: pytest.LogCaptureFixture) -> None:
    metrics, ticks = Metrics(), Ticks()
    timer = PhaseTimer(metrics.loop.phases, ticks, slow_s=1.0)
    timer.start()
    ticks.now += 0.1
    timer.lap("consume")
    timer.finish()
    assert not caplog.records, "a fast step says nothing"
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.metrics"):
        timer.start()
        ticks.now += 0.01
        timer.lap("consume")
        ticks.now += 1.5
        timer.lap("commit")
        timer.finish()
    [record] = caplog.records
    assert record.getMessage() == "slow step: 1.510 s (consume 0.010, commit 1.500)"


def slow_step(timer: PhaseTimer, ticks: Ticks, seconds: float) -> None:
    timer.start()
    ticks.now += seconds
    timer.lap("commit")
    timer.finish()


def test_slow_steps_log_one_line_a_minute_and_sum_up_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, ticks = Metrics(), Ticks()
    timer = PhaseTimer(metrics.loop.phases, ticks, slow_s=1.0, log_every_s=60.0)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.metrics"):
        slow_step(timer, ticks, 1.5)
        for seconds in (2.0, 4.0, 1.2):  # within the minute: counted, not logged
            slow_step(timer, ticks, seconds)
        assert len(caplog.records) == 1
        ticks.now += 60.0
        slow_step(timer, ticks, 1.1)
    assert [r.getMessage() for r in caplog.records] == [
        "slow step: 1.500 s (commit 1.500)",
        "slow step: 1.100 s (commit 1.100); 3 more slow steps since the last line, "
        "the slowest 4.000 s (commit 4.000)",
    ]
    # Every step still lands in the histogram.
    assert count(metrics, "commit", "+Inf") == 5


def test_slow_steps_held_back_are_summed_up_by_the_next_step_past_the_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, ticks = Metrics(), Ticks()
    timer = PhaseTimer(metrics.loop.phases, ticks, slow_s=1.0, log_every_s=60.0)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.metrics"):
        slow_step(timer, ticks, 1.5)
        slow_step(timer, ticks, 3.0)
        slow_step(timer, ticks, 0.1)  # fast, within the minute: nothing
        ticks.now += 60.0
        slow_step(timer, ticks, 0.1)  # fast, past it: the summary
        slow_step(timer, ticks, 0.1)  # nothing held any more
    assert [r.getMessage() for r in caplog.records] == [
        "slow step: 1.500 s (commit 1.500)",
        "1 more slow step since the last line, the slowest 3.000 s (commit 3.000)",
    ]
