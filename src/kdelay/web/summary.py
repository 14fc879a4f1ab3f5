"""A compact in-memory copy of every pending entry, for the console's screens at scale.

The overview, the timeline and the pending list's counts come from a
:class:`Summary`: per index partition, four numpy columns in due order (due
time, the request partition and offset of the original, and a route number
naming the ``(target, lane)`` of :attr:`Summary.routes`), 16 bytes an entry and
no Python object per entry (10 M pending: about 160 MB). Counting, bucketing
and filtering are vector operations over those columns, so a screen answers
in well under a second whatever the backlog, instead of walking the view per
request.

A summary is a snapshot: :func:`summarize` builds it from a synced
:class:`~kdelay.view.pending.PendingView` (reading every original whose route
the view has not cached yet, as ``kdelay backlog --by target`` does), and its
``as_of_ms`` says when. Nothing here reads Kafka; entries delivered since the
snapshot still count until the next one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
import numpy.typing as npt

from kdelay.protocol import codec
from kdelay.protocol.controls import Scope, Subject
from kdelay.view.backlog import Backlog, HeldBack, routes
from kdelay.view.listing import BURST_MIN, Filter, Timeline
from kdelay.view.pending import Originals, PendingView

CHUNK = 100_000
"""Due keys decoded (and routes looked up) at a time while building."""
DUE_KEY = np.dtype([("due", ">u8"), ("partition", ">u4"), ("offset", ">u8")])
"""The layout of :func:`kdelay.protocol.codec.encode_due_key`, as numpy reads it."""
Route = tuple[str, str | None]
Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Columns:
    """The pending entries one index partition holds, in due order, column by column."""

    due_ms: Ints
    partition: npt.NDArray[np.uint16]
    offset: Ints
    route: npt.NDArray[np.uint16]

    def __len__(self) -> int:
        return len(self.due_ms)

    @property
    def nbytes(self) -> int:
        """Bytes the columns take."""
        return sum(column.nbytes for column in (self.due_ms, self.partition, self.offset,
                                                self.route))


def decode_keys(keys: list[bytes]) -> npt.NDArray[np.void]:
    """Due keys (each :data:`kdelay.protocol.codec.DUE_KEY_SIZE` bytes) as one record array."""
    return np.frombuffer(b"".join(keys), dtype=DUE_KEY)


@dataclass(slots=True)
class Builder:
    """Accumulates one partition's chunks of ``(due keys, their routes)`` into columns,
    numbering each distinct route once."""

    routes: list[Route] = field(default_factory=list)
    _numbers: dict[Route, int] = field(default_factory=dict)

    def number(self, route: Route) -> int:
        """The route's number, given on first sight (at most 65 535 routes)."""
        found = self._numbers.get(route)
        if found is None:
            if len(self.routes) >= np.iinfo(np.uint16).max:
                raise ValueError("more than 65 535 distinct (target, lane) routes")
            found = self._numbers[route] = len(self.routes)
            self.routes.append(route)
        return found

    def columns(self, chunks: Iterable[tuple[list[bytes], list[Route]]]) -> Columns:
        """One partition's columns from its chunks, which come in due order."""
        parts: list[Columns] = []
        for keys, found in chunks:
            decoded = decode_keys(keys)
            numbers = np.fromiter((self.number(route) for route in found), dtype=np.uint16,
                                  count=len(found))
            parts.append(Columns(decoded["due"].astype(np.int64),
                                 decoded["partition"].astype(np.uint16),
                                 decoded["offset"].astype(np.int64), numbers))
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Columns(empty, np.zeros(0, dtype=np.uint16), empty,
                           np.zeros(0, dtype=np.uint16))
        return Columns(*(np.concatenate([getattr(p, name) for p in parts])
                         for name in ("due_ms", "partition", "offset", "route")))


@dataclass(frozen=True, slots=True)
class Summary:
    """Every pending entry as of ``as_of_ms``, as columns per index partition."""

    as_of_ms: int
    routes: list[Route]
    by_index: dict[int, Columns]

    @property
    def total(self) -> int:
        """Entries pending at the snapshot."""
        return sum(len(columns) for columns in self.by_index.values())

    @property
    def nbytes(self) -> int:
        """Bytes the columns take."""
        return sum(columns.nbytes for columns in self.by_index.values())

    def _wanted(self, chosen: Filter) -> npt.NDArray[np.bool_] | None:
        """Per route number, whether ``chosen``'s target and lane keep it (None: all)."""
        if not chosen.routed:
            return None
        return np.array([chosen.passes(target, lane) for target, lane in self.routes] or
                        [False], dtype=np.bool_)

    def _kept(self, columns: Columns, chosen: Filter) -> tuple[int, int, npt.NDArray[np.bool_]
                                                               | None]:
        """The due window's bounds in ``columns`` and, for a routed filter, which of the
        window's entries ``chosen`` keeps."""
        low = 0 if chosen.due_from_ms is None else int(np.searchsorted(
            columns.due_ms, chosen.due_from_ms, side="left"))
        high = len(columns) if chosen.due_to_ms is None else int(np.searchsorted(
            columns.due_ms, chosen.due_to_ms, side="right"))
        wanted = self._wanted(chosen)
        mask = None if wanted is None else wanted[columns.route[low:high]]
        return low, high, mask

    def backlog(self, now_ms: int, bucket_ms: int) -> Backlog:
        """What ``kdelay backlog --by target`` counts, from the columns."""
        if bucket_ms < 1:
            raise ValueError(f"a bucket must be at least 1 ms, got {bucket_ms}")
        buckets: Counter[int] = Counter()
        by_partition: Counter[int] = Counter(dict.fromkeys(self.by_index, 0))
        by_route: Counter[int] = Counter()
        overdue, earliest, latest = 0, None, None
        for columns in self.by_index.values():
            if not len(columns):
                continue
            buckets.update(runs(columns.due_ms // bucket_ms * bucket_ms))
            by_partition.update(counts(columns.partition))
            by_route.update(counts(columns.route))
            overdue += int(np.searchsorted(columns.due_ms, now_ms, side="right"))
            first, last = int(columns.due_ms[0]), int(columns.due_ms[-1])
            earliest = first if earliest is None else min(earliest, first)
            latest = last if latest is None else max(latest, last)
        by_target: Counter[str] = Counter()
        for number, count in by_route.items():
            by_target[self.routes[number][0]] += count
        return Backlog(now_ms, self.total, overdue, earliest, latest, bucket_ms,
                       sorted(buckets.items()), dict(sorted(by_partition.items())),
                       dict(by_target.most_common()))

    def held_back(self, now_ms: int, subjects: Iterable[Subject]) -> dict[Subject, HeldBack]:
        """What :func:`kdelay.view.backlog.held_back` counts, from the columns: per
        controlled subject, the entries due by ``now_ms`` of its target (or lane)."""
        wanted = set(subjects)
        found = dict.fromkeys(wanted, HeldBack())
        for columns in self.by_index.values():
            due_count = int(np.searchsorted(columns.due_ms, now_ms, side="right"))
            if not due_count:
                continue
            numbers, firsts, sizes = np.unique(columns.route[:due_count], return_index=True,
                                               return_counts=True)
            for number, first, size in zip(numbers.tolist(), firsts.tolist(), sizes.tolist(),
                                           strict=True):
                target, lane = self.routes[number]
                oldest = int(columns.due_ms[first])  # due order: the first is the oldest
                for subject in (Subject(Scope.TARGET, target),
                                None if lane is None else Subject(Scope.LANE, lane)):
                    if subject in wanted:
                        found[subject] = found[subject].merged(size, oldest)
        return found

    def lanes(self) -> dict[str, int]:
        """Every pending entry counted by its request's lane (``(none)`` for no lane)."""
        found: Counter[str] = Counter()
        for columns in self.by_index.values():
            for number, count in counts(columns.route).items():
                found[self.routes[number][1] or "(none)"] += count
        return dict(found.most_common())

    def timeline(self, bucket_ms: int, chosen: Filter | None = None) -> Timeline:
        """What :func:`kdelay.view.listing.timeline` counts, without an id prefix (which
        the columns do not hold; raises ValueError for one)."""
        if bucket_ms < 1:
            raise ValueError(f"a bucket must be at least 1 ms, got {bucket_ms}")
        chosen = chosen or Filter()
        if chosen.id_prefix is not None:
            raise ValueError("the summary holds no ids: an id prefix reads the view")
        per_target: dict[str, Counter[int]] = {}
        second_runs: list[tuple[Ints, Ints]] = []
        total = 0
        for columns in self.by_index.values():
            low, high, mask = self._kept(columns, chosen)
            due, route = columns.due_ms[low:high], columns.route[low:high]
            if mask is not None:
                due, route = due[mask], route[mask]
            total += len(due)
            second_runs.append(run_lengths(due // 1_000 * 1_000))
            for number in np.unique(route).tolist():
                target = self.routes[number][0]
                starts = due[route == number] // bucket_ms * bucket_ms
                per_target.setdefault(target, Counter()).update(runs(starts))
        by_target = {target: dict(sorted(c.items())) for target, c in sorted(per_target.items())}
        return Timeline(bucket_ms, total, by_target, _busiest(_summed(second_runs), bucket_ms))

    def page(self, chosen: Filter, skip: int, limit: int) -> tuple[int, list[tuple[int, bytes]]]:
        """The true count of entries ``chosen`` keeps (no id prefix), and the page
        ``skip``/``limit`` of them in delivery order (due, partition, offset), each as
        the index partition that holds it and its due key."""
        if chosen.id_prefix is not None:
            raise ValueError("the summary holds no ids: an id prefix reads the view")
        total = 0
        heads: list[tuple[int, int, int, int]] = []
        for index, columns in self.by_index.items():
            low, high, mask = self._kept(columns, chosen)
            picked = np.arange(low, high) if mask is None else low + np.flatnonzero(mask)
            total += len(picked)
            head = picked[:skip + limit]
            heads += zip(columns.due_ms[head].tolist(), columns.partition[head].tolist(),
                         columns.offset[head].tolist(), [index] * len(head), strict=True)
        shown = sorted(heads)[skip:skip + limit]
        return total, [(index, codec.encode_due_key(due, partition, offset))
                       for due, partition, offset, index in shown]


def counts(values: npt.NDArray[np.uint16]) -> dict[int, int]:
    """How often each value occurs."""
    found = np.bincount(values)
    return {int(value): int(found[value]) for value in np.flatnonzero(found)}


def run_lengths(values: Ints) -> tuple[Ints, Ints]:
    """Each distinct value of the sorted ``values`` and how often it occurs: one pass,
    no sort."""
    if not len(values):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    starts = np.concatenate(([0], np.flatnonzero(np.diff(values)) + 1))
    lengths = np.diff(np.concatenate((starts, [len(values)])))
    return values[starts], lengths.astype(np.int64)


def runs(values: Ints) -> dict[int, int]:
    """:func:`run_lengths` as a dict (for few distinct values: buckets)."""
    distinct, lengths = run_lengths(values)
    return dict(zip(distinct.tolist(), lengths.tolist(), strict=True))


def _summed(parts: list[tuple[Ints, Ints]]) -> Counter[int]:
    """The seconds holding at least :data:`BURST_MIN` entries over every partition's
    ``(seconds, counts)``: a burst may be split across partitions."""
    if not parts:
        return Counter()
    seconds = np.concatenate([second for second, _ in parts])
    counted = np.concatenate([count for _, count in parts])
    distinct, where = np.unique(seconds, return_inverse=True)
    totals = np.bincount(where, weights=counted).astype(np.int64)
    keep = totals >= BURST_MIN
    return Counter(dict(zip(distinct[keep].tolist(), totals[keep].tolist(), strict=True)))


def _busiest(seconds: Counter[int], bucket_ms: int) -> dict[int, tuple[int, int]]:
    """Per bucket, its busiest burst second (see :func:`kdelay.view.listing.bursts`)."""
    found: dict[int, tuple[int, int]] = {}
    for second, count in sorted(seconds.items()):
        if count < BURST_MIN:
            continue
        start = second // bucket_ms * bucket_ms
        if start not in found or count > found[start][1]:
            found[start] = (second, count)
    return found


def _chunks(view: PendingView, originals: Originals,
            partition: int) -> Iterator[tuple[list[bytes], list[Route]]]:
    """``partition``'s due keys a chunk at a time, with their routes (cached, or read)."""
    stream = view.key_stream(partition)
    while keys := list(islice(stream, CHUNK)):
        yield keys, routes(view, originals, partition, keys)


def summarize(view: PendingView, originals: Originals, as_of_ms: int,
              progress: Callable[[int], None] | None = None) -> Summary:
    """Build the summary of a synced ``view``; ``progress`` hears the entries done so far.

    Reads the originals whose route the view has not cached (the first build
    of a large backlog reads every pending original once).
    """
    builder = Builder()
    by_index: dict[int, Columns] = {}
    done = 0

    def counted(partition: int) -> Iterator[tuple[list[bytes], list[Route]]]:
        nonlocal done
        for keys, found in _chunks(view, originals, partition):
            done += len(keys)
            if progress is not None:
                progress(done)
            yield keys, found

    for partition in view.partitions:
        by_index[partition] = builder.columns(counted(partition))
    return Summary(as_of_ms, builder.routes, by_index)


def decoded_keys(columns: Columns) -> list[bytes]:
    """The due keys of ``columns`` again (for tests and rebuilding)."""
    return [codec.encode_due_key(due, partition, offset) for due, partition, offset in
            zip(columns.due_ms.tolist(), columns.partition.tolist(), columns.offset.tolist(),
                strict=True)]
