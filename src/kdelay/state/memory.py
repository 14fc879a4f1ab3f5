"""The memory RocksDB may use for the local indexes, and where it goes.

Every store a process opens (one per request partition) shares one
:class:`StoreMemory`: one LRU block cache that holds data blocks *and* the
index and filter blocks (so they do not grow outside any bound with the
number of entries: at 100 M entries the bloom filters alone are 125 MB), and
one write buffer manager that bounds the memtables of every column family of
every store together. What RocksDB holds is then about
``cache_bytes + write_buffer_bytes`` whatever the pending count, plus the
small top-level index and filter partitions pinned in the cache.

Filters and indexes are partitioned (two-level): a lookup reads only the
partition it needs, and the cache can evict the rest. Files are compressed
with ZSTD, level 0 too: measured on 1 M entries with a target name, 14 B an
entry closed against LZ4's 23, for 0.1 us more CPU an entry written (every
entry is compressed with ZSTD anyway once compacted to the bottom level, 9.5 B
an entry). Keys share prefixes within a block (due time and partition).

:meth:`StoreMemory.usage` reads where the memory goes (RocksDB's
``rocksdb.*`` properties) for the metrics and ``kdelay stats``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from rocksdict import (
    BlockBasedIndexType,
    BlockBasedOptions,
    Cache,
    DBCompressionType,
    Options,
    WriteBufferManager,
    WriteOptions,
)

MB = 1 << 20
DEFAULT_CACHE_MB = 256
DEFAULT_WRITE_BUFFER_MB = 128
# One memtable of a column family; the manager flushes the largest when all of
# them together pass its budget, so many partitions never hold 64 MB each.
MEMTABLE_BYTES = 16 * MB
# The due index's memtable while a restore writes a store (PartitionIndex.bulk): each
# fills and flushes (atomically, every column family) in the background as the
# restore goes on, and the flush that ends the restore, which the partition waits
# for, holds no more than this.
BULK_MEMTABLE_BYTES = 4 * MB
BLOCK_BYTES = 16 * 1024
BLOOM_BITS_PER_KEY = 10
BLOOM_MEMTABLE_RATIO = 0.02  # of a memtable: 13 bits a key when full

# The RocksDB properties :meth:`StoreMemory.usage` sums, by the part they measure.
TABLE_READERS = "rocksdb.estimate-table-readers-mem"
MEMTABLES = "rocksdb.cur-size-all-mem-tables"
PINNED = "rocksdb.block-cache-pinned-usage"


class PropertyReader(Protocol):
    """What :meth:`StoreMemory.usage` reads: a store's or column family's int properties."""

    def property_int_value(self, name: str) -> int | None:
        """The value of a RocksDB integer property, None if unknown."""
        ...


@dataclass(frozen=True, slots=True)
class Usage:
    """Where RocksDB's memory goes, in bytes, summed over the stores read.

    ``block_cache`` is the shared cache's usage (data, index and filter
    blocks; ``pinned`` of it cannot be evicted); ``memtables`` the write
    buffers; ``table_readers`` what open files hold outside the cache (index
    and filter blocks not cached: small with these options).
    """

    block_cache: int
    pinned: int
    memtables: int
    table_readers: int
    cache_capacity: int
    write_buffer_budget: int

    @property
    def total(self) -> int:
        """Every byte counted: the cache, the memtables and the table readers."""
        return self.block_cache + self.memtables + self.table_readers


class StoreMemory:
    """The block cache and write buffer manager every store of a process shares.

    ``cache_bytes`` bounds the block cache (data, index and filter blocks);
    ``write_buffer_bytes`` bounds the memtables of all stores together. Raises
    ValueError for a budget below 1 MB.
    """

    def __init__(self, cache_bytes: int = DEFAULT_CACHE_MB * MB,
                 write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_MB * MB) -> None:
        if cache_bytes < MB or write_buffer_bytes < MB:
            raise ValueError("the RocksDB cache and write buffers need at least 1 MB each, "
                             f"got {cache_bytes} and {write_buffer_bytes} bytes")
        self.cache_bytes = cache_bytes
        self.write_buffer_bytes = write_buffer_bytes
        self.cache = Cache(cache_bytes)
        self.write_buffers = WriteBufferManager(write_buffer_bytes, False)
        self.pin_l0 = True
        """Whether the index and filter blocks of level-0 files stay pinned in the cache."""

    def options(self, looked_up: bool = False) -> Options:
        """A column family's options on the shared budget; ``looked_up`` adds bloom filters
        (memtables and files) for one looked up for keys mostly absent (each put's tally
        lookup, each new id's): a miss 0.6 us, not 1.2."""
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.create_missing_column_families(True)
        options.set_write_buffer_manager(self.write_buffers)
        options.set_write_buffer_size(self.memtable_bytes())
        options.set_compression_type(DBCompressionType.zstd())
        options.set_bottommost_compression_type(DBCompressionType.zstd())
        options.set_level_compaction_dynamic_level_bytes(True)
        table = BlockBasedOptions()
        table.set_block_cache(self.cache)
        table.set_block_size(BLOCK_BYTES)
        table.set_format_version(5)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(self.pin_l0)
        table.set_pin_top_level_index_and_filter(True)
        table.set_index_type(BlockBasedIndexType.two_level_index_search())
        if looked_up:
            options.set_memtable_prefix_bloom_ratio(BLOOM_MEMTABLE_RATIO)
            options.set_memtable_whole_key_filtering(True)
            table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
            table.set_partition_filters(True)
        options.set_block_based_table_factory(table)
        return options

    def memtable_bytes(self, bulk: bool = False) -> int:
        """The size of a column family's memtable; with ``bulk``, of the due index's while
        a restore writes it (:data:`BULK_MEMTABLE_BYTES`)."""
        return min(BULK_MEMTABLE_BYTES if bulk else MEMTABLE_BYTES, self.write_buffer_bytes)

    def store_options(self) -> Options:
        """The options of a store and its default column family (the due index, looked
        up): flushes are atomic across the column families, so a store written
        without its write-ahead log (a restore, :meth:`PartitionIndex.bulk`)
        that a crash interrupts holds a consistent prefix of its writes."""
        options = self.options(looked_up=True)
        options.set_atomic_flush(True)
        return options

    def write_options(self) -> WriteOptions | None:
        """The stores' write options: None, RocksDB's own (with the write-ahead log)."""
        return None

    def usage(self, stores: Iterable[PropertyReader]) -> Usage:
        """Sum where the memory of ``stores`` (every column family of every store) goes."""
        memtables = table_readers = 0
        for store in stores:
            memtables += store.property_int_value(MEMTABLES) or 0
            table_readers += store.property_int_value(TABLE_READERS) or 0
        return Usage(self.cache.get_usage(), self.cache.get_pinned_usage(), memtables,
                     table_readers, self.cache_bytes, self.write_buffer_bytes)


_shared: list[StoreMemory] = []


def shared() -> StoreMemory:
    """The process's default budget (:data:`DEFAULT_CACHE_MB`, :data:`DEFAULT_WRITE_BUFFER_MB`),
    for stores opened without one: tools, tests, views."""
    if not _shared:
        _shared.append(StoreMemory())
    return _shared[0]
