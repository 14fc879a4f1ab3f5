"""What the figures were taken on: cores, CPU, memory, load, library versions.

The load average is sampled at the start and the end of the run: on a shared
development machine it says how much the figures were disturbed.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path

import confluent_kafka

from kdelay_bench.broker import ROOT
from kdelay_bench.report import Result


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / (1 << 20), 1)
    return 0.0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _commit() -> str:
    """Return the kdelay commit measured, ``+dirty`` when ``src/`` has local changes."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True,
                           text=True, check=False).stdout.strip()
    return (head or "unknown") + ("+dirty" if dirty else "")


def machine(bootstrap: str) -> Result:
    """Return the ``machine`` record; call :func:`finish` on it when the run ends."""
    return Result("machine", {
        "cores": os.cpu_count(), "cpu": _cpu_model(), "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "confluent_kafka": version("confluent-kafka"),
        "librdkafka": confluent_kafka.libversion()[0], "rocksdict": version("rocksdict"),
        "kdelay_commit": _commit(), "broker": bootstrap, "loadavg_start": _load()})


def finish(record: Result) -> None:
    """Add the load average at the end of the run."""
    record.figures["loadavg_end"] = _load()
