"""A target consumer in its own process: what arrived, when, and how late.

Run as ``python -m kdelay_bench.collector`` by :class:`CollectorProcess`, so
that counting never competes with the service under test for the GIL. It reads
every partition of the target from the beginning (``read_committed``), and for
each record notes the wall time it was received, the due time
(``kdelay-due-ms``), the record timestamp (the service's delivery time) and
the origin (``kdelay-origin``, for duplicates). Offsets skipped by a
``read_committed`` read (``offset_gaps``) are transaction markers (or aborted
records): they show that the target was written in transactions. It stops at ``--expect``
records or at the deadline and writes one JSON summary to ``--out``.
Records carrying the warm-up header are counted but left out of percentiles.
"""

from __future__ import annotations

import argparse
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

from kdelay import envelope
from kdelay.clients import take
from kdelay_bench.broker import wait_for_topic
from kdelay_bench.load import WARMUP
from kdelay_bench.stats import summary


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

    def add(self, message: Message, received_s: float) -> None:
        """Account for one record received at wall time ``received_s``."""
        headers = dict(message.headers() or [])
        due = int(headers.get(envelope.DUE_MS) or 0)
        stamp = message.timestamp()[1]
        self.count += 1
        self.first_s = self.first_s or received_s
        self.last_s = received_s
        origin = headers.get(envelope.ORIGIN) or b""
        self.origins.add(origin.encode() if isinstance(origin, str) else origin)
        self.early += stamp < due
        partition = int(message.partition() or 0)
        self.ends[partition] = max(self.ends.get(partition, 0), int(message.offset() or 0) + 1)
        if WARMUP in headers:
            self.warmup += 1
            return
        self.late_ms.append(received_s * 1000 - due)
        self.stamp_late_ms.append(float(stamp - due))

    def as_json(self) -> dict[str, object]:
        """Return the summary the parent reads."""
        return {"count": self.count, "warmup": self.warmup, "early": self.early,
                "duplicates": self.count - len(self.origins), "first_s": self.first_s,
                "offset_gaps": sum(self.ends.values()) - self.count,
                "last_s": self.last_s, "lateness_ms": summary(list(self.late_ms)),
                "stamp_lateness_ms": summary(list(self.stamp_late_ms))}


def collect(bootstrap: str, topic: str, expect: int, timeout_s: float, ready: IO[str]) -> Tally:
    """Consume ``topic`` from the start until ``expect`` records or ``timeout_s``."""
    partitions = wait_for_topic(bootstrap, topic)
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"bench-collector-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "isolation.level": "read_committed",
        "fetch.wait.max.ms": 10})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    tally = Tally()
    deadline = time.monotonic() + timeout_s
    print("ready", file=ready, flush=True)
    try:
        while tally.count < expect and time.monotonic() < deadline:
            batch = take(consumer, 10_000, 0.05)
            received = time.time()
            for message in batch:
                if message.error() is None:
                    tally.add(message, received)
    finally:
        consumer.close()
    return tally


def main() -> None:
    """Entry point of the collector process."""
    p = argparse.ArgumentParser(prog="kdelay_bench.collector")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--expect", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    tally = collect(args.bootstrap, args.topic, args.expect, args.timeout, sys.stdout)
    args.out.write_bytes(orjson.dumps(tally.as_json()))


class CollectorProcess:
    """Starts a collector process and returns its summary."""

    def __init__(self, bootstrap: str, topic: str, expect: int, timeout_s: float,
                 out: Path) -> None:
        self._out = out
        self._timeout_s = timeout_s
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kdelay_bench.collector", "--bootstrap", bootstrap,
             "--topic", topic, "--expect", str(expect), "--timeout", str(timeout_s),
             "--out", str(out)], stdout=subprocess.PIPE, text=True)
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
