"""Microbenchmarks of the per-record work of delivery and intake, without a broker.

One :class:`~kdelay.state.index.PartitionIndex` in a temporary directory, with
``kdelay run``'s garbage-collector settings. Per record, in µs of this
thread's CPU: ``plan`` (intake's planner over batches of 1 000 request
records: headers parsed, fingerprints, keys and index values encoded, the
changelog records built; no produce), ``apply_puts`` (intake's index write of
its fresh puts: keys and encoded values, the tally counted from their extremes,
one ``WriteBatch`` per 1 000), ``scan`` (delivery's
read-ahead: 1 000 keys and values a scan from a cursor, the keys decoded to
fetch their originals), ``send`` (the
sender's hot loop over a run slice: fingerprint check, headers, one
``produce`` to a real producer whose broker never answers, so the records
only queue) and ``seal`` (what settling a landed batch costs: the seal and
its index write, deletes counted from the values the scan read, each run
read whole leaving the index as one range, as a burst's do). The figures
are what the loop itself spends per record; a run against a broker adds
librdkafka's threads, the delivery reports and the reads of originals. Run as
``python -m kdelay_bench.hotpath [--records N] [--repeats R]``; the best of R
repeats is printed, since a shared machine only ever adds time. With
``KDELAY_PURE_PYTHON=1`` the hot path runs interpreted, else compiled if built.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import TIMESTAMP_CREATE_TIME, KafkaError, Message, Producer

from kdelay import native
from kdelay.engine.delivery._book import Book, Job
from kdelay.engine.delivery._controls import Controls
from kdelay.engine.delivery._failures import TopicCheck
from kdelay.engine.delivery._flights import Flight
from kdelay.engine.delivery._runs import Run
from kdelay.engine.delivery._sealing import Marks, landed_runs, seal_of
from kdelay.engine.delivery._sender import Routes, Sender
from kdelay.engine.intake import IdWindow, Planner, Topics
from kdelay.engine.runner import tune_gc
from kdelay.plumbing.clock import SystemClock
from kdelay.protocol import codec, durations, envelope
from kdelay.protocol.codec import IndexValue
from kdelay.protocol.controls import Subject
from kdelay.protocol.envelope import Headers
from kdelay.protocol.targets import TargetPolicy
from kdelay.state.changes import Changes, Entry, FreshPuts
from kdelay.state.index import PartitionIndex
from kdelay.state.originals import Found

BATCH = 1_000
BASE_MS = 1_800_000_000_000
REQUESTS = "bench.requests"
TARGET = "bench.target"
VALUE = bytes(range(100))


def _originals(count: int) -> list[Message]:
    """``count`` request records as a producer of the bench writes them."""
    headers: Headers = [(envelope.TARGET, TARGET.encode()),
                        (envelope.DUE_MS, str(BASE_MS).encode())]
    return [Message(topic=REQUESTS, partition=0, offset=i, key=f"k{i}".encode(), value=VALUE,
                    headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, BASE_MS - 5_000))
            for i in range(count)]


def _entries(originals: list[Message]) -> list[Entry]:
    """The index entries of ``originals``, 50 to a due millisecond (raw values given)."""
    out = []
    for i, message in enumerate(originals):
        value = IndexValue(codec.fingerprint_of(message), None, TARGET)
        out.append(Entry(codec.encode_due_key(BASE_MS + i // 50, 0, i), value,
                         codec.encode_index_value(value)))
    return out


def _fresh(entries: list[Entry]) -> FreshPuts:
    """``entries`` as intake plans them: fresh puts of request partition 0."""
    fresh = FreshPuts(0)
    for e in entries:
        fresh.add(e.key, e.raw, e.due.due_ms, e.value.fingerprint.timestamp_ms)
    return fresh


def _timed(work: Callable[[], int]) -> float:
    """Return µs of thread CPU per record that ``work`` reports handling."""
    start = time.thread_time()
    records = work()
    return (time.thread_time() - start) * 1e6 / max(records, 1)


def _sender(producer: Producer) -> Sender:
    """A sender producing with ``producer``, every topic known to exist."""
    topics = TopicCheck(producer, SystemClock())
    topics._known[TARGET] = (float("inf"), None)  # no metadata request
    return Sender(REQUESTS, "bench.dlq", producer, producer,
                  TargetPolicy((REQUESTS, "bench.changelog", "bench.dlq"), ()), topics, set(),
                  _NeverTaken(), lambda: False, Controls())


class _NeverTaken:
    """The bench's runs need no care: an entry taken out is a broken bench."""

    def take_out(self, run: Run, at: int, flight: Flight | None = None,
                 refused: KafkaError | None = None) -> Job:
        raise AssertionError(f"entry {at} of the bench's run was taken out")

    def hold_back(self, job: Job, subject: Subject) -> None:
        raise AssertionError(f"{job.key!r} held back by {subject}: the bench has no controls")


def run_once(count: int) -> dict[str, float]:
    """Measure each part once over ``count`` records; return µs per record by part."""
    originals = _originals(count)
    entries = _entries(originals)
    batches = [_fresh(entries[s:s + BATCH]) for s in range(0, count, BATCH)]
    index = PartitionIndex(Path(tempfile.mkdtemp(prefix="hotpath-")) / "p0", 0)
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "linger.ms": 60_000,
                         "queue.buffering.max.messages": count + 1,
                         "queue.buffering.max.kbytes": 2_000_000, "log_level": 0})
    runs: list[Run] = []
    planner = Planner(Topics(REQUESTS, "bench.changelog", "bench.dlq"),
                      durations.limits_for_retention(
                          None, 0, durations.parse_levels(durations.DEFAULT_LEVELS)),
                      index.id_state, lambda _: False, None, None,
                      IdWindow(3_600_000, SystemClock(), index))

    def plan() -> int:
        for s in range(0, count, BATCH):
            planner.done(planner.plan(0, originals[s:s + BATCH]))
        return count

    def puts() -> int:  # as intake's: requests read the first time, fresh puts
        for fresh in batches:
            index.apply(Changes(fresh=fresh))
        return count

    def scan() -> int:
        cursor = None
        while True:
            keys, values, gapless, seen, _, _ = index.scan_raw(BASE_MS + count, BATCH, start=cursor)
            if not keys:
                return count
            cursor = codec.key_after(keys[-1])
            first = len(runs) * BATCH
            found: list[Found] = list(originals[first:first + len(keys)])
            # Decoded as the read-ahead does, to fetch the originals.
            runs.append(Run(0, keys, values, found, gapless=gapless, puts_seen=seen,
                            fields=codec.due_key_fields(b"".join(keys))))

    def send() -> int:
        sender, routes, now = _sender(producer), Routes(), BASE_MS + count
        for run in runs:
            flight = Flight(run, 0, 0)
            if not sender.slice(run, 0, len(run.keys), now, flight, routes):
                raise AssertionError("the producer's queue filled up")
            run.landed = run.sent
        return count

    def seal() -> int:
        marks = Marks.of(None, [])
        for run in runs:
            item = seal_of(0, landed_runs([run]), [], marks, codec.key_after(run.keys[-1]),
                           Book().jobs_of(0), BASE_MS)
            index.apply(item.changes)
            marks.written(item.cover, item.done)
        return count

    try:
        return {"plan": _timed(plan), "apply_puts": _timed(puts), "scan": _timed(scan),
                "send": _timed(send), "seal": _timed(seal)}
    finally:
        producer.purge()
        producer.flush(0)
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
          f"{args.repeats}; hot path {native.mode})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
