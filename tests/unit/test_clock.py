"""The injected clock: a manual clock only moves forward, the system clock is the wall clock."""

from __future__ import annotations

import time

import pytest

from kdelay.clock import Clock, ManualClock, SystemClock


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
