"""How far delivery has read one partition's index ahead, and when to read it again."""

from __future__ import annotations

from dataclasses import dataclass

from kdelay.protocol import codec


@dataclass(slots=True)
class Window:
    """How far delivery has read one partition's index ahead."""

    covered: int | None = None
    """Every entry due at or before this time is held or gone; None: scan again."""
    cursor: bytes | None = None
    """Where the next scan resumes: every key below it is held or gone."""
    truncated: bool = False
    """The last scan stopped at its limit: there may be more below ``covered``."""
    lowest_put: bytes | None = None
    """The smallest key put since the last scan, that delivery was not handed."""

    def needs_scan(self, now: int, lookahead_ms: int) -> bool:
        """Whether the index must be read again at ``now``: nothing read yet, the last scan
        was cut short, a key was put below what is covered, or half the look-ahead is used."""
        lowest, self.lowest_put = self.lowest_put, None
        if lowest is not None:
            self.rewind(lowest)
        covered = self.covered
        if covered is None or self.truncated:
            return True
        if lowest is not None and codec.decode_due_key(lowest).due_ms <= covered:
            return True
        return now + lookahead_ms // 2 >= covered

    def held_below(self) -> bytes | None:
        """Return a key below which every entry of the index is held by delivery or gone
        (None: not known, nothing was read yet).

        After a complete scan that is everything due by ``covered``: what was put
        since is adopted, or noted as ``lowest_put``. After a scan cut short, or
        a rewind, it is the cursor.
        """
        if self.covered is not None and not self.truncated:
            bound: bytes | None = codec.due_upper_bound(self.covered)
        else:
            bound = self.cursor
        lowest = self.lowest_put
        if lowest is not None and (bound is None or lowest < bound):
            bound = lowest
        return bound

    def rewind(self, key: bytes) -> None:
        """Move the scan cursor back to ``key`` (an entry not held yet)."""
        if self.cursor is not None and key < self.cursor:
            self.cursor = key
