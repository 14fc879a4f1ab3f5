"""Worker processes: one ``kdelay run`` that uses N cores, and the parent that supervises them.

One Python process uses one core. With ``--workers N`` (N > 1) the
``kdelay run`` process becomes a parent that serves nothing itself: it starts
N worker processes, each a full service and a member of the consumer group, so
the group splits the request partitions between them. Each worker gets
(:func:`worker_settings`):

- its own state dir, ``<state dir>/worker-<i>``, locked by the worker as a
  single instance locks its state dir; the parent holds the lock of
  ``<state dir>`` itself, so a second ``kdelay run`` on it stops at once;
- its own identity: the instance id (given, or derived as for one process)
  suffixed ``-w<i>``, so static member ids and transactional ids differ per
  worker and stay stable across the worker's restarts;
- its own metrics port, ``--metrics-port + i`` (0 stays 0: every worker an
  ephemeral port).

The parent (:class:`Supervisor`) restarts a worker that dies, after a backoff
that doubles with every death in a row (:class:`RestartPolicy`); a worker
that ran for a while before it died starts a fresh count. A worker that exits
with code 2 (a setting error: it would fail the same way again) is not
restarted: the parent stops the others and exits 2. A worker that dies too
many times in a row stops the parent with ``error[workers-failing]`` and code
1. SIGTERM or SIGINT to the parent sends SIGTERM to every worker; the parent
exits 0 once all of them stopped cleanly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kdelay.plumbing import identity
from kdelay.plumbing.settings import Settings, SettingsError

log = logging.getLogger(__name__)

SETTING_ERROR_EXIT = 2
FAILING_EXIT = 1
MAX_PORT = 65_535
_PR_SET_PDEATHSIG = 1


def worker_dir(state_dir: Path, index: int) -> Path:
    """The state dir of worker ``index`` under the parent's ``state_dir``."""
    return state_dir / f"worker-{index}"


def worker_settings(settings: Settings, index: int, hostname: str) -> Settings:
    """The settings worker ``index`` runs with, derived from the parent's.

    Pure. The member id is the parent's (``--instance-id``, or derived from
    the host name and the parent's state dir) plus ``-w<index>``; a given
    ``--transactional-id`` gets the same suffix, a derived one follows from
    the member id. Raises :class:`SettingsError` when the metrics ports of
    the workers would pass 65535.
    """
    member = identity.derive(settings, hostname).member_id
    transactional = settings.transactional_id
    return dataclasses.replace(
        settings,
        state_dir=worker_dir(settings.state_dir, index),
        instance_id=f"{member}-w{index}",
        transactional_id=None if transactional is None else f"{transactional}-w{index}",
        metrics_port=worker_port(settings.metrics_port, index),
    )


def worker_port(port: int | None, index: int) -> int | None:
    """Worker ``index``'s metrics port: ``port + index``; None and 0 stay as they are."""
    if not port:
        return port
    if port + index > MAX_PORT:
        raise SettingsError("invalid-setting", f"metrics_port {port} leaves no port for "
                            f"worker {index} (ports {port}..{port + index} must be <= {MAX_PORT})")
    return port + index


def describe_exit(code: int) -> str:
    """``code 1`` or ``signal SIGKILL``, for an exit code as multiprocessing reports it."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a dead worker is started again, and when the parent gives up.

    The n-th death in a row waits ``first_backoff_s * 2**(n-1)``, at most
    ``max_backoff_s``. A worker that ran ``healthy_after_s`` or longer before it
    died starts a fresh count. After ``deaths_in_a_row`` deaths in a row the
    parent gives up.
    """

    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    healthy_after_s: float = 60.0
    deaths_in_a_row: int = 5

    def backoff_s(self, deaths: int) -> float:
        """The wait before the restart that follows the ``deaths``-th death in a row."""
        return float(min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, deaths - 1)))


@dataclass(frozen=True, slots=True)
class Restart:
    """Start the worker again at monotonic time ``at``."""

    at: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Stop every worker and exit with ``exit_code``: ``error[code]: message``."""

    exit_code: int
    code: str
    message: str


class Restarts:
    """The restart decisions for N workers: pure, driven by the times it is given."""

    def __init__(self, workers: int, policy: RestartPolicy) -> None:
        self._policy = policy
        self._started = [0.0] * workers
        self._deaths = [0] * workers

    def started(self, index: int, now: float) -> None:
        """Worker ``index`` was (re)started at ``now``."""
        self._started[index] = now

    def exited(self, index: int, exit_code: int, now: float) -> Restart | GiveUp:
        """Decide what follows worker ``index`` exiting with ``exit_code`` at ``now``."""
        if exit_code == SETTING_ERROR_EXIT:
            return GiveUp(SETTING_ERROR_EXIT, "worker-setting-error",
                          f"worker {index} exited with code 2 (a setting error, see its "
                          "error line above); not restarted")
        if now - self._started[index] >= self._policy.healthy_after_s:
            self._deaths[index] = 0
        self._deaths[index] += 1
        deaths = self._deaths[index]
        if deaths >= self._policy.deaths_in_a_row:
            return GiveUp(FAILING_EXIT, "workers-failing",
                          f"worker {index} died {deaths} times in a row, each within "
                          f"{self._policy.healthy_after_s:g} s of its start (last: "
                          f"{describe_exit(exit_code)}); see its log lines above")
        return Restart(now + self._policy.backoff_s(deaths))


class Child(Protocol):
    """A started worker process, as the supervisor sees it (what :class:`multiprocessing.Process`
    offers); not a task worker (:class:`kdelay.tasks.Worker`)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


Spawn = Callable[[int], Child]
Wait = Callable[[Sequence[int], float], object]


@dataclass(frozen=True, slots=True)
class Timing:
    """How often the parent looks at its workers, and how long a stop may take."""

    tick_s: float = 0.2
    stop_timeout_s: float = 60.0


class Supervisor:
    """Starts N workers, restarts the ones that die, stops them all on :meth:`stop`.

    ``spawn(i)`` starts worker ``i``; ``wait(sentinels, timeout)`` returns
    when a worker exits or the timeout passes
    (:func:`multiprocessing.connection.wait`); ``monotonic`` is the clock.
    """

    def __init__(self, workers: int, spawn: Spawn, wait: Wait, monotonic: Callable[[], float],
                 policy: RestartPolicy | None = None, timing: Timing | None = None) -> None:
        self._count = workers
        self._spawn = spawn
        self._wait = wait
        self._monotonic = monotonic
        self._restarts = Restarts(workers, policy or RestartPolicy())
        self._timing = timing or Timing()
        self._running: dict[int, Child] = {}
        self._due: dict[int, float] = {}
        self._stopping = False

    def stop(self) -> None:
        """Ask the supervisor to stop every worker and return (safe in a signal handler)."""
        self._stopping = True

    def run(self) -> int:
        """Supervise until :meth:`stop` or a :class:`GiveUp`; return the exit code."""
        for index in range(self._count):
            self._start(index)
        while not self._stopping:
            verdict = self._reap()
            if verdict is not None:
                log.error("error[%s]: %s", verdict.code, verdict.message)
                self._stop_all()
                return verdict.exit_code
            self._restart_due()
            self._wait([w.sentinel for w in self._running.values()], self._next_wait_s())
        log.info("stopping %d workers", len(self._running))
        return self._stop_all()

    def _start(self, index: int) -> None:
        worker = self._spawn(index)
        self._running[index] = worker
        self._restarts.started(index, self._monotonic())
        log.info("worker %d started (pid %s)", index, worker.pid)

    def _reap(self) -> GiveUp | None:
        """Take in the workers that exited; the first :class:`GiveUp` ends the run."""
        for index, worker in list(self._running.items()):
            code = worker.exitcode
            if code is None:
                continue
            del self._running[index]
            verdict = self._restarts.exited(index, code, self._monotonic())
            if isinstance(verdict, GiveUp):
                return verdict
            self._due[index] = verdict.at
            log.warning("worker %d (pid %s) exited with %s; restarting it in %.1f s",
                        index, worker.pid, describe_exit(code), verdict.at - self._monotonic())
        return None

    def _restart_due(self) -> None:
        now = self._monotonic()
        for index, at in sorted(self._due.items()):
            if at <= now:
                del self._due[index]
                self._start(index)

    def _next_wait_s(self) -> float:
        until_due = min(self._due.values(), default=float("inf")) - self._monotonic()
        return max(0.0, min(self._timing.tick_s, until_due))

    def _stop_all(self) -> int:
        """SIGTERM every running worker and wait for all; 0 when all stopped cleanly.

        A worker still running ``stop_timeout_s`` after the SIGTERM is killed
        and the code is 1.
        """
        self._due.clear()
        for worker in self._running.values():
            worker.terminate()
        deadline = self._monotonic() + self._timing.stop_timeout_s
        clean = True
        while self._running:
            for index, worker in list(self._running.items()):
                if worker.exitcode is not None:
                    del self._running[index]
                    clean = self._stopped(index, worker, worker.exitcode) and clean
            if self._running and self._monotonic() >= deadline:
                return self._kill_late()
            self._wait([w.sentinel for w in self._running.values()], self._timing.tick_s)
        return 0 if clean else FAILING_EXIT

    def _stopped(self, index: int, worker: Child, code: int) -> bool:
        """Whether a worker stopped cleanly: 0, or killed by SIGTERM before its handler."""
        clean = code in (0, -signal.SIGTERM)
        if not clean:
            log.warning("worker %d (pid %s) stopped with %s", index, worker.pid,
                        describe_exit(code))
        return clean

    def _kill_late(self) -> int:
        for index, worker in self._running.items():
            log.error("error[worker-stop-timeout]: worker %d (pid %s) did not stop within "
                      "%g s of SIGTERM; killed", index, worker.pid, self._timing.stop_timeout_s)
            worker.kill()
        self._running.clear()
        return FAILING_EXIT


def bind_to_parent(parent_pid: int) -> None:
    """Make this worker die with its parent, and keep terminal signals for the parent.

    The worker leaves the parent's process group, so a Ctrl-C at a terminal
    reaches the parent alone, which stops the workers in order. On Linux the
    kernel sends the worker SIGTERM when the parent dies, however it dies, so
    no worker outlives a killed parent; a parent already gone ends the worker
    at once.
    """
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        raise SystemExit(FAILING_EXIT)
