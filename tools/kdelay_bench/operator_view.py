"""Scenario ``operator``: ``kdelay due --within 1m``, ``backlog`` (also ``--by target``), and
``retention check`` with N pending.

N requests (value ``value_size`` bytes) are produced to a deployment's requests
topic with explicit timestamps, due evenly over the next 24 hours, and the
matching changelog puts (fingerprints that match the originals) to its
changelog, as intake would have written them. Each command then runs as the
real ``kdelay`` subprocess, as an operator runs it: *cold* with an empty view
directory (the whole changelog is replayed), then *warm* with the same view
(nothing new to replay). The time includes interpreter start-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec
from kdelay_bench.broker import Topics
from kdelay_bench.load import Loader, request_headers, values
from kdelay_bench.progress import Progress, say
from kdelay_bench.report import Result

SPREAD_MS = 86_400_000
TARGET_WARM_S = 5.0
VALUE_POOL = 256


def load_pending(settings: Settings, count: int, partitions: int, value_size: int) -> None:
    """Produce ``count`` requests and their changelog puts, round-robin over partitions."""
    loader = Loader(settings.bootstrap_servers)
    pool = values(value_size)
    now_ms = SystemClock().now_ms()
    progress = Progress("operator: producing requests and changelog", count)
    for i in range(count):
        partition, offset = i % partitions, i // partitions
        due_ms = now_ms + i * SPREAD_MS // count
        key, value = f"k{i}".encode(), pool[i % VALUE_POOL]
        loader.produce(settings.requests_topic, key, value,
                       request_headers("bench-target", due_ms), partition, timestamp=now_ms)
        index_value = codec.IndexValue(codec.fingerprint(key, value, now_ms), None)
        loader.produce(settings.changelog_topic, codec.encode_due_key(due_ms, partition, offset),
                       codec.encode_index_value(index_value), partition=partition)
        if i % 1_000 == 0:
            loader.poll()
            progress.update(i)
    loader.finish()


def timed(settings: Settings, view: Path, *args: str) -> tuple[float, str]:
    """Run one ``kdelay`` command on the deployment; return seconds and its stdout."""
    env = {"KDELAY_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "KDELAY_REQUESTS_TOPIC": settings.requests_topic,
           "KDELAY_CHANGELOG_TOPIC": settings.changelog_topic,
           "KDELAY_DLQ_TOPIC": settings.dlq_topic, "KDELAY_VIEW_DIR": str(view),
           "PATH": str(Path(sys.executable).parent),
           # The kdelay under test: a checkout's sources when the bench runs from them.
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "kdelay", *args, "--json"]
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                          timeout=3_600)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"kdelay {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return seconds, done.stdout


def run_operator(topics: Topics, work_dir: Path, count: int, partitions: int,
                 value_size: int, batch_size: int) -> Result:
    """Load ``count`` pending entries; time ``due --within 1m`` and ``backlog``, cold and warm."""
    settings = topics.deployment("operator", partitions, work_dir / "operator-state", batch_size)
    say(f"operator: {count:,} pending over {partitions} partitions")
    load_pending(settings, count, partitions, value_size)
    seconds: dict[str, float] = {}
    lines: dict[str, int] = {}
    commands = {"due": ("due", "--within", "1m"), "backlog": ("backlog",),
                "retention_check": ("retention", "check"),
                "backlog_by_target": ("backlog", "--by", "target")}
    for name, command in commands.items():
        view = Path(tempfile.mkdtemp(prefix="view-", dir=work_dir))
        seconds[f"{name}_cold_s"], _ = timed(settings, view, *command)
        seconds[f"{name}_warm_s"], out = timed(settings, view, *command)
        lines[f"{name}_output_lines"] = len(out.splitlines())
        say(f"operator: {name} cold {seconds[f'{name}_cold_s']:.2f} s, "
            f"warm {seconds[f'{name}_warm_s']:.2f} s")
    result = Result("operator", {"pending": count, **lines,
                                 **{k: round(v, 3) for k, v in seconds.items()}})
    for name in ("due", "backlog"):
        warm = seconds[f"{name}_warm_s"]
        result.check(f"{name} warm < {TARGET_WARM_S:.0f} s", round(warm, 2),
                     warm < TARGET_WARM_S if count <= 1_000_000 else None)
    return result
