"""What an index write is made of: the entries put and the changes around them.

Intake puts most requests as :class:`FreshPuts`, keys and encoded values side by
side, and the rest (ids, reschedules, forwards) as an :class:`Entry` each;
delivery reads entries back; both hand :class:`Changes` to
:meth:`~kdelay.state.index.PartitionIndex.apply`. They
live apart from the index so that they run compiled with the hot path (see
:mod:`kdelay.native`): the index itself stays interpreted.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field

from kdelay.protocol import codec
from kdelay.protocol.codec import IdState, IndexValue, Watermark


class Entry:
    """A pending request: where its original lives and how to recognise it.

    Treated as immutable. A class of its own rather than a dataclass: intake
    makes one per request, and a dataclass's generated ``__init__`` runs
    interpreted even here; :attr:`due` is decoded from the key, and :attr:`value`
    from ``raw`` when the entry was made without it, when first asked (of
    intake's entries, only those delivery may adopt are). Entries are equal
    when key and value are.
    """

    def __init__(self, key: bytes, value: IndexValue | None, raw: bytes = b"") -> None:
        """``raw`` is the value as encoded, when the caller already has it (saves
        encoding twice); ``value`` may then be None, decoded from ``raw`` if asked.
        ValueError when both are missing."""
        if value is None and not raw:
            raise ValueError("an entry needs its value, decoded or encoded")
        self.key = key
        self._value = value
        self.raw = raw
        self._due: codec.DueKey | None = None

    @property
    def value(self) -> IndexValue:
        """The index value: the request's fingerprint, id and target."""
        value = self._value
        if value is None:
            value = self._value = codec.decode_index_value(self.raw)
        return value

    @property
    def due(self) -> codec.DueKey:
        """The key decoded: due time, request partition, request offset."""
        due = self._due
        if due is None:
            due = self._due = codec.decode_due_key(self.key)
        return due

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return self.key == other.key and self.value == other.value

    def __repr__(self) -> str:
        return f"Entry(key={self.key!r}, value={self.value!r})"


class FreshPuts:
    """Puts of keys certainly not in the store, as intake plans a batch's usual requests.

    Requests without an id read for the first time: their due keys are new,
    so neither the index nor the tally looks them up. Keys and encoded values
    are kept side by side, no object a request, together with the least and
    greatest due time and request timestamp of the entries, so the tally
    counts a batch whose due times (and slacks) fall in one minute without a
    pass over it. Every key names request partition ``origin``. Treated as
    append-only: readers keep :attr:`keys` without copying it.
    """

    def __init__(self, origin: int = 0) -> None:
        self.origin = origin
        self.keys: list[bytes] = []
        self.values: list[bytes] = []
        self.first_due = self.last_due = self.oldest = self.newest = 0

    def add(self, key: bytes, value: bytes, due_ms: int, timestamp_ms: int) -> None:
        """Add the put of ``key`` (a due key of :attr:`origin`, due at ``due_ms``) with its
        encoded index value ``value``, whose request timestamp is ``timestamp_ms``."""
        keys = self.keys
        if not keys:
            self.first_due = self.last_due = due_ms
            self.oldest = self.newest = timestamp_ms
        else:
            if due_ms < self.first_due:
                self.first_due = due_ms
            elif due_ms > self.last_due:
                self.last_due = due_ms
            if timestamp_ms < self.oldest:
                self.oldest = timestamp_ms
            elif timestamp_ms > self.newest:
                self.newest = timestamp_ms
        keys.append(key)
        self.values.append(value)

    def extremes(self) -> tuple[int, int, int, int]:
        """The least and greatest due time, then the least and greatest request timestamp
        (all 0 when empty)."""
        return self.first_due, self.last_due, self.oldest, self.newest

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FreshPuts):
            return NotImplemented
        return self.keys == other.keys and self.values == other.values  # keys tell the origin

    def __repr__(self) -> str:
        return f"FreshPuts(origin={self.origin}, keys={self.keys!r})"


@dataclass(slots=True)
class Changes:
    """Writes for one partition's store, applied atomically by :meth:`PartitionIndex.apply`."""

    puts: list[Entry] = field(default_factory=list)
    # Puts of keys certainly not in the store, no Entry each (intake's usual requests).
    fresh: FreshPuts = field(default_factory=FreshPuts)
    # Already encoded index values (changelog replay): written as they are.
    raw_puts: dict[bytes, bytes] = field(default_factory=dict)
    deletes: list[bytes] = field(default_factory=list)
    ids: dict[str, IdState | None] = field(default_factory=dict)
    # Expiry keys (see :func:`codec.encode_expiry_key`) to delete: markers dropped.
    expired: list[bytes] = field(default_factory=list)
    consumed: int | None = None
    changelog: int | None = None
    # The partition's new watermark, once written to the changelog (or replayed).
    watermark: Watermark | None = None
    # Keys done under the watermark whose puts still await a changelog tombstone,
    # and the sweep chunks whose tombstones are written (see :meth:`PartitionIndex.unswept`).
    swept: list[bytes] = field(default_factory=list)
    unswept: list[bytes] = field(default_factory=list)
    # The encoded values of deleted keys the caller knows to be in the store (read
    # by a scan, untouched since): their tally needs no lookup.
    known: dict[bytes, bytes] = field(default_factory=dict)
    # Or the encoded value of each of ``deletes``, in order, when the caller knows every
    # one and ``deletes`` are in strictly increasing key order (delivery's seal of a
    # burst: no dict entry a record, the extremes at the ends).
    deleted_values: list[bytes] | None = None
    # Put keys certainly not in the store (requests read for the first time): their
    # tally needs no lookup either.
    absent: set[bytes] = field(default_factory=set)
    # Slices ``deletes[start:end]`` that were every key of the store in their range
    # when read, at ``puts_seen`` (see ``Scan``): each is deleted as one range unless
    # a put since fell inside it.
    ranges: list[tuple[int, int, int]] = field(default_factory=list)

    def encoded_puts(self) -> dict[bytes, bytes]:
        """The puts by key, values encoded (a raw put wins over an entry, and an entry
        over a fresh put)."""
        new = dict(zip(self.fresh.keys, self.fresh.values, strict=True))
        new.update({e.key: e.raw or codec.encode_index_value(e.value) for e in self.puts})
        new.update(self.raw_puts)
        return new

    def put_fields(self) -> tuple[list[bytes], list[bytes]]:
        """The keys and encoded values of :attr:`puts` and :attr:`fresh` (not ``raw_puts``),
        entries first, side by side. Fresh puts alone come as their own lists, not copied;
        the order is the same on every call."""
        fresh = self.fresh
        if not self.puts:
            return fresh.keys, fresh.values
        return ([*(e.key for e in self.puts), *fresh.keys],
                [*(e.raw or codec.encode_index_value(e.value) for e in self.puts),
                 *fresh.values])

    def entries(self) -> list[Entry]:
        """:attr:`puts` and then :attr:`fresh` as entries (values decoded when asked)."""
        fresh = self.fresh
        return [*self.puts, *(Entry(key, None, raw)
                              for key, raw in zip(fresh.keys, fresh.values, strict=True))]

    def __bool__(self) -> bool:
        return bool(self.puts or self.fresh.keys or self.raw_puts or self.deletes or self.ids
                    or self.expired or self.swept or self.unswept) or (
            self.consumed is not None or self.changelog is not None
            or self.watermark is not None
        )


def collect(items: Iterator[tuple[bytes, bytes]], skip: Container[bytes], limit: int,
            keys: list[bytes], values: list[bytes],
            shelved: Callable[[bytes, bytes], bool] | None = None,
            ) -> tuple[int, bytes, bytes, bytes]:
    """Append the ``items`` not in ``skip`` to ``keys`` and ``values``, up to ``limit``.

    The loop of :meth:`~kdelay.state.index.PartitionIndex.scan_raw`, compiled
    with the hot path. An item that ``shelved`` answers True for, given its key
    and encoded value
    (a target that a control holds back enough of) is passed over too, and
    counts as a gap like a key in ``skip``. Returns how many keys were appended
    when the first key was passed over after them (-1: none was), the first key
    read (b"": none), and the first and the last key ``shelved`` passed over
    (b"": none).
    """
    gap = -1
    first = b""
    shelf_first = b""
    shelf_last = b""
    for key, raw in items:
        if not first:
            first = key
        if key in skip:
            if keys and gap < 0:
                gap = len(keys)
            continue
        if shelved is not None and shelved(key, raw):
            if keys and gap < 0:
                gap = len(keys)
            if not shelf_first:
                shelf_first = key
            shelf_last = key
            continue
        keys.append(key)
        values.append(raw)
        if len(keys) >= limit:
            break
    return gap, first, shelf_first, shelf_last


def put_all(put: Callable[[bytes, bytes], None], entries: dict[bytes, bytes]) -> None:
    """Put every entry with ``put`` (a write batch's): the loop runs compiled here."""
    for key, raw in entries.items():
        put(key, raw)


def put_each(put: Callable[[bytes, bytes], None], keys: list[bytes],
             values: list[bytes]) -> None:
    """Put ``keys[i]`` with ``values[i]`` with ``put``, as :func:`put_all` does a dict."""
    for key, raw in zip(keys, values, strict=True):
        put(key, raw)
