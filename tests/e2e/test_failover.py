"""Instances that die, come back or are many, with default settings only.

No test here sets ``--instance-id`` or any timeout: a restarted instance must
take its partitions back at once (static membership under an id derived from
host name and state dir), an instance that died for good must be replaced by
the survivors within the session timeout, and instances started from one
image (same ``/state`` path, own host names) must never fence each other.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.e2e.conftest import (
    FAILOVER_S,
    Deployment,
    KdelayProcess,
    Receiver,
    produce_requests,
)

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

kafka = pytest.mark.kafka
# What docs/operations/deployment.md promises: serving again within 10 s of a restart; a dead
# instance's partitions are served by a survivor within FAILOVER_S (see its comment).
RESTART_SERVING_S = 10.0
GUARANTEES = ["at-least-once", "exactly-once"]


def requests(target: str, count: int, due_ms: int, prefix: str) -> list[dict[str, Any]]:
    """``count`` keyed requests due at ``due_ms``, spread over three request partitions."""
    return [{"key": f"{prefix}{i}".encode(), "value": b"v", "partition": i % 3,
             "headers": [(envelope.TARGET, target.encode()),
                         (envelope.DUE_MS, str(due_ms).encode())]}
            for i in range(count)]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def assert_each_once(out: Receiver, keys: set[bytes]) -> None:
    seen = Counter(r.message.key() for r in out.received)
    assert set(seen) == keys
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:10]


@kafka
@pytest.mark.parametrize("guarantee", GUARANTEES)
def test_a_killed_instance_restarted_with_the_same_settings_serves_again_at_once(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    guarantee: str,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("target", 3)
    first = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee)
    first.wait_ready()
    produce_requests(deployment, requests(target, 30, now_ms() + 2_000, "before-"))
    first.kill()
    restarted = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee)
    serving_s = restarted.wait_ready()
    produce_requests(deployment, requests(target, 30, now_ms(), "after-"))
    out = receiver([target])
    out.until(lambda: out.poll() >= 60, "every request delivered after the restart", 60)
    out.drain(1.0)
    print(f"restart to serving ({guarantee}): {serving_s:.2f} s")
    assert serving_s < RESTART_SERVING_S
    keys = {f"{p}{i}".encode() for p in ("before-", "after-") for i in range(30)}
    if guarantee == "exactly-once":
        assert_each_once(out, keys)
    else:
        assert {r.message.key() for r in out.received} == keys


@kafka
@pytest.mark.parametrize("guarantee", GUARANTEES)
def test_the_partitions_of_an_instance_that_died_for_good_move_to_a_survivor(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    tmp_path: Path, guarantee: str,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("target", 3)
    doomed = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee,
                          KDELAY_STATE_DIR=str(tmp_path / "doomed"))
    doomed.wait_ready()
    survivor = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee,
                            KDELAY_STATE_DIR=str(tmp_path / "survivor"))
    survivor.wait_ready()
    doomed.wait_ready(times=2)  # the group has rebalanced: both own partitions
    produce_requests(deployment, requests(target, 60, now_ms() + 1_000, "k"))
    killed = time.monotonic()
    doomed.kill()
    survivor.wait_ready(timeout_s=60, times=2)
    failover_s = time.monotonic() - killed
    out = receiver([target])
    out.until(lambda: out.poll() >= 60, "every request delivered by the survivor", 60)
    print(f"dead instance to survivor serving ({guarantee}): {failover_s:.2f} s")
    assert failover_s < FAILOVER_S
    assert {r.message.key() for r in out.received} == {f"k{i}".encode() for i in range(60)}


def _namespaces_available() -> bool:
    probe = subprocess.run(["unshare", "--mount", "--uts", "true"], capture_output=True,
                           check=False)
    return probe.returncode == 0


def _container(host: str, own_dir: Path, shared_path: Path) -> tuple[str, ...]:
    """A command prefix that runs the rest as in a container: own host name, own ``/state``.

    ``unshare`` gives the process its own mount and UTS namespaces; inside, the
    instance's own directory is bind-mounted over ``shared_path``, so both
    instances see the same state-dir path, as containers of one image do.
    """
    own_dir.mkdir(parents=True)
    script = f'hostname {host} && mount --bind {own_dir} {shared_path} && exec "$@"'
    return ("unshare", "--mount", "--uts", "--", "sh", "-c", script, "sh")


@kafka
def test_two_exactly_once_instances_with_one_state_dir_path_never_fence_each_other(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    tmp_path: Path,
) -> None:
    if not _namespaces_available():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("unshare --mount --uts is not permitted; CI runs as root")
        pytest.skip("needs unshare --mount --uts (root)")
    deployment = deploy(partitions=3)
    target = topic_factory("target", 3)
    shared = tmp_path / "state"
    shared.mkdir()
    env = {"KDELAY_GUARANTEE": "exactly-once", "KDELAY_STATE_DIR": str(shared)}
    a = start_kdelay(deployment, prefix=_container("kdelay-a", tmp_path / "a", shared), **env)
    a.wait_ready()
    produce_requests(deployment, requests(target, 150, now_ms() + 500, "early-"))
    b = start_kdelay(deployment, prefix=_container("kdelay-b", tmp_path / "b", shared), **env)
    b.wait_ready()
    produce_requests(deployment, requests(target, 150, now_ms() + 1_500, "late-"))
    out = receiver([target])
    out.until(lambda: out.poll() >= 300, "every request delivered once", 90)
    out.drain(3.0)
    keys = {f"{p}{i}".encode() for p in ("early-", "late-") for i in range(150)}
    assert_each_once(out, keys)
    assert a.popen.poll() is None, a.tail()
    assert b.popen.poll() is None, b.tail()
    assert "kdelay-a-" in a.log()
    assert "kdelay-b-" in b.log()
    assert not any((tmp_path / "state").iterdir()), "instances wrote past their own mounts"
