"""``kdelay export`` and ``kdelay import`` end to end: a move between two deployments.

Two deployments (different requests, changelog and DLQ topics) share the test
broker. Schedules taken in by the first are exported after it stops, imported
twice into the second, and must each arrive once from the second: on time by
the record timestamps (never before the due time the first deployment gave
them), key, value and user headers intact, the due time carried over.

The target is paused in both deployments until the checks of what is pending
are done: the near schedules stay pending however long the moves take on a
busy machine (they fall due during them there), and go out on resume.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay.view.archive import Archived, ArchiveReader, ArchiveWriter, Header, Trailer
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests, run_cli

kafka = pytest.mark.kafka
Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]
NEAR_MS = 5_000
HOUR_MS = 3_600_000


def cli(deployment: Deployment, view: Path, *args: str) -> Any:
    """Run one operator command with ``--json``; return its parsed output (lines for ``due``)."""
    result = run_cli(deployment.env(KDELAY_VIEW_DIR=str(view)), *args, "--json")
    assert result.returncode == 0, result.stderr
    if args[0] == "due":
        return [json.loads(line) for line in result.stdout.splitlines()]
    return json.loads(result.stdout)


def due_rows(deployment: Deployment, view: Path) -> list[dict[str, Any]]:
    """The ``due --within 2h`` rows of ``deployment``."""
    rows: list[dict[str, Any]] = cli(deployment, view, "due", "--within", "2h")
    return rows


def transfer(deployment: Deployment, view: Path, *args: str) -> str:
    """Run ``export`` or ``import``; return its summary line."""
    result = run_cli(deployment.env(KDELAY_VIEW_DIR=str(view)), *args, timeout_s=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def request(target: str, i: int, delay_ms: int, **extra: Any) -> dict[str, Any]:
    """A request with its own key, value and user headers (one with a null value)."""
    headers: list[tuple[str, bytes | None]] = [
        ("kdelay-target", target.encode()), ("kdelay-delay-ms", str(delay_ms).encode()),
        ("trace", f"t-{i}".encode()), ("empty", None), ("trace", b"\x00\xff")]
    if "id" in extra:
        headers.append(("kdelay-id", extra["id"].encode()))
    if "to" in extra:
        headers.append(("kdelay-partition", str(extra["to"]).encode()))
    return {"partition": i % 2, "key": extra.get("key", f"k{i}".encode()),
            "value": extra.get("value", bytes(range(256)) * (i + 1)), "headers": headers}


def same(key: bytes | None, value: bytes | None,
         records: list[dict[str, Any]]) -> dict[str, Any]:
    """The one record of ``records`` with this key and value."""
    found = [r for r in records if (r["key"], r["value"]) == (key, value)]
    assert len(found) == 1, (key, value)
    return found[0]


def wait_pending(deployment: Deployment, view: Path, count: int,
                 timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The ``due --within 2h`` rows of ``deployment`` once there are ``count`` of them."""
    deadline = time.monotonic() + timeout_s
    rows = due_rows(deployment, view)
    while len(rows) < count:
        assert time.monotonic() < deadline, f"{len(rows)} of {count} pending after {timeout_s}s"
        time.sleep(0.2)
        rows = due_rows(deployment, view)
    return rows


def user_headers(record: dict[str, Any]) -> list[tuple[str, bytes | None]]:
    """The headers of a request or delivered record that are not ``kdelay-*``."""
    return [(k, v) for k, v in record["headers"] or [] if not k.startswith("kdelay-")]


def received_headers(message: Message) -> dict[str, bytes | None]:
    """The headers of a delivered record by name (the last of each name)."""
    pairs = message.headers() or []
    assert isinstance(pairs, list)
    return {name: value if not isinstance(value, str) else value.encode()
            for name, value in pairs}


@kafka
def test_pending_schedules_move_to_another_deployment_once_and_on_time(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    admin: AdminClient, tmp_path: Path,
) -> None:
    source, destination = deploy(partitions=2), deploy(partitions=3)
    target = topic_factory("e2e-target", 2)
    view, file = tmp_path / "view", tmp_path / "pending.jsonl.gz"
    out = receiver([target])
    for deployment in (source, destination):
        paused = run_cli(deployment.env(), "target", "pause", target, "--reason", "moving")
        assert paused.returncode == 0, paused.stderr
    old = start_kdelay(source)
    old.wait_ready()
    records = [request(target, 0, NEAR_MS, id="with-id"), request(target, 1, NEAR_MS),
               request(target, 2, NEAR_MS, key=None, value=None, to=1),
               request(target, 3, NEAR_MS + 1, id="also"), request(target, 4, HOUR_MS)]
    reports = produce_requests(source, records)
    pending = wait_pending(source, view, len(records))
    assert old.terminate() == 0
    due = {(row["partition"], row["offset"]): row["due_ms"] for row in pending}
    sent = {(r.partition(), r.offset()): same(r.key(), r.value(), records) for r in reports}

    summary = transfer(source, view, "export", "--output", str(file))
    assert summary == f"exported 5 of 5 pending schedules to {file}"
    checked = run_cli(destination.env(), "import", str(file), "--check")
    assert checked.returncode == 0, checked.stderr
    assert "5 entries" in checked.stdout

    # Twice before the destination's service runs: the service drops the second five.
    for _ in range(2):
        imported = transfer(destination, view, "import", str(file))
        assert imported.startswith("sent 5, skipped 0"), imported
    start_kdelay(destination).wait_ready()
    moved = wait_pending(destination, view, len(records))
    # Once more while they are pending: the import itself skips them.
    again = transfer(destination, view, "import", str(file))
    assert again.startswith("sent 0, skipped 5"), again
    assert len(due_rows(destination, view)) == len(records)
    assert sorted(row["due_ms"] for row in moved) == sorted(due.values())
    assert out.on(target) == []

    resumed = run_cli(destination.env(), "target", "resume", target)
    assert resumed.returncode == 0, resumed.stderr
    out.until(lambda: len(out.on(target)) >= 4, "the near schedules delivered")
    out.drain(3.0)
    arrived = out.on(target)
    assert len(arrived) == 4, [r.message.headers() for r in arrived]
    origins: Counter[bytes] = Counter()
    for received in arrived:
        message = received.message
        headers = received_headers(message)
        origin = headers["kdelay-origin"]
        assert origin is not None
        assert origin.decode().startswith(f"{destination.requests}/")
        origins[origin] += 1
        place = next(p for p, r in sent.items() if r is same(message.key(), message.value(),
                                                               records))
        record = sent[place]
        assert user_headers({"headers": message.headers()}) == user_headers(record)
        assert headers["kdelay-due-ms"] == str(due[place]).encode()
        assert message.timestamp()[1] >= due[place], "delivered before its due time"
        assert received.received_ms >= due[place]
        if record["key"] is None:
            assert message.partition() == 1
    assert set(origins.values()) == {1}

    far = next(place for place, record in sent.items() if record is records[4])
    cluster = admin.describe_cluster().result(timeout=30).cluster_id
    shown = cli(destination, view, "show",
                f"kdelay-export:{cluster}:{source.requests}:{far[0]}:{far[1]}")
    assert (shown["pending"], shown["due_ms"]) == (True, due[far])


@kafka
def test_an_entry_already_due_is_delivered_at_once(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    tmp_path: Path,
) -> None:
    destination = deploy(partitions=1)
    target = topic_factory("e2e-target", 1)
    file = tmp_path / "late.jsonl"
    due_ms = time.time_ns() // 1_000_000 - 60_000
    writer = ArchiveWriter(file, Header("elsewhere", None, due_ms, 1, due_ms))
    writer.write(Archived(due_ms, target, None, "late", b"k", b"v", [("h", b"1")],
                       "elsewhere/0/7", due_ms - 1_000))
    writer.finish({})
    writer.close()
    start_kdelay(destination).wait_ready()
    out = receiver([target])
    assert transfer(destination, tmp_path / "view", "import", str(file)).startswith(
        "sent 1, skipped 0")
    out.until(lambda: len(out.on(target)) == 1, "the overdue entry delivered")
    message = out.on(target)[0].message
    assert (message.key(), message.value()) == (b"k", b"v")
    assert user_headers({"headers": message.headers()}) == [("h", b"1")]
    assert received_headers(message)["kdelay-due-ms"] == str(due_ms).encode()


@kafka
def test_an_import_the_destination_cannot_hold_is_refused_before_sending(
    deploy: Deploy, tmp_path: Path,
) -> None:
    destination = deploy(partitions=1)  # retention.ms 7 days
    file = tmp_path / "far.jsonl"
    due_ms = time.time_ns() // 1_000_000 + 30 * 86_400_000
    writer = ArchiveWriter(file, Header("elsewhere", None, due_ms, 1, due_ms))
    writer.write(Archived(due_ms, "t", None, "far", None, b"v", [], "elsewhere/0/1", due_ms))
    writer.finish({})
    writer.close()
    env = destination.env(KDELAY_VIEW_DIR=str(tmp_path / "view"))
    refused = run_cli(env, "import", str(file))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("error[retention-too-short]: "), refused.stderr
    assert "kdelay retention set " in refused.stderr
    consumer = Consumer({"bootstrap.servers": destination.bootstrap, "group.id": "unused"})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(destination.requests, 0),
                                                   timeout=30)
    finally:
        consumer.close()
    assert high == low == 0, "the refused import sent a request"


@kafka
def test_an_entry_whose_original_expired_is_counted_not_exported(
    deploy: Deploy, start_kdelay: Start, topic_factory: TopicFactory, admin: AdminClient,
    tmp_path: Path,
) -> None:
    source = deploy(partitions=1)
    target = topic_factory("e2e-target", 1)
    view, file = tmp_path / "view", tmp_path / "pending.jsonl"
    start_kdelay(source).wait_ready()
    produce_requests(source, [request(target, 2 * i, HOUR_MS, id=f"r{i}") for i in range(3)])
    wait_pending(source, view, 3)
    # Offset 0 is the warm-up cancel; the requests are at 1, 2 and 3.
    for future in admin.delete_records([TopicPartition(source.requests, 0, 2)]).values():
        future.result(timeout=30)
    result = run_cli(source.env(KDELAY_VIEW_DIR=str(view)), "export", "--output", str(file))
    assert result.returncode == 3, result.stderr
    assert result.stdout.strip() == (f"exported 2 of 3 pending schedules to {file}; "
                                     "not exported: 1 expired")
    with ArchiveReader(file) as reader:
        assert [entry.schedule_id for entry in reader.entries()] == ["r1", "r2"]
        assert reader.trailer == Trailer(2, {"expired": 1})
