"""What is pending and when it comes due: ``kdelay due`` and ``kdelay backlog``.

Both read a synced :class:`~kdelay.view.pending.PendingView`. ``due`` lists the
entries of a time window in due order with their originals, read a page at a
time; ``backlog`` counts every pending entry by due-time bucket and partition
from each store's tally (:mod:`kdelay.state.tally`, exact by due minute and
request partition) without reading the entries, and by target from the
originals (cached in the view).
Both can keep to one lane: the lane a request names in ``kdelay-lane``, read
from its original (for ``backlog``, every pending original, cached as the
targets are).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from kdelay.protocol import codec
from kdelay.protocol.controls import Scope, Subject
from kdelay.state.tally import MINUTE_MS
from kdelay.view.pending import (
    Original,
    Originals,
    Pending,
    PendingView,
    decode_route,
    encode_route,
)


@dataclass(frozen=True, slots=True)
class DueQuery:
    """Which pending entries ``kdelay due`` lists.

    Entries due at or before ``now_ms + within_ms`` (only those due at or
    before ``now_ms`` with ``overdue_only``), of ``partition``, ``target`` and
    ``lane`` (the request's ``kdelay-lane``) when given, at most ``limit`` of
    them (all when None).
    """

    within_ms: int = 60_000
    overdue_only: bool = False
    target: str | None = None
    partition: int | None = None
    limit: int | None = 100
    lane: str | None = None

    def matches(self, original: Original) -> bool:
        """Whether an entry with this original passes the target and lane filters."""
        return ((self.target is None or original.target == self.target)
                and (self.lane is None or original.lane == self.lane))


def due(view: PendingView, originals: Originals, query: DueQuery,
        now_ms: int) -> list[tuple[Pending, Original]]:
    """List the entries ``query`` asks for, in due order, each with its original.

    Originals are read a page at a time and only until ``limit`` entries
    match, so a small listing of a large backlog reads few records.
    """
    upper = now_ms if query.overdue_only else now_ms + query.within_ms
    candidates = view.entries(upper)
    if query.partition is not None:
        # By the partition the request lies on: a request whose id belongs to
        # another partition is held by that partition's index.
        wanted = query.partition
        candidates = (entry for entry in candidates if entry.partition == wanted)
    listed: list[tuple[Pending, Original]] = []
    page_size = 1_000 if query.limit is None else max(query.limit, 100)
    while query.limit is None or len(listed) < query.limit:
        page = [entry for _, entry in zip(range(page_size), candidates, strict=False)]
        if not page:
            break
        read = originals.read(page)
        for entry in page:
            original = read[(entry.partition, entry.offset)]
            if query.matches(original):
                listed.append((entry, original))
    return listed if query.limit is None else listed[:query.limit]


@dataclass(frozen=True, slots=True)
class Backlog:
    """How much is pending and when it comes due.

    ``buckets`` holds ``(start_ms, count)`` for every non-empty bucket of
    ``bucket_ms``, in time order; ``by_target`` is None unless asked for
    (``(expired)``, ``(absent)``, ``(mismatch)`` and ``(unread)`` stand for
    entries whose original could not be read). ``lane`` is the lane counted,
    None for every entry.
    """

    now_ms: int
    pending: int
    overdue: int
    earliest_due_ms: int | None
    latest_due_ms: int | None
    bucket_ms: int
    buckets: list[tuple[int, int]]
    by_partition: dict[int, int]
    by_target: dict[str, int] | None = None
    lane: str | None = None


def backlog(view: PendingView, now_ms: int, bucket_ms: int,
            originals: Originals | None = None, lane: str | None = None) -> Backlog:
    """Count the pending entries of ``view`` by due-time bucket and request partition.

    An entry counts under the request partition its original lies on, even
    when its id's partition holds it (a request forwarded there).

    With ``originals``, every pending entry's original is read to count them
    by target too: that reads the whole pending payload once (see the
    operations guide for its cost). With ``lane`` (which needs ``originals``)
    only the entries whose request names that lane are counted, by target too.
    Raises ValueError for a bucket below 1 ms or a lane without originals.
    """
    if bucket_ms < 1:
        raise ValueError(f"a bucket must be at least 1 ms, got {bucket_ms}")
    if lane is not None:
        if originals is None:
            raise ValueError("counting one lane reads the originals: give them")
        return _lane_backlog(view, originals, now_ms, bucket_ms, lane)
    if bucket_ms % MINUTE_MS:
        counted = scanned_backlog(view, now_ms, bucket_ms)
    else:
        counted = tallied_backlog(view, now_ms, bucket_ms)
    if originals is None:
        return counted
    return replace(counted, by_target=_by_target(view, originals))


def tallied_backlog(view: PendingView, now_ms: int, bucket_ms: int) -> Backlog:
    """:func:`backlog` by partition from each store's tally, for whole-minute buckets.

    The tally counts every entry by due minute and by request partition
    (:mod:`kdelay.state.tally`), exactly, so the count reads no entry but those
    due in the current minute up to ``now_ms`` (overdue counts to the
    millisecond), and two seeks a store for the earliest and latest due time:
    its cost does not grow with the pending count. ValueError unless
    ``bucket_ms`` is a whole number of minutes (every minute then falls in
    one bucket).
    """
    if bucket_ms < MINUTE_MS or bucket_ms % MINUTE_MS:
        raise ValueError(f"the tally counts whole minutes, not buckets of {bucket_ms} ms")
    buckets: Counter[int] = Counter()
    by_partition: Counter[int] = Counter(dict.fromkeys(view.partitions, 0))
    now_minute = now_ms // MINUTE_MS
    overdue, firsts, lasts = 0, [], []
    for number, partition in enumerate(view.partitions, start=1):
        view.report("counting pending entries (partitions)", number, len(view.partitions))
        tally = view.tally(partition)
        by_partition.update(tally.origin)
        for minute, count in tally.due.items():
            buckets[minute * MINUTE_MS // bucket_ms * bucket_ms] += count
            if minute < now_minute:
                overdue += count
        if tally.due.get(now_minute):
            overdue += view.count_due(partition, now_minute * MINUTE_MS, now_ms)
        span = view.due_range(partition) if tally.total else None
        if span is not None:
            firsts.append(span[0])
            lasts.append(span[1])
    return Backlog(now_ms, sum(by_partition.values()), overdue, min(firsts, default=None),
                   max(lasts, default=None), bucket_ms, sorted(buckets.items()),
                   dict(sorted(by_partition.items())))


def scanned_backlog(view: PendingView, now_ms: int, bucket_ms: int) -> Backlog:
    """:func:`backlog` by partition from every key of the view (any bucket of 1 ms or
    more): a read of the whole view, whose cost grows with the pending count."""
    buckets: Counter[int] = Counter()
    by_partition: Counter[int] = Counter(dict.fromkeys(view.partitions, 0))
    overdue, earliest, latest = 0, None, None
    for number, partition in enumerate(view.partitions, start=1):
        view.report("counting pending entries (partitions)", number, len(view.partitions))
        keys = list(view.due_times(partition))
        by_partition.update(origin for _, origin, _ in keys)
        dues = [due_ms for due_ms, _, _ in keys]
        if not dues:
            continue
        buckets.update(dict(bucket_counts(dues, bucket_ms)))
        overdue += bisect.bisect_right(dues, now_ms)
        earliest = dues[0] if earliest is None else min(earliest, dues[0])
        latest = dues[-1] if latest is None else max(latest, dues[-1])
    return Backlog(now_ms, sum(by_partition.values()), overdue, earliest, latest, bucket_ms,
                   sorted(buckets.items()), dict(sorted(by_partition.items())))


def bucket_counts(dues: Sequence[int], bucket_ms: int) -> list[tuple[int, int]]:
    """``(bucket start, count)`` of every non-empty bucket of the sorted ``dues``.

    One binary search per non-empty bucket instead of a step per entry.
    """
    counts = []
    low = 0
    while low < len(dues):
        start = dues[low] // bucket_ms * bucket_ms
        high = bisect.bisect_left(dues, start + bucket_ms, low)
        counts.append((start, high - low))
        low = high
    return counts


def _lane_backlog(view: PendingView, originals: Originals, now_ms: int, bucket_ms: int,
                  lane: str) -> Backlog:
    """:func:`backlog` of the entries whose request names ``lane``, by target too."""
    buckets: Counter[int] = Counter()
    # By the request partition in the due key: where the request lies.
    by_partition: Counter[int] = Counter(dict.fromkeys(view.partitions, 0))
    by_target: Counter[str] = Counter()
    dues: list[int] = []
    lowest: list[bytes] = []
    for number, partition in enumerate(view.partitions, start=1):
        view.report("reading lanes (partitions)", number, len(view.partitions))
        keys = view.keys(partition)
        lowest += keys[:1]
        found = routes(view, originals, partition, keys)
        mine = [(codec.decode_due_key(key), target)
                for key, (target, of) in zip(keys, found, strict=True) if of == lane]
        partition_dues = [due.due_ms for due, _ in mine]
        buckets.update(dict(bucket_counts(partition_dues, bucket_ms)))
        by_partition.update(due.partition for due, _ in mine)
        by_target.update(target for _, target in mine)
        dues += partition_dues
    view.targets.prune(min(lowest, default=None))
    return Backlog(now_ms, len(dues), sum(1 for due in dues if due <= now_ms),
                   min(dues, default=None), max(dues, default=None), bucket_ms,
                   sorted(buckets.items()), dict(sorted(by_partition.items())),
                   dict(by_target.most_common()), lane)


@dataclass(frozen=True, slots=True)
class HeldBack:
    """What a control holds back: the pending entries due by now whose target it
    controls (or whose request names the lane it controls), and the oldest due time."""

    count: int = 0
    oldest_due_ms: int | None = None

    def merged(self, count: int, oldest_due_ms: int) -> HeldBack:
        """This, with ``count`` more entries, the oldest due at ``oldest_due_ms``."""
        oldest = self.oldest_due_ms
        return HeldBack(self.count + count,
                        oldest_due_ms if oldest is None else min(oldest, oldest_due_ms))


def held_back(view: PendingView, originals: Originals, now_ms: int,
              subjects: Iterable[Subject]) -> dict[Subject, HeldBack]:
    """Count, per controlled subject, the pending entries due by ``now_ms`` that it
    holds back: a paused target's whole due backlog, a capped one's queue.

    Reads the originals of the due entries only (their routes are cached in the
    view, as ``backlog --by target`` caches them). A record to a target under
    both a target and a lane control counts under both.
    """
    wanted = set(subjects)
    found = dict.fromkeys(wanted, HeldBack())
    if not wanted:
        return found
    upper = codec.due_upper_bound(now_ms)
    for number, partition in enumerate(view.partitions, start=1):
        view.report("counting held-back entries (partitions)", number, len(view.partitions))
        keys = view.keys(partition)
        keys = keys[:bisect.bisect_left(keys, upper)]
        for key, (target, lane) in zip(keys, routes(view, originals, partition, keys),
                                       strict=True):
            for subject in (Subject(Scope.TARGET, target),
                            None if lane is None else Subject(Scope.LANE, lane)):
                if subject in wanted:
                    found[subject] = found[subject].merged(1, codec.decode_due_key(key).due_ms)
    return found


def routes(view: PendingView, originals: Originals, partition: int,
           keys: list[bytes]) -> list[tuple[str, str | None]]:
    """The ``(target, lane)`` of every entry under ``keys``, from the cache or read and cached.

    An entry whose original cannot be read has the target ``(expired)``,
    ``(absent)``, ``(mismatch)`` or ``(unread)`` and no lane.
    """
    cached = view.targets.get(keys)
    known = {key: decode_route(raw) for key, raw in zip(keys, cached, strict=True)
             if raw is not None}
    missing = [key for key in keys if key not in known]
    if missing:
        known.update(_read_routes(view, originals, partition, missing))
    return [known.get(key, ("(absent)", None)) for key in keys]


def _read_routes(view: PendingView, originals: Originals, partition: int,
                 keys: list[bytes]) -> dict[bytes, tuple[str, str | None]]:
    """Read the originals under ``keys``; cache the routes of those found; return all."""
    entries = view.pending(partition, keys)
    read = originals.read(entries)
    routes: dict[bytes, tuple[str, str | None]] = {}
    found: dict[bytes, bytes] = {}
    for entry in entries:
        original = read[(entry.partition, entry.offset)]
        key = codec.encode_due_key(entry.due_ms, entry.partition, entry.offset)
        target = original.target
        if target is None:
            routes[key] = (f"({original.state.value})", None)
            continue
        routes[key] = (target, original.lane)
        found[key] = encode_route(target, original.lane)
    view.targets.put(found)
    return routes


def _by_target(view: PendingView, originals: Originals) -> dict[str, int]:
    """Count every pending entry by the target its original names.

    Targets already in the view's cache cost a lookup; the rest are read
    from Kafka and cached. Entries whose original cannot be read count under
    ``(expired)``, ``(absent)``, ``(mismatch)`` or ``(unread)``.
    """
    counts: Counter[str] = Counter()
    lowest: list[bytes] = []
    for partition in view.partitions:
        keys = view.keys(partition)
        lowest += keys[:1]
        counts.update(target for target, _ in routes(view, originals, partition, keys))
    view.targets.prune(min(lowest, default=None))
    return dict(counts.most_common())

