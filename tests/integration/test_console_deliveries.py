"""The console's deliveries, lateness and trace ends, against what the targets received.

A service delivers requests with ids to two targets on a manual clock; one
schedule is cancelled and one rescheduled. The console's reads must then list exactly the
records the targets hold (target, partition, offset, id, lateness), sum them
up per target as they are, and trace a delivered id to its target record
(a rescheduled one: late against its new due time) and a cancelled one to
its cancel: all read from the broker, under both
guarantees (under exactly-once the targets end with commit markers no reader
sees, which the bounded reads must not wait on).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from kdelay.view.deliveries import percentile
from kdelay.web.reads import Reads
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, header, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
COUNT = 20


def _request(target: str, due_ms: int, schedule_id: str) -> dict[str, object]:
    return {"key": schedule_id.encode(), "value": b"{}", "partition": 0, "headers": [
        (envelope.TARGET, target.encode()), (envelope.DUE_MS, str(due_ms).encode()),
        (envelope.SCHEDULE_ID, schedule_id.encode())]}


@pytest.mark.kafka
def test_the_console_shows_what_the_targets_received(
    deployment_factory: Make, running: Run, bootstrap: str, tmp_path: Path,
    topic_factory: TopicFactory, collector: Callable[[list[str]], Collector],
) -> None:
    deployment = deployment_factory(partitions=2)
    orders, mail = topic_factory("orders", 2), topic_factory("mail", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    group.add()
    start = clock.now_ms()
    records = [_request(orders if n % 4 else mail, start + 1_000 + 37 * n, f"ord-{n}")
               for n in range(COUNT)]
    records.append(_request(orders, start + 3_600_000, "ord-kept-back"))
    records.append(_request(orders, start + 3_600_000, "ord-moved"))
    produce(bootstrap, deployment.requests, records)
    moved_due = start + 2_000
    produce(bootstrap, deployment.requests, [
        {"partition": 0, "headers": [(envelope.CANCEL, b"ord-kept-back")]},
        {"partition": 0, "headers": envelope.reschedule_headers("ord-moved", due_ms=moved_due)}])
    targets = collector([orders, mail])
    group.until(lambda: targets.poll() >= COUNT + 1, advance_ms=150)
    group.until(lambda: clock.now_ms() >= start + 20_000, advance_ms=500)  # seals
    group.close()

    received = {}
    for message in targets.messages:
        origin = (header(message, envelope.ORIGIN) or b"").decode()
        due = int(header(message, envelope.DUE_MS) or b"0")
        received[origin] = (message.topic(), message.partition(), message.offset(),
                            message.timestamp()[1] - due)
    ids = {f"{deployment.requests}/0/{n}": f"ord-{n}" for n in range(COUNT)}
    ids[f"{deployment.requests}/0/{COUNT + 1}"] = "ord-moved"

    reads = Reads(deployment.settings, tmp_path / "console", clock, audit_topic="no-audit")
    shown = reads.deliveries()
    assert {d.origin: (d.target, d.partition, d.offset, d.lateness_ms)
            for d in shown.deliveries} == received
    assert {d.origin: d.schedule_id for d in shown.deliveries} == ids
    assert [d.delivered_ms for d in shown.deliveries] == sorted(
        (d.delivered_ms for d in shown.deliveries), reverse=True), "newest first"
    only_mail = reads.deliveries(mail)
    assert {d.target for d in only_mail.deliveries} == {mail}
    assert len(only_mail.deliveries) == COUNT // 4

    report = reads.lateness(3_600_000)
    assert {orders, mail} <= set(report.targets)
    for row in report.rows:
        late = sorted(v[3] for v in received.values() if v[0] == row.target)
        assert (row.count, row.early, row.max_ms) == (len(late), 0, late[-1])
        assert (row.p50_ms, row.p99_ms) == (percentile(late, 50), percentile(late, 99))
        assert sum(row.bins) == row.count
    assert {row.target for row in report.rows} == {orders, mail}

    origin = f"{deployment.requests}/0/3"
    topic, partition, offset, lateness_ms = received[origin]
    shown_record = reads.record("ord-3", show_payload=False)
    assert shown_record.found.status.startswith("delivered at"), shown_record.found.status
    trace = shown_record.trace
    delivered = [step for step in trace if step.what == "delivered"]
    assert len(delivered) == 1, trace
    assert f"{topic}/{partition}/{offset}" in delivered[0].detail
    assert delivered[0].at_ms - (start + 1_000 + 37 * 3) == lateness_ms
    assert {"requested", "scheduled"} <= {step.what for step in trace}, trace

    moved = reads.record("ord-moved", show_payload=False).trace
    assert [step.what for step in moved if step.what in ("scheduled", "rescheduled",
                                                          "delivered")] == [
        "scheduled", "rescheduled", "delivered"], moved
    _, _, moved_offset, moved_late = received[f"{deployment.requests}/0/{COUNT + 1}"]
    assert moved[-1].at_ms - moved_due == moved_late, "late against the new due time"
    assert f"(target offset {moved_offset})" in moved[-1].detail

    ended = reads.record("ord-kept-back", show_payload=False)
    assert ended.found.status.startswith("cancelled at"), ended.found.status
    cancelled = ended.trace
    assert "cancelled" in [step.what for step in cancelled], cancelled
    assert "delivered" not in [step.what for step in cancelled]
