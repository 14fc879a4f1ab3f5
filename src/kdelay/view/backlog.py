"""What is pending and when it comes due: ``kdelay due`` and ``kdelay backlog``.

Both read a synced :class:`~kdelay.view.pending.PendingView`. ``due`` lists the
entries of a time window in due order with their originals, read a page at a
time; ``backlog`` counts every pending entry by due-time bucket and partition
from the keys alone, and by target from the originals (cached in the view).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kdelay.protocol import codec
from kdelay.view.pending import Original, Originals, Pending, PendingView


@dataclass(frozen=True, slots=True)
class DueQuery:
    """Which pending entries ``kdelay due`` lists.

    Entries due at or before ``now_ms + within_ms`` (only those due at or
    before ``now_ms`` with ``overdue_only``), of ``partition`` and ``target``
    when given, at most ``limit`` of them (all when None).
    """

    within_ms: int = 60_000
    overdue_only: bool = False
    target: str | None = None
    partition: int | None = None
    limit: int | None = 100


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
            if query.target is None or original.target == query.target:
                listed.append((entry, original))
    return listed if query.limit is None else listed[:query.limit]


@dataclass(frozen=True, slots=True)
class Backlog:
    """How much is pending and when it comes due.

    ``buckets`` holds ``(start_ms, count)`` for every non-empty bucket of
    ``bucket_ms``, in time order; ``by_target`` is None unless asked for
    (``(expired)``, ``(absent)``, ``(mismatch)`` and ``(unread)`` stand for
    entries whose original could not be read).
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


def backlog(view: PendingView, now_ms: int, bucket_ms: int,
            originals: Originals | None = None) -> Backlog:
    """Count the pending entries of ``view`` by due-time bucket and request partition.

    An entry counts under the request partition its original lies on, even
    when its id's partition holds it (a request forwarded there).

    With ``originals``, every pending entry's original is read to count them
    by target too: that reads the whole pending payload once (see the
    operations guide for its cost). Raises ValueError for a bucket below 1 ms.
    """
    if bucket_ms < 1:
        raise ValueError(f"a bucket must be at least 1 ms, got {bucket_ms}")
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
    by_target = None if originals is None else _by_target(view, originals)
    return Backlog(now_ms, sum(by_partition.values()), overdue, earliest, latest, bucket_ms,
                   sorted(buckets.items()), dict(sorted(by_partition.items())), by_target)


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
        cached = view.targets.get(keys)
        counts.update(target.decode("utf-8", "replace") for target in cached if target)
        missing = [key for key, target in zip(keys, cached, strict=True) if target is None]
        counts.update(_read_targets(view, originals, partition, missing))
    view.targets.prune(min(lowest, default=None))
    return dict(counts.most_common())


def _read_targets(view: PendingView, originals: Originals, partition: int,
                  keys: list[bytes]) -> Counter[str]:
    """Read the originals under ``keys``, cache the targets found, and count them."""
    entries = view.pending(partition, keys)
    read = originals.read(entries)
    found: dict[bytes, bytes] = {}
    counts: Counter[str] = Counter()
    for entry in entries:
        original = read[(entry.partition, entry.offset)]
        target = original.target
        if target is None:
            counts[f"({original.state.value})"] += 1
            continue
        counts[target] += 1
        found[codec.encode_due_key(entry.due_ms, entry.partition, entry.offset)] = (
            target.encode())
    view.targets.put(found)
    return counts
