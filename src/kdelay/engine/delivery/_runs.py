"""Runs: delivery's batches of index entries, held as columns rather than objects.

A :class:`Run` is what one read-ahead scan (or one intake plan) hands
delivery: entries of one partition's index in key order, as parallel lists of
keys, encoded index values and original records. Delivery walks a run with
three cursors, ``settled <= landed <= sent``: entries before ``sent`` were
produced, those before ``landed`` are acknowledged (or, under transactions,
part of the transaction being committed), those before ``settled`` are out of
the index. The happy path of a million records is a walk over lists; only
entries that need care (withheld by a cancel, failed, dead-lettered) leave
their run, as a job of the :class:`~kdelay.engine.delivery._book.Book`.

:func:`merged` orders the due slices of several runs by key, a slice at a
time rather than an entry at a time: in a burst, whole runs follow each
other and are sent as they are.
"""

from __future__ import annotations

import bisect
import heapq
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kdelay.state.originals import Found

INDEXED = sys.maxsize
"""The ``indexed_to`` of a run whose every entry is in the index (one read ahead)."""


@dataclass(slots=True, eq=False)
class Run:
    """Entries of one partition's index, in key order, with their originals.

    ``taken`` holds the positions of entries taken out of the run (into the
    book, or dropped by a cancel): the cursors step over them. ``adopted``
    runs come from intake, with their records, and were never read back; the
    plans of several steps may follow each other in one (:meth:`extend`).
    Entries from ``indexed_to`` on are not in the index yet (their plan is not
    applied): they may go out, but leave the index only once they are in it.
    A ``gapless`` run was every key of its index between its first and last
    when read, at the index's ``puts_seen``: its settled ranges may leave the
    index as ranges (see :class:`~kdelay.state.changes.Changes`).
    """

    partition: int
    keys: list[bytes]
    values: list[bytes]
    originals: list[Found]
    adopted: bool = False
    indexed_to: int = INDEXED
    sent: int = 0
    landed: int = 0
    settled: int = 0
    taken: set[int] | None = None
    indexed_ahead: set[int] | None = None
    gapless: bool = False
    puts_seen: int = 0
    # ``due_ms, partition, offset`` of each key laid flat (see codec.due_key_fields),
    # when the read-ahead decoded them already (to fetch the originals); None: each
    # key is decoded as it is sent.
    fields: list[int] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def extend(self, keys: list[bytes], values: list[bytes], originals: list[Found]) -> None:
        """Append entries (not in the index yet) whose keys all follow the run's last
        (an adopted run's: it has no decoded fields)."""
        self.fields = None
        self.keys += keys
        self.values += values
        self.originals += originals

    def indexed(self, positions: Iterable[int]) -> None:
        """The entries at ``positions`` are in the index now: the indexed prefix grows
        over them (and over entries taken out, which are the book's)."""
        ahead = self.indexed_ahead
        if ahead is None:
            ahead = self.indexed_ahead = set()
        ahead.update(at for at in positions if at >= self.indexed_to)
        at, end, taken = self.indexed_to, len(self.keys), self.taken
        while at < end and (at in ahead or (taken is not None and at in taken)):
            ahead.discard(at)
            at += 1
        self.indexed_to = at
        if not ahead:
            self.indexed_ahead = None

    def in_index(self, at: int) -> bool:
        """Whether the entry at ``at`` is in the index (its plan was applied)."""
        return at < self.indexed_to

    def settles_to(self) -> int:
        """The end of what may be settled: landed, and in the index."""
        return min(self.landed, self.indexed_to)

    @property
    def finished(self) -> bool:
        """Whether every entry is settled or taken out."""
        return self.settled >= len(self.keys)

    def due_end(self, bound: bytes) -> int:
        """Return the position after the last unsent entry whose key is below ``bound``."""
        return bisect.bisect_left(self.keys, bound, self.sent)

    def below(self, bound: bytes) -> int:
        """Return the position of the first entry whose key is not below ``bound``."""
        return bisect.bisect_left(self.keys, bound)

    def position(self, key: bytes) -> int | None:
        """Return where ``key`` is in the run, None if it is not (or was taken out)."""
        at = bisect.bisect_left(self.keys, key)
        if at == len(self.keys) or self.keys[at] != key:
            return None
        if self.taken is not None and at in self.taken:
            return None
        return at

    def take(self, at: int) -> None:
        """Take the entry at ``at`` out of the run: the cursors step over it."""
        if self.taken is None:
            self.taken = set()
        self.taken.add(at)

    def flying(self, at: int) -> bool:
        """Whether the entry at ``at`` is produced and not settled."""
        return self.settled <= at < self.sent

    def first_pending(self) -> bytes | None:
        """Return the smallest key whose entry is not done, None if none: not landed, or
        (not indexed yet) not settled; entries taken out are the book's."""
        return self._first_live(max(self.settled, self.settles_to()))

    def unsent_key(self) -> bytes | None:
        """Return the smallest key not yet produced (nor taken out), None if none."""
        return self._first_live(self.sent)

    def _first_live(self, at: int) -> bytes | None:
        taken = self.taken
        while at < len(self.keys):
            if taken is None or at not in taken:
                return self.keys[at]
            at += 1
        return None

    def live(self, start: int, end: int) -> Iterator[int]:
        """The positions in ``[start, end)`` not taken out."""
        taken = self.taken
        if not taken:
            return iter(range(start, end))
        return (at for at in range(start, end) if at not in taken)


Slice = tuple[Run, int, int]
"""Entries ``[start, end)`` of a run."""


def merged(slices: list[Slice]) -> Iterator[Slice]:
    """Yield the entries of ``slices`` in key order, as sub-slices of them.

    Each slice is sorted; the result cuts them only where their key ranges
    interleave. Slices that follow each other (a burst of one due time over
    several partitions, or one run) come out whole.
    """
    live = [(run.keys[start], index, run, start, end)
            for index, (run, start, end) in enumerate(slices) if start < end]
    if len(live) <= 1:
        for _, _, run, start, end in live:
            yield run, start, end
        return
    heapq.heapify(live)
    while live:
        _, index, run, start, end = heapq.heappop(live)
        if not live:
            yield run, start, end
            return
        # Everything of this slice below the next slice's head goes out now.
        cut = bisect.bisect_left(run.keys, live[0][0], start + 1, end)
        yield run, start, cut
        if cut < end:
            heapq.heappush(live, (run.keys[cut], index, run, cut, end))
