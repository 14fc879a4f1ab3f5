"""Scenario ``transfer`` (opt-in): ``kdelay export`` and ``import`` of N pending 1 KB entries.

N requests with random (incompressible) 1 KB values, due evenly over the next
24 hours, and their changelog puts are written to one deployment as the
``operator`` scenario writes them. ``kdelay export --output FILE`` then runs
on it, and ``kdelay import FILE`` on a second, empty deployment, each as the
real command under ``/usr/bin/time -v``: wall time and peak RSS of the whole
process, interpreter start-up and the view's changelog replay included. The
import's time is until every request is written to the destination's requests
topic; the destination's intake of them is the service's (see ``capacity``).
A cold ``kdelay backlog`` on the source gives the cost of the view alone
(replaying the changelog into its RocksDB stores), which export includes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kdelay.plumbing.settings import Settings
from kdelay_bench.broker import Topics
from kdelay_bench.operator_view import load_pending
from kdelay_bench.progress import say
from kdelay_bench.report import Result, per_record_us

VALUE_SIZE = 1_024
_RSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")
_CPU = re.compile(r"(?:User|System) time \(seconds\): ([\d.]+)")
_WALL = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)")


def measured(stderr: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) from ``/usr/bin/time -v`` output."""
    wall, rss = _WALL.search(stderr), _RSS.search(stderr)
    if wall is None or rss is None:
        raise RuntimeError(f"no /usr/bin/time -v figures in: {stderr[-500:]}")
    hours, minutes, seconds = wall.groups()
    return int(hours or 0) * 3_600 + int(minutes) * 60 + float(seconds), int(rss[1]) / 1_024


def cpu_seconds(stderr: str) -> float | None:
    """User + system seconds of the whole process from ``/usr/bin/time -v`` output."""
    found = _CPU.findall(stderr)
    return sum(float(x) for x in found) if len(found) == 2 else None


def _timed(settings: Settings, view: Path, *args: str) -> tuple[float, float, str, float | None]:
    """Run one ``kdelay`` command under ``/usr/bin/time -v``; return seconds, MB, stdout
    and CPU seconds (user + system)."""
    env = {"KDELAY_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "KDELAY_REQUESTS_TOPIC": settings.requests_topic,
           "KDELAY_CHANGELOG_TOPIC": settings.changelog_topic,
           "KDELAY_DLQ_TOPIC": settings.dlq_topic, "KDELAY_VIEW_DIR": str(view),
           "PATH": str(Path(sys.executable).parent)}
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "kdelay", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                          timeout=7_200)
    if done.returncode != 0:
        raise RuntimeError(f"kdelay {' '.join(args)} exited {done.returncode}: "
                           f"{done.stderr[-2_000:]}")
    seconds, rss_mb = measured(done.stderr)
    return seconds, rss_mb, done.stdout.strip(), cpu_seconds(done.stderr)


def run_transfer(topics: Topics, work_dir: Path, count: int, partitions: int,
                 batch_size: int) -> Result:
    """Load ``count`` pending 1 KB entries; time and measure export, then import elsewhere."""
    source = topics.deployment("transfer-src", partitions, work_dir / "src-state", batch_size)
    destination = topics.deployment("transfer-dst", partitions, work_dir / "dst-state",
                                    batch_size)
    say(f"transfer: {count:,} pending 1 KB entries over {partitions} partitions")
    load_pending(source, count, partitions, VALUE_SIZE)
    file = work_dir / "pending.jsonl"
    views = [Path(tempfile.mkdtemp(prefix="view-", dir=work_dir)) for _ in range(3)]
    backlog_s, backlog_mb, _, _ = _timed(source, views[2], "backlog", "--json")
    say(f"transfer: backlog (cold view, for reference) in {backlog_s:.1f} s, "
        f"peak RSS {backlog_mb:.0f} MB")
    export_s, export_mb, exported, export_cpu = _timed(source, views[0], "export", "--output",
                                                       str(file))
    say(f"transfer: {exported} in {export_s:.1f} s, peak RSS {export_mb:.0f} MB")
    size_mb = file.stat().st_size / 1_048_576
    import_s, import_mb, imported, import_cpu = _timed(destination, views[1], "import", str(file))
    say(f"transfer: {imported} in {import_s:.1f} s, peak RSS {import_mb:.0f} MB")
    file.unlink()
    result = Result("transfer", {
        "pending": count, "value_bytes": VALUE_SIZE, "file_mb": round(size_mb, 1),
        "export_s": round(export_s, 1), "export_rss_mb": round(export_mb),
        "export_per_s": round(count / export_s), "import_s": round(import_s, 1),
        "import_rss_mb": round(import_mb), "import_per_s": round(count / import_s),
        "backlog_cold_s": round(backlog_s, 1), "backlog_cold_rss_mb": round(backlog_mb),
        "export_cpu_us_per_record": per_record_us(export_cpu, count),
        "import_cpu_us_per_record": per_record_us(import_cpu, count)})
    result.headline("export (whole command)", round(count / export_s),
                    result.figures["export_cpu_us_per_record"])
    result.headline("import (whole command)", round(count / import_s),
                    result.figures["import_cpu_us_per_record"])
    result.check("export complete", exported, exported.startswith(f"exported {count} of"))
    result.check("import sent all", imported, imported.startswith(f"sent {count}, skipped 0"))
    return result
