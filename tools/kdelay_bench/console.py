"""Scenario ``console`` (named only): the web console's screens with N pending.

N requests and their changelog puts are loaded as ``operator`` loads them (due
evenly over the next 24 hours, target ``bench-target``). ``kdelay web`` then
runs as the real subprocess, as an operator starts it, on an empty view
directory: the scenario times its first summary (the whole changelog replayed
and every original's route read once), then asks each screen ``ROUNDS`` times
over HTTP: the overview page, the timeline page by minute, and a filtered
pending-list page (target and a due window; the page of 100 and the true
total), and that page sorted by request and filtered by a key prefix. Each
screen's slowest answer is its figure; the console's RSS is read from
``/proc`` after the screens (current and peak).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kdelay.plumbing.clock import SystemClock
from kdelay_bench.broker import Topics
from kdelay_bench.operator_view import load_pending
from kdelay_bench.progress import say
from kdelay_bench.report import Result

ROUNDS = 5
TARGET_SCREEN_S = 1.0
TARGET_RSS_MB = 300.0
READY_TIMEOUT_S = 3_600.0


@dataclass(frozen=True, slots=True)
class Memory:
    """The console's resident set now and at its peak, in MB (``/proc/PID/status``)."""

    rss_mb: float
    peak_mb: float


def parse_status(text: str) -> Memory:
    """Read ``VmRSS`` and ``VmHWM`` (kB) from a ``/proc/PID/status`` text; ValueError
    when either is missing."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(rest.split()[0]) / 1024
    if set(found) != {"VmRSS", "VmHWM"}:
        raise ValueError("no VmRSS/VmHWM in the status text")
    return Memory(round(found["VmRSS"], 1), round(found["VmHWM"], 1))


TARGETED = ("overview", "timeline", "pending_filtered")
"""The screens the issue sets its 1 s target for; the sorted and keyed pages are shown."""


def screens(now_ms: int) -> dict[str, str]:
    """The screens asked, by name: overview, timeline by minute, a filtered list page
    (target and the next 12 hours' due window), the same page sorted by request
    (every match ranked) and filtered by a key prefix (the first 10 000 matches'
    originals read)."""
    hour = 3_600_000
    start, end = now_ms + hour, now_ms + 13 * hour
    iso = time.strftime
    window = (f"due_from={iso('%Y-%m-%dT%H:%M:%SZ', time.gmtime(start / 1000))}"
              f"&due_to={iso('%Y-%m-%dT%H:%M:%SZ', time.gmtime(end / 1000))}")
    return {"overview": "/", "timeline": "/timeline?bucket=1m",
            "pending_filtered": f"/pending?target=bench-target&{window}&limit=100",
            "pending_by_request": f"/pending?target=bench-target&{window}&limit=100"
                                  "&sort=request&order=desc",
            "pending_key": f"/pending?target=bench-target&{window}&limit=100&key_prefix=k1"}


def report(count: int, first_summary_s: float, seconds: dict[str, list[float]],
           memory: Memory, load: tuple[float, float, float]) -> Result:
    """The scenario's result: each screen's slowest and median answer, the first
    summary's time, the RSS, the machine's load average, and the targets checked."""
    figures: dict[str, float | int | str | None] = {
        "pending": count, "first_summary_s": round(first_summary_s, 1),
        "rss_mb": memory.rss_mb, "peak_rss_mb": memory.peak_mb,
        "load_avg_1_5_15": " ".join(f"{value:.1f}" for value in load)}
    for name, times in seconds.items():
        ordered = sorted(times)
        figures[f"{name}_max_s"] = round(ordered[-1], 3)
        figures[f"{name}_median_s"] = round(ordered[len(ordered) // 2], 3)
    result = Result("console", figures)
    for name, times in seconds.items():
        if name not in TARGETED:
            continue
        slowest = max(times)
        result.check(f"{name} < {TARGET_SCREEN_S:.0f} s", round(slowest, 3),
                     slowest < TARGET_SCREEN_S)
    result.check(f"console RSS < {TARGET_RSS_MB:.0f} MB", memory.peak_mb,
                 memory.peak_mb < TARGET_RSS_MB)
    return result


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _get(url: str) -> tuple[int, float]:
    """Status and seconds of one GET (an HTTP error's status too)."""
    start = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=120) as answer:  # noqa: S310 - http only
            answer.read()
            status = int(answer.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        status = exc.code
    return status, time.monotonic() - start


def _ready(base: str, console: subprocess.Popen[bytes]) -> float:
    """Wait until the overview answers 200 (the first summary is built); return seconds."""
    start = time.monotonic()
    while time.monotonic() - start < READY_TIMEOUT_S:
        if console.poll() is not None:
            raise RuntimeError(f"kdelay web exited {console.returncode}")
        try:
            status, _ = _get(base + "/api/v1/timeline?bucket=1d")
        except OSError:
            status = 0
        if status == 200:
            return time.monotonic() - start
        time.sleep(1.0)
    raise RuntimeError(f"the console had no summary after {READY_TIMEOUT_S:.0f} s")


def run_console(topics: Topics, work_dir: Path, count: int, partitions: int,
                value_size: int, batch_size: int) -> Result:
    """Load ``count`` pending entries; start ``kdelay web``; time its screens and its RSS."""
    settings = topics.deployment("console", partitions, work_dir / "console-state", batch_size)
    say(f"console: {count:,} pending over {partitions} partitions")
    load_pending(settings, count, partitions, value_size)
    view = Path(tempfile.mkdtemp(prefix="web-view-", dir=work_dir))
    port = _free_port()
    env = {**os.environ, "KDELAY_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "KDELAY_REQUESTS_TOPIC": settings.requests_topic,
           "KDELAY_CHANGELOG_TOPIC": settings.changelog_topic,
           "KDELAY_DLQ_TOPIC": settings.dlq_topic}
    command = [sys.executable, "-m", "kdelay", "web", "--web-port", str(port),
               "--view-dir", str(view), "--no-create-audit-topic",
               "--audit-topic", f"{settings.requests_topic}-audit"]
    console = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        first = _ready(base, console)
        say(f"console: first summary after {first:.1f} s")
        asked = screens(SystemClock().now_ms())
        seconds: dict[str, list[float]] = {name: [] for name in asked}
        for _ in range(ROUNDS):
            for name, path in asked.items():
                status, took = _get(base + path)
                if status != 200:
                    raise RuntimeError(f"{path} answered {status}")
                seconds[name].append(took)
        memory = parse_status(Path(f"/proc/{console.pid}/status").read_text())
    finally:
        console.terminate()
        console.wait(timeout=60)
    say("console: " + ", ".join(f"{name} max {max(t):.2f} s" for name, t in seconds.items())
        + f", RSS {memory.rss_mb:.0f} MB (peak {memory.peak_mb:.0f})")
    return report(count, first, seconds, memory, os.getloadavg())
