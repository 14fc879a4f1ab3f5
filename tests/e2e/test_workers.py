"""``kdelay run --workers 2`` end to end: two supervised worker processes on a real broker.

Both workers join the group as static members with their own ids and split
the partitions, each serves its metrics on its own port, a worker killed with
SIGKILL is restarted and takes its partitions back with nothing lost, and
SIGTERM to the parent stops every worker and exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import urllib.request
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient

from kdelay.state.statedir import StateDirLock
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests
from tests.e2e.prometheus_server import free_port
from tests.e2e.test_run import check_all, delivered, distinct, request, sent_requests

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

kafka = pytest.mark.kafka
STARTED = re.compile(r"worker (\d) started \(pid (\d+)\)")
OWNED = re.compile(r"^kdelay_owned_partitions (\S+)$", re.MULTILINE)


def two_free_ports() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    pytest.fail("no two consecutive free ports")


def worker_pids(process: KdelayProcess) -> dict[int, list[int]]:
    """Each worker's pids, in start order, from the parent's log."""
    pids: dict[int, list[int]] = {}
    for index, pid in STARTED.findall(process.log()):
        pids.setdefault(int(index), []).append(int(pid))
    return pids


def owned(port: int) -> int:
    """The ``kdelay_owned_partitions`` gauge one worker serves on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = OWNED.search(text)
    assert found is not None, "kdelay_owned_partitions missing"
    return int(float(found.group(1)))


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.1)


def members(admin: AdminClient, group: str) -> dict[str, set[int]]:
    """The group's static member ids and the partitions each is assigned."""
    description = admin.describe_consumer_groups([group])[group].result(timeout=30)
    return {m.group_instance_id: {tp.partition for tp in m.assignment.topic_partitions}
            for m in description.members}


def alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@kafka
def test_two_workers_split_the_group_survive_a_kill_and_stop_together(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    admin: AdminClient,
) -> None:
    deployment = deploy(partitions=4)
    target = topic_factory("e2e-workers-target", 2)
    out = receiver([target, deployment.dlq])
    port = two_free_ports()
    process = start_kdelay(deployment, KDELAY_WORKERS="2", KDELAY_METRICS_PORT=str(port))
    process.wait_ready(times=2)

    eventually(lambda: sorted(p for parts in members(admin, deployment.group_id).values()
                              for p in parts) == [0, 1, 2, 3], "the group's assignment")
    group = members(admin, deployment.group_id)
    assert len(group) == 2, group
    assert all(id_.endswith(("-w0", "-w1")) for id_ in group), group
    assert all(group.values()), f"a worker with no partition: {group}"
    assert sorted(p for parts in group.values() for p in parts) == [0, 1, 2, 3]
    shares = {index: len(parts) for index, parts in enumerate(group.values())}
    eventually(lambda: sorted([owned(port), owned(port + 1)]) == sorted(shares.values()),
               "each worker's metrics port shows its own partitions")
    assert sorted(path.name for path in deployment.state_dir.iterdir()
                  if path.is_dir()) == ["worker-0", "worker-1"]

    records = [request(target, i, 4_000, partition=i % 4) for i in range(400)]
    sent = sent_requests(deployment, records, produce_requests(deployment, records))
    first = worker_pids(process)
    os.kill(first[0][0], signal.SIGKILL)
    out.until(lambda: len(worker_pids(process).get(0, [])) == 2, "worker 0 restarted")
    process.wait_ready(times=3)
    out.until(lambda: distinct(out, [target]) >= len(sent), "all 400 delivered")

    check_all(delivered(out, [target]), sent)
    assert out.on(deployment.dlq) == []
    assert "exited with signal SIGKILL; restarting it" in process.log()
    assert process.terminate() == 0
    pids = [pid for started in worker_pids(process).values() for pid in started]
    assert len(pids) == 3
    assert [pid for pid in pids if alive(pid)] == []
    assert "error[" not in process.log()


@kafka
def test_a_worker_that_keeps_dying_ends_the_parent_with_an_error(
    deploy: Deploy, start_kdelay: Start,
) -> None:
    deployment = deploy(partitions=2)
    held = StateDirLock(deployment.state_dir / "worker-1")
    try:
        process = start_kdelay(deployment, KDELAY_WORKERS="2")
        code = process.popen.wait(timeout=120)
    finally:
        held.release()
    log = process.log()
    assert code == 1, log
    assert len(worker_pids(process)[1]) == 5, log
    assert log.count("error[state-dir-in-use]") == 5, log
    assert "error[workers-failing]: worker 1 died 5 times in a row" in log
    assert [pid for started in worker_pids(process).values() for pid in started
            if alive(pid)] == []
