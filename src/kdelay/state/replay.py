"""A restore's runs of new puts: changelog records told, counted and kept in one pass.

A restore into an empty store (:meth:`~kdelay.state.index.PartitionIndex.fresh`)
replays mostly intake's own records: puts of due keys of one request partition
in increasing request-offset order, whose values name no schedule id, with the
partition's consumed offset (:data:`~kdelay.protocol.codec.CONSUMED_MARKER`)
between them. Such a run holds no key twice, so it needs no dict; and once its
first key lies above every key the restore has put for its request partition,
none of its keys is in the store, so it needs no lookup either.
:meth:`FreshRun.extend` tells whether a batch of records continues the run and
counts the run's tally (due and slack minutes, as
:meth:`~kdelay.state.tally.Change.count_all` does) in one loop that runs compiled
with the hot path (see :mod:`kdelay.native`), without an object a record.

Anything else (a tombstone, a watermark, an ended id, an odd key, a key out of
order) does not continue a run: such a batch and the rest of the write go the
general way (:class:`kdelay.state.changelog.Staging`), as does a run whose
first key the store may hold.
"""

from __future__ import annotations

from typing import Final

from kdelay.protocol import codec
from kdelay.state.tally import MINUTE_MS, NEGATIVE_BYTE, Change

_KEY_SIZE: Final = 20  # codec.DUE_KEY_SIZE: due time (8), request partition (4), offset (8)
_HEAD_SIZE: Final = 12  # codec.INDEX_HEAD_SIZE: request timestamp (8), fingerprint (4)
_WITH_TARGET: Final = 0xFF  # after the head: a target follows, and an id of this length (u16)


class FreshRun:
    """Puts of increasing request offsets of one request partition, with their tally.

    :attr:`keys` and :attr:`values` side by side, in changelog order; the
    partition's latest consumed-offset record (:attr:`consumed`, its value as
    encoded); how many entries fall in each due and slack minute; and the least
    and greatest due time put.
    """

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.values: list[bytes] = []
        self.consumed: bytes | None = None
        self.partition = -1  # the request partition every key names
        self.last = -1  # the request offset of the last key
        self.due: dict[int, int] = {}
        self.slack: dict[int, int] = {}
        self.first_due = 0
        self.last_due = 0

    def __len__(self) -> int:
        """The records the run holds: its puts, and the consumed-offset record if any."""
        return len(self.keys) + (self.consumed is not None)

    def change(self) -> Change:
        """What the run's puts, all new to the store, add to the tally."""
        return Change(dict(self.due), dict(self.slack), {self.partition: len(self.keys)})

    def extend(self, keys: list[bytes | None], values: list[bytes | None]) -> bool:
        """Add the records ``keys[i]``, ``values[i]`` (in changelog order) when every one
        continues the run; else add none and return False.

        A record continues it when it is a put of a due key of the run's request
        partition above its last offset, whose value names no schedule id; or the
        consumed-offset record; or a clock probe (ignored on replay).
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        put_keys: list[bytes] = []
        put_values: list[bytes] = []
        consumed = self.consumed
        partition, last = self.partition, self.last
        first_due, last_due = self.first_due, self.last_due
        due: dict[int, int] = {}
        slack: dict[int, int] = {}
        due_run = slack_run = 0  # the current run's minute and its length
        due_count = slack_count = 0
        for i in range(len(keys)):
            key, raw = keys[i], values[i]
            if key is None:
                return False
            if len(key) != _KEY_SIZE:
                if key == codec.CLOCK_PROBE:
                    continue
                if key != codec.CONSUMED_MARKER or raw is None:
                    return False
                consumed = raw
                continue
            if raw is None:
                return False
            size = len(raw)
            if size < _HEAD_SIZE or (size != _HEAD_SIZE and (
                    size < _HEAD_SIZE + 3 or raw[_HEAD_SIZE] != _WITH_TARGET
                    or raw[_HEAD_SIZE + 1] or raw[_HEAD_SIZE + 2])):
                return False
            origin = (key[8] << 24) | (key[9] << 16) | (key[10] << 8) | key[11]
            offset = ((key[12] << 56) | (key[13] << 48) | (key[14] << 40) | (key[15] << 32)
                      | (key[16] << 24) | (key[17] << 16) | (key[18] << 8) | key[19])
            if partition < 0 and not put_keys:
                partition = origin
            elif origin != partition or offset <= last:
                return False
            last = offset
            due_ms = ((key[0] << 56) | (key[1] << 48) | (key[2] << 40) | (key[3] << 32)
                      | (key[4] << 24) | (key[5] << 16) | (key[6] << 8) | key[7])
            stamp = ((raw[0] << 56) | (raw[1] << 48) | (raw[2] << 40) | (raw[3] << 32)
                     | (raw[4] << 24) | (raw[5] << 16) | (raw[6] << 8) | raw[7])
            if raw[0] >= NEGATIVE_BYTE:
                stamp -= 1 << 64
            if not put_keys and not self.keys:
                first_due = last_due = due_ms
            elif due_ms < first_due:
                first_due = due_ms
            elif due_ms > last_due:
                last_due = due_ms
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
            put_keys.append(key)
            put_values.append(raw)
        if due_count:
            due[due_run] = due.get(due_run, 0) + due_count
        if slack_count:
            slack[slack_run] = slack.get(slack_run, 0) + slack_count
        _add(self.due, due)
        _add(self.slack, slack)
        self.keys.extend(put_keys)
        self.values.extend(put_values)
        self.consumed = consumed
        self.partition, self.last = partition, last
        self.first_due, self.last_due = first_due, last_due
        return True


def _add(counts: dict[int, int], found: dict[int, int]) -> None:
    """Add each of ``found``'s counts to ``counts``."""
    for minute, n in found.items():
        counts[minute] = counts.get(minute, 0) + n
