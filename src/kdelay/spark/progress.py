"""A long Spark job's progress, told in one line: its phase and the tasks done so far.

Spark's console progress bar is off in every kdelay session (it interleaves
with the reports); :class:`JobProgress` polls the session's status tracker
from a daemon thread instead and hands a line such as ``writing 1,000,000
requests: 7/12 tasks`` to a callback (the CLI's status line) whenever it
changes. It only reads Spark's status; it never stops or slows a job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Self

from pyspark.sql import SparkSession

POLL_S = 0.5
Report = Callable[[str], None]
"""Where progress lines go (the CLI's status line)."""


class JobProgress:
    """Tell ``show`` the current phase and, while Spark runs stages, their tasks.

    Use as a context manager; :meth:`phase` names what the job does next.
    """

    def __init__(self, spark: SparkSession, show: Callable[[str], None]) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._show = show
        self._phase = ""
        self._shown = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kdelay-spark-progress",
                                        daemon=True)

    def phase(self, text: str) -> None:
        """Name the job's next phase; shown at once."""
        self._phase = text
        self._tell(text)

    def line(self) -> str:
        """The phase with the tasks of Spark's active stages: done / total."""
        done = total = 0
        for stage_id in self._tracker.getActiveStageIds():
            info = self._tracker.getStageInfo(stage_id)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
        return f"{self._phase}: {done}/{total} tasks" if total else self._phase

    def _tell(self, text: str) -> None:
        if text != self._shown:
            self._shown = text
            self._show(text)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._tell(self.line())

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
