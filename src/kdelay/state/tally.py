"""The exact count of a partition's pending entries, by due minute and by slack.

A gauge of pending entries that is an estimate hides a backlog that is
growing; one that scans the store costs more the more is pending. The tally
is exact and cheap: :class:`~kdelay.state.index.PartitionIndex` keeps it in memory,
changes it with every batch it writes (counting only keys that really appear
or disappear, as the batch's one multi-get shows), and stores the changed
buckets in its meta column family *in the same* ``WriteBatch``, so the tally
on disk always matches the entries on disk, through crashes and restores.

Two histograms, bucketed by whole minutes, and a count by request partition:

- ``due``: entries by due minute. :meth:`Tally.by_horizon` sums it into the
  horizons operators watch (overdue, due within 1 m, 10 m, 1 h, 1 d, beyond).
  An entry counts in the horizon its due *minute* starts in: entries due in
  the current minute count as "1m" until that minute is over, so "overdue" may
  trail the millisecond truth by up to a minute.
- ``slack``: entries by ``request time - due time``. Retention deletes a
  request's original ``retention.ms`` after its record time, so an entry is at
  risk when its slack is below ``-retention.ms``; :meth:`Tally.at_risk` counts
  them (the bucket that straddles the limit counts as at risk).
- ``origin``: entries by the request partition their original lies on (the
  partition in the due key): the store's own, and another one for a schedule
  forwarded to its id's partition. ``kdelay backlog`` counts by it.

Stored buckets are rows ``tally/<kind><i64>`` (kind ``d``, ``s`` or ``o``);
:data:`~kdelay.protocol.codec.TALLY_COMPLETE` holds the layout's version, and a
store whose marker is missing or older is counted once from scratch.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from kdelay.protocol import codec

MINUTE_MS: Final = 60_000
DUE: Final = b"d"
SLACK: Final = b"s"
ORIGIN: Final = b"o"
# (label, the horizon's end relative to now); entries past the last go to "beyond".
HORIZONS: Final = (("1m", 60_000), ("10m", 600_000), ("1h", 3_600_000), ("1d", 86_400_000))
OVERDUE: Final = "overdue"
DUE_TIME_SIZE: Final = 8  # the due time at the head of a due key
PARTITION_SIZE: Final = 4  # the request partition after it
NEGATIVE_BYTE: Final = 0x80  # a big-endian i64 whose first byte is this or more is negative
BEYOND: Final = "beyond"
COUNT_CHUNK: Final = 65_536  # entries :meth:`Tally.of` counts in one :meth:`Change.count_all`


def _probe() -> None:
    """Nothing: its type tells whether this module runs compiled (:data:`COMPILED`)."""


COMPILED: Final = type(_probe).__name__ != "function"
"""Whether this module runs compiled (mypyc): a compiled function is a builtin."""


def buckets(key: bytes, raw: bytes) -> tuple[int, int]:
    """The due minute and the slack minute of one index entry (encoded key and value)."""
    due_ms = codec.due_ms_of(key)
    return due_ms // MINUTE_MS, (codec.request_timestamp_of(raw) - due_ms) // MINUTE_MS


@dataclass(slots=True)
class Change:
    """What one batch adds to and takes from the tally, before it is written.

    Plain dicts, not Counters: every index write builds one, and a Counter
    costs a Python ``__init__`` to build and a ``__missing__`` call per new key.
    """

    due: dict[int, int] = field(default_factory=dict)
    slack: dict[int, int] = field(default_factory=dict)
    origin: dict[int, int] = field(default_factory=dict)

    def count(self, key: bytes, raw: bytes, sign: int) -> None:
        """Count an entry that appears (``sign`` 1) or disappears (-1)."""
        due, slack = buckets(key, raw)
        self.due[due] = self.due.get(due, 0) + sign
        self.slack[slack] = self.slack.get(slack, 0) + sign
        origin = origin_of(key)
        self.origin[origin] = self.origin.get(origin, 0) + sign

    def count_all(self, keys: Sequence[bytes], values: Sequence[bytes], sign: int,
                  ordered: bool = False, extremes: tuple[int, int, int, int] | None = None,
                  origin: int | None = None) -> None:
        """Count every entry (``keys[i]`` with encoded value ``values[i]``) as
        :meth:`count` would: one pass per histogram over the batch, the minutes
        counted in C. A write batch counts hundreds of entries, and two calls per
        entry cost more than the counting. ``ordered``: the keys are due keys in
        increasing order (as read from an index), so their extremes are at the ends.
        A caller that knows them gives the ``extremes`` (least and greatest due
        time, least and greatest request timestamp) and the request partition
        every key names (``origin``): with both, a batch whose due times and
        slacks fall in one minute each is counted without a pass over it."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return
        # A batch whose due times, or slacks, all fall in one minute (a burst: one due
        # time, requests written close together) is counted in one step; floor division
        # is monotonic, so the extremes tell, and the per-entry numbers are only
        # decoded for a histogram that spans minutes.
        dues: list[int] | None = None
        stamps: list[int] | None = None
        if extremes is None and not ordered and COMPILED:
            # A batch in no order (a restore's): one compiled pass counts both
            # histograms; finding the extremes first would cost as much.
            runs = _minute_runs(keys, values)
            if runs is not None:
                _add(self.origin, _origins(keys) if origin is None else {origin: len(keys)},
                     sign)
                _add(self.due, runs[0], sign)
                _add(self.slack, runs[1], sign)
                return
        if extremes is None:
            extremes = _extremes_of_bytes(keys, values, ordered)
        if extremes is None:
            dues, stamps = codec.due_times(keys), codec.record_times(values)
            extremes = (min(dues), max(dues), min(stamps), max(stamps))
        first, last, oldest, newest = extremes
        _add(self.origin, _origins(keys) if origin is None else {origin: len(keys)}, sign)
        if first // MINUTE_MS == last // MINUTE_MS:
            _add(self.due, {first // MINUTE_MS: len(keys)}, sign)
        else:
            dues = codec.due_times(keys) if dues is None else dues
            _add(self.due, Counter([due_ms // MINUTE_MS for due_ms in dues]), sign)
        low, high = oldest - last, newest - first
        if low // MINUTE_MS == high // MINUTE_MS:
            _add(self.slack, {low // MINUTE_MS: len(keys)}, sign)
            return
        dues = codec.due_times(keys) if dues is None else dues
        stamps = codec.record_times(values) if stamps is None else stamps
        _add(self.slack, Counter([(stamp - due_ms) // MINUTE_MS
                                  for stamp, due_ms in zip(stamps, dues, strict=True)]),
             sign)


def _minute_runs(keys: Sequence[bytes], values: Sequence[bytes]
                 ) -> tuple[dict[int, int], dict[int, int]] | None:
    """How many of the entries (``keys[i]`` with encoded value ``values[i]``) fall in
    each due minute and in each slack minute, as :meth:`Change.count_all` counts them;
    None when a key or value is too short to hold its time.

    Compiled, the times are read byte by byte without an object per entry, and a
    bucket's count is touched once per run of entries in the same minute (a
    changelog's neighbours are mostly due close together): no list of times, no
    Counter. Interpreted, this loop is slower than the struct and Counter passes
    :meth:`Change.count_all` makes otherwise, so only the compiled form calls it.
    """
    due: dict[int, int] = {}
    slack: dict[int, int] = {}
    due_run = slack_run = 0  # the current run's minute and its length
    due_count = slack_count = 0
    size = codec.INDEX_HEAD_SIZE
    for i in range(len(keys)):
        key, raw = keys[i], values[i]
        if len(key) < DUE_TIME_SIZE or len(raw) < size:
            return None
        due_ms = ((key[0] << 56) | (key[1] << 48) | (key[2] << 40) | (key[3] << 32)
                  | (key[4] << 24) | (key[5] << 16) | (key[6] << 8) | key[7])
        stamp = ((raw[0] << 56) | (raw[1] << 48) | (raw[2] << 40) | (raw[3] << 32)
                 | (raw[4] << 24) | (raw[5] << 16) | (raw[6] << 8) | raw[7])
        if raw[0] >= NEGATIVE_BYTE:
            stamp -= 1 << 64
        minute = due_ms // MINUTE_MS
        if minute != due_run or not due_count:
            if due_count:
                due[due_run] = due.get(due_run, 0) + due_count
            due_run, due_count = minute, 0
        due_count += 1
        minute = (stamp - due_ms) // MINUTE_MS
        if minute != slack_run or not slack_count:
            if slack_count:
                slack[slack_run] = slack.get(slack_run, 0) + slack_count
            slack_run, slack_count = minute, 0
        slack_count += 1
    if due_count:
        due[due_run] = due.get(due_run, 0) + due_count
    if slack_count:
        slack[slack_run] = slack.get(slack_run, 0) + slack_count
    return due, slack


def origin_of(key: bytes) -> int:
    """The request partition of a due key: where its original lies."""
    return int.from_bytes(key[DUE_TIME_SIZE:DUE_TIME_SIZE + PARTITION_SIZE], "big")


def _origins(keys: Sequence[bytes]) -> Mapping[int, int]:
    """How many of the due ``keys`` name each request partition. A batch's keys mostly
    name one (the store's own): that is told by comparing bytes in C, and only a
    batch with a forwarded schedule among them is counted key by key."""
    first = keys[0][DUE_TIME_SIZE:DUE_TIME_SIZE + PARTITION_SIZE]
    if all(map(bytes.startswith, keys, itertools.repeat(first),
               itertools.repeat(DUE_TIME_SIZE))):
        return {int.from_bytes(first, "big"): len(keys)}
    return Counter([origin_of(key) for key in keys])


def _extremes_of_bytes(keys: Sequence[bytes], values: Sequence[bytes], ordered: bool
                       ) -> tuple[int, int, int, int] | None:
    """The least and greatest due time and timestamp of a batch, found by comparing
    bytes in C without a number per entry; None when bytes do not order as the numbers.

    Due keys order as their due times (a big-endian u64 first), and index values
    whose timestamps are not negative as those (a big-endian i64 first). ``ordered``
    due keys have theirs at the ends.
    """
    if ((not ordered and min(map(len, keys)) < DUE_TIME_SIZE)
            or min(map(len, values)) < codec.INDEX_HEAD_SIZE
            or (newest := max(values))[0] >= NEGATIVE_BYTE):
        return None
    first, last = (keys[0], keys[-1]) if ordered else (min(keys), max(keys))
    return (codec.due_ms_of(first), codec.due_ms_of(last),
            codec.request_timestamp_of(min(values)), codec.request_timestamp_of(newest))


def _add(counts: dict[int, int], found: Mapping[int, int], sign: int) -> None:
    """Add ``sign`` times each of ``found``'s counts to ``counts``."""
    for minute, n in found.items():
        counts[minute] = counts.get(minute, 0) + sign * n


class Tally:
    """The in-memory tally of one partition's pending entries (see the module)."""

    def __init__(self, due: Mapping[int, int] | None = None,
                 slack: Mapping[int, int] | None = None,
                 origin: Mapping[int, int] | None = None) -> None:
        self.due: Counter[int] = Counter(due or {})
        self.slack: Counter[int] = Counter(slack or {})
        self.origin: Counter[int] = Counter(origin or {})
        self.total = sum(self.due.values())

    @classmethod
    def of(cls, entries: Iterable[tuple[bytes, bytes]], ordered: bool = False) -> Tally:
        """Count ``(key, value)`` entries from scratch (a store without a stored tally),
        a chunk at a time (:meth:`Change.count_all`: no Python call per entry);
        ``ordered``: the keys come in increasing order (a store's scan)."""
        change = Change()
        it = iter(entries)
        first, second = operator.itemgetter(0), operator.itemgetter(1)
        while chunk := list(itertools.islice(it, COUNT_CHUNK)):
            change.count_all(list(map(first, chunk)), list(map(second, chunk)), 1, ordered)
        return cls({m: n for m, n in change.due.items() if n},
                   {m: n for m, n in change.slack.items() if n},
                   {p: n for p, n in change.origin.items() if n})

    @classmethod
    def load(cls, stored: Iterable[tuple[bytes, bytes]]) -> Tally:
        """Rebuild the tally from its stored buckets (meta keys under ``tally/``)."""
        kinds: dict[bytes, dict[int, int]] = {DUE: {}, SLACK: {}, ORIGIN: {}}
        for key, raw in stored:
            if key == codec.TALLY_COMPLETE:
                continue
            kind, minute = codec.decode_tally_key(key)
            kinds[kind][minute] = codec.decode_count(raw)
        return cls(kinds[DUE], kinds[SLACK], kinds[ORIGIN])

    def rows(self, change: Change) -> list[tuple[bytes, int]]:
        """The buckets ``change`` touches, as ``(meta key, new count)`` (0: delete the key)."""
        key = codec.encode_tally_key
        due, slack, origin = self.due.get, self.slack.get, self.origin.get
        return [*((key(DUE, m), due(m, 0) + d) for m, d in change.due.items() if d),
                *((key(SLACK, m), slack(m, 0) + d) for m, d in change.slack.items() if d),
                *((key(ORIGIN, p), origin(p, 0) + d) for p, d in change.origin.items() if d)]

    def all_rows(self) -> Iterator[tuple[bytes, int]]:
        """Every bucket, as ``(meta key, count)``: to store a tally counted from scratch."""
        for kind, counts in ((DUE, self.due), (SLACK, self.slack), (ORIGIN, self.origin)):
            for bucket, count in counts.items():
                yield codec.encode_tally_key(kind, bucket), count

    def commit(self, change: Change) -> None:
        """Take ``change`` in, once its batch is written."""
        for counts, delta in ((self.due, change.due), (self.slack, change.slack),
                              (self.origin, change.origin)):
            for minute, diff in delta.items():
                count = counts.get(minute, 0) + diff
                if count > 0:
                    counts[minute] = count
                else:
                    counts.pop(minute, None)
        self.total += sum(change.due.values())

    def by_horizon(self, now_ms: int) -> dict[str, int]:
        """Pending entries by horizon at ``now_ms``, by due minute (see the module)."""
        result = dict.fromkeys(horizons(), 0)
        for minute, count in self.due.items():
            result[_horizon(minute * MINUTE_MS, now_ms)] += count
        return result

    def at_risk(self, retention_ms: int | None) -> int:
        """Entries whose original retention may delete before they are due (0: unlimited)."""
        if retention_ms is None:
            return 0
        return sum(count for minute, count in self.slack.items()
                   if minute * MINUTE_MS < -retention_ms)


def change_of(new: dict[bytes, bytes], deletes: list[bytes], known: dict[bytes, bytes],
              absent: set[bytes], values_of: Callable[[list[bytes]], list[bytes | None]]
              ) -> Change:
    """How the puts ``new`` and the ``deletes`` move a tally: the keys they really add
    and really remove. ``known`` are values certainly in the store (read by a scan,
    untouched since), ``absent`` keys certainly not; every other key is looked up in
    one ``values_of`` call (a multi-get). Here, compiled, rather than in the index:
    it runs per entry written."""
    change = Change()
    if not new and known and len(known) == len(deletes):
        change.count_all(deletes, [known[key] for key in deletes], -1)
        return change
    looked_up = [key for key in new if key not in absent] if absent else [*new]
    keys = [*looked_up, *(key for key in deletes if key not in known)]
    present: dict[bytes, bytes] = {}
    if keys:
        for key, value in zip(keys, values_of(keys), strict=True):
            if value is not None:
                present[key] = value
    present.update(known)
    if present:
        added = [key for key in new if key not in present]
        added_values = [new[key] for key in added]
    else:  # intake's usual batch: every put new, nothing deleted
        added, added_values = [*new], [*new.values()]
    change.count_all(added, added_values, 1)
    if not deletes:
        return change
    present.update(zip(added, added_values, strict=True))
    removed = [key for key in dict.fromkeys(deletes) if key in present]
    change.count_all(removed, [present.pop(key) for key in removed], -1)
    return change


def deleted_change(deletes: list[bytes], values: list[bytes]) -> Change:
    """How removing ``deletes`` moves a tally: due keys as an index holds them, in
    strictly increasing order (none twice), each in the store with encoded value
    ``values[i]`` (delivery's seal; no lookup, no dict)."""
    change = Change()
    change.count_all(deletes, values, -1, ordered=True)
    return change


def horizons() -> list[str]:
    """Every horizon label, nearest first."""
    return [OVERDUE, *(name for name, _ in HORIZONS), BEYOND]


def _horizon(minute_start_ms: int, now_ms: int) -> str:
    """The horizon of a due minute that starts at ``minute_start_ms``."""
    if minute_start_ms + MINUTE_MS <= now_ms:
        return OVERDUE
    ahead = minute_start_ms - now_ms
    return next((name for name, end in HORIZONS if ahead < end), BEYOND)
