"""Intake and burst of a real ``kdelay run --workers N`` subprocess, for N in ``--workers``.

``tools/bench`` runs the service in-process on a manual clock, which cannot
measure worker processes; this script starts the ``kdelay`` command as an
operator does and reads every figure from outside: record counts from each
worker's ``/metrics`` endpoint (``--metrics-port + i``), CPU time of the
worker processes from ``/proc``.

- intake: N requests due in an hour are pre-produced; the rate counts from
  the moment every worker has its partitions (and the records read by then)
  to the moment all are indexed.
- burst: N requests due at one instant are pre-produced and indexed before it;
  the rate is N over the time from the due instant to the last delivery
  (``kdelay_delivered_records``, counted when the target acknowledged), with
  how many were delivered within 1 s and 5 s of the instant.

Usage: ``KDELAY_BOOTSTRAP_SERVERS=host:port .venv/bin/python tools/bench_workers.py
--count 200000 --workers 1 2``. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from kdelay_bench.load import produce_requests

KDELAY = str(Path(sys.executable).parent / "kdelay")
STARTED = re.compile(r"worker \d started \(pid (\d+)\)")
ASSIGNED = re.compile(r"\[([^\]]+)\] INFO kdelay\.engine\.service: assigned \[\d")
TICKS = os.sysconf("SC_CLK_TCK")
HOUR_MS = 3_600_000
READ_AHEAD_S = 3.0  # the default --lookahead-ms (2 s) and a margin: burst CPU counts from here


@dataclass
class Run:
    """One ``kdelay run`` subprocess on fresh topics, started on creation."""

    env: dict[str, str]
    workers: int
    port: int
    log: Path
    popen: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                [KDELAY, "run", "--workers", str(self.workers), "--metrics-port",
                 str(self.port)], env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def ready(self) -> bool:
        return len(set(ASSIGNED.findall(self.text()))) >= self.workers

    def pids(self) -> list[int]:
        if self.workers == 1:
            return [self.popen.pid]
        return [int(pid) for pid in STARTED.findall(self.text())]

    def cpu_s(self) -> float:
        """User + system CPU seconds of the serving processes so far."""
        total = 0
        for pid in self.pids():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / TICKS

    def counter(self, name: str) -> float:
        """Sum of a counter over every worker's endpoint."""
        total = 0.0
        for i in range(self.workers):
            url = f"http://127.0.0.1:{self.port + i}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                for line in response.read().decode().splitlines():
                    if line.startswith(name):
                        total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout=120)


def deploy(bootstrap: str, partitions: int, work: Path, role: str) -> tuple[dict[str, str], str]:
    """Fresh kdelay topics and a target topic; the environment of a service on them."""
    suffix = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDELAY_")}
    env.update({"KDELAY_BOOTSTRAP_SERVERS": bootstrap,
                "KDELAY_REQUESTS_TOPIC": f"bw-{role}-req-{suffix}",
                "KDELAY_CHANGELOG_TOPIC": f"bw-{role}-chg-{suffix}",
                "KDELAY_DLQ_TOPIC": f"bw-{role}-dlq-{suffix}",
                "KDELAY_GROUP_ID": f"bw-{role}-{suffix}",
                "KDELAY_STATE_DIR": tempfile.mkdtemp(prefix=f"{role}-", dir=work)})
    subprocess.run([KDELAY, "topics", "create", "--partitions", str(partitions)], env=env,
                   check=True, capture_output=True)
    target = f"bw-{role}-target-{suffix}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(target, partitions, 1)])[target].result(timeout=30)
    return env, target


def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` every 50 ms; stop the script after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout_s}s")
        time.sleep(0.05)


def intake(args: argparse.Namespace, workers: int, work: Path) -> dict[str, object]:
    env, target = deploy(args.bootstrap, args.partitions, work, f"intake{workers}")
    due = int(time.time() * 1000) + HOUR_MS
    produce_requests(args.bootstrap, env["KDELAY_REQUESTS_TOPIC"], target, args.count,
                     args.value_size, lambda i: due, args.partitions)
    run = Run(env, workers, args.port, work / f"intake-{workers}.log")
    until(run.ready, 120, "workers assigned")
    t0, read0, cpu0 = time.monotonic(), run.counter("kdelay_intake_records_total"), run.cpu_s()
    until(lambda: run.counter("kdelay_intake_records_total") >= args.count, 600, "intake")
    elapsed, cpu = time.monotonic() - t0, run.cpu_s() - cpu0
    code = run.stop()
    measured = args.count - read0
    return {"scenario": "intake", "workers": workers, "count": args.count,
            "measured_records": int(measured), "rate_per_s": round(measured / elapsed),
            "cpu_us_per_record": round(cpu / measured * 1e6, 1), "exit": code}


def burst(args: argparse.Namespace, workers: int, work: Path) -> dict[str, object]:
    env, target = deploy(args.bootstrap, args.partitions, work, f"burst{workers}")
    due_s = time.time() + args.lead_s
    produce_requests(args.bootstrap, env["KDELAY_REQUESTS_TOPIC"], target, args.count,
                     args.value_size, lambda i: int(due_s * 1000), args.partitions)
    run = Run(env, workers, args.port, work / f"burst-{workers}.log")
    until(run.ready, 120, "workers assigned")
    until(lambda: run.counter("kdelay_intake_records_total") >= args.count, 600, "intake")
    if time.time() > due_s - 1:
        raise SystemExit("intake did not finish a second before the due instant: raise --lead-s")
    time.sleep(max(0.0, due_s - time.time() - READ_AHEAD_S))
    cpu0 = run.cpu_s()
    marks: dict[float, float] = {}
    while (done := run.counter("kdelay_delivered_records_total")) < args.count:
        late = time.time() - due_s
        for mark in (1.0, 5.0):
            if late >= mark and mark not in marks:
                marks[mark] = done
        time.sleep(0.05)
    drain_s, cpu = time.time() - due_s, run.cpu_s() - cpu0
    code = run.stop()
    return {"scenario": "burst", "workers": workers, "count": args.count,
            "drain_s": round(drain_s, 2), "rate_per_s": round(args.count / drain_s),
            "within_1s": int(marks.get(1.0, args.count)),
            "within_5s": int(marks.get(5.0, args.count)),
            "cpu_us_per_record": round(cpu / args.count * 1e6, 1), "exit": code}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default=os.environ.get("KDELAY_BOOTSTRAP_SERVERS"))
    p.add_argument("--count", type=int, default=200_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--lead-s", type=float, default=60.0)
    p.add_argument("--port", type=int, default=19_400)
    p.add_argument("--scenarios", nargs="+", default=["intake", "burst"])
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    for workers in args.workers:
        for scenario in args.scenarios:
            figures = (intake if scenario == "intake" else burst)(args, workers, work)
            print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
