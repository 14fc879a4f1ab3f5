"""Watermarks: one changelog record that says a whole prefix of a partition is done.

A tombstone per delivered entry costs a produce per record, as much as the
delivery itself. Instead, each time delivery settles a batch it writes one
watermark record per partition (see :class:`~kdelay.protocol.codec.Watermark`):
every entry put before it whose key is below its bound is done, except the
pending keys it lists. The bound is the partition's *frontier*: the smallest
key delivery has not finished and expects to finish soon (the next entry to
send, an entry awaiting its acknowledgement, what the read-ahead has not seen
yet, a plan not yet applied). Keys below it that are not done (a retry backing
off, a cancel being planned, a request indexed after its due time passed) are
listed as pending, as long as they are few.

:class:`Marks` keeps one partition's side of this: the bound last written, the
pending keys below it, the puts of plans not yet applied, and turns a batch of
done keys into a :class:`Seal`: the watermark to write, the done keys it covers
(their puts get a tombstone later, from the index's sweep list) and those it
cannot cover (a tombstone each, now). The bound never goes down, so a newer
record always says what an older one did and compaction may keep the latest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from kdelay.protocol.codec import Watermark

MAX_PENDING = 1_000
"""The most pending keys a watermark lists (20 bytes each). Past it the bound
stays where it is and done keys get a tombstone each, as before watermarks."""


@dataclass(frozen=True, slots=True)
class Seal:
    """What settling a batch of done keys writes for one partition.

    ``mark`` is the watermark to write (None: none this time), ``covered``
    the done keys it covers and ``uncovered`` those that need a tombstone.
    """

    mark: Watermark | None
    covered: list[bytes]
    uncovered: list[bytes]


@dataclass(slots=True)
class Marks:
    """One partition's watermark state: the last bound, the pending keys below it, and
    the puts of plans written but not yet applied to the index."""

    bound: bytes | None = None
    below: set[bytes] = field(default_factory=set)
    # Per plan not yet applied (by its first key): the smallest key it puts, and its keys.
    unapplied: dict[bytes, tuple[bytes, list[bytes]]] = field(default_factory=dict)
    # Whether the bound is the one the partition's index holds (see of).
    loaded: bool = False

    @classmethod
    def of(cls, mark: Watermark | None, present: Iterable[bytes]) -> Marks:
        """The state after ``mark`` was written, with ``present`` its pending keys still pending."""
        if mark is None:
            return cls(loaded=True)
        return cls(mark.bound, set(present), loaded=True)

    def next_bound(self, frontier: bytes | None) -> bytes | None:
        """The bound a seal at ``frontier`` would write: the frontier, never below the last."""
        if self.bound is None or (frontier is not None and frontier > self.bound):
            return frontier
        return self.bound

    def put(self, token: bytes, keys: list[bytes]) -> None:
        """A plan's puts were written; they are pending until applied (or given back)."""
        if not keys:
            return
        self.unapplied[token] = (min(keys), keys)
        bound = self.bound
        if bound is not None:
            self.below.update(key for key in keys if key < bound)

    def applied(self, token: bytes) -> None:
        """The plan ``token`` is in the index: its keys are pending there (and in ``below``)."""
        self.unapplied.pop(token, None)

    def given_back(self, token: bytes) -> None:
        """The plan ``token`` was not made durable: its puts never happened."""
        found = self.unapplied.pop(token, None)
        if found is not None:
            self.below.difference_update(found[1])

    def gone(self, keys: Iterable[bytes]) -> None:
        """Entries left the index by other means (a cancel): they are no longer pending."""
        self.below.difference_update(keys)

    def frontier(self) -> bytes | None:
        """The smallest key an unapplied plan puts (None: no plan is unapplied)."""
        return min((low for low, _ in self.unapplied.values()), default=None)

    def seal(self, frontier: bytes | None, pending: Iterable[bytes],
             done: list[bytes]) -> Seal:
        """Turn ``done`` keys into a seal, the bound at ``frontier`` (never lower than now).

        ``pending`` are keys delivery holds that are not done (retries,
        withheld, unsent); with the known pending ones below the bound and the
        unapplied puts they become the watermark's pending keys. Without any
        bound, or with too many pending keys, nothing is written and every
        done key needs a tombstone.
        """
        bound = self.next_bound(frontier)
        if bound is None:
            return Seal(None, [], done)
        unapplied = itertools.chain.from_iterable(keys for _, keys in self.unapplied.values())
        below = {key for key in itertools.chain(self.below, pending, unapplied) if key < bound}
        if below:  # a set of the done keys only when something below the bound may be one
            below.difference_update(done)
        if len(below) > MAX_PENDING:
            return Seal(None, [], done)
        if not done or max(done) < bound:  # every done key below the bound: a burst's seal
            return Seal(Watermark(bound, frozenset(below)), list(done), [])
        covered = [key for key in done if key < bound]
        uncovered = [key for key in done if key >= bound]
        return Seal(Watermark(bound, frozenset(below)), covered, uncovered)

    def sealed(self, seal: Seal, done: Iterable[bytes]) -> None:
        """Take a seal in once it is written (and, under transactions, committed)."""
        if seal.mark is not None:
            self.bound = seal.mark.bound
            self.below = set(seal.mark.pending)
        else:
            self.below.difference_update(done)
