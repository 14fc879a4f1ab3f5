"""Scenario ``restore``: changelog entries/s replayed into an empty state directory.

N changelog puts are produced to one partition of a compacted topic; a
:class:`kdelay.state.changelog.Restorer` then replays them into a fresh
:class:`kdelay.state.index.PartitionIndex`, exactly as the service does when a
partition's store is missing.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from kdelay.plumbing.clock import SystemClock
from kdelay.state.changelog import Restorer
from kdelay.state.index import PartitionIndex
from kdelay_bench.broker import Topics
from kdelay_bench.cputime import own_cpu_s
from kdelay_bench.load import produce_changelog
from kdelay_bench.progress import Progress, say
from kdelay_bench.report import Result, per_record_us

TARGET_PER_S = 300_000


def run_restore(topics: Topics, work_dir: Path, count: int) -> Result:
    """Produce ``count`` changelog entries, restore them, report entries/s."""
    topic = topics.create("changelog", 1, {"cleanup.policy": "compact"})
    say(f"restore: producing {count:,} changelog entries")
    produce_changelog(topics.bootstrap, topic, count, SystemClock().now_ms())
    path = Path(tempfile.mkdtemp(prefix="restore-", dir=work_dir)) / "p0"
    restorer = Restorer({"bootstrap.servers": topics.bootstrap}, topic)
    index = PartitionIndex(path, 0)
    progress = Progress("restore", count)
    try:
        start, cpu_start = time.monotonic(), own_cpu_s()
        applied = restorer.restore(index, lambda done, _: progress.update(done))
        seconds, cpu_s = time.monotonic() - start, own_cpu_s() - cpu_start
        pending = sum(1 for _ in index.entries())
    finally:
        index.close()
        restorer.close()
    rate = applied / max(seconds, 1e-9)
    result = Result("restore", {"entries": count, "applied": applied, "pending_after": pending,
                                "seconds": round(seconds, 3), "entries_per_s": round(rate),
                                "cpu_us_per_entry": per_record_us(cpu_s, applied)})
    result.headline("restore (per changelog entry)", round(rate),
                    result.figures["cpu_us_per_entry"])
    result.check(f"restore >= {TARGET_PER_S:,} entries/s", round(rate),
                 rate >= TARGET_PER_S)
    return result
