"""Progress of a running Spark job, read from Spark's status tracker while it runs.

A job's work is stages of tasks; the driver knows how many tasks each active
stage has and how many are done. :class:`StageProgress` polls that from a
daemon thread every ``every_s`` seconds and hands a one-line summary (``stage
4: 37/200 tasks``) to a callback, which the CLI shows on stderr. It reads
counters only: nothing per record, and a poll that fails (the context
stopping) ends the thread quietly, since progress is a courtesy, never the
job's outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from pyspark import SparkContext

Report = Callable[[str], None]


def describe(context: SparkContext) -> str | None:
    """The active stages' task counts in one line, or None when no stage runs."""
    tracker = context.statusTracker()
    parts = []
    for stage_id in sorted(tracker.getActiveStageIds()):
        info = tracker.getStageInfo(stage_id)
        if info is not None:
            parts.append(f"stage {stage_id}: {info.numCompletedTasks}/{info.numTasks} tasks")
    return ", ".join(parts) or None


class StageProgress:
    """Report the active stages of ``context`` to ``report`` while the block runs."""

    def __init__(self, context: SparkContext, report: Report, what: str,
                 every_s: float = 1.0) -> None:
        self._context = context
        self._report = report
        self._what = what
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kdelay-progress", daemon=True)

    def _run(self) -> None:
        last = None
        while not self._stop.wait(self._every_s):
            try:
                line = describe(self._context)
            except Exception:  # the context stopping ends the courtesy
                return
            if line is not None and line != last:
                self._report(f"{self._what}: {line}")
                last = line

    def __enter__(self) -> StageProgress:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
