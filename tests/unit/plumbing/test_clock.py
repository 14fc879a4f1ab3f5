"""The injected clock: a manual clock only moves forward, the system clock is the wall clock."""

from __future__ import annotations

import time

import pytest

from kdelay.plumbing.clock import Clock, ManualClock, SystemClock


def test_manual_clock_starts_where_told_and_stays_put() -> None:
    clock = ManualClock(5_000)
    assert clock.now_ms() == 5_000
    assert clock.now_ms() == 5_000


def test_manual_clock_default_start_is_a_recent_epoch_time() -> None:
    assert ManualClock().now_ms() == 1_700_000_000_000


def test_manual_clock_advances_and_jumps_forward() -> None:
    clock = ManualClock(1_000)
    clock.advance(250)
    assert clock.now_ms() == 1_250
    clock.advance(0)
    assert clock.now_ms() == 1_250
    clock.set(9_000)
    assert clock.now_ms() == 9_000
    clock.set(9_000)
    assert clock.now_ms() == 9_000


def test_manual_clock_refuses_a_negative_advance() -> None:
    clock = ManualClock(1_000)
    with pytest.raises(ValueError, match="never moves backwards"):
        clock.advance(-1)
    assert clock.now_ms() == 1_000


def test_manual_clock_refuses_to_be_set_into_the_past() -> None:
    clock = ManualClock(1_000)
    with pytest.raises(ValueError, match="never moves backwards"):
        clock.set(999)
    assert clock.now_ms() == 1_000


def test_system_clock_is_close_to_time_time() -> None:
    before = int(time.time() * 1000)
    now = SystemClock().now_ms()
    after = int(time.time() * 1000)
    assert isinstance(now, int)
    assert before - 1 <= now <= after + 1


def test_both_clocks_satisfy_the_protocol() -> None:
    clocks: list[Clock] = [SystemClock(), ManualClock(7)]
    assert [c.now_ms() > 0 for c in clocks] == [True, True]


class Machine:
    """A wall clock and a monotonic clock that a test moves by hand (nanoseconds)."""

    def __init__(self, wall_ms: int = 1_700_000_000_000) -> None:
        self.wall = wall_ms * 1_000_000
        self.mono = 5 * 1_000_000_000

    def run(self, ms: int) -> None:
        """Let ``ms`` pass: both clocks move."""
        self.wall += ms * 1_000_000
        self.mono += ms * 1_000_000

    def step(self, ms: int) -> None:
        """Step the wall clock alone (an operator, or NTP correcting a large error)."""
        self.wall += ms * 1_000_000

    def clock(self) -> SystemClock:
        return SystemClock(wall_ns=lambda: self.wall, mono_ns=lambda: self.mono)


def test_system_clock_follows_an_unstepped_wall_clock() -> None:
    machine = Machine()
    clock = machine.clock()
    for _ in range(100):
        machine.run(37)
        assert clock.now_ms() == machine.wall // 1_000_000


def test_a_forward_step_of_the_wall_clock_is_taken_up_slowly_never_at_once() -> None:
    machine = Machine()
    clock = machine.clock()
    start = clock.now_ms()
    machine.step(60_000)
    machine.run(1_000)
    assert clock.now_ms() - start <= 1_050, "a due time inside the skipped minute came early"
    seen = clock.now_ms()
    for _ in range(1_300):
        machine.run(1_000)
        now = clock.now_ms()
        assert 1_000 <= now - seen <= 1_050
        seen = now
    assert clock.now_ms() == machine.wall // 1_000_000, "caught up after 60 s / 5 %"


def test_a_backward_step_never_moves_the_clock_back_and_is_taken_up_slowly() -> None:
    machine = Machine()
    clock = machine.clock()
    seen = clock.now_ms()
    machine.step(-60_000)
    for _ in range(1_300):
        machine.run(1_000)
        now = clock.now_ms()
        assert 950 <= now - seen <= 1_000
        seen = now
    assert clock.now_ms() == machine.wall // 1_000_000
    assert clock.wall_gap_ms() == 0


def test_the_gap_to_the_wall_clock_is_reported() -> None:
    machine = Machine()
    clock = machine.clock()
    machine.step(10_000)
    assert clock.wall_gap_ms() == 10_000
