"""Pending entries picked by a filter, counted whole, and counted by due bucket per target.

What the console's pending list and timeline show, read from a synced
:class:`~kdelay.view.pending.PendingView` as ``kdelay due`` and ``backlog`` read it.
A :class:`Filter` keeps to a due window (by binary search over each
partition's sorted keys: no entry outside it is decoded), an id prefix (from
the index values, no Kafka read) and a target or lane (from each entry's
route: the view's cache, else its original, read once and cached, as
``backlog --by target`` does). The total is always the true count of every
matching entry; only the rows shown are capped.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kdelay.protocol import codec
from kdelay.view.backlog import routes
from kdelay.view.pending import Original, Originals, Pending, PendingView


def _order(entry: Pending) -> tuple[int, int, int]:
    """Delivery order: due time, then (partition, offset)."""
    return entry.due_ms, entry.partition, entry.offset


SORTS = ("due", "id", "target", "request")
"""What the pending list sorts by: due time, schedule id, target (then due time), or the
request's coordinates (partition, offset); each ties broken by due time, partition, offset."""
RANKED = ("target", "request")
"""The sorts the console's summary ranks whole (see :meth:`kdelay.web.summary.Summary.page`)."""
SCAN_DEPTH = 10_000
"""How deep the pages of a sort other than by due time reach; a sort by id (the summary
holds no ids) looks at the first this many matches by due time."""
KEY_SCAN = 10_000
"""A key filter looks at the first this many matches (by due time) of the other filters:
the key is in the original only, read back from Kafka."""


@dataclass(frozen=True, slots=True)
class Order:
    """How the pending list is sorted: by one of :data:`SORTS`, ascending or descending."""

    sort: str = "due"
    descending: bool = False


DUE = Order()


@dataclass(frozen=True, slots=True)
class KeyMatch:
    """A record key to keep: ``key`` exactly, or (``prefix``) any key that starts with it."""

    key: bytes
    prefix: bool = False

    def matches(self, key: bytes | None) -> bool:
        """Whether a record's ``key`` (None: no key) is kept."""
        if key is None:
            return False
        return key.startswith(self.key) if self.prefix else key == self.key


def row_order(order: Order) -> Callable[[tuple[Pending, Original]], tuple[Any, ...]]:
    """The sort key of a shown row (entry and original) under ``order`` (ascending)."""
    def by(row: tuple[Pending, Original]) -> tuple[Any, ...]:
        entry, original = row
        tail = (entry.due_ms, entry.partition, entry.offset)
        if order.sort == "id":
            return (entry.schedule_id is None, entry.schedule_id or "", *tail)
        if order.sort == "target":
            return (original.target or f"({original.state.value})", original.lane or "", *tail)
        if order.sort == "request":
            return entry.partition, entry.offset, entry.due_ms
        return tail
    return by


@dataclass(frozen=True, slots=True)
class Filter:
    """Which pending entries to keep; every field None keeps all.

    ``due_from_ms`` and ``due_to_ms`` bound the due time (both inclusive);
    ``id_prefix`` keeps entries whose schedule id starts with it (entries
    without an id never match one); ``target`` and ``lane`` compare with the
    original's ``kdelay-target`` and ``kdelay-lane``.
    """

    target: str | None = None
    lane: str | None = None
    due_from_ms: int | None = None
    due_to_ms: int | None = None
    id_prefix: str | None = None

    @property
    def routed(self) -> bool:
        """Whether the filter needs each entry's route (target or lane)."""
        return self.target is not None or self.lane is not None

    def passes(self, target: str, lane: str | None) -> bool:
        """Whether an entry routed to ``target`` in ``lane`` passes the route filters."""
        return ((self.target is None or target == self.target)
                and (self.lane is None or lane == self.lane))


@dataclass(frozen=True, slots=True)
class Listing:
    """A page of the entries a filter keeps, in due order, and how many it keeps in all."""

    total: int
    rows: list[tuple[Pending, Original]]
    skip: int
    limit: int
    order: Order = DUE
    capped: int | None = None
    """Set when the sort (by id) or a key filter looked at the first this many matches
    of the other filters only (by due time): then ``total`` counts among those."""
    of: int | None = None
    """With ``capped``: how many the other filters match in all."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """Pending entries by due bucket (start ms) and target; ``total`` counts them all."""

    bucket_ms: int
    total: int
    by_target: dict[str, dict[int, int]] = field(default_factory=dict)
    bursts: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per bucket start, its busiest second ``(start ms, entries due in it)`` when that
    second holds at least :data:`BURST_MIN` entries: a same-second burst."""

    @property
    def starts(self) -> list[int]:
        """Every non-empty bucket's start, in time order."""
        return sorted({start for counts in self.by_target.values() for start in counts})

    def count(self, start: int) -> int:
        """Entries of every target in the bucket that starts at ``start``."""
        return sum(counts.get(start, 0) for counts in self.by_target.values())


def window(keys: list[bytes], chosen: Filter) -> list[bytes]:
    """The due keys (sorted, as a partition holds them) within the filter's due window."""
    low = 0 if chosen.due_from_ms is None else bisect.bisect_left(
        keys, codec.encode_due_key(max(chosen.due_from_ms, 0), 0, 0))
    high = len(keys) if chosen.due_to_ms is None else bisect.bisect_left(
        keys, codec.encode_due_key(max(chosen.due_to_ms + 1, 0), 0, 0))
    return keys[low:high]


def matching(view: PendingView, originals: Originals, partition: int,
             chosen: Filter) -> list[bytes]:
    """The due keys of ``partition``'s index that ``chosen`` keeps, in due order."""
    keys = window(view.keys(partition), chosen)
    prefix = chosen.id_prefix
    if prefix is not None:
        kept = [entry for entry in view.pending(partition, keys)
                if entry.schedule_id is not None and entry.schedule_id.startswith(prefix)]
        keys = [codec.encode_due_key(e.due_ms, e.partition, e.offset) for e in kept]
    if chosen.routed and keys:
        found = routes(view, originals, partition, keys)
        keys = [key for key, (target, lane) in zip(keys, found, strict=True)
                if chosen.passes(target, lane)]
    return keys


def listing(view: PendingView, originals: Originals, chosen: Filter, *, skip: int = 0,
            limit: int = 100, order: Order = DUE) -> Listing:
    """The entries ``chosen`` keeps in ``order``, ``skip`` of them left out, at most
    ``limit`` shown.

    Counts every matching entry; reads the originals of the rows shown only
    (and, for a target or lane filter or sort, the routes not cached yet; for a
    sort by id, every match's index entry). Raises ValueError for a negative
    ``skip`` or a ``limit`` below 1.
    """
    if skip < 0 or limit < 1:
        raise ValueError(f"skip must be >= 0 and limit >= 1, got {skip} and {limit}")
    if order.sort != "due":
        return _sorted_listing(view, originals, chosen, skip, limit, order)
    total = 0
    heads: list[list[Pending]] = []
    for partition in view.partitions:
        keys = matching(view, originals, partition, chosen)
        total += len(keys)
        heads.append(view.pending(partition, keys[max(0, len(keys) - skip - limit):]
                                  if order.descending else keys[:skip + limit]))
    merged = sorted((e for head in heads for e in head), key=_order, reverse=True) \
        if order.descending else list(heapq.merge(*heads, key=_order))
    shown = merged[skip:skip + limit]
    read = originals.read(shown)
    rows = [(entry, read[(entry.partition, entry.offset)]) for entry in shown]
    return Listing(total, rows, skip, limit, order)


def _sorted_listing(view: PendingView, originals: Originals, chosen: Filter, skip: int,
                    limit: int, order: Order) -> Listing:
    """:func:`listing` by id, target or request: every match ranked, its page read."""
    ranked: list[tuple[tuple[Any, ...], int, bytes]] = []
    for partition in view.partitions:
        keys = matching(view, originals, partition, chosen)
        dues = codec.decode_due_keys(b"".join(keys))
        if order.sort == "target":
            found = routes(view, originals, partition, keys)
            ranked += [((target, lane or "", *due), partition, key)
                       for key, due, (target, lane) in zip(keys, dues, found, strict=True)]
        elif order.sort == "id":
            ranked += [((e.schedule_id is None, e.schedule_id or "", e.due_ms, e.partition,
                         e.offset), partition, codec.encode_due_key(e.due_ms, e.partition,
                                                                    e.offset))
                       for e in view.pending(partition, keys)]
        else:
            ranked += [((due[1], due[2], due[0]), partition, key)
                       for key, due in zip(keys, dues, strict=True)]
    ranked.sort(key=lambda item: item[0], reverse=order.descending)
    shown: list[Pending] = []
    for _, partition, key in ranked[skip:skip + limit]:
        shown += view.pending(partition, [key])
    read = originals.read(shown)
    return Listing(len(ranked), [(e, read[(e.partition, e.offset)]) for e in shown], skip,
                   limit, order)


def matching_ids(view: PendingView, originals: Originals,
                 chosen: Filter) -> tuple[list[tuple[str, str | None]], int]:
    """The schedule ids of every entry ``chosen`` keeps, each with its lane (None: no
    lane; an id is unique within its lane), in due order, and how many entries it keeps
    that have no id (those no cancel or reschedule can name)."""
    kept: list[Pending] = []
    for partition in view.partitions:
        kept += view.pending(partition, matching(view, originals, partition, chosen))
    kept.sort(key=_order)
    ids = [(entry.schedule_id, entry.lane) for entry in kept if entry.schedule_id is not None]
    return ids, len(kept) - len(ids)


BURST_MIN = 100
"""Entries due in one second that make it a burst on the timeline."""


def bursts(seconds: Counter[int], bucket_ms: int,
           minimum: int = BURST_MIN) -> dict[int, tuple[int, int]]:
    """The busiest second of each bucket of ``bucket_ms``, from entries counted by the
    second they are due in (``seconds``: start ms -> count), where it holds at least
    ``minimum`` entries; the earliest second wins a tie."""
    found: dict[int, tuple[int, int]] = {}
    for second, count in sorted(seconds.items()):
        if count < minimum:
            continue
        start = second // bucket_ms * bucket_ms
        if start not in found or count > found[start][1]:
            found[start] = (second, count)
    return found


def timeline(view: PendingView, originals: Originals, bucket_ms: int,
             chosen: Filter | None = None) -> Timeline:
    """Count the entries ``chosen`` keeps by due bucket of ``bucket_ms`` and by target, and
    mark each bucket's same-second burst (see :func:`bursts`).

    Needs every entry's route: the first call reads the originals not cached
    yet (see :func:`kdelay.view.backlog.backlog` with ``by target``). Raises
    ValueError for a bucket below 1 ms.
    """
    if bucket_ms < 1:
        raise ValueError(f"a bucket must be at least 1 ms, got {bucket_ms}")
    chosen = chosen or Filter()
    counts: dict[str, Counter[int]] = {}
    seconds: Counter[int] = Counter()
    total = 0
    for partition in view.partitions:
        keys = window(view.keys(partition), chosen)
        if chosen.id_prefix is not None:
            keys = matching(view, originals, partition, chosen)
        found = routes(view, originals, partition, keys)
        dues = codec.decode_due_keys(b"".join(keys))
        for (due_ms, _, _), (target, lane) in zip(dues, found, strict=True):
            if chosen.passes(target, lane):
                counts.setdefault(target, Counter())[due_ms // bucket_ms * bucket_ms] += 1
                seconds[due_ms // 1_000 * 1_000] += 1
                total += 1
    by_target = {target: dict(sorted(c.items())) for target, c in sorted(counts.items())}
    return Timeline(bucket_ms, total, by_target, bursts(seconds, bucket_ms))


def by_lane(view: PendingView, originals: Originals) -> dict[str, int]:
    """Every pending entry counted by its request's lane (``(none)`` for no lane)."""
    counts: Counter[str] = Counter()
    for partition in view.partitions:
        keys = view.keys(partition)
        counts.update(lane or "(none)" for _, lane in routes(view, originals, partition, keys))
    return dict(counts.most_common())
