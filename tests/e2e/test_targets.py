"""``kdelay target pause|resume|limit|list`` end to end, against a ``kdelay run`` process.

The controls are written by the real command, the service applies them from the
controls topic, and ``target list`` counts what each holds back from the
operator's view. Requests are due on arrival (a past due time), so nothing waits
on the wall clock for a due time: the waits below are for the service to act.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TopicFactory
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    Receiver,
    produce_requests,
    run_cli,
)

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]
HELD = 30


def wait(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.2)


def target(deployment: Deployment, view: Path, *args: str) -> Any:
    """Run ``kdelay target ARGS --json`` when it lists, else as is; return its output."""
    result = run_cli(deployment.env(KDELAY_VIEW_DIR=str(view)), "target", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if "--json" in args else result.stdout


def due_now(name: str, count: int) -> list[dict[str, Any]]:
    past = str(int(time.time() * 1000) - 60_000).encode()
    return [{"partition": i % 2, "key": f"k{i}".encode(), "value": b"payload",
             "headers": [("kdelay-target", name.encode()), ("kdelay-due-ms", past)]}
            for i in range(count)]


@pytest.mark.kafka
def test_pause_list_resume_and_limit_through_the_commands(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    tmp_path: Path,
) -> None:
    deployment = deploy(partitions=2)
    orders, billing = topic_factory("e2e-orders", 1), topic_factory("e2e-billing", 1)
    view = tmp_path / "view"
    service = start_kdelay(deployment, KDELAY_STATE_DIR=str(tmp_path / "state"))
    service.wait_ready()
    out = receiver([orders, billing])

    said = target(deployment, view, "pause", orders, "--reason", "orders-db maintenance",
                  "--by", "alice")
    assert said.strip() == f"target {orders}: paused"
    wait(lambda: f"target {orders} paused by alice" in service.log(),
         "the service applies the pause")
    produce_requests(deployment, due_now(orders, HELD) + due_now(billing, 5))
    out.until(lambda: len(out.on(billing)) == 5, "the other target flows")

    def listed() -> dict[str, Any]:
        [row] = target(deployment, view, "list", "--json")
        return dict(row)

    wait(lambda: listed()["held_back"] == HELD, "target list counts the held-back records")
    row = listed()
    assert (row["scope"], row["name"], row["paused_by"], row["reason"]) == (
        "target", orders, "alice", "orders-db maintenance")
    assert row["oldest_held_due"] is not None
    assert out.on(orders) == []
    table = target(deployment, view, "list")
    assert "held back" in table
    assert "orders-db maintenance" in table

    target(deployment, view, "resume", orders, "--catch-up-rate", "50/s", "--by", "alice")
    out.until(lambda: len(out.on(orders)) == HELD, "the held records go out on resume")
    wait(lambda: listed()["held_back"] == 0, "nothing held back any more")
    resumed = listed()
    assert (resumed["paused_since"], resumed["catch_up_per_s"]) == (None, 50.0)

    said = target(deployment, view, "limit", orders, "1000/s", "--by", "bob")
    assert said.strip() == f"target {orders}: delivering, cap 1000/s, catch-up 50/s"
    [capped] = target(deployment, view, "list", "--json", "--no-backlog")
    assert (capped["rate_per_s"], capped["changed_by"], capped["held_back"]) == (
        1000.0, "bob", None)
    said = target(deployment, view, "limit", orders, "--off")
    assert said.strip() == f"target {orders}: delivering, catch-up 50/s"
    target(deployment, view, "resume", orders)  # no catch-up rate: nothing left in force
    assert target(deployment, view, "list", "--json") == []


@pytest.mark.kafka
@pytest.mark.parametrize(("args", "code"), [
    (("limit", "orders", "fast"), "bad-control"),
    (("limit", "orders"), "invalid-argument"),
    (("pause", "{requests}", "--reason", "x"), "bad-control"),
])
def test_a_wrong_control_is_refused_with_its_code(
    deploy: Deploy, tmp_path: Path, args: tuple[str, ...], code: str,
) -> None:
    deployment = deploy(partitions=1)
    named = [arg.format(requests=deployment.requests) for arg in args]
    result = run_cli(deployment.env(KDELAY_VIEW_DIR=str(tmp_path / "view")), "target", *named)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error[{code}]"), result.stderr
