"""The operator's commands end to end, against ``kdelay run`` processes that hold their stores.

``due``, ``backlog``, ``show`` and ``retention check`` run as the real command
while the service runs, from their own view directory, and must see every
partition whichever instance owns it; what is delivered or cancelled must
disappear from them, and an original deleted under a pending entry must be
reported. ``docs/runbook-retention.md`` is executed here too: every command it
shows is run against a deployment.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from tests.conftest import ROOT, TopicFactory
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    Receiver,
    produce_requests,
    run_cli,
)

kafka = pytest.mark.kafka
Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]
HOUR_MS = 3_600_000
ASSIGNED = re.compile(r"assigned \[([\d, ]*)\]")
RUNBOOK = ROOT / "docs" / "runbook-retention.md"


def cli(deployment: Deployment, view: Path, *args: str) -> Any:
    """Run one operator command; return its parsed ``--json`` output (lines for ``due``)."""
    result = run_cli(deployment.env(KDELAY_VIEW_DIR=str(view)), *args, "--json")
    assert result.returncode in (0, 3), result.stderr
    if args[0] == "due":
        return [json.loads(line) for line in result.stdout.splitlines()]
    return json.loads(result.stdout)


def request(target: str, partition: int, delay_ms: int, schedule_id: str | None = None,
            key: bytes | None = None) -> dict[str, Any]:
    headers = [("kdelay-target", target.encode()), ("kdelay-delay-ms", str(delay_ms).encode()),
               ("trace", b"t-" + str(partition).encode())]
    if schedule_id is not None:
        headers.append(("kdelay-id", schedule_id.encode()))
    return {"partition": partition, "key": key, "value": b"payload", "headers": headers}


def owned(process: KdelayProcess) -> set[int]:
    """The partitions the process's latest assignment log line names."""
    found = ASSIGNED.findall(process.log())
    return {int(p) for p in found[-1].split(",") if p.strip()} if found else set()


def wait(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.2)


@pytest.mark.compat
@kafka
def test_listing_spans_instances_and_drops_delivered_and_cancelled(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    tmp_path: Path,
) -> None:
    deployment = deploy(partitions=2)
    target = topic_factory("e2e-target", 1)
    view = tmp_path / "view"
    first = start_kdelay(deployment, KDELAY_STATE_DIR=str(tmp_path / "a"))
    first.wait_ready()
    second = start_kdelay(deployment, KDELAY_STATE_DIR=str(tmp_path / "b"))
    wait(lambda: owned(first) | owned(second) == {0, 1} and not owned(first) & owned(second)
         and bool(owned(first)) and bool(owned(second)), "each instance owns one partition")
    out = receiver([target])
    reports = produce_requests(deployment, [
        request(target, 0, HOUR_MS, "far-0", b"k0"), request(target, 1, HOUR_MS, "far-1"),
        request(target, 1, HOUR_MS, "doomed"), request(target, 0, 1_500, "soon")])
    # Not a fixed offset: a request whose id belongs on the other partition is
    # forwarded there by kdelay, and that forward may land before far-0 does.
    far_0 = next(r.offset() for r in reports if r.partition() == 0 and r.key() == b"k0")

    def ids(*args: str) -> set[str | None]:
        return {row["id"] for row in cli(deployment, view, "due", "--within", "2h", *args)}

    wait(lambda: ids() >= {"far-0", "far-1", "doomed"}, "intake of both partitions")
    out.until(lambda: len(out.on(target)) == 1, "the soon entry delivered")
    produce_requests(deployment, [{"partition": 1, "headers": [("kdelay-cancel", b"doomed")]}])
    wait(lambda: ids() == {"far-0", "far-1"}, "the cancelled entry gone")

    rows = {row["id"]: row for row in cli(deployment, view, "due", "--within", "2h")}
    assert (rows["far-0"]["partition"], rows["far-1"]["partition"]) == (0, 1)
    assert rows["far-0"] | {"due_ms": 0} == {
        "due_ms": 0, "topic": deployment.requests, "partition": 0, "offset": far_0, "id": "far-0",
        "target": target, "lane": None, "key": "k0", "key_hex": "6b30", "value_bytes": 7,
        "record_ms": rows["far-0"]["record_ms"], "original": "found", "held_by": None}
    assert rows["far-0"]["due_ms"] == rows["far-0"]["record_ms"] + HOUR_MS
    assert ids("--within", "1m") == set()
    assert ids("--partition", "1") == {"far-1"}
    assert ids("--target", "elsewhere") == set()

    backlog = cli(deployment, view, "backlog", "--by", "target", "--bucket", "1d")
    assert (backlog["pending"], backlog["overdue"]) == (2, 0)
    assert backlog["by_partition"] == {"0": 1, "1": 1}
    assert backlog["by_target"] == {target: 2}
    assert sum(b["count"] for b in backlog["buckets"]) == 2
    assert backlog["earliest_due_ms"] == min(r["due_ms"] for r in rows.values())
    cached = cli(deployment, view, "backlog", "--by", "target", "--bucket", "1d")
    assert cached | {"now_ms": 0} == backlog | {"now_ms": 0}  # targets from the view's cache

    shown = cli(deployment, view, "show", "far-1")
    assert (shown["pending"], shown["target"], shown["partition"]) == (True, target, 1)
    assert shown["headers"] == [["kdelay-target", target], ["kdelay-delay-ms", str(HOUR_MS)],
                                ["trace", "t-1"], ["kdelay-id", "far-1"]]
    by_coordinates = cli(deployment, view, "show", f"{deployment.requests}/0/{far_0}")
    assert (by_coordinates["id"], by_coordinates["pending"]) == ("far-0", True)
    for gone in ("doomed", "soon", "never-sent"):
        assert not cli(deployment, view, "show", gone)["pending"]
    foreign = run_cli(deployment.env(KDELAY_VIEW_DIR=str(view)), "show", "other/0/1")
    assert foreign.returncode == 2
    assert foreign.stderr.startswith("error[not-a-request]")


@pytest.mark.compat
@kafka
def test_retention_check_reports_expired_and_late_originals(
    deploy: Deploy, start_kdelay: Start, admin: AdminClient, tmp_path: Path,
) -> None:
    deployment = deploy(partitions=1)
    view = tmp_path / "view"
    start_kdelay(deployment).wait_ready()
    produce_requests(deployment, [request("t", 0, 2 * HOUR_MS, f"r{i}") for i in range(3)])
    wait(lambda: len(cli(deployment, view, "due", "--within", "3h")) == 3, "intake")
    clean = cli(deployment, view, "retention", "check")
    assert (clean["at_risk"], clean["partitions"][0]["oldest_pending_offset"]) == (0, 1)
    assert clean["recommended_retention_ms"] == 3 * HOUR_MS  # 2 h delay + 1 h margin

    low = TopicPartition(deployment.requests, 0, 3)
    for future in admin.delete_records([low]).values():
        future.result(timeout=30)
    report = cli(deployment, view, "retention", "check")
    partition = report["partitions"][0]
    assert (partition["log_start_offset"], partition["expired"], report["expired"]) == (3, 2, 2)
    assert (report["at_risk"], partition["headroom_ms"]) == (2, 0)
    assert [(r["partition"], r["offset"], r["why"]) for r in report["at_risk_records"]] == [
        (0, 1, "expired"), (0, 2, "expired")]
    assert run_cli(deployment.env(KDELAY_VIEW_DIR=str(view)), "retention", "check"
                   ).returncode == 3
    shown = cli(deployment, view, "show", "r0")
    assert (shown["pending"], shown["original"]) == (True, "expired")

    # Below the default levels and margin: allowed only with a 1 s level table and no margin.
    lowered = run_cli(deployment.env(KDELAY_LEVELS="1s", KDELAY_RETENTION_MARGIN_MS="0"),
                      "retention", "set", "1h")
    assert lowered.returncode == 0, lowered.stderr
    late = cli(deployment, view, "retention", "check")
    assert (late["retention_ms"], late["at_risk"]) == (HOUR_MS, 3)
    assert [r["why"] for r in late["at_risk_records"]] == ["expired", "expired", "retention"]
    assert late["at_risk_records"][2]["expires_ms"] < late["at_risk_records"][2]["due_ms"]
    assert late["partitions"][0]["headroom_ms"] < late["partitions"][0]["due_in_ms"]


def runbook_commands() -> list[str]:
    """Every ``$ kdelay ...`` line of the runbook's fenced blocks, in order."""
    commands, fenced = [], False
    for line in RUNBOOK.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith("$ "):
            commands.append(line[2:].split("  #")[0].strip())
    return commands


@kafka
def test_every_runbook_command_runs(deploy: Deploy, start_kdelay: Start,
                                    tmp_path: Path) -> None:
    deployment = deploy(partitions=1)
    env = deployment.env(KDELAY_VIEW_DIR=str(tmp_path / "view"))
    start_kdelay(deployment).wait_ready()
    commands = runbook_commands()
    assert len(commands) >= 6, commands
    assert all(c.startswith("kdelay ") for c in commands), commands
    for command in commands:
        result = run_cli(env, *shlex.split(command)[1:])
        allowed = (0, 3) if "retention check" in command else (0,)
        assert result.returncode in allowed, f"{command}: {result.stderr}"


@kafka
def test_show_reports_a_series_and_its_next_occurrence(
    deploy: Deploy, start_kdelay: Start, tmp_path: Path,
) -> None:
    deployment = deploy(partitions=2)
    view = tmp_path / "view"
    start_kdelay(deployment).wait_ready()
    sent = run_cli(deployment.env(), "send", "orders", "--value", "tick", "--every", "1h",
                   "--id", "hourly-report")
    assert sent.returncode == 0, sent.stderr
    first_ms = int(sent.stdout.split("first-due-ms=")[1])

    def shown() -> Any:
        return cli(deployment, view, "show", "hourly-report")

    wait(lambda: shown()["pending"], "the first occurrence pending")
    series = shown()["series"]
    assert series == {"id": "hourly-report", "spec": "every 1h", "n": 1,
                      "due_ms": first_ms, "next_due_ms": first_ms + HOUR_MS,
                      "until_ms": None, "count": None, "target": "orders"}
    text = run_cli(deployment.env(KDELAY_VIEW_DIR=str(view)), "show", "hourly-report")
    assert "series hourly-report: every 1h (no end), to orders" in text.stdout
    assert "this is occurrence 1; next occurrence" in text.stdout
