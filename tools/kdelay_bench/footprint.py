"""Scenario ``footprint``: bytes on disk per pending entry, kdelay against payload-copy.

The same synthetic requests (due times spread over an hour, sequential
offsets, random values) are stored twice: through
:meth:`kdelay.state.index.PartitionIndex.apply`, kdelay's own write path (due key ->
fingerprint), and the payload-copy way many delay services use (due key ->
the whole record: target, key, headers, value) in a rocksdict store with the
same options. Both are flushed and fully compacted before their SST files are
measured. Values are random bytes, so compression cannot help payload-copy.
"""

from __future__ import annotations

import random
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rocksdict import AccessType, Options, Rdict, WriteBatch

from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import PartitionIndex
from kdelay_bench.load import request_headers
from kdelay_bench.progress import Progress, say
from kdelay_bench.report import Result

BASE_MS = 1_760_000_000_000
SPREAD_MS = 3_600_000
CHUNK = 10_000
TARGET = "orders"
_FRAME = struct.Struct(">I")


def _options() -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    return options


def _requests(count: int, value_size: int, seed: int = 5) -> Iterator[tuple[bytes, int, bytes]]:
    """Yield ``(due key, crc, value)`` of ``count`` requests of partition 0."""
    rng = random.Random(seed)
    for offset in range(count):
        value = rng.randbytes(value_size)
        key = codec.encode_due_key(BASE_MS + rng.randrange(SPREAD_MS), 0, offset)
        yield key, codec.fingerprint(f"k{offset}".encode(), value, BASE_MS).crc, value


def _frame(*parts: bytes) -> bytes:
    return b"".join(_FRAME.pack(len(p)) + p for p in parts)


def _payload_record(offset: int, value: bytes, due_key: bytes) -> bytes:
    """The whole request as a payload-copy store keeps it."""
    due_ms = codec.decode_due_key(due_key).due_ms
    headers = b"".join(_frame(k.encode(), v if isinstance(v, bytes) else b"")
                       for k, v in request_headers(TARGET, due_ms))
    return _frame(TARGET.encode(), f"k{offset}".encode(), headers, value)


def _fill_index(path: Path, count: int, value_size: int) -> None:
    index = PartitionIndex(path, 0)
    progress = Progress(f"footprint index {value_size} B", count)
    try:
        changes = Changes()
        for offset, (key, crc, _) in enumerate(_requests(count, value_size)):
            changes.puts.append(Entry(key, IndexValue(Fingerprint(BASE_MS, crc), None, TARGET)))
            if len(changes.puts) >= CHUNK:
                changes.consumed = offset + 1
                index.apply(changes)
                changes = Changes()
                progress.update(offset)
        index.apply(changes)
    finally:
        index.close()


def _fill_payload(path: Path, count: int, value_size: int) -> None:
    db = Rdict(str(path), _options())
    progress = Progress(f"footprint payload-copy {value_size} B", count)
    try:
        batch = WriteBatch(raw_mode=True)
        for offset, (key, _, value) in enumerate(_requests(count, value_size)):
            batch.put(key, _payload_record(offset, value, key))
            if len(batch) >= CHUNK:
                db.write(batch)
                batch = WriteBatch(raw_mode=True)
                progress.update(offset)
        db.write(batch)
    finally:
        db.close()


def compacted_sst_bytes(path: Path) -> int:
    """Flush and fully compact every column family of the store at ``path``; return the
    total size of its live SST files."""
    names = [n for n in Rdict.list_cf(str(path), _options()) if n != "default"]
    db = Rdict(str(path), _options(), column_families={n: _options() for n in names},
               access_type=AccessType.read_write())
    try:
        families = [db.get_column_family(name) for name in names]
        for handle in [db, *families]:
            handle.flush()
            handle.compact_range(None, None)
        for family in families:
            family.close()
        return sum(int(f["size"]) for f in db.live_files())
    finally:
        db.close()


def run_footprint(work_dir: Path, count: int, value_sizes: tuple[int, ...]) -> list[Result]:
    """Measure both layouts for every value size; one result per size."""
    return [_one(work_dir, count, size) for size in value_sizes]


def _one(work_dir: Path, count: int, value_size: int) -> Result:
    root = Path(tempfile.mkdtemp(prefix=f"footprint-{value_size}-", dir=work_dir))
    say(f"footprint: {count:,} entries, {value_size} B values")
    _fill_index(root / "index", count, value_size)
    _fill_payload(root / "payload", count, value_size)
    index = compacted_sst_bytes(root / "index") / count
    payload = compacted_sst_bytes(root / "payload") / count
    shutil.rmtree(root, ignore_errors=True)
    result = Result(f"footprint {value_size} B", {
        "entries": count, "value_bytes": value_size, "index_bytes_per_entry": round(index, 2),
        "payload_copy_bytes_per_entry": round(payload, 1),
        "ratio": round(payload / index, 1)})
    result.check("<= 24 B per pending entry", round(index, 2), index <= 24)
    if value_size >= 1_000:
        result.check(">= 30x less than payload-copy", round(payload / index, 1),
                     payload / index >= 30)
    return result
