"""The memory of a store that the changelog can rebuild: an operator's copy, not the service's.

The service's stores are tuned for write throughput and durability: memtables
of 64 MB per column family, RocksDB's own block cache per column family, and a
write-ahead log. A copy that a command or the console keeps of the changelog
(:class:`~kdelay.view.pending.PendingView`) needs none of that: it is written
only by replaying the changelog, and a copy lost in a crash is replayed again.
A :class:`StoreBudget` bounds such a copy's memory instead, whatever the backlog:

- it is a :class:`~kdelay.state.memory.StoreMemory` (one block cache that
  holds the index and filter blocks too, one write buffer manager for every
  memtable), with small sizes: 8 MB each by default;
- no write-ahead log: column families flush together (atomic flush), so a crash
  leaves a store at a consistent earlier changelog offset, from which the next
  sync replays on;
- the restore consumer fetches and queues little (:meth:`fetch`): librdkafka's
  own queue of a few hundred thousand small changelog records, with its
  per-record overhead and the fetch buffers they hold, took 80 MB of the
  console's peak at 1 M pending.

One budget is shared by every store of a copy: open them all with the same object.
"""

from __future__ import annotations

from typing import Any, cast

from rocksdict import WriteOptions

from kdelay.state.memory import StoreMemory

MIB = 1024 * 1024
QUEUED_RECORDS = 20_000
"""Changelog records a restore consumer keeps queued: two of the restore's takes."""


class StoreBudget(StoreMemory):
    """Memory bounds shared by the stores of an operator's copy (see the module)."""

    def __init__(self, *, memtables_bytes: int = 8 * MIB, cache_bytes: int = 8 * MIB,
                 fetch_kbytes: int = 2 * 1024) -> None:
        super().__init__(cache_bytes, memtables_bytes)
        self.fetch_kbytes = fetch_kbytes
        # A copy is written in bulk by a restore (many level-0 files at once) and then
        # read: pinned, their filter and index blocks outgrew the cache (14 MB pinned in
        # an 8 MB cache at 10 M pending), and a copy's reads need them rarely.
        self.pin_l0 = False

    def write_options(self) -> WriteOptions:
        """Writes without the write-ahead log (see the module)."""
        options = WriteOptions()
        # A property at run time, though rocksdict's stubs call it a method.
        cast(Any, options).disable_wal = True
        return options

    def originals(self) -> dict[str, str | int | bool]:
        """Settings of a reader of originals (:class:`~kdelay.view.pending.Originals`)
        that bound its fetches and queue to this budget, as :meth:`fetch` does."""
        kbytes = max(self.fetch_kbytes, 2_048)
        return {"queued.max.messages.kbytes": kbytes, "fetch.max.bytes": kbytes * 1024 // 2}

    def fetch(self) -> dict[str, str | int | bool]:
        """Consumer settings that bound a restore's fetches and queue to this budget:
        ``fetch_kbytes`` queued (at least 2 048: a fetch holds one largest message) and
        :data:`QUEUED_RECORDS` records, a couple of the restore's takes.

        The queue's caps are reached often at this size, so the next fetch must not
        wait librdkafka's default 1 s back-off for it to drain.
        """
        kbytes = max(self.fetch_kbytes, 2_048)
        return {"queued.max.messages.kbytes": kbytes, "queued.min.messages": QUEUED_RECORDS,
                "fetch.max.bytes": kbytes * 1024 // 2,
                "max.partition.fetch.bytes": kbytes * 1024 // 2,
                "fetch.queue.backoff.ms": 5}
