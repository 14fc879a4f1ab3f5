"""The index and where it comes from: RocksDB stores, the changelog, the originals.

- :mod:`~kdelay.state.index`: one RocksDB store per request partition (due
  index, schedule ids, metadata) written in one ``WriteBatch`` per change;
- :mod:`~kdelay.state.changes`: what one such write is made of (entries put, keys deleted);
- :mod:`~kdelay.state.tally`: the exact count of pending entries, kept with the index;
- :mod:`~kdelay.state.changelog`: restoring an index from the compacted changelog;
- :mod:`~kdelay.state.originals`: reading original requests back by offset, in ranges.

The engine writes this state; the operator's view reads it (a copy of the
changelog of its own, the originals in Kafka). May import:
:mod:`kdelay.protocol`, :mod:`kdelay.plumbing`.
"""
