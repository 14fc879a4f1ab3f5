"""Small measuring helpers: percentiles, resident memory, directory sizes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def percentile(ordered: Sequence[float], fraction: float) -> float | None:
    """Return the nearest-rank percentile of an ascending sequence, None when empty."""
    if not ordered:
        return None
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary(values: list[float]) -> dict[str, float | None]:
    """Return p50, p99, p999 and max of ``values`` (sorted in place)."""
    values.sort()
    return {"p50": percentile(values, 0.50), "p99": percentile(values, 0.99),
            "p999": percentile(values, 0.999), "max": values[-1] if values else None}


def rss_bytes() -> int:
    """Return this process's resident set size (``VmRSS``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def dir_bytes(path: Path) -> int:
    """Return the total size of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def process_memory(pid: int) -> tuple[int, int]:
    """Return process ``pid``'s resident set now and at its peak (``VmRSS``, ``VmHWM``)
    in bytes; zeros when it has gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0, 0
    sizes = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines
             if line.startswith(("VmRSS:", "VmHWM:"))}
    return sizes.get("VmRSS", 0), sizes.get("VmHWM", 0)
