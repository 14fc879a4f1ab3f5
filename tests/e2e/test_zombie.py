"""No zombie: an instance that can no longer serve ends, and a running one shows it runs.

A second ``kdelay run`` on the state dir of a running one must stop before it
talks to the group: joining under the same static member id would fence the
first. An instance fenced anyway (another process started with its
``--instance-id``) must exit with ``error[fenced]`` and a non-zero code, so a
supervisor restarts it, instead of running on serving nothing. And a running
loop advances ``kdelay_last_step_timestamp_seconds``, the heartbeat the
``KdelayStalled`` alert watches.
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests
from tests.e2e.prometheus_server import free_port

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

kafka = pytest.mark.kafka
EXIT_TIMEOUT_S = 30.0
HEARTBEAT = re.compile(r"^kdelay_last_step_timestamp_seconds (\S+)$", re.MULTILINE)


def due_now(target: str, count: int, prefix: str) -> list[dict[str, Any]]:
    """``count`` keyed requests due at once, spread over three request partitions."""
    return [{"key": f"{prefix}{i}".encode(), "value": b"v", "partition": i % 3,
             "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"0")]}
            for i in range(count)]


def exit_code(process: KdelayProcess, timeout_s: float = EXIT_TIMEOUT_S) -> int:
    """Wait for ``process`` to exit on its own; fail if it still runs after ``timeout_s``."""
    try:
        return process.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{process.name} still runs {timeout_s}s later:\n{process.tail()}")


def delivered(out: Receiver, count: int, what: str) -> set[bytes]:
    """Wait until ``count`` records arrived; return their keys."""
    out.until(lambda: out.poll() >= count, what, 60)
    return {r.message.key() or b"" for r in out.received}


@kafka
def test_a_second_instance_on_the_same_state_dir_stops_before_it_fences_the_first(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("target", 3)
    first = start_kdelay(deployment)
    first.wait_ready()
    second = start_kdelay(deployment)
    assert exit_code(second) != 0
    assert "error[state-dir-in-use]" in second.log()
    assert "assigned" not in second.log()
    produce_requests(deployment, due_now(target, 30, "after-"))
    out = receiver([target])
    keys = delivered(out, 30, "the first instance serves on")
    assert keys == {f"after-{i}".encode() for i in range(30)}
    assert first.popen.poll() is None
    assert first.terminate() == 0


@kafka
@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_an_instance_fenced_by_another_with_its_ids_exits_with_an_error(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    guarantee: str,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("target", 3)
    first = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee, KDELAY_INSTANCE_ID="twin")
    first.wait_ready()
    second = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee, KDELAY_INSTANCE_ID="twin",
                          KDELAY_STATE_DIR=str(deployment.state_dir) + "-other")
    second.wait_ready()
    assert exit_code(first) != 0
    errors = [line for line in first.log().splitlines() if "error[fenced]" in line]
    assert len(errors) == 1, first.tail()
    assert "Traceback" not in first.log()
    produce_requests(deployment, due_now(target, 30, "after-"))
    out = receiver([target])
    keys = delivered(out, 30, "the instance that took over serves")
    assert keys == {f"after-{i}".encode() for i in range(30)}


def heartbeat(port: int) -> float:
    """The service's ``kdelay_last_step_timestamp_seconds``, scraped from its endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        found = HEARTBEAT.search(response.read().decode())
    assert found is not None, "kdelay_last_step_timestamp_seconds is not exported"
    return float(found.group(1))


@kafka
def test_an_idle_service_keeps_its_heartbeat_fresh(
    deploy: Deploy, start_kdelay: Start,
) -> None:
    deployment = deploy(partitions=3)
    port = free_port()
    service = start_kdelay(deployment, KDELAY_METRICS_PORT=str(port))
    service.wait_ready()
    first = heartbeat(port)
    time.sleep(1.0)  # no traffic at all: the loop must step anyway
    second = heartbeat(port)
    assert second > first
    assert abs(time.time() - second) < 2.0
    assert service.terminate() == 0
