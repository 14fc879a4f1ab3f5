"""Time as the service sees it.

Every module that needs "now" receives a :class:`Clock`; nothing calls
``time.time()`` directly. The service runs on :class:`SystemClock`; tests run on
:class:`ManualClock` and move it, so no test waits on the wall clock for a due
time to pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

MAX_SLEW = 0.05
"""How fast :class:`SystemClock` may run ahead of or behind monotonic time to
close a gap to the wall clock: 5 %, i.e. 3 s per minute."""


class Clock(Protocol):
    """Wall-clock time in integer milliseconds since the epoch (UTC), and a monotonic
    time in seconds for deadlines and time-outs (which no step of the wall clock moves)."""

    def now_ms(self) -> int:
        """Return the current time in milliseconds since the Unix epoch."""
        ...

    def monotonic(self) -> float:
        """Return seconds from an arbitrary start that only ever go forward."""
        ...


class SystemClock:
    """The machine's wall clock, made safe against steps: monotonic, slewed toward wall time.

    The service releases a record when this clock reaches its due time, so a
    wall clock stepped forward (by an operator, or by NTP correcting a large
    error) would release everything due in the skipped interval at once, early
    in real time, and a step backward would hold records back. This clock
    advances with the monotonic clock and closes any gap to the wall clock by
    running at most ``max_slew`` faster or slower than it: a forward step of
    one minute is taken up over twenty minutes, never at once, and the clock
    never goes backwards. It starts at the wall clock's time.

    ``wall_ns`` and ``mono_ns`` are injected so tests can step them.
    """

    def __init__(self, wall_ns: Callable[[], int] = time.time_ns,
                 mono_ns: Callable[[], int] = time.monotonic_ns,
                 max_slew: float = MAX_SLEW) -> None:
        self._wall_ns = wall_ns
        self._mono_ns = mono_ns
        self._max_slew = max_slew
        self._mono = mono_ns()
        self._now = wall_ns()

    def now_ms(self) -> int:
        """Return the steady time in whole milliseconds since the epoch."""
        mono = self._mono_ns()
        elapsed = max(0, mono - self._mono)
        self._mono = mono
        steady = self._now + elapsed
        limit = int(elapsed * self._max_slew)
        gap = self._wall_ns() - steady
        self._now = steady + max(-limit, min(limit, gap))
        return self._now // 1_000_000

    def monotonic(self) -> float:
        """Return the monotonic clock's seconds (``mono_ns`` as given)."""
        return self._mono_ns() / 1e9

    def wall_gap_ms(self) -> int:
        """Return how far the wall clock is ahead of this clock now (negative: behind)."""
        return (self._wall_ns() - self._now) // 1_000_000


class ManualClock:
    """A clock that moves only when told to; for tests."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms
        self._start_ms = start_ms

    def now_ms(self) -> int:
        """Return the time last set."""
        return self._now_ms

    def monotonic(self) -> float:
        """Return the seconds moved since the clock was made: it is its own monotonic time."""
        return (self._now_ms - self._start_ms) / 1000

    def advance(self, delta_ms: int) -> None:
        """Move the clock forward by ``delta_ms`` (never backwards)."""
        if delta_ms < 0:
            raise ValueError("a ManualClock never moves backwards")
        self._now_ms += delta_ms

    def set(self, now_ms: int) -> None:
        """Jump to ``now_ms``, which must not be earlier than the current time."""
        self.advance(now_ms - self._now_ms)
