"""Failover probe: how soon partitions are served again, with default settings.

Two measurements, each over ``--trials`` rounds on fresh topics, with
``kdelay run`` configured only by its defaults (no instance id, no timeouts):

- restart: an instance is killed with SIGKILL and started again at once with
  the same settings; measured from the new process's start to the moment it
  logs its partition assignment (it serves from then on);
- dead instance: two instances share the partitions, one is killed with
  SIGKILL for good; measured from the kill to the moment the survivor logs
  the assignment that includes the dead one's partitions.

Run ``tools/failover --help``. Prints a table with median and max.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import kafka_broker

ROOT = Path(__file__).resolve().parent.parent
KDELAY = ROOT / ".venv" / "bin" / "kdelay"
ASSIGNED = re.compile(r"assigned \[([\d, ]+)\]")
TIMEOUT_S = 90.0


def log(message: str) -> None:
    """Progress goes to stderr."""
    print(f"failover: {message}", file=sys.stderr, flush=True)


class Instance:
    """``kdelay run`` as a subprocess, logging at INFO to a file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.started = time.monotonic()
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen([str(KDELAY), "run", "--log-level", "INFO"], env=env,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def assignments(self) -> list[set[int]]:
        """Every partition assignment the instance has logged, in order."""
        text = self.log_path.read_text(errors="replace")
        return [{int(p) for p in m.group(1).split(",")} for m in ASSIGNED.finditer(text)]

    def wait(self, condition: str, done: Callable[[list[set[int]]], bool]) -> float:
        """Poll the log until ``done(assignments)``; return monotonic time it held."""
        deadline = time.monotonic() + TIMEOUT_S
        while not done(self.assignments()):
            if self.proc.poll() is not None:
                raise SystemExit(f"failover: instance exited waiting for {condition}; "
                                 f"see {self.log_path}")
            if time.monotonic() > deadline:
                raise SystemExit(f"failover: no {condition} within {TIMEOUT_S}s; "
                                 f"see {self.log_path}")
            time.sleep(0.02)
        return time.monotonic()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def deployment(bootstrap: str, workdir: Path, partitions: int, guarantee: str) -> dict[str, str]:
    """Create fresh topics with ``kdelay topics create``; return the environment naming them."""
    suffix = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDELAY_")}
    env.update({"KDELAY_BOOTSTRAP_SERVERS": bootstrap,
                "KDELAY_REQUESTS_TOPIC": f"failover.req.{suffix}",
                "KDELAY_CHANGELOG_TOPIC": f"failover.chg.{suffix}",
                "KDELAY_DLQ_TOPIC": f"failover.dlq.{suffix}",
                "KDELAY_GROUP_ID": f"failover-{suffix}", "KDELAY_GUARANTEE": guarantee,
                "KDELAY_STATE_DIR": str(workdir / f"state-{suffix}")})
    subprocess.run([str(KDELAY), "topics", "create", "--partitions", str(partitions)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return env


def restart_trial(env: dict[str, str], workdir: Path, n: int) -> float:
    """Seconds from a killed instance's restart to its serving again."""
    first = Instance(env, workdir / f"restart-{n}-a.log")
    first.wait("first assignment", lambda seen: bool(seen))
    first.kill()
    again = Instance(env, workdir / f"restart-{n}-b.log")
    served = again.wait("assignment after restart", lambda seen: bool(seen))
    again.kill()
    return served - again.started


def dead_trial(env: dict[str, str], workdir: Path, n: int, partitions: int) -> float:
    """Seconds from killing one of two instances to the survivor serving every partition."""
    doomed = Instance({**env, "KDELAY_STATE_DIR": env["KDELAY_STATE_DIR"] + "-doomed"},
                      workdir / f"dead-{n}-doomed.log")
    doomed.wait("first assignment", lambda seen: bool(seen))
    survivor = Instance({**env, "KDELAY_STATE_DIR": env["KDELAY_STATE_DIR"] + "-survivor"},
                        workdir / f"dead-{n}-survivor.log")
    survivor.wait("a share of the partitions", lambda seen: bool(seen))
    doomed.wait("the rebalance", lambda seen: len(seen) >= 2)
    killed = time.monotonic()
    doomed.kill()
    served = survivor.wait("every partition", lambda seen: len(seen[-1]) == partitions)
    survivor.kill()
    return served - killed


def main() -> int:
    """Run the trials and print the table."""
    parser = argparse.ArgumentParser(prog="tools/failover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--guarantee", choices=["at-least-once", "exactly-once"],
                        default="exactly-once")
    args = parser.parse_args()
    bootstrap = kafka_broker.address()
    workdir = Path(tempfile.mkdtemp(prefix="kdelay-failover-"))
    restarts, deaths = [], []
    for n in range(args.trials):
        restarts.append(restart_trial(
            deployment(bootstrap, workdir, args.partitions, args.guarantee), workdir, n))
        deaths.append(dead_trial(
            deployment(bootstrap, workdir, args.partitions, args.guarantee), workdir, n,
            args.partitions))
        log(f"trial {n + 1}: restart {restarts[-1]:.2f} s, dead instance {deaths[-1]:.2f} s")
    print(f"| {args.guarantee}, {args.trials} trials | median | max |\n|---|---|---|")
    for name, values in (("restart to serving", restarts), ("dead instance to survivor",
                                                             deaths)):
        print(f"| {name} | {statistics.median(values):.2f} s | {max(values):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
