"""The worker supervisor's pure parts: derived settings, restart policy, and the loop.

The loop runs against fake workers on a fake monotonic clock that the fake
``wait`` advances, so no test waits for a backoff.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest

from kdelay.engine.workers import (
    Child,
    GiveUp,
    Restart,
    RestartPolicy,
    Restarts,
    Supervisor,
    Timing,
    describe_exit,
    worker_dir,
    worker_settings,
)
from kdelay.plumbing import identity
from kdelay.plumbing.settings import Settings, SettingsError

HOST = "node-a"


def base(**fields: object) -> Settings:
    fields = {"state_dir": Path("/var/lib/kdelay"), "group_id": "g", **fields}
    return Settings(**fields)  # type: ignore[arg-type]


# -- derived settings ----------------------------------------------------------


def test_each_worker_gets_its_own_state_subdir() -> None:
    dirs = [worker_settings(base(), i, HOST).state_dir for i in range(3)]
    assert dirs == [Path("/var/lib/kdelay/worker-0"), Path("/var/lib/kdelay/worker-1"),
                    Path("/var/lib/kdelay/worker-2")]
    assert worker_dir(Path("s"), 4) == Path("s/worker-4")


def test_worker_ids_are_the_instance_id_suffixed_and_stable() -> None:
    parent = identity.derive(base(), HOST)
    ids = [identity.derive(worker_settings(base(), i, HOST), HOST) for i in range(2)]
    assert [i.member_id for i in ids] == [f"{parent.member_id}-w0", f"{parent.member_id}-w1"]
    assert [i.transactional_id for i in ids] == [f"kdelay-g-{parent.member_id}-w0",
                                                  f"kdelay-g-{parent.member_id}-w1"]
    again = identity.derive(worker_settings(base(), 1, HOST), HOST)
    assert again == ids[1]


def test_worker_ids_differ_between_hosts_and_state_dirs() -> None:
    ours = identity.derive(worker_settings(base(), 0, HOST), HOST).member_id
    other_host = identity.derive(worker_settings(base(), 0, "node-b"), "node-b").member_id
    other_dir = worker_settings(base(state_dir=Path("/srv/other")), 0, HOST).instance_id
    assert len({ours, other_host, other_dir}) == 3


def test_given_instance_and_transactional_ids_are_suffixed() -> None:
    given = base(instance_id="delay-1", transactional_id="tx-1")
    worker = worker_settings(given, 1, HOST)
    assert (worker.instance_id, worker.transactional_id) == ("delay-1-w1", "tx-1-w1")


def test_metrics_port_is_one_per_worker() -> None:
    assert [worker_settings(base(metrics_port=9400), i, HOST).metrics_port
            for i in range(3)] == [9400, 9401, 9402]
    assert worker_settings(base(), 1, HOST).metrics_port is None
    assert worker_settings(base(metrics_port=0), 1, HOST).metrics_port == 0


def test_metrics_port_beyond_65535_is_a_setting_error() -> None:
    with pytest.raises(SettingsError, match="worker 1"):
        worker_settings(base(metrics_port=65_535), 1, HOST)


def test_the_rest_of_the_settings_is_the_parents() -> None:
    parent = base(batch_size=77, lookahead_ms=123)
    worker = worker_settings(parent, 0, HOST)
    assert (worker.batch_size, worker.lookahead_ms, worker.group_id) == (77, 123, "g")


# -- restart policy ------------------------------------------------------------


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(first_backoff_s=1.0, max_backoff_s=10.0)
    assert [policy.backoff_s(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_deaths_in_a_row_back_off_then_give_up() -> None:
    restarts = Restarts(2, RestartPolicy(deaths_in_a_row=3, healthy_after_s=60.0))
    restarts.started(0, 100.0)
    assert restarts.exited(0, 1, 101.0) == Restart(102.0)
    restarts.started(0, 102.0)
    assert restarts.exited(0, -9, 103.0) == Restart(105.0)
    restarts.started(0, 105.0)
    verdict = restarts.exited(0, 1, 106.0)
    assert isinstance(verdict, GiveUp)
    assert (verdict.exit_code, verdict.code) == (1, "workers-failing")
    assert "worker 0 died 3 times in a row" in verdict.message


def test_a_worker_that_ran_long_enough_starts_a_fresh_count() -> None:
    restarts = Restarts(1, RestartPolicy(deaths_in_a_row=2, healthy_after_s=60.0))
    restarts.started(0, 0.0)
    assert restarts.exited(0, 1, 1.0) == Restart(2.0)
    restarts.started(0, 2.0)
    assert restarts.exited(0, -9, 62.0) == Restart(63.0)


def test_counts_are_per_worker() -> None:
    restarts = Restarts(2, RestartPolicy(deaths_in_a_row=2))
    assert isinstance(restarts.exited(0, 1, 1.0), Restart)
    assert isinstance(restarts.exited(1, 1, 1.0), Restart)


def test_a_setting_error_is_never_restarted() -> None:
    verdict = Restarts(1, RestartPolicy()).exited(0, 2, 500.0)
    assert isinstance(verdict, GiveUp)
    assert (verdict.exit_code, verdict.code) == (2, "worker-setting-error")


def test_exit_descriptions() -> None:
    assert describe_exit(1) == "code 1"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"


# -- the supervision loop ------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeWorker:
    """Exits with ``code`` once ``life_s`` passed; exits 0 at SIGTERM unless ``stubborn``."""

    def __init__(self, clock: Clock, pid: int, life_s: float | None, code: int,
                 stubborn: bool) -> None:
        self._clock = clock
        self._dies_at = None if life_s is None else clock.now + life_s
        self._code = code
        self._stubborn = stubborn
        self.pid = pid
        self.sentinel = pid
        self.signals: list[str] = []

    @property
    def exitcode(self) -> int | None:
        if self._dies_at is not None and self._clock.now >= self._dies_at:
            return self._code
        return None

    def terminate(self) -> None:
        self.signals.append("TERM")
        if not self._stubborn and self.exitcode is None:
            self._dies_at, self._code = self._clock.now, 0

    def kill(self) -> None:
        self.signals.append("KILL")
        self._dies_at, self._code = self._clock.now, -signal.SIGKILL


Life = tuple[float | None, int]


class Pool:
    """Spawns fake workers; ``lives[i]`` gives the (life, exit code) of each start of worker i."""

    def __init__(self, clock: Clock, lives: dict[int, list[Life]], stubborn: bool = False,
                 stop_at: float | None = None) -> None:
        self.clock = clock
        self.lives = lives
        self.stubborn = stubborn
        self.started: list[tuple[int, float]] = []
        self.workers: list[FakeWorker] = []
        self.stop_at = stop_at
        self.supervisor: Supervisor | None = None

    def spawn(self, index: int) -> Child:
        queue = self.lives.get(index)
        life, code = queue.pop(0) if queue else (None, 0)
        worker = FakeWorker(self.clock, 100 + len(self.workers), life, code, self.stubborn)
        self.workers.append(worker)
        self.started.append((index, self.clock.now))
        return worker

    def wait(self, sentinels: Sequence[int], timeout_s: float) -> None:
        self.clock.now = round(self.clock.now + timeout_s, 6)
        if self.stop_at is not None and self.clock.now >= self.stop_at and self.supervisor:
            self.supervisor.stop()

    def supervise(self, workers: int, policy: RestartPolicy | None = None) -> Supervisor:
        self.supervisor = Supervisor(workers, self.spawn, self.wait, self.clock, policy,
                                     Timing(tick_s=0.5, stop_timeout_s=10.0))
        return self.supervisor


def pool(lives: dict[int, list[Life]] | None = None, **kwargs: object) -> Pool:
    return Pool(Clock(), lives or {}, **kwargs)  # type: ignore[arg-type]


def test_starts_every_worker_and_stops_them_all_cleanly() -> None:
    p = pool(stop_at=5.0)
    assert p.supervise(3).run() == 0
    assert [index for index, _ in p.started] == [0, 1, 2]
    assert all(w.signals == ["TERM"] for w in p.workers)
    assert all(w.exitcode == 0 for w in p.workers)


def test_a_killed_worker_is_restarted_after_its_backoff() -> None:
    p = pool({1: [(2.0, -signal.SIGKILL)]}, stop_at=20.0)
    assert p.supervise(2, RestartPolicy(first_backoff_s=3.0)).run() == 0
    assert p.started == [(0, 0.0), (1, 0.0), (1, 5.0)]


def test_restarts_back_off_further_with_each_death_in_a_row() -> None:
    p = pool({0: [(1.0, 1), (1.0, 1), (1.0, 1)]}, stop_at=30.0)
    assert p.supervise(1, RestartPolicy(first_backoff_s=1.0, deaths_in_a_row=9)).run() == 0
    assert [at for _, at in p.started] == [0.0, 2.0, 5.0, 10.0]


def test_a_worker_that_keeps_dying_ends_the_parent(caplog: pytest.LogCaptureFixture) -> None:
    p = pool({0: [(1.0, 1)] * 10}, stop_at=1000.0)
    with caplog.at_level(logging.ERROR, logger="kdelay.engine.workers"):
        code = p.supervise(2, RestartPolicy(deaths_in_a_row=3)).run()
    assert code == 1
    assert len([i for i, _ in p.started if i == 0]) == 3
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 1
    assert errors[0].startswith("error[workers-failing]: worker 0 died 3 times in a row")
    assert p.workers[1].signals == ["TERM"]


def test_a_setting_error_stops_the_others_and_exits_2() -> None:
    p = pool({1: [(1.0, 2)]}, stop_at=1000.0)
    assert p.supervise(2).run() == 2
    assert [i for i, _ in p.started] == [0, 1]
    assert p.workers[0].signals == ["TERM"]


def test_a_worker_that_ignores_sigterm_is_killed_after_the_stop_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = pool(stubborn=True, stop_at=1.0)
    with caplog.at_level(logging.ERROR, logger="kdelay.engine.workers"):
        assert p.supervise(1).run() == 1
    assert p.workers[0].signals == ["TERM", "KILL"]
    assert p.clock.now >= 11.0
    assert "error[worker-stop-timeout]" in caplog.records[0].getMessage()


def test_no_restart_is_started_once_stopping() -> None:
    p = pool({0: [(1.0, 1)]}, stop_at=1.5)
    assert p.supervise(1, RestartPolicy(first_backoff_s=5.0)).run() == 0
    assert p.started == [(0, 0.0)]
