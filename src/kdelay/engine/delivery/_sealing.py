"""Sealing: what delivery writes, and applies, once a batch of entries is done.

A tombstone per delivered entry costs a produce per record, as much as the
delivery itself. Instead, each time delivery settles a batch it writes one
watermark record per partition (see :class:`~kdelay.protocol.codec.Watermark`):
every entry put before it whose key is below its bound is done, except the
pending keys it lists. The bound is the partition's *frontier*
(:func:`frontier`): the smallest key delivery has not finished and expects to
finish soon (the next entry to send, an entry awaiting its acknowledgement,
what the read-ahead has not seen yet, a plan not yet applied). Keys below it
that are not done (a retry backing off, a cancel being planned, a request
indexed after its due time passed) are listed as pending
(:func:`pending_below`), as long as they are few.

:class:`Marks` keeps one partition's side of this: the bound last written, the
pending keys below it, the puts of plans not yet applied, and turns a batch of
done keys into a :class:`Cover`: the watermark to write, the done keys it covers
(their puts get a tombstone later, from the index's sweep list) and those it
cannot cover (a tombstone each, now). The bound never goes down, so a newer
record always says what an older one did and compaction may keep the latest.

A seal covers one partition: the entries of its runs that landed (and are in
the index), and the book's jobs that are done. :func:`seal_of` turns them into
a :class:`Seal`: the index changes (deletes, ids' ends, the watermark, the
sweep keys) and the changelog records: the watermark covering what it can, a
tombstone for each done entry it cannot, and an end record for each schedule
id. :class:`Cadence` says how often at-least-once seals a partition.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from kdelay.engine.delivery._book import Job, Sink
from kdelay.engine.delivery._readahead import Window
from kdelay.engine.delivery._runs import Run
from kdelay.protocol import codec
from kdelay.protocol.codec import End, IdRecord, IndexValue, Watermark
from kdelay.state.changes import Changes
from kdelay.state.index import PartitionIndex


@dataclass(slots=True)
class Seal:
    """One partition's seal, and what applying it to the index does: the changes, the
    runs whose landed range it settles (with that range's end) and the jobs it ends.
    ``ended`` holds the changelog records of the ids whose schedules end."""

    partition: int
    cover: Cover
    done: list[bytes]
    changes: Changes
    runs: list[tuple[Run, int]]
    jobs: list[tuple[Job, Sink]]
    ended: list[IdRecord] = field(default_factory=list)


@dataclass(slots=True)
class Seals:
    """What one :meth:`~kdelay.engine.delivery.Delivery.seal` wrote, for
    :meth:`~kdelay.engine.delivery.Delivery.settle` to apply: the seal of each
    partition with entries done.

    The checkpoint decides what happens to it: at-least-once settles it at
    once (its records are durable on their own acknowledgements); exactly-once
    writes it into the transaction and settles it once that committed, or
    drops it when the transaction aborted (:meth:`Delivery.abandon` then
    sends the entries again). ``behind`` are the partitions whose index must
    not record its changelog position with these seals: exactly-once's
    partitions with a plan in the same transaction, whose puts come before
    the seals in the changelog and are applied to the index after them (the
    plan's apply records the position, past both).
    """

    seals: list[Seal] = field(default_factory=list)
    behind: frozenset[int] = frozenset()


RANGE_DELETE_MIN = 100
"""A settled slice of a gapless run this long leaves the index as one range tombstone
(a burst); a shorter one (a steady rate's) key by key, so that range tombstones stay few."""

SEAL_EVERY_STEPS = 10
"""With a cadence, a partition is sealed again after this many seals were asked for, if
its time has not come before (a clock that stands still, in tests, still seals)."""


class Cadence:
    """When each partition was sealed last: at-least-once seals a partition at most so
    often while less than a batch landed (a seal per step of a steady rate costs more
    than its records). Exactly-once seals with each transaction."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, int]] = {}
        self._asked = 0

    def asked(self) -> None:
        """A seal of every partition is asked for."""
        self._asked += 1

    def due(self, partition: int, now_s: float, every_s: float) -> bool:
        """Whether ``partition`` may be sealed at monotonic ``now_s`` (every ``every_s``)."""
        last = self._last.get(partition)
        return (every_s <= 0 or last is None or now_s - last[0] >= every_s
                or self._asked - last[1] >= SEAL_EVERY_STEPS)

    def sealed(self, partition: int, now_s: float) -> None:
        """``partition`` was sealed at ``now_s``."""
        self._last[partition] = (now_s, self._asked)


def landed_runs(runs: Iterable[Run]) -> list[tuple[Run, int]]:
    """The runs with landed entries in the index not yet settled, with their end."""
    return [(run, end) for run in runs if run.settled < (end := run.settles_to())]


def seal_of(partition: int, runs: list[tuple[Run, int]], jobs: list[tuple[Job, Sink]],
            marks: Marks, frontier_key: bytes | None, held: Iterable[Job],
            now: int) -> Seal:
    """Cover what is done in ``partition``: the landed ranges of ``runs`` and ``jobs``.

    ``held`` are the partition's jobs in the book (pending, unless in ``jobs``).
    Entries with a schedule id get their end, at ``now``.
    """
    changes = Changes()
    done: list[bytes] = []
    # The value of every done key, in order (b"": a job's value not known).
    values_done: list[bytes] = []
    all_known = True
    ordered = True  # whether ``done`` is in strictly increasing key order (each run's is)
    ended: list[IdRecord] = []
    for run, landed in runs:
        if run.taken:
            live = list(run.live(run.settled, landed))
            keys = [run.keys[at] for at in live]
            values = [run.values[at] for at in live]
        else:  # a whole range, sliced in C
            keys, values = run.keys[run.settled:landed], run.values[run.settled:landed]
            if run.gapless and len(keys) >= RANGE_DELETE_MIN:
                changes.ranges.append((len(done), len(done) + len(keys), run.puts_seen))
        if keys and done and keys[0] <= done[-1]:
            ordered = False
        done.extend(keys)
        values_done.extend(values)
        if any(map(codec.has_schedule_id, values)):
            for key, raw in zip(keys, values, strict=True):
                if codec.has_schedule_id(raw):
                    _end(changes, ended, key, codec.decode_index_value(raw), Sink.TARGET,
                         now)
    for job, sink in jobs:
        key, raw = job.key, job.entry.raw
        if done and key <= done[-1]:
            ordered = False
        all_known = all_known and bool(raw)
        done.append(key)
        values_done.append(raw)
        _end(changes, ended, key, job.entry.value, sink, now)
    if all_known and ordered:  # keys strictly increasing: none twice, extremes at the ends
        changes.deleted_values = values_done
    else:
        changes.known = {key: raw for key, raw in zip(done, values_done, strict=True) if raw}
    if not done:  # only entries taken out of their runs: nothing leaves the index
        return Seal(partition, Cover(None, [], []), [], changes, runs, jobs)
    bound = marks.next_bound(frontier_key)
    cover = marks.cover(frontier_key, pending_below(bound, held, (run for run, _ in runs)),
                      done)
    changes.deletes = done
    changes.watermark = cover.mark
    changes.swept = cover.covered
    return Seal(partition, cover, done, changes, runs, jobs, ended)


def _end(changes: Changes, ended: list[IdRecord], key: bytes, value: IndexValue, sink: Sink,
         now: int) -> None:
    """Record how the schedule of a done entry with an id ended."""
    end = End.DELIVERED if sink is Sink.TARGET else End.DEAD_LETTERED
    state, record = codec.end_of(value.schedule_id, end, now, key, value.fingerprint)
    if value.schedule_id is not None and state is not None and record is not None:
        changes.ids[value.schedule_id] = state
        ended.append(record)


def frontier(window: Window | None, marks: Marks, runs: Iterable[Run]) -> bytes | None:
    """The smallest key of a partition that is neither done nor an exception: the next
    entry of a run that is not landed (or not indexed), what the read-ahead has not
    seen, a plan not yet applied.

    None when the read-ahead has not looked at the partition yet: then nothing
    is known of the keys above the last watermark.
    """
    seen = None if window is None else window.held_below()
    if seen is None:
        return None
    candidates = [seen, marks.frontier(), *(run.first_pending() for run in runs)]
    return min(key for key in candidates if key is not None)


def pending_below(bound: bytes | None, held: Iterable[Job], runs: Iterable[Run]) -> list[bytes]:
    """The keys delivery holds below ``bound`` that are not done: the book's jobs and
    the entries of runs that have not landed."""
    if bound is None:
        return []
    pending = [job.key for job in held if job.key < bound]
    for run in runs:
        pending.extend(run.keys[at] for at in run.live(run.landed, run.below(bound)))
    return pending

MAX_PENDING = 1_000
"""The most pending keys a watermark lists (20 bytes each). Past it the bound
stays where it is and done keys get a tombstone each, as before watermarks."""


@dataclass(frozen=True, slots=True)
class Cover:
    """What one partition's watermark covers of a batch of done keys (part of a :class:`Seal`).

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
        """The bound a cover at ``frontier`` would write: the frontier, never below the last."""
        if self.bound is None or (frontier is not None and frontier > self.bound):
            return frontier
        return self.bound

    def put(self, token: bytes, keys: list[bytes]) -> None:
        """A plan's puts were written; they are pending until applied (or given back)."""
        if not keys:
            return
        least = min(keys)
        self.unapplied[token] = (least, keys)
        bound = self.bound
        if bound is not None and least < bound:  # intake's puts are mostly due beyond it
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

    def cover(self, frontier: bytes | None, pending: Iterable[bytes],
             done: list[bytes]) -> Cover:
        """Turn ``done`` keys into a cover, the bound at ``frontier`` (never lower than now).

        ``pending`` are keys delivery holds that are not done (retries,
        withheld, unsent); with the known pending ones below the bound and the
        unapplied puts they become the watermark's pending keys. Without any
        bound, or with too many pending keys, nothing is written and every
        done key needs a tombstone.
        """
        bound = self.next_bound(frontier)
        if bound is None:
            return Cover(None, [], done)
        unapplied = itertools.chain.from_iterable(keys for _, keys in self.unapplied.values())
        below = {key for key in itertools.chain(self.below, pending, unapplied) if key < bound}
        if below:  # a set of the done keys only when something below the bound may be one
            below.difference_update(done)
        if len(below) > MAX_PENDING:
            return Cover(None, [], done)
        if not done or max(done) < bound:  # every done key below the bound: a burst's seal
            return Cover(Watermark(bound, frozenset(below)), list(done), [])
        covered = [key for key in done if key < bound]
        uncovered = [key for key in done if key >= bound]
        return Cover(Watermark(bound, frozenset(below)), covered, uncovered)

    def written(self, cover: Cover, done: Iterable[bytes]) -> None:
        """Take a cover in once it is written (and, under transactions, committed)."""
        if cover.mark is not None:
            self.bound = cover.mark.bound
            self.below = set(cover.mark.pending)
        else:
            self.below.difference_update(done)


class PartitionMarks:
    """The :class:`Marks` of every partition delivery serves, the partition of each plan
    written and not yet applied (by its first key), and the :class:`Cadence` of their seals."""

    def __init__(self) -> None:
        self._marks: dict[int, Marks] = {}
        self._plans: dict[bytes, int] = {}
        self.cadence = Cadence()

    def of(self, partition: int) -> Marks:
        """The marks of ``partition`` (empty ones at first)."""
        marks = self._marks.get(partition)
        if marks is None:
            marks = self._marks[partition] = Marks()
        return marks

    def load(self, partition: int, index: PartitionIndex) -> None:
        """Start ``partition`` from the watermark its index holds (restored, or written
        before a restart), once: later calls find it loaded.

        Every entry the index holds below the watermark's bound is pending: the
        keys the watermark lists that are still there, and the entries put after
        it was written with keys below its bound (indexed after their due time
        passed). A running instance adds the latter to its pending keys as it
        writes them (:meth:`Marks.put`); after a restart only the index knows
        them, and a watermark written without them would cover entries never
        delivered (the next restore would drop them).
        """
        early = self._marks.get(partition)
        if early is not None and early.loaded:
            return
        mark = index.watermark
        present = [] if mark is None else index.keys_below(mark.bound)
        loaded = Marks.of(mark, present)
        if early is not None:  # plans written before the partition's first read-ahead
            for token, (_, keys) in early.unapplied.items():
                loaded.put(token, keys)
        self._marks[partition] = loaded

    def put(self, partition: int, keys: list[bytes]) -> None:
        """A plan of ``partition`` putting ``keys`` was written (its first key names it)."""
        self._plans[keys[0]] = partition
        self.of(partition).put(keys[0], keys)

    def applied(self, partition: int, token: bytes) -> None:
        """The plan ``token`` of ``partition`` is in the index now."""
        self._plans.pop(token, None)
        self.of(partition).applied(token)

    def given_back(self, token: bytes) -> None:
        """The plan ``token`` was not made durable: its puts never happened."""
        partition = self._plans.pop(token, None)
        if partition is not None:
            self.of(partition).given_back(token)

    def gone(self, keys: list[bytes]) -> None:
        """Entries left their index by other means (a cancel)."""
        for marks in self._marks.values():
            marks.gone(keys)

    def drop(self, partition: int) -> None:
        """Forget a partition this instance no longer owns."""
        self._marks.pop(partition, None)
