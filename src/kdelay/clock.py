"""Time as the service sees it.

Every module that needs "now" receives a :class:`Clock`; nothing calls
``time.time()`` directly. The service runs on :class:`SystemClock`; tests run on
:class:`ManualClock` and move it, so no test waits on the wall clock for a due
time to pass.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of wall-clock time in integer milliseconds since the epoch (UTC)."""

    def now_ms(self) -> int:
        """Return the current time in milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The machine's wall clock."""

    def now_ms(self) -> int:
        """Return ``time.time()`` in whole milliseconds."""
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that moves only when told to; for tests."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms

    def now_ms(self) -> int:
        """Return the time last set."""
        return self._now_ms

    def advance(self, delta_ms: int) -> None:
        """Move the clock forward by ``delta_ms`` (never backwards)."""
        if delta_ms < 0:
            raise ValueError("a ManualClock never moves backwards")
        self._now_ms += delta_ms

    def set(self, now_ms: int) -> None:
        """Jump to ``now_ms``, which must not be earlier than the current time."""
        self.advance(now_ms - self._now_ms)
