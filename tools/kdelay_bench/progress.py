"""Progress lines on stderr for the long phases of a run."""

from __future__ import annotations

import sys
import time

EVERY_S = 2.0


def say(message: str) -> None:
    """Write one progress line to stderr."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


class Progress:
    """Reports ``done/total`` and the rate, at most every :data:`EVERY_S` seconds."""

    def __init__(self, label: str, total: int) -> None:
        self._label = label
        self._total = total
        self._start = time.monotonic()
        self._next = self._start + EVERY_S

    def update(self, done: int) -> None:
        """Report ``done`` if the last report is old enough."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + EVERY_S
        rate = done / max(now - self._start, 1e-9)
        say(f"{self._label}: {done:,}/{self._total:,} ({rate:,.0f}/s)")
