"""Microbenchmarks of the per-record work delivery and intake do in the state rooms.

No broker: one :class:`~kdelay.state.index.PartitionIndex` in a temporary
directory, with ``kdelay run``'s garbage-collector settings. Per record, in
µs of this thread's CPU: ``apply_puts`` (intake's index write: encoded
entries, tally multi-get and counts, one ``WriteBatch`` per 1 000),
``scan`` (delivery's read-ahead, 1 000 entries a scan from a cursor) and
``apply_deletes`` (delivery's index deletes of what each scan returned, as
delivery interleaves them), and ``book``
(hold, send and drop a job in :class:`~kdelay.engine.book.Book`). Run as
``python -m kdelay_bench.hotpath [--records N] [--repeats R]``; the best of R
repeats is printed, since a shared machine only ever adds time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kdelay.engine.book import Book, Job
from kdelay.engine.runner import tune_gc
from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.state.index import Changes, Entry, PartitionIndex
from kdelay.state.originals import Missing

BATCH = 1_000
BASE_MS = 1_800_000_000_000


def _entries(count: int) -> list[Entry]:
    """``count`` entries, 50 to a due millisecond, as intake builds them (raw given)."""
    out = []
    for i in range(count):
        value = IndexValue(Fingerprint(BASE_MS - 5_000 + i, i & 0xFFFF), None)
        out.append(Entry(codec.encode_due_key(BASE_MS + i // 50, 0, i), value,
                         codec.encode_index_value(value)))
    return out


def _timed(work: Callable[[], int]) -> float:
    """Return µs of thread CPU per record that ``work`` reports handling."""
    start = time.thread_time()
    records = work()
    return (time.thread_time() - start) * 1e6 / max(records, 1)


def run_once(count: int) -> dict[str, float]:
    """Measure each part once over ``count`` records; return µs per record by part."""
    entries = _entries(count)
    index = PartitionIndex(Path(tempfile.mkdtemp(prefix="hotpath-")) / "p0", 0)
    scans: list[list[Entry]] = []

    def puts() -> int:
        for s in range(0, count, BATCH):
            index.apply(Changes(puts=entries[s:s + BATCH]))
        return count

    def scan_and_delete() -> tuple[float, float]:
        """Return the thread CPU seconds of the scans and of the deletes."""
        cursor, scanning, deleting = None, 0.0, 0.0
        while True:
            start = time.thread_time()
            found = index.scan(BASE_MS + count, BATCH, skip=(), start=cursor)
            scanning += time.thread_time() - start
            if not found:
                return scanning, deleting
            cursor = found[-1].key + b"\x00"
            scans.append(found)
            start = time.thread_time()
            index.apply(Changes(deletes=[e.key for e in found]))
            deleting += time.thread_time() - start

    jobs: list[Job] = []

    def book() -> int:
        held = Book()
        for s in range(0, len(jobs), BATCH):
            for job in jobs[s:s + BATCH]:
                held.hold(job)
            while (ready := held.next_to_send()) is not None:
                held.sent(ready)
            for job in jobs[s:s + BATCH]:
                held.drop(job.key)
        return len(jobs)

    try:
        times = {"apply_puts": _timed(puts)}
        scanning, deleting = scan_and_delete()
        times["scan"], times["apply_deletes"] = scanning * 1e6 / count, deleting * 1e6 / count
        jobs.extend(Job(e, Missing.ABSENT, 0) for found in scans for e in found)
        times["book"] = _timed(book)
        return times
    finally:
        index.close()


def main(argv: list[str] | None = None) -> int:
    """Print the best µs per record of each part over the repeats."""
    p = argparse.ArgumentParser(prog="python -m kdelay_bench.hotpath")
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    tune_gc()
    runs = [run_once(args.records) for _ in range(args.repeats)]
    best = {part: min(run[part] for run in runs) for part in runs[0]}
    print("  ".join(f"{part} {us:.2f}" for part, us in best.items()), "(µs per record, best of "
          f"{args.repeats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
