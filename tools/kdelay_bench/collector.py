"""A target consumer in its own process: what arrived, when, and how late.

Run as ``python -m kdelay_bench.collector`` by :class:`CollectorProcess`, so
that counting never competes with the service under test for the GIL. It reads
every partition of the target from the beginning (``read_committed``), and for
each record notes the wall time it was received, the due time
(``kdelay-due-ms``), the record timestamp (the service's delivery time) and
the origin (``kdelay-origin``, for duplicates). Offsets skipped by a
``read_committed`` read (``offset_gaps``) are transaction markers (or aborted
records): they show that the target was written in transactions. It stops at ``--expect``
records or at the deadline and writes one JSON summary to ``--out``, with the
CPU seconds and run-queue wait it had from "ready" to the end (``cpu_s``,
``wait_s``: see :mod:`kdelay_bench.cputime`). Records carrying the warm-up
header are counted but left out of percentiles. With ``--raw`` it also writes,
per measured record in arrival order, the receive wall time (s) and the target
timestamp minus the due time (ms) as two float64 arrays (:func:`read_raw`), so
the parent can count against an instant the collector does not know.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import time
import uuid
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

from kdelay.plumbing.clients import take
from kdelay.protocol import envelope
from kdelay_bench.broker import wait_for_topic
from kdelay_bench.cputime import Usage, read_process
from kdelay_bench.load import WARMUP
from kdelay_bench.peer import ORIGINAL_KEY
from kdelay_bench.stats import summary

RAW_HEADER = struct.Struct("<Q")


@dataclass(slots=True)
class Tally:
    """What the collector has seen so far."""

    count: int = 0
    warmup: int = 0
    early: int = 0
    first_s: float | None = None
    last_s: float | None = None
    origins: set[bytes] = field(default_factory=set)
    ends: dict[int, int] = field(default_factory=dict)
    late_ms: array[float] = field(default_factory=lambda: array("d"))
    stamp_late_ms: array[float] = field(default_factory=lambda: array("d"))
    received_s: array[float] | None = None

    def add(self, message: Message, received_s: float) -> None:
        """Account for one record received at wall time ``received_s``."""
        headers = dict(message.headers() or [])
        due = int(headers.get(envelope.DUE_MS) or 0)
        stamp = message.timestamp()[1]
        self.count += 1
        self.first_s = self.first_s or received_s
        self.last_s = received_s
        # The peer marks what it delivers with the schedule's id, where kdelay has its origin.
        origin = headers.get(envelope.ORIGIN) or headers.get(ORIGINAL_KEY) or b""
        self.origins.add(origin.encode() if isinstance(origin, str) else origin)
        self.early += stamp < due
        partition = int(message.partition() or 0)
        self.ends[partition] = max(self.ends.get(partition, 0), int(message.offset() or 0) + 1)
        if WARMUP in headers:
            self.warmup += 1
            return
        self.late_ms.append(received_s * 1000 - due)
        self.stamp_late_ms.append(float(stamp - due))
        if self.received_s is not None:
            self.received_s.append(received_s)

    def write_raw(self, path: Path) -> None:
        """Write the receive times and the stamp lateness of the measured records, in
        arrival order (see :func:`read_raw`)."""
        with path.open("wb") as out:
            out.write(RAW_HEADER.pack(len(self.stamp_late_ms)))
            (self.received_s or array("d")).tofile(out)
            self.stamp_late_ms.tofile(out)

    def as_json(self) -> dict[str, object]:
        """Return the summary the parent reads."""
        return {"count": self.count, "warmup": self.warmup, "early": self.early,
                "duplicates": self.count - len(self.origins), "first_s": self.first_s,
                "offset_gaps": sum(self.ends.values()) - self.count,
                "last_s": self.last_s, "lateness_ms": summary(list(self.late_ms)),
                "stamp_lateness_ms": summary(list(self.stamp_late_ms))}


def read_raw(path: Path) -> tuple[array[float], array[float]]:
    """Return ``(receive wall times in s, target timestamp - due in ms)`` per measured
    record, as written by a collector run with ``--raw``."""
    with path.open("rb") as raw:
        (count,) = RAW_HEADER.unpack(raw.read(RAW_HEADER.size))
        received, stamps = array("d"), array("d")
        received.fromfile(raw, count)
        stamps.fromfile(raw, count)
    return received, stamps


def collect(bootstrap: str, topic: str, expect: int, timeout_s: float, ready: IO[str],
            *, raw: bool = False, idle_s: float | None = None) -> tuple[Tally, Usage]:
    """Consume ``topic`` from the start until ``expect`` records or ``timeout_s``, or,
    with ``idle_s``, until that long has passed since the last record (once one came):
    a service that lost records would otherwise hold the run to its deadline. Return
    what was seen and this process's CPU usage from "ready" to the end."""
    partitions = wait_for_topic(bootstrap, topic)
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"bench-collector-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "isolation.level": "read_committed",
        "fetch.wait.max.ms": 10})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    tally = Tally(received_s=array("d") if raw else None)
    deadline = time.monotonic() + timeout_s
    start = read_process(os.getpid())
    print("ready", file=ready, flush=True)
    try:
        quiet_since = time.monotonic()
        while tally.count < expect and time.monotonic() < deadline:
            batch = take(consumer, 10_000, 0.05)
            received = time.time()
            for message in batch:
                if message.error() is None:
                    tally.add(message, received)
            if batch:
                quiet_since = time.monotonic()
            elif idle_s is not None and tally.count and time.monotonic() - quiet_since > idle_s:
                break
    finally:
        end = read_process(os.getpid())
        consumer.close()
    usage = end.since(start) if start and end else Usage(0.0, 0.0)
    return tally, usage


def main() -> None:
    """Entry point of the collector process."""
    p = argparse.ArgumentParser(prog="kdelay_bench.collector")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--expect", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--raw", type=Path)
    p.add_argument("--idle", type=float, help="stop this many seconds after the last record")
    args = p.parse_args()
    tally, usage = collect(args.bootstrap, args.topic, args.expect, args.timeout, sys.stdout,
                           raw=args.raw is not None, idle_s=args.idle)
    if args.raw is not None:
        tally.write_raw(args.raw)
    args.out.write_bytes(orjson.dumps({**tally.as_json(), "cpu_s": usage.cpu_s,
                                       "wait_s": usage.wait_s, "busiest": usage.busiest}))


class CollectorProcess:
    """Starts a collector process and returns its summary."""

    def __init__(self, bootstrap: str, topic: str, expect: int, timeout_s: float,
                 out: Path, *, raw: Path | None = None, idle_s: float | None = None) -> None:
        self._out = out
        self._timeout_s = timeout_s
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kdelay_bench.collector", "--bootstrap", bootstrap,
             "--topic", topic, "--expect", str(expect), "--timeout", str(timeout_s),
             "--out", str(out), *(("--raw", str(raw)) if raw else ()),
             *(("--idle", str(idle_s)) if idle_s is not None else ())],
            stdout=subprocess.PIPE, text=True)
        stdout = self._proc.stdout
        line = stdout.readline() if stdout is not None else ""
        if line.strip() != "ready":
            self._proc.kill()
            raise RuntimeError(f"collector did not start (rc={self._proc.wait()})")

    def result(self) -> dict[str, object]:
        """Wait for the collector to finish; return its summary."""
        rc = self._proc.wait(timeout=self._timeout_s + 60)
        if rc != 0:
            raise RuntimeError(f"collector failed with rc={rc}")
        summary_: dict[str, object] = orjson.loads(self._out.read_bytes())
        return summary_

    def kill(self) -> None:
        """Stop the collector if it still runs."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    main()
