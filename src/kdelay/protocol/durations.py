"""Durations and delay levels: how a request's time headers are read, and how far ahead a due
time may lie.

- :func:`parse_duration_ms` reads ``"1500ms"``, ``"30s"``, ``"2h"``, ``"7d"`` (the CLI's
  options and the ``kdelay-delay-ms`` companion forms), and :func:`duration_text` writes them;
- :func:`parse_levels` reads a RocketMQ-style delay-level table (:data:`DEFAULT_LEVELS`);
- :class:`Limits` is what intake accepts, built from the requests topic's retention by
  :func:`limits_for_retention`.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

DEFAULT_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
"""RocketMQ's delay-level table; level 1 is 1 s, level 18 is 2 h."""

_DURATION = re.compile(r"([0-9]+)(ms|s|m|h|d)?")
_UNIT_MS = {None: 1, "ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: str) -> int:
    """Parse ``"1500"``, ``"1500ms"``, ``"30s"``, ``"5m"``, ``"2h"`` or ``"7d"`` to ms.

    A plain integer is milliseconds. Raises ValueError for anything else,
    including negative numbers and unknown units.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"not a duration: {text!r}; expected a non-negative integer with an optional "
            "unit ms, s, m, h or d, such as '1500ms' or '2h'"
        )
    return int(match[1]) * _UNIT_MS[match[2]]


def duration_text(ms: int) -> str:
    """``ms`` in the largest unit that divides it exactly: ``"1h"``, ``"90s"``, ``"1500ms"``.

    The inverse of :func:`parse_duration_ms`: ``parse_duration_ms(duration_text(ms)) == ms``
    for every non-negative ``ms``.
    """
    for unit in ("d", "h", "m", "s"):
        if ms and ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


def _check_levels(levels: tuple[int, ...]) -> None:
    """Raise ValueError unless ``levels`` is non-empty, positive and strictly increasing."""
    if not levels:
        raise ValueError("a delay-level table needs at least one level")
    if levels[0] <= 0:
        raise ValueError(f"delay levels must be positive, got {levels[0]} ms")
    if any(b <= a for a, b in itertools.pairwise(levels)):
        raise ValueError(f"delay levels must be strictly increasing, got {levels}")


def parse_levels(spec: str) -> tuple[int, ...]:
    """Parse a delay-level table such as ``"1s 5s 1m"`` (spaces or commas) to ms.

    Level ``n`` (1-based) is element ``n - 1``. Raises ValueError for a bad
    duration, an empty table, or levels that are not strictly increasing.
    """
    levels = tuple(parse_duration_ms(part) for part in re.split(r"[\s,]+", spec) if part)
    _check_levels(levels)
    return levels


@dataclass(frozen=True, slots=True)
class Limits:
    """What intake accepts: the level table and how far ahead a due time may lie.

    ``max_due_after_ms`` bounds ``due_ms - record timestamp``: the payload lives
    only in the requests topic, so a due time past its retention would find the
    record deleted. ``None`` means unlimited.
    """

    levels: tuple[int, ...]
    max_due_after_ms: int | None

    def __post_init__(self) -> None:
        """Raise ValueError for a bad level table or a negative maximum."""
        _check_levels(self.levels)
        if self.max_due_after_ms is not None and self.max_due_after_ms < 0:
            raise ValueError(f"max_due_after_ms must not be negative, got {self.max_due_after_ms}")


def limits_for_retention(
    retention_ms: int | None, margin_ms: int, levels: tuple[int, ...]
) -> Limits:
    """Build :class:`Limits` from the requests topic's ``retention.ms``.

    ``None`` or ``-1`` (infinite retention) gives no limit. A margin larger than
    the retention leaves a maximum of 0: only requests due no later than their
    own timestamp are accepted. Raises ValueError for a negative margin or any
    other negative retention.
    """
    if margin_ms < 0:
        raise ValueError(f"the retention safety margin must not be negative, got {margin_ms}")
    if retention_ms is None or retention_ms == -1:
        return Limits(levels, None)
    if retention_ms < 0:
        raise ValueError(f"retention.ms must be -1 or non-negative, got {retention_ms}")
    return Limits(levels, max(retention_ms - margin_ms, 0))
