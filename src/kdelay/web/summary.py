"""A compact in-memory copy of every pending entry, for the console's screens at scale.

The overview, the timeline and the pending list's counts come from a
:class:`Summary`: per index partition, five numpy columns in due order (the due
second and its milliseconds, the request partition and offset of the original,
and a route number naming the ``(target, lane)`` of :attr:`Summary.routes`),
each as narrow as its values allow: 12 bytes an entry in the usual case (due
before 2106, offsets below 2³², fewer than 256 partitions and routes), 120 MB
at 10 M pending, and no Python object per entry. A column whose values are all
alike takes one value (:func:`repeated`): the request partition, unless the
index partition holds forwarded schedules, and the route when every entry has
the same target and lane (10 bytes an entry then). Counting, bucketing and
filtering are vector operations over those columns, a slice of
:data:`SPAN` entries at a time so that no screen allocates per entry, and a
screen answers in well under a second whatever the backlog.

A summary is a snapshot: :class:`Builder` builds it, a partition at a time,
from a synced :class:`~kdelay.view.pending.PendingView`: its due keys decoded
in bulk, their routes from the view's cache, and the routes not cached yet read
from the originals (checked against the fingerprint, as ``kdelay backlog --by
target`` does) and cached. ``as_of_ms`` says when. Nothing here reads Kafka but
those originals; entries delivered since the snapshot still count until the
next one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from confluent_kafka import Message

from kdelay.protocol import codec, envelope
from kdelay.protocol.controls import Scope, Subject
from kdelay.state.originals import Missing
from kdelay.view.backlog import Backlog, HeldBack
from kdelay.view.listing import BURST_MIN, DUE, RANKED, SCAN_DEPTH, Filter, Order, Timeline
from kdelay.view.pending import Originals, PendingView, decode_route, encode_route

CHUNK = 50_000
"""Due keys decoded (and routes looked up) at a time while building."""
READ_CHUNK = 10_000
"""Originals read at a time for routes not cached (their records held meanwhile)."""
SPAN = 1 << 18
"""Entries a screen's vector operations take at a time: their temporaries (a few
int64 arrays of a slice) stay under 10 MB. Slices of a million added some 30 MB
to the console's peak at every screen."""
RANK_SPAN = 1 << 18
"""Entries a sort other than by due time ranks at a time (its temporaries: about 5 MB)."""
DUE_KEY = np.dtype([("due", ">u8"), ("partition", ">u4"), ("offset", ">u8")])
"""The layout of :func:`kdelay.protocol.codec.encode_due_key`, as numpy reads it."""
NO_ROUTE = 0xFFFF
"""Route number of an entry whose route is not known yet (while building)."""
Route = tuple[str, str | None]
Ints = npt.NDArray[np.int64]
Unsigned = npt.NDArray[np.unsignedinteger[Any]]
Side = Literal["left", "right"]
_NONE: Ints = np.zeros(0, dtype=np.int64)
_EXCLUDED = np.iinfo(np.int64).max  # the rank of an entry the filter leaves out


@dataclass(frozen=True, slots=True)
class Columns:
    """The pending entries one index partition holds, in due order, column by column:
    the due time as its second (``due_s``) and milliseconds (``due_rest``)."""

    due_s: Unsigned
    due_rest: npt.NDArray[np.uint16]
    partition: Unsigned
    offset: Unsigned
    route: Unsigned

    def __len__(self) -> int:
        return len(self.due_s)

    @property
    def nbytes(self) -> int:
        """Bytes the columns take (a :func:`repeated` column: one value)."""
        return sum(held(column) for column in (self.due_s, self.due_rest, self.partition,
                                               self.offset, self.route))

    def due_ms(self, low: int = 0, high: int | None = None) -> Ints:
        """The due times of entries ``low`` to ``high``, in ms."""
        return self.due_s[low:high].astype(np.int64) * 1_000 + self.due_rest[low:high]

    def bound(self, at_ms: int, side: Side) -> int:
        """Where ``at_ms`` would go among the due times (as ``np.searchsorted``)."""
        second, rest = divmod(at_ms, 1_000)
        if second < 0:
            return 0
        if second > np.iinfo(self.due_s.dtype).max:
            return len(self)
        low = int(np.searchsorted(self.due_s, second, side="left"))
        high = int(np.searchsorted(self.due_s, second, side="right"))
        return low + int(np.searchsorted(self.due_rest[low:high], rest, side=side))

    def bucket_starts(self, low: int, high: int, bucket_ms: int) -> Ints:
        """The start of the ``bucket_ms`` bucket of entries ``low`` to ``high``."""
        if bucket_ms % 1_000 == 0:
            step = bucket_ms // 1_000
            return (self.due_s[low:high] // step).astype(np.int64) * bucket_ms
        return self.due_ms(low, high) // bucket_ms * bucket_ms


def decode_keys(keys: list[bytes]) -> npt.NDArray[np.void]:
    """Due keys (each :data:`kdelay.protocol.codec.DUE_KEY_SIZE` bytes) as one record array."""
    return np.frombuffer(b"".join(keys), dtype=DUE_KEY)


def slices(low: int, high: int, size: int | None = None) -> Iterator[tuple[int, int]]:
    """``[low, high)`` cut into slices of at most ``size`` (:data:`SPAN` when None)."""
    size = size or SPAN
    for start in range(low, high, size):
        yield start, min(start + size, high)


def repeated(value: int, size: int, dtype: np.dtype[Any]) -> Unsigned:
    """``size`` times ``value`` (of ``dtype``, or a byte when it fits), read-only, in the
    memory of one value: a column whose entries are all alike (the request partition
    of an index partition holding no forwarded schedule; the route when every pending
    entry has the same target and lane) takes no bytes an entry."""
    kind = np.uint8 if value <= 0xFF else dtype
    return np.broadcast_to(np.array([value], dtype=kind), (size,))


def held(column: npt.NDArray[Any]) -> int:
    """The bytes ``column`` holds: one value for a :func:`repeated` one."""
    if column.ndim == 1 and len(column) > 1 and column.strides[0] == 0:
        return column.itemsize
    return column.nbytes


class _Column:
    """A column filled a chunk at a time, widened when a chunk's values do not fit."""

    def __init__(self, capacity: int, dtype: type[np.unsignedinteger[Any]]) -> None:
        self._values: Unsigned = np.empty(capacity, dtype=dtype)
        self._size = 0

    def add(self, chunk: npt.NDArray[Any]) -> None:
        """Append ``chunk`` (non-negative integers)."""
        need = self._size + len(chunk)
        dtype = self._values.dtype
        if len(chunk) and int(chunk.max()) > np.iinfo(dtype).max:
            dtype = np.promote_types(dtype, np.min_scalar_type(int(chunk.max())))
        if need > len(self._values) or dtype != self._values.dtype:
            grown = np.empty(max(need, len(self._values) * 5 // 4), dtype=dtype)
            grown[:self._size] = self._values[:self._size]
            self._values = grown
        self._values[self._size:need] = chunk
        self._size = need

    def done(self) -> Unsigned:
        """The values, in the narrowest unsigned type that holds them; values all alike
        as one value repeated (:func:`repeated`)."""
        values = self._values[:self._size]
        if self._size and int(values.min()) == int(values.max()):
            return repeated(int(values[0]), self._size, values.dtype)
        if self._size and values.dtype.itemsize > 1 and int(values.max()) <= 0xFF:
            return values.astype(np.uint8)
        if len(self._values) - self._size > self._size // 16:
            return values.copy()  # not the slack too
        return values


class _Sink:
    """One partition's columns, filled a chunk of keys (and their route numbers) at a time."""

    def __init__(self, capacity: int) -> None:
        self.due_s = _Column(capacity, np.uint32)
        self.due_rest = _Column(capacity, np.uint16)
        self.partition = _Column(capacity, np.uint8)  # widened when a chunk needs it
        self.offset = _Column(capacity, np.uint32)
        self.route = _Column(capacity, np.uint8)

    def add(self, decoded: npt.NDArray[np.void], numbers: npt.NDArray[np.uint16]) -> None:
        due = decoded["due"]
        self.due_s.add(due // 1_000)
        self.due_rest.add((due % 1_000).astype(np.uint16))
        self.partition.add(decoded["partition"])
        self.offset.add(decoded["offset"])
        self.route.add(numbers)

    def columns(self) -> Columns:
        rest = self.due_rest.done()
        return Columns(self.due_s.done(), rest.astype(np.uint16) if rest.dtype != np.uint16
                       else rest, self.partition.done(), self.offset.done(), self.route.done())


@dataclass(slots=True)
class Builder:
    """Builds a partition's columns, numbering each distinct route once.

    One builder serves a console's every build: route numbers stay the same from
    one build to the next, so a summary can take one partition's new columns
    while keeping the others'.
    """

    routes: list[Route] = field(default_factory=list)
    _numbers: dict[Route, int] = field(default_factory=dict)
    # Route numbers by cached route bytes (None: not cached), and by raw headers.
    _cached: dict[bytes | None, int] = field(default_factory=lambda: {None: NO_ROUTE})
    _headers: dict[tuple[bytes | str | None, bytes | str | None], tuple[int, bytes | None]] = \
        field(default_factory=dict)

    def number(self, route: Route) -> int:
        """The route's number, given on first sight (at most 65 535 routes)."""
        found = self._numbers.get(route)
        if found is None:
            if len(self.routes) >= NO_ROUTE:
                raise ValueError("more than 65 535 distinct (target, lane) routes")
            found = self._numbers[route] = len(self.routes)
            self.routes.append(route)
        return found

    def columns(self, chunks: Iterable[tuple[list[bytes], list[Route]]],
                capacity: int = 0) -> Columns:
        """One partition's columns from its chunks of keys and routes, in due order."""
        sink = _Sink(capacity)
        for keys, found in chunks:
            sink.add(decode_keys(keys), np.fromiter(
                (self.number(route) for route in found), dtype=np.uint16, count=len(found)))
        return sink.columns()

    def partition(self, view: PendingView, originals: Originals, partition: int,
                  progress: Callable[[int], None] | None = None) -> Columns:
        """The columns of ``partition`` of a synced ``view``: its due keys decoded a chunk at
        a time, each chunk's routes from the view's cache, the rest read (and cached).
        ``progress`` hears the entries done per chunk."""
        sink = _Sink(view.count(partition))
        stream = view.key_stream(partition)
        while keys := list(islice(stream, CHUNK)):
            sink.add(decode_keys(keys), self.routed(view, originals, partition, keys))
            if progress is not None:
                progress(len(keys))
        return sink.columns()

    def routed(self, view: PendingView, originals: Originals, partition: int,
               keys: list[bytes]) -> npt.NDArray[np.uint16]:
        """The route numbers of ``keys`` of ``partition``: cached, else read from the
        originals (``(expired)``, ``(absent)``, ``(mismatch)``, ``(unread)`` when unreadable)."""
        cached = view.targets.get(keys)
        known = self._cached
        for raw in set(cached).difference(known):
            assert raw is not None  # noqa: S101 - None is in known
            known[raw] = self.number(decode_route(raw))
        numbers = np.array([known[raw] for raw in cached], dtype=np.uint16)
        missing = np.flatnonzero(numbers == NO_ROUTE)
        for low, high in slices(0, len(missing), READ_CHUNK):
            where = missing[low:high]
            numbers[where] = self._read(view, originals, partition,
                                        [keys[at] for at in where.tolist()])
        return numbers

    def _read(self, view: PendingView, originals: Originals, partition: int,
              keys: list[bytes]) -> list[int]:
        """Read the originals under ``keys``; cache the routes of those found; return the
        route number of each."""
        raws = view.raw_values(partition, keys)
        decoded = decode_keys(keys)
        partitions, offsets = decoded["partition"].tolist(), decoded["offset"].tolist()
        wanted: dict[int, list[int]] = {}
        for where, offset, raw in zip(partitions, offsets, raws, strict=True):
            if raw is not None:
                wanted.setdefault(where, []).append(offset)
        found = originals.fetch(wanted) if wanted else {}
        numbers: list[int] = []
        cache_keys: list[bytes] = []
        cache_routes: list[bytes] = []
        for key, where, offset, raw in zip(keys, partitions, offsets, raws, strict=True):
            if raw is None:  # gone from the view since the keys were read
                numbers.append(self.number(("(absent)", None)))
                continue
            record = found[where].get(offset)
            number, cached = self._judged(record, raw)
            numbers.append(number)
            if cached is not None:
                cache_keys.append(key)
                cache_routes.append(cached)
        if cache_keys:
            view.targets.put_many(cache_keys, cache_routes)
        return numbers

    def _judged(self, record: Message | Missing | None, raw: bytes) -> tuple[int, bytes | None]:
        """The route number of an entry (index value ``raw``) whose original read found
        ``record``, and its route to cache (None: not cached, as for an unreadable one)."""
        if record is None:
            return self.number(("(unread)", None)), None
        if isinstance(record, Missing):
            return self.number((f"({record.value})", None)), None
        stored = codec.index_head(raw)
        if codec.fingerprint(record.key(), record.value(),
                             codec.record_time(record, 0)) != stored:
            return self.number(("(mismatch)", None)), None
        target = lane = None
        headers = record.headers() or []
        for name, value in headers.items() if isinstance(headers, dict) else headers:
            if name == envelope.TARGET:
                target = value
            elif name == envelope.LANE:
                lane = value
        known = self._headers.get((target, lane))
        if known is None:
            known = self._headers[(target, lane)] = self._of_headers(target, lane)
        return known

    def _of_headers(self, target: bytes | str | None,
                    lane: bytes | str | None) -> tuple[int, bytes | None]:
        """The number and cached form of the route the header values name, as
        :class:`~kdelay.view.pending.Original` reads them."""
        if target is None:
            return self.number(("(found)", None)), None
        named = _text(target)
        of = None if lane is None else _text(lane)
        return self.number((named, of)), encode_route(named, of)


def _text(value: bytes | str) -> str:
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Summary:
    """Every pending entry as of ``as_of_ms``, as columns per index partition."""

    as_of_ms: int
    routes: Sequence[Route]
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

    def _window(self, columns: Columns, chosen: Filter) -> tuple[int, int]:
        """The bounds of ``chosen``'s due window in ``columns``."""
        low = 0 if chosen.due_from_ms is None else columns.bound(chosen.due_from_ms, "left")
        high = len(columns) if chosen.due_to_ms is None else columns.bound(
            chosen.due_to_ms, "right")
        return low, max(low, high)

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
            for low, high in slices(0, len(columns)):
                buckets.update(runs(columns.bucket_starts(low, high, bucket_ms)))
            by_partition.update(counts(columns.partition))
            by_route.update(counts(columns.route))
            overdue += columns.bound(now_ms, "right")
            first, last = int(columns.due_ms(0, 1)[0]), int(columns.due_ms(-1)[0])
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
            sizes: Counter[int] = Counter()
            firsts: dict[int, int] = {}  # due order: a route's first entry is its oldest
            for start, end in slices(0, columns.bound(now_ms, "right")):
                route = columns.route[start:end]
                for number, size in counts(route).items():
                    sizes[number] += size
                    if number not in firsts:
                        firsts[number] = start + int(np.argmax(route == number))
            for number, size in sizes.items():
                target, lane = self.routes[number]
                first = firsts[number]
                oldest = int(columns.due_ms(first, first + 1)[0])
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
        wanted = self._wanted(chosen)
        per_target: dict[str, Counter[int]] = {}
        total = 0
        for columns, start, end, keep in self._slices(chosen, wanted):
            starts = columns.bucket_starts(start, end, bucket_ms)
            route = columns.route[start:end]
            if keep is not None:
                starts, route = starts[keep], route[keep]
            total += len(starts)
            for number in np.unique(route).tolist():
                target = self.routes[number][0]
                per_target.setdefault(target, Counter()).update(runs(starts[route == number]))
        by_target = {target: dict(sorted(c.items())) for target, c in sorted(per_target.items())}
        return Timeline(bucket_ms, total, by_target,
                        _busiest(self._bursts(chosen, wanted), bucket_ms))

    def _slices(self, chosen: Filter, wanted: npt.NDArray[np.bool_] | None
                ) -> Iterator[tuple[Columns, int, int, npt.NDArray[np.bool_] | None]]:
        """Each partition's due window of ``chosen`` in slices of :data:`SPAN`, with which of
        a slice's entries ``wanted`` keeps (None: all)."""
        for columns in self.by_index.values():
            low, high = self._window(columns, chosen)
            for start, end in slices(low, high):
                yield columns, start, end, (None if wanted is None
                                            else wanted[columns.route[start:end]])

    def _bursts(self, chosen: Filter, wanted: npt.NDArray[np.bool_] | None) -> Counter[int]:
        """The seconds (as ms) holding at least :data:`BURST_MIN` of the entries ``chosen``
        keeps, over every partition: a burst may be split across them.

        Two passes, so that nothing is held per entry or per distinct second: over
        ``n`` partitions a burst second holds at least ``BURST_MIN / n`` entries in
        one of them, so the first pass keeps only such seconds (and each slice's
        first and last, which a slice's cut may split) as candidates; the second
        counts the candidates in every partition.
        """
        least = max(1, -(-BURST_MIN // max(1, len(self.by_index))))
        found: list[Ints] = []
        for columns, start, end, keep in self._slices(chosen, wanted):
            second = _seconds(columns, start, end, keep)
            distinct, lengths = run_lengths(second)
            if len(distinct):
                kept = lengths >= least
                kept[[0, -1]] = True
                found.append(distinct[kept])
        if not found:
            return Counter()
        candidates = np.unique(np.concatenate(found))
        totals = np.zeros(len(candidates), dtype=np.int64)
        for columns, start, end, keep in self._slices(chosen, wanted):
            second = _seconds(columns, start, end, keep)
            if not len(second):
                continue
            # Only the candidates within the slice's seconds: not every candidate each slice.
            low = int(np.searchsorted(candidates, second[0], side="left"))
            high = int(np.searchsorted(candidates, second[-1], side="right"))
            within = candidates[low:high]
            totals[low:high] += (np.searchsorted(second, within, side="right")
                                 - np.searchsorted(second, within, side="left"))
        burst = totals >= BURST_MIN
        return Counter(dict(zip((candidates[burst] * 1_000).tolist(), totals[burst].tolist(),
                                strict=True)))

    def page(self, chosen: Filter, skip: int, limit: int, order: Order = DUE
             ) -> tuple[int, list[tuple[int, bytes]]]:
        """The true count of entries ``chosen`` keeps (no id prefix), and the page
        ``skip``/``limit`` of them in ``order``, each as the index partition that holds
        it and its due key.

        By due time (either way) a page takes the first ``skip + limit`` matches of
        each partition's due window from its end; by target or by request
        (partition, offset) every match is ranked, a slice at a time
        (:meth:`_ranked`), and the pages reach the first :data:`SCAN_DEPTH` only
        (ValueError past them). The ids are not in the columns: ValueError for
        ``order.sort == "id"`` (:class:`kdelay.web.reads.Reads` sorts by id itself).
        """
        if chosen.id_prefix is not None:
            raise ValueError("the summary holds no ids: an id prefix reads the view")
        if order.sort == "due":
            return self._by_due(chosen, skip, limit, order.descending)
        if order.sort not in RANKED:
            raise ValueError(f"the summary cannot sort by {order.sort}")
        if skip + limit > SCAN_DEPTH:
            raise ValueError(f"sorted by {order.sort}, pages reach the first {SCAN_DEPTH} "
                             "matches")
        return self._ranked(chosen, skip, limit, order)

    def _by_due(self, chosen: Filter, skip: int, limit: int,
                descending: bool) -> tuple[int, list[tuple[int, bytes]]]:
        """:meth:`page` by due time, then (partition, offset); ``descending`` reverses it."""
        wanted = self._wanted(chosen)
        total = 0
        heads: list[tuple[int, int, int, int]] = []
        for index, columns in self.by_index.items():
            low, high = self._window(columns, chosen)
            need = skip + limit
            spans = list(slices(low, high))
            for start, end in reversed(spans) if descending else spans:
                keep = None if wanted is None else wanted[columns.route[start:end]]
                if keep is None:
                    total += end - start
                    picked = np.arange(max(start, end - need), end) if descending \
                        else np.arange(start, min(end, start + need))
                else:
                    total += int(np.count_nonzero(keep))
                    where = np.flatnonzero(keep)
                    picked = _NONE if not need else start + (
                        where[max(0, len(where) - need):] if descending else where[:need])
                if len(picked):
                    need -= len(picked)
                    heads += zip(((columns.due_s[picked].astype(np.int64) * 1_000
                                   + columns.due_rest[picked]).tolist()),
                                 columns.partition[picked].tolist(),
                                 columns.offset[picked].tolist(), [index] * len(picked),
                                 strict=True)
        shown = sorted(heads, reverse=descending)[skip:skip + limit]
        return total, [(index, codec.encode_due_key(due, partition, offset))
                       for due, partition, offset, index in shown]

    def _ranked(self, chosen: Filter, skip: int, limit: int,
                order: Order) -> tuple[int, list[tuple[int, bytes]]]:
        """:meth:`page` by target (its name, then due time) or by request (partition,
        offset): every match ranked, a slice of :data:`RANK_SPAN` at a time, each slice
        keeping only its ``skip + limit`` best (with their ties), then those sorted."""
        wanted = self._wanted(chosen)
        need = skip + limit
        names = sorted(range(len(self.routes)), key=lambda n: (self.routes[n][0],
                                                               self.routes[n][1] or ""))
        place = np.zeros(max(1, len(self.routes)), dtype=np.int64)
        place[names] = np.arange(len(names))
        sign = -1 if order.descending else 1
        total = 0
        kept: list[Ints] = []  # rows: rank, due ms, partition, offset, index (signed)
        for index, columns in self.by_index.items():
            low, high = self._window(columns, chosen)
            for start, end in slices(low, high, RANK_SPAN):
                keep = None if wanted is None else wanted[columns.route[start:end]]
                rank = _rank(columns, start, end, order.sort, place) * sign
                count = end - start
                if keep is not None:
                    rank[~keep] = _EXCLUDED
                    count = int(np.count_nonzero(keep))
                total += count
                if not min(need, count):
                    continue
                at = np.flatnonzero(rank <= np.partition(rank, min(need, count) - 1)[
                    min(need, count) - 1])
                kept.append(np.stack((
                    rank[at], (columns.due_s[start + at].astype(np.int64) * 1_000
                               + columns.due_rest[start + at]) * sign,
                    columns.partition[start + at].astype(np.int64) * sign,
                    columns.offset[start + at].astype(np.int64) * sign,
                    np.full(len(at), index, dtype=np.int64))))
        if not kept:
            return total, []
        rows = np.concatenate(kept, axis=1)
        rows = rows[:, np.lexsort(rows[3::-1])][:, skip:skip + limit]
        return total, [(int(index), codec.encode_due_key(due * sign, partition * sign,
                                                         offset * sign))
                       for _, due, partition, offset, index in rows.T.tolist()]


def _rank(columns: Columns, start: int, end: int, sort: str, place: Ints) -> Ints:
    """The rank of entries ``start`` to ``end`` by target (its place among the routes'
    names, then the due ms: 16 + 43 bits) or by request (partition, then offset: 24 + 40
    bits; an offset past 2⁴⁰ ranks as 2⁴⁰ - 1)."""
    if sort == "target":
        return (place[columns.route[start:end]] << 43) | columns.due_ms(start, end)
    partition = columns.partition[start:end].astype(np.int64)
    return (partition << 40) | np.minimum(columns.offset[start:end].astype(np.int64),
                                          (1 << 40) - 1)


def _seconds(columns: Columns, start: int, end: int,
             keep: npt.NDArray[np.bool_] | None) -> Ints:
    """The due seconds of entries ``start`` to ``end`` that ``keep`` keeps (None: all)."""
    second = columns.due_s[start:end].astype(np.int64)
    return second if keep is None else second[keep]


def counts(values: Unsigned) -> dict[int, int]:
    """How often each value occurs (a slice of :data:`SPAN` at a time)."""
    found: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
    for low, high in slices(0, len(values)):
        part = np.bincount(values[low:high])
        if len(part) > len(found):
            part[:len(found)] += found
            found = part
        else:
            found[:len(part)] += part
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


def summarize(view: PendingView, originals: Originals, as_of_ms: int,
              progress: Callable[[int], None] | None = None,
              builder: Builder | None = None) -> Summary:
    """Build the summary of a synced ``view`` (every partition); ``progress`` hears the
    entries done so far.

    Reads the originals whose route the view has not cached (the first build
    of a large backlog reads every pending original once).
    """
    builder = builder or Builder()
    done = 0

    def counted(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done)

    by_index = {partition: builder.partition(view, originals, partition, counted)
                for partition in view.partitions}
    return Summary(as_of_ms, tuple(builder.routes), by_index)


def decoded_keys(columns: Columns) -> list[bytes]:
    """The due keys of ``columns`` again (for tests and rebuilding)."""
    return [codec.encode_due_key(due, partition, offset) for due, partition, offset in
            zip(columns.due_ms().tolist(), columns.partition.tolist(), columns.offset.tolist(),
                strict=True)]
