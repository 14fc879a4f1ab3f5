"""A scheduler the bench runs as a process: kdelay run, or the peer.

:class:`SchedulerProcess` starts it with its output in a log, reads how many
records it has taken in from its Prometheus endpoint (each scheduler names
that figure its own way: ``count``), and stops it with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

STOP_TIMEOUT_S = 30.0


class SchedulerProcess:
    """A running scheduler, its log and its metrics endpoint on ``metrics_port``."""

    def __init__(self, command: list[str], log: Path, metrics_port: int,
                 count: Callable[[str], int], env: Mapping[str, str] | None = None,
                 metric: str | None = None) -> None:
        self.metrics_port = metrics_port
        self._count = count
        # Only the metric ``count`` reads, where the endpoint can be asked for one: the
        # bench polls 20 times a second, and a whole exposition costs the process more
        # CPU than it spends on thousands of requests (see docs/benchmarks.md).
        self._query = "" if metric is None else f"?name[]={metric}"
        self._log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(command, env=None if env is None else dict(env),
                                         stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether it still runs."""
        return self.proc.poll() is None

    def taken_in(self) -> int | None:
        """How many records it has taken in, from its metrics; None while they do not
        answer."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics{self._query}"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return self._count(answer.read().decode())
        except OSError:
            return None

    def tail(self) -> str:
        """The last lines it logged, for an error message."""
        text = self._log.read_text(errors="replace").strip() if self._log.exists() else ""
        return " ".join(text.splitlines()[-3:])[-400:] or "no output"

    def stop(self) -> None:
        """SIGTERM (each flushes its producer); SIGKILL if it has not finished in 30 s."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
