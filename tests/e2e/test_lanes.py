"""Lanes end to end: ``kdelay run --lanes`` with default settings, ``send --lane``,
``due --lane`` and ``backlog --lane`` as the real commands."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, run_cli

kafka = pytest.mark.kafka


def _json(result: Any) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@kafka
def test_lanes_keep_two_environments_apart_and_due_lists_one_lane(
    deploy: Callable[..., Deployment], start_kdelay: Callable[..., KdelayProcess],
    receiver: Callable[[list[str]], Receiver], topic_factory: TopicFactory, tmp_path: Path,
) -> None:
    run = uuid.uuid4().hex[:8]
    first, second = f"dev1-{run}.", f"dev2-{run}."
    lanes = f"dev1={first},dev2={second}"
    deployment = deploy(partitions=2)
    one, two = topic_factory(f"{first}orders", 1), topic_factory(f"{second}orders", 1)
    env = deployment.env(KDELAY_LANES=lanes, KDELAY_VIEW_DIR=str(tmp_path / "view"))
    kdelay = start_kdelay(deployment, KDELAY_LANES=lanes)
    kdelay.wait_ready()

    def send(target: str, lane: str, *args: str) -> None:
        result = run_cli(env, "send", target, "--lane", lane, "--value", "v", *args)
        assert result.returncode == 0, result.stderr

    send(one, "dev1", "--delay", "1s", "--key", "soon-1")
    send(two, "dev2", "--delay", "1s", "--key", "soon-2")
    send(two, "dev1", "--delay", "1s", "--key", "crossing")
    send(one, "dev1", "--delay", "2h", "--id", "far-1")
    send(two, "dev2", "--delay", "2h", "--id", "far-2")
    out = receiver([one, two, deployment.dlq])
    out.until(lambda: len(out.received) >= 3, "two deliveries and one refusal")
    out.drain(1.0)
    assert [r.message.key() for r in out.on(one)] == [b"soon-1"]
    assert [r.message.key() for r in out.on(two)] == [b"soon-2"]
    [dead] = [r.message for r in out.on(deployment.dlq)]
    assert dead.key() == b"crossing"
    assert dict(dead.headers() or [])[envelope.ERROR] == b"wrong-lane"

    def due(*args: str) -> dict[str | None, str | None]:
        result = run_cli(env, "due", "--within", "3h", "--json", *args)
        assert result.returncode == 0, result.stderr
        rows = [json.loads(line) for line in result.stdout.splitlines()]
        return {row["id"]: row["lane"] for row in rows}

    assert due() == {"far-1": "dev1", "far-2": "dev2"}
    assert due("--lane", "dev1") == {"far-1": "dev1"}
    assert due("--lane", "dev2") == {"far-2": "dev2"}
    assert due("--lane", "staging") == {}

    shown = _json(run_cli(env, "show", "far-2", "--json"))
    assert (shown["pending"], shown["target"], shown["lane"]) == (True, two, "dev2")
    text = run_cli(env, "show", "far-2")
    assert f"goes to {two} (lane dev2)" in text.stdout

    backlog = _json(run_cli(env, "backlog", "--lane", "dev1", "--bucket", "1d", "--json"))
    assert (backlog["lane"], backlog["pending"], backlog["overdue"]) == ("dev1", 1, 0)
    assert backlog["by_target"] == {one: 1}
    assert sum(backlog["by_partition"].values()) == 1
    everything = _json(run_cli(env, "backlog", "--bucket", "1d", "--json"))
    assert everything["pending"] == 2
    cached = _json(run_cli(env, "backlog", "--lane", "dev2", "--bucket", "1d", "--json"))
    assert (cached["pending"], cached["by_target"]) == (1, {two: 1})

    _moved_with_their_lanes(deploy, start_kdelay, env, lanes, tmp_path)
    _one_id_in_two_lanes(env, send, due, {"dev1": one, "dev2": two})

    series = run_cli(env, "send", one, "--lane", "dev1", "--every", "5m")
    assert series.returncode == 2
    assert series.stderr.startswith("error[invalid-argument]")
    bad = run_cli(env, "send", one, "--lane", "dev 1", "--delay", "1s")
    assert bad.returncode == 2
    assert "not a lane name" in bad.stderr
    assert kdelay.terminate() == 0


def _one_id_in_two_lanes(env: dict[str, str], send: Callable[..., None],
                         due: Callable[..., dict[str | None, str | None]],
                         targets: dict[str, str]) -> None:
    """The same id in dev1 and dev2 is two schedules; a cancel reaches its own lane's."""
    for lane in ("dev1", "dev2"):
        send(targets[lane], lane, "--delay", "2h", "--id", "twin", "--wait")  # both scheduled
    unlaned = run_cli(env, "cancel", "twin", "--wait")
    assert unlaned.returncode == 4, unlaned.stdout + unlaned.stderr  # unknown: no lane-less twin
    cancelled = run_cli(env, "cancel", "twin", "--lane", "dev1", "--wait")
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert "\ncancelled twin schedule=" in cancelled.stdout
    assert cancelled.stdout.rstrip().endswith(" lane=dev1")
    deadline = time.monotonic() + 30  # the view reads the changelog, written alongside
    while "twin" in due("--lane", "dev1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "twin" not in due("--lane", "dev1")
    assert due("--lane", "dev2")["twin"] == "dev2"
    shown = _json(run_cli(env, "show", "twin", "--json"))
    assert (shown["pending"], shown["lane"]) == (True, "dev2")


def _moved_with_their_lanes(deploy: Callable[..., Deployment],
                            start_kdelay: Callable[..., KdelayProcess], env: dict[str, str],
                            lanes: str, tmp_path: Path) -> None:
    """Export the two pending schedules and import them into a second laned deployment."""
    file = tmp_path / "pending.jsonl"
    exported = run_cli(env, "export", "--output", str(file))
    assert exported.returncode == 0, exported.stderr
    entries = [json.loads(line) for line in file.read_text().splitlines()[1:-1]]
    assert {entry["id"]: entry["lane"] for entry in entries} == {"far-1": "dev1", "far-2": "dev2"}
    destination = deploy(partitions=1)
    there = destination.env(KDELAY_LANES=lanes, KDELAY_VIEW_DIR=str(tmp_path / "view-2"))
    imported = run_cli(there, "import", str(file))
    assert imported.returncode == 0, imported.stderr
    start_kdelay(destination, KDELAY_LANES=lanes).wait_ready()
    deadline = time.monotonic() + 60

    def due(*args: str) -> list[tuple[str, str]]:
        result = run_cli(there, "due", "--within", "3h", "--json", *args)
        assert result.returncode == 0, result.stderr
        return [(row["id"], row["lane"]) for row in map(json.loads, result.stdout.splitlines())]

    while len(due()) < len(entries) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert due("--lane", "dev1") == [("far-1", "dev1")]
    assert due("--lane", "dev2") == [("far-2", "dev2")]
