"""The audit over a seeded scenario on the real broker with a running service.

Every outcome is made on purpose: deliveries, pending entries, a duplicate by
id, cancels, malformed requests, a request whose original retention deleted
(``expired``), then copies and an early delivery injected straight into a
target, and, with the service stopped, a request it never saw (lost) and one
due a moment ago (overdue). The audit must count each class exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from pyspark.sql import SparkSession
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec, envelope, forward
from kdelay.spark.audit import AuditReport, AuditWindow, audit, pending_frame
from tests.conftest import TopicFactory, produce_all
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    Receiver,
    produce_requests,
)

pytestmark = pytest.mark.kafka
HOUR_MS = 3_600_000
SETTLE_MS = 600_000
EXPIRING = 2


def _now() -> int:
    return time.time_ns() // 1_000_000


def _schedule(partition: int, target: str, *, schedule_id: str | None = None,
              lane: str | None = None, **when: int) -> dict[str, object]:
    headers = envelope.schedule_headers(target, schedule_id=schedule_id, lane=lane,
                                        due_ms=when.get("due_ms"), delay_ms=when.get("delay_ms"))
    return {"partition": partition, "value": b"payload", "headers": headers}


def _origin(deployment: Deployment, message: Message) -> str:
    return envelope.origin_of(deployment.requests, int(message.partition() or 0),
                              int(message.offset() or 0))


def _wait_indexed(deployment: Deployment, partition: int, offset: int) -> None:
    """Wait until the changelog holds the entry of request ``partition``/``offset``."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap, "group.id": "audit-wait",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(deployment.changelog, partition, OFFSET_BEGINNING)])
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.2):
                key = message.key() or b""
                if len(key) == codec.DUE_KEY_SIZE and codec.decode_due_key(key)[1:] == (
                        partition, offset):
                    return
        pytest.fail("the expiring request never reached the changelog")
    finally:
        consumer.close()


def _inject(bootstrap: str, topic: str, origin: str, due_ms: int, timestamp: int) -> None:
    """Write a record to a target as if kdelay had delivered ``origin`` at ``timestamp``."""
    produce_all(Producer({"bootstrap.servers": bootstrap}), topic, [{
        "value": b"injected", "timestamp": timestamp,
        "headers": envelope.delivery_tail(origin, due_ms)}])


def _seed(deployment: Deployment, admin: AdminClient, orders: str, refunds: str,
          kdelay: KdelayProcess, receive: Callable[[list[str]], Receiver]) -> dict[str, object]:
    """Play the scenario; return what the assertions need."""
    base = _now()
    records = [
        _schedule(0, orders, delay_ms=500), _schedule(1, orders, delay_ms=500),
        _schedule(0, orders, delay_ms=500), _schedule(1, refunds, delay_ms=500),
        _schedule(0, orders, due_ms=base + HOUR_MS), _schedule(1, refunds, due_ms=base + HOUR_MS),
        _schedule(1, orders, due_ms=base + HOUR_MS),  # the early delivery's victim
        _schedule(0, orders, due_ms=base + HOUR_MS, schedule_id="dup-1"),
        _schedule(0, orders, due_ms=base + HOUR_MS, schedule_id="dup-1"),
        _schedule(1, orders, due_ms=base + HOUR_MS, schedule_id="c-1"),
        _schedule(1, orders, due_ms=base + HOUR_MS, schedule_id="c-2"),
        {"partition": 1, "headers": envelope.cancel_headers("c-1")},
        {"partition": 1, "headers": envelope.cancel_headers("c-2")},
        {"partition": 0, "headers": [(envelope.DELAY_MS, b"10")]},
        {"partition": 1, "headers": [(envelope.TARGET, orders.encode()),
                                     (envelope.DUE_MS, b"soon")]},
        _schedule(EXPIRING, orders, due_ms=base + 12_000)]
    # Delivery reports come back in no particular order across partitions: a key
    # per record tells them apart.
    keyed = [{**record, "key": str(i).encode()} for i, record in enumerate(records)]
    sent = sorted(produce_requests(deployment, keyed), key=lambda m: int(m.key() or b"0"))
    expiring = sent[-1]
    _wait_indexed(deployment, EXPIRING, int(expiring.offset() or 0))
    gone = TopicPartition(deployment.requests, EXPIRING, int(expiring.offset() or 0) + 1)
    admin.delete_records([gone])[gone].result(timeout=30)

    targets = receive([orders, refunds])
    dlq = receive([deployment.dlq])
    targets.until(lambda: len(targets.received) >= 4, "four deliveries")
    dlq.until(lambda: len(dlq.received) >= 3, "two rejections and one expired record", 60)
    first = next(r.message for r in targets.received if r.message.topic() == orders)
    first_headers = dict(first.headers() or [])
    origin = first_headers[envelope.ORIGIN]
    assert isinstance(origin, bytes)
    due = int(first_headers[envelope.DUE_MS] or b"0")
    _inject(deployment.bootstrap, orders, origin.decode(), due, _now())
    early_ms = _now()
    _inject(deployment.bootstrap, orders, _origin(deployment, sent[6]), base + HOUR_MS, early_ms)
    assert kdelay.terminate() == 0

    stopped = _now()
    late = produce_all(Producer({"bootstrap.servers": deployment.bootstrap}),
                       deployment.requests, [_schedule(0, orders, due_ms=stopped - HOUR_MS),
                                             _schedule(1, refunds, due_ms=stopped - 10_000)])
    assert len(late) == 2
    lateness = [_lateness(r.message) for r in targets.received]
    assert len(lateness) == 4
    return {"stopped": stopped, "lateness": [*lateness, early_ms - base - HOUR_MS],
            "refunds": [_lateness(r.message) for r in targets.on(refunds)]}


def _lateness(message: Message) -> int:
    """A delivered record's time minus the due time it carries."""
    due = dict(message.headers() or [])[envelope.DUE_MS]
    assert isinstance(due, bytes)
    return int(message.timestamp()[1]) - int(due)


def test_audit_counts_every_class(
        spark: SparkSession, deploy: Callable[..., Deployment], admin: AdminClient,
        start_kdelay: Callable[..., KdelayProcess], receiver: Callable[[list[str]], Receiver],
        topic_factory: TopicFactory, tmp_path: Path) -> None:
    deployment = deploy(partitions=3)
    orders, refunds = topic_factory("audit-orders"), topic_factory("audit-refunds")
    kdelay = start_kdelay(deployment)
    kdelay.wait_ready()
    seeded = _seed(deployment, admin, orders, refunds, kdelay, receiver)
    settings = Settings(bootstrap_servers=deployment.bootstrap,
                        requests_topic=deployment.requests,
                        changelog_topic=deployment.changelog, dlq_topic=deployment.dlq,
                        outcomes_topic=deployment.outcomes)

    report, table = audit(spark, settings, AuditWindow(now_ms=_now(), settle_ms=SETTLE_MS))
    assert table.count() == report.requests
    table.unpersist()

    assert report.to_json() | {"lateness_ms": None, "lateness_ms_by_target": None} == {
        "requests": 16, "delivered_once": 4, "delivered_more_than_once": 1, "extra_copies": 1,
        "pending": 3, "overdue": 1, "cancelled": 2, "deduplicated": 1,
        "dead_lettered": {"bad-time": 1, "expired": 1, "missing-target": 1}, "lost": 1,
        "early": 1, "lateness_ms": None, "lateness_ms_by_target": None, "missing_topics": [],
        "reschedules": {"rescheduled": 0, "unknown": 0, "too_late": 0, "unanswered": 0}}
    _check_lateness(report, seeded)
    assert not report.clean(exactly_once=False)
    _check_cli(deployment, int(str(seeded["stopped"])), tmp_path)


def _check_lateness(report: AuditReport, seeded: dict[str, object]) -> None:
    """Lateness is the first copy's time minus due: kdelay's four, and the early one."""
    firsts = seeded["lateness"]
    assert isinstance(firsts, list)
    firsts.sort()
    assert (report.lateness.p50, report.lateness.max) == (firsts[2], firsts[-1])
    refunds = seeded["refunds"]
    assert isinstance(refunds, list)
    assert len(refunds) == 1
    by_target = [(v.p50, v.p99, v.max) for v in report.lateness_by_target.values()]
    assert (refunds[0], refunds[0], refunds[0]) in by_target


def _check_cli(deployment: Deployment, since_ms: int, tmp_path: Path) -> None:
    """``kdelay audit --since --json --output``: the two late requests, exit 4, files."""
    args = ["audit", "--json", "--output", str(tmp_path / "out"), "--settle", "10m",
            "--since", str(since_ms)]
    result = CliRunner().invoke(app, args, env=deployment.env())
    assert result.exit_code == 4, result.output
    printed = orjson.loads(result.stdout)
    assert (printed["requests"], printed["lost"], printed["overdue"]) == (2, 1, 1)
    assert (tmp_path / "out" / "requests.parquet").is_dir()
    for chart in ("lateness.png", "outcomes.png"):
        assert (tmp_path / "out" / chart).read_bytes().startswith(b"\x89PNG")


def test_audit_of_one_lane_counts_only_that_lanes_requests(
        spark: SparkSession, deploy: Callable[..., Deployment],
        start_kdelay: Callable[..., KdelayProcess], receiver: Callable[[list[str]], Receiver],
        topic_factory: TopicFactory) -> None:
    run = f"{_now()}"
    first, second = f"adev1-{run}.", f"adev2-{run}."
    lanes = f"dev1={first},dev2={second}"
    deployment = deploy(partitions=2)
    one, two = topic_factory(f"{first}orders"), topic_factory(f"{second}orders")
    kdelay = start_kdelay(deployment, KDELAY_LANES=lanes)
    kdelay.wait_ready()
    far = _now() + HOUR_MS
    reports = produce_requests(deployment, [
        _schedule(0, one, delay_ms=500, lane="dev1"), _schedule(1, one, delay_ms=500, lane="dev1"),
        _schedule(0, one, due_ms=far, lane="dev1"), _schedule(1, two, delay_ms=500, lane="dev1"),
        _schedule(0, two, delay_ms=500, lane="dev2"), _schedule(1, two, due_ms=far, lane="dev2"),
        _schedule(0, one, delay_ms=500)])
    out = receiver([one, two, deployment.dlq])
    out.until(lambda: len(out.received) >= 5, "three deliveries and two refusals")
    # The dev2 entry due in an hour: the last request of partition 1, at the offset its
    # report gives (reports come in delivery order, not in the order above).
    far_dev2 = max(int(m.offset() or 0) for m in reports if m.partition() == 1)
    _wait_indexed(deployment, 1, far_dev2)
    settings = Settings(bootstrap_servers=deployment.bootstrap,
                        requests_topic=deployment.requests,
                        changelog_topic=deployment.changelog, dlq_topic=deployment.dlq,
                        outcomes_topic=deployment.outcomes)

    def outcomes(lane: str | None) -> dict[str, object]:
        window = AuditWindow(now_ms=_now(), settle_ms=SETTLE_MS, lane=lane)
        report, table = audit(spark, settings, window)
        table.unpersist()
        found = report.to_json()
        return {k: v for k, v in found.items() if v and k in (
            "requests", "delivered_once", "pending", "dead_lettered", "lost")}

    assert outcomes("dev1") == {"requests": 4, "delivered_once": 2, "pending": 1,
                                "dead_lettered": {"wrong-lane": 1}}
    assert outcomes("dev2") == {"requests": 2, "delivered_once": 1, "pending": 1}
    assert outcomes(None) == {"requests": 7, "delivered_once": 3, "pending": 2,
                              "dead_lettered": {"missing-lane": 1, "wrong-lane": 1}}
    result = CliRunner().invoke(app, ["audit", "--json", "--lane", "dev2"], env=deployment.env())
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout)["requests"] == 2
    assert kdelay.terminate() == 0


def _wait_record(deployment: Deployment, topic: str, partition: int,
                 wanted: Callable[[Message], bool], what: str) -> None:
    """Wait until ``partition`` of ``topic`` holds a record that ``wanted`` accepts."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap, "group.id": "audit-wait",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if any(wanted(message) for message in consumer.consume(100, timeout=0.2)):
                return
        pytest.fail(f"{what}: not in {topic} [{partition}] within 60s")
    finally:
        consumer.close()


def _entry_of(origin: Message, *, gone: bool) -> Callable[[Message], bool]:
    """A changelog record that puts (or, ``gone``, deletes) the entry of request ``origin``."""
    wanted = (origin.partition(), origin.offset())

    def matches(message: Message) -> bool:
        key = message.key() or b""
        return (len(key) == codec.DUE_KEY_SIZE and codec.decode_due_key(key)[1:] == wanted
                and (message.value() is None) == gone)
    return matches


def _forward_of(origin: Message) -> Callable[[Message], bool]:
    """The forward record that brings request ``origin`` to its id's partition."""
    wanted = f"{origin.partition()}/{origin.offset()}".encode()
    return lambda message: dict(message.headers() or []).get(forward.FORWARD) == wanted


def test_audit_follows_ids_written_off_their_partition_through_their_forwards(
        spark: SparkSession, deploy: Callable[..., Deployment],
        start_kdelay: Callable[..., KdelayProcess], receiver: Callable[[list[str]], Receiver],
        topic_factory: TopicFactory) -> None:
    # A producer that places records by a business key: every id lands off its partition.
    partitions = 3
    deployment = deploy(partitions=partitions)
    target = topic_factory("audit-fwd")
    kdelay = start_kdelay(deployment)
    kdelay.wait_ready()
    run = f"{_now()}"
    sent, held, twice = f"sent-{run}", f"held-{run}", f"twice-{run}"
    home = {sid: forward.id_partition(sid, partitions) for sid in (sent, held, twice)}

    def off(sid: str, *others: int) -> int:
        return next(p for p in range(partitions) if p not in (home[sid], *others))

    def keyed(record: dict[str, object], key: str) -> dict[str, object]:
        return {**record, "key": key.encode()}

    def by_key(reports: list[Message]) -> dict[str, Message]:
        # Delivery reports come back in no particular order across partitions.
        return {(r.key() or b"").decode(): r for r in reports}

    far = _now() + HOUR_MS
    first = by_key(produce_requests(deployment, [
        keyed(_schedule(off(sent), target, delay_ms=500, schedule_id=sent), sent),
        keyed(_schedule(off(held), target, due_ms=far, schedule_id=held), held),
        keyed(_schedule(off(twice), target, due_ms=far, schedule_id=twice), twice)]))
    for sid in (held, twice):
        _wait_record(deployment, deployment.changelog, home[sid],
                     _entry_of(first[sid], gone=False), f"the entry of {sid}")
    again = by_key(produce_requests(deployment, [
        {"partition": off(held, off(held)), "headers": envelope.cancel_headers(held)},
        keyed(_schedule(off(twice, off(twice)), target, due_ms=far, schedule_id=twice),
              twice)]))
    _wait_record(deployment, deployment.changelog, home[held],
                 _entry_of(first[held], gone=True), f"the cancel of {held}")
    # The audit orders the second request of the id where its forward lies.
    _wait_record(deployment, deployment.requests, home[twice], _forward_of(again[twice]),
                 f"the forward of the second {twice}")
    out = receiver([target])
    out.until(lambda: len(out.received) >= 1, "the due one delivered")
    settings = Settings(bootstrap_servers=deployment.bootstrap,
                        requests_topic=deployment.requests,
                        changelog_topic=deployment.changelog, dlq_topic=deployment.dlq,
                        outcomes_topic=deployment.outcomes)
    report, table = audit(spark, settings, AuditWindow(now_ms=_now(), settle_ms=SETTLE_MS))
    table.unpersist()
    found = {k: v for k, v in report.to_json().items() if v and k in (
        "requests", "delivered_once", "deduplicated", "cancelled", "pending", "lost")}
    assert found == {"requests": 4, "delivered_once": 1, "pending": 1, "deduplicated": 1,
                     "cancelled": 1}
    assert kdelay.terminate() == 0


def test_an_entry_moved_to_its_ids_new_partition_stays_pending(spark: SparkSession) -> None:
    # `kdelay topics grow` puts an entry at its id's new changelog partition, then
    # tombstones it where it was: at an offset higher than the put's, in another partition.
    key = codec.encode_due_key(1_700_000_000_000, 0, 5)
    value = codec.encode_index_value(codec.IndexValue(codec.Fingerprint(1, 2), "order-1", "t"))
    changelog = spark.createDataFrame(
        [(0, 10, key, value), (0, 11, key, None), (3, 2, key, value)],
        "partition int, offset long, key binary, value binary")
    pending = pending_frame(changelog).collect()
    assert [(row.partition, row.offset) for row in pending] == [(0, 5)]


def test_a_watermark_ends_the_entries_put_before_it_below_its_bound(
        spark: SparkSession) -> None:
    """Delivery writes no tombstone per entry: the partition's latest watermark says which
    older puts are done. A put after it, at or above its bound, or pending in it stays."""
    keys = [codec.encode_due_key(1_700_000_000_000 + i, 0, i) for i in range(5)]
    value = codec.encode_index_value(codec.IndexValue(codec.Fingerprint(1, 2), None, "t"))
    old = codec.encode_watermark(codec.Watermark(keys[1]))
    mark = codec.encode_watermark(codec.Watermark(keys[3], frozenset({keys[1]})))
    rows = [(0, offset, key, value) for offset, key in enumerate(keys[:4])]
    rows += [(0, 4, codec.WATERMARK_MARKER, old), (0, 5, codec.WATERMARK_MARKER, mark),
             (0, 6, keys[2], value), (0, 7, keys[4], value),
             (1, 0, codec.encode_due_key(1, 1, 1), value)]
    changelog = spark.createDataFrame(
        rows, "partition int, offset long, key binary, value binary")
    pending = pending_frame(changelog).collect()
    assert sorted((row.partition, row.offset) for row in pending) == [
        (0, 1), (0, 2), (0, 3), (0, 4), (1, 1)], (
        "0 is covered; 1 pending in the mark; 2 put again after it; 3 at its bound; "
        "4 after it; another partition's entries are not its")
