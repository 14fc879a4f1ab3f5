"""The audit and the forecast of schedules moved by reschedules, on a running service.

One deployment plays every fate of a ``kdelay-reschedule``: a schedule moved to
a time already past (delivered at once), one moved later (pending), one moved
then cancelled, a reschedule after the cancel and one of an id never
scheduled (``unknown``), one after the delivery (too late), one past the
retention bound (dead-lettered), and a schedule and its reschedule both
written off the id's partition (forwarded). A reschedule is no schedule of its
own: the audit counts it by what became of it, judges each schedule against
its latest accepted due time, and the forecast places it there. A copy
injected at a schedule's original due time, after its reschedule moved it
later, is early.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, Producer, TopicPartition
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope, forward, idkeys
from kdelay.spark.audit import (
    AuditWindow,
    answers_frame,
    audit,
    classified,
    dead_letter_traces,
    delivery_traces,
    joined,
    moves_frame,
    pending_frame,
    requests_frame,
    reschedule_verdicts,
)
from kdelay.spark.forecast import entries
from tests.conftest import TopicFactory, produce_all
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    Receiver,
    produce_requests,
)
from tests.spark.test_audit import _entry_of, _wait_record

pytestmark = pytest.mark.kafka
MINUTE_MS = 60_000
HOUR_MS = 3_600_000
DAY_MS = 86_400_000
SETTLE_MS = 600_000
PARTITIONS = 3


def _now() -> int:
    return time.time_ns() // 1_000_000


def _schedule(partition: int, target: str, sid: str, **when: int) -> dict[str, object]:
    headers = envelope.schedule_headers(target, schedule_id=sid, due_ms=when.get("due_ms"),
                                        delay_ms=when.get("delay_ms"))
    return {"partition": partition, "value": b"payload", "headers": headers,
            "key": f"s-{sid}".encode()}


def _reschedule(partition: int, sid: str, due_ms: int, name: str) -> dict[str, object]:
    return {"partition": partition, "headers": envelope.reschedule_headers(sid, due_ms=due_ms),
            "key": name.encode()}


def _cancel(partition: int, sid: str) -> dict[str, object]:
    return {"partition": partition, "headers": envelope.cancel_headers(sid),
            "key": f"c-{sid}".encode()}


def _by_key(reports: list[Message]) -> dict[str, Message]:
    """Delivery reports by record key: they come back in no order across partitions."""
    return {(r.key() or b"").decode(): r for r in reports}


def _where(deployment: Deployment, message: Message) -> str:
    return envelope.origin_of(deployment.requests, int(message.partition() or 0),
                              int(message.offset() or 0))


def _wait_answers(deployment: Deployment, requests: set[str]) -> dict[str, str]:
    """Read the outcomes topic until every request in ``requests`` is answered; return
    each one's outcome."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap, "group.id": "resched-wait",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(deployment.outcomes, p, OFFSET_BEGINNING)
                     for p in range(PARTITIONS)])
    answers: dict[str, str] = {}
    deadline = time.monotonic() + 60
    try:
        while not requests <= answers.keys():
            if time.monotonic() > deadline:
                pytest.fail(f"no outcome for {sorted(requests - answers.keys())} within 60s")
            for message in consumer.consume(100, timeout=0.2):
                if message.error() is None and message.value():
                    answer = idkeys.decode_answer(message.value() or b"")
                    answers[answer.request] = answer.outcome
        return {request: answers[request] for request in requests}
    finally:
        consumer.close()


def _wait_dead_letter(deployment: Deployment, origin: bytes) -> None:
    """Wait until the DLQ (any partition) holds the record of request ``origin``."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap, "group.id": "resched-wait",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(deployment.dlq, p, OFFSET_BEGINNING)
                     for p in range(PARTITIONS)])
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.2):
                if dict(message.headers() or []).get(envelope.ORIGIN) == origin:
                    return
        pytest.fail(f"{origin!r} not dead-lettered within 60s")
    finally:
        consumer.close()


def _play(deployment: Deployment, target: str, run: str,
          receive: Callable[[list[str]], Receiver]) -> dict[str, object]:
    """Write the scenario and wait until the service has answered all of it."""
    ids = {name: f"{name}-{run}" for name in
           ("moved", "held", "dropped", "late", "fwd", "never")}
    home = {name: forward.id_partition(sid, PARTITIONS) for name, sid in ids.items()}
    base = _now()
    first = _by_key(produce_requests(deployment, [
        _schedule(home["moved"], target, ids["moved"], due_ms=base + HOUR_MS),
        _reschedule(home["moved"], ids["moved"], base - 20 * MINUTE_MS, "r-moved"),
        _schedule(home["held"], target, ids["held"], due_ms=base + 30 * MINUTE_MS),
        _reschedule(home["held"], ids["held"], base + 2 * HOUR_MS, "r-held"),
        _reschedule(home["held"], ids["held"], base + 30 * DAY_MS, "r-too-long"),
        _schedule(home["dropped"], target, ids["dropped"], due_ms=base + HOUR_MS),
        _reschedule(home["dropped"], ids["dropped"], base + 2 * HOUR_MS, "r-dropped"),
        _cancel(home["dropped"], ids["dropped"]),
        _reschedule(home["dropped"], ids["dropped"], base + 3 * HOUR_MS, "r-after-cancel"),
        _reschedule(home["never"], ids["never"], base + HOUR_MS, "r-never"),
        _schedule(home["late"], target, ids["late"], delay_ms=500),
        _schedule((home["fwd"] + 1) % PARTITIONS, target, ids["fwd"], due_ms=base + HOUR_MS)]))
    out = receive([target])
    out.until(lambda: len(out.received) >= 2, "the moved and the due schedule delivered")
    fwd = first[f"s-{ids['fwd']}"]
    _wait_record(deployment, deployment.changelog, home["fwd"], _entry_of(fwd, gone=False),
                 "the forwarded schedule's entry")
    second = _by_key(produce_requests(deployment, [
        _reschedule(home["late"], ids["late"], base + HOUR_MS, "r-late"),
        _reschedule((home["fwd"] + 2) % PARTITIONS, ids["fwd"], base + 2 * HOUR_MS, "r-fwd")]))
    sent = first | second
    answered = {name: _where(deployment, sent[name]) for name in (
        "r-moved", "r-held", "r-dropped", "r-after-cancel", "r-never", "r-late", "r-fwd")}
    answers = _wait_answers(deployment, set(answered.values()))
    assert {name: answers[where] for name, where in answered.items()} == {
        "r-moved": "rescheduled", "r-held": "rescheduled", "r-dropped": "rescheduled",
        "r-after-cancel": "unknown", "r-never": "unknown", "r-late": "already-delivered",
        "r-fwd": "rescheduled"}
    refused = _where(deployment, sent["r-too-long"]).encode()
    _wait_dead_letter(deployment, refused)
    schedules = {name: sent[f"s-{sid}"] for name, sid in ids.items() if name != "never"}
    return {"base": base, "schedules": schedules}


def test_reschedules_move_their_schedules_in_the_audit_and_the_forecast(
        spark: SparkSession, deploy: Callable[..., Deployment],
        start_kdelay: Callable[..., KdelayProcess], receiver: Callable[[list[str]], Receiver],
        topic_factory: TopicFactory) -> None:
    deployment = deploy(partitions=PARTITIONS)
    target = topic_factory("resched-target")
    kdelay = start_kdelay(deployment)
    kdelay.wait_ready()
    played = _play(deployment, target, f"{_now()}", receiver)
    base = int(str(played["base"]))
    schedules = played["schedules"]
    assert isinstance(schedules, dict)
    origin = {name: _where(deployment, m) for name, m in schedules.items()}
    settings = Settings(bootstrap_servers=deployment.bootstrap,
                        requests_topic=deployment.requests, changelog_topic=deployment.changelog,
                        dlq_topic=deployment.dlq, outcomes_topic=deployment.outcomes)

    report, table = audit(spark, settings, AuditWindow(now_ms=_now(), settle_ms=SETTLE_MS))
    rows = {row["origin"]: row for row in table.collect()}
    table.unpersist()
    found = report.to_json()
    assert {k: v for k, v in found.items() if v and k in (
        "requests", "delivered_once", "pending", "overdue", "cancelled", "dead_lettered", "lost",
        "early", "reschedules")} == {
        "requests": 6, "delivered_once": 2, "pending": 2, "cancelled": 1,
        "dead_lettered": {"delay-too-long": 1},
        "reschedules": {"rescheduled": 4, "unknown": 2, "too_late": 1, "unanswered": 0}}
    assert report.clean(exactly_once=True)
    due = {name: rows[where]["due_ms"] for name, where in origin.items()}
    assert {name: due[name] - base for name in ("moved", "held", "dropped", "fwd")} == {
        "moved": -20 * MINUTE_MS, "held": 2 * HOUR_MS, "dropped": 2 * HOUR_MS,
        "fwd": 2 * HOUR_MS}
    assert 20 * MINUTE_MS <= rows[origin["moved"]]["lateness_ms"] < 25 * MINUTE_MS
    assert 0 <= rows[origin["late"]]["lateness_ms"] < MINUTE_MS

    pending = {(row["partition"], row["offset"]): row["due_ms"]
               for row in entries(spark, settings).collect()}
    at = {name: (int(m.partition() or 0), int(m.offset() or 0)) for name, m in schedules.items()}
    assert pending == {at["held"]: base + 2 * HOUR_MS, at["fwd"]: base + 2 * HOUR_MS}

    result = CliRunner().invoke(app, ["audit", "--json", "--settle", "10m"],
                                env=deployment.env())
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout)["reschedules"]["rescheduled"] == 4

    # A copy at the held schedule's original due time: early against the time it was
    # moved to, although the copy claims the original time.
    original = base + 30 * MINUTE_MS
    produce_all(Producer({"bootstrap.servers": deployment.bootstrap}), target, [{
        "value": b"injected", "timestamp": original,
        "headers": envelope.delivery_tail(origin["held"], original)}])
    report, table = audit(spark, settings, AuditWindow(now_ms=_now(), settle_ms=SETTLE_MS))
    table.unpersist()
    assert (report.early, report.counts.get("delivered_once")) == (1, 3)
    assert not report.clean(exactly_once=False)
    assert kdelay.terminate() == 0


_RAW = "partition int, offset bigint, ts_ms bigint, headers array<struct<key:string,value:binary>>"


def _headers(*pairs: tuple[str, object]) -> list[tuple[str, bytes]]:
    return [(name, str(value).encode()) for name, value in pairs]


def test_a_schedule_is_judged_by_the_moves_decided_before_its_first_delivery(
        spark: SparkSession) -> None:
    """Frames as the topics hold them (no broker): the last move decided before the first
    copy sets the due time; one decided after it (a redelivery's) does not; a reschedule
    without an answer is unanswered, and a malformed outcome record is skipped."""
    settings = Settings(requests_topic="req", outcomes_topic="out")
    due, reschedule = envelope.DUE_MS, envelope.RESCHEDULE
    requests = spark.createDataFrame([
        (0, 0, 10, _headers((envelope.TARGET, "t"), (due, 1_000), (envelope.SCHEDULE_ID, "a"))),
        (0, 1, 20, _headers((reschedule, "a"), (due, 2_000))),
        (0, 2, 10, _headers((envelope.TARGET, "t"), (due, 1_000), (envelope.SCHEDULE_ID, "b"))),
        (0, 3, 20, _headers((reschedule, "b"), (due, 3_000))),
        (0, 4, 10, _headers((envelope.TARGET, "t"), (due, 1_000), (envelope.SCHEDULE_ID, "c"))),
        (0, 5, 20, _headers((reschedule, "c"), (due, 2_000))),
        (0, 6, 30, _headers((reschedule, "c"), (due, 2_500))),
        (0, 7, 30, _headers((reschedule, "d"), (envelope.DELAY_MS, 5))),
        (0, 8, 30, _headers((reschedule, "e"), (due, 9_000)))], _RAW)
    copies = spark.createDataFrame([
        (0, 0, 1_500, envelope.delivery_tail("req/0/0", 1_000)),
        (0, 1, 1_500, envelope.delivery_tail("req/0/2", 1_000)),
        (0, 2, 2_600, envelope.delivery_tail("req/0/4", 2_500))],
        _RAW).withColumn("topic", F.lit("t"))

    def answer(offset: int, request: str, outcome: str, at_ms: int,
               schedule: str | None) -> tuple[int, bytes]:
        return offset, orjson.dumps({"id": "x", "outcome": outcome, "request": request,
                                     "at_ms": at_ms, "schedule": schedule})

    answers = spark.createDataFrame([
        answer(0, "req/0/1", "rescheduled", 1_600, "req/0/0"),  # after its first copy
        answer(1, "req/0/3", "rescheduled", 900, "req/0/2"),
        answer(2, "req/0/5", "rescheduled", 800, "req/0/4"),
        answer(3, "req/0/6", "rescheduled", 850, "req/0/4"),
        answer(4, "req/0/7", "unknown", 900, None), (5, b"not json"),
        answer(6, "other/0/8", "rescheduled", 900, "other/0/0")], "offset bigint, value binary")
    changelog = spark.createDataFrame([], "partition int, offset bigint, key binary, "
                                          "value binary")
    dead = spark.createDataFrame([], _RAW)
    found = requests_frame(settings, requests)
    said = answers_frame(settings, answers)
    rows = joined(settings, found, delivery_traces(settings, copies),
                  dead_letter_traces(settings, dead), pending_frame(changelog),
                  moves_frame(settings, found, said))
    window = AuditWindow(now_ms=10_000, settle_ms=SETTLE_MS)
    judged = {r["origin"]: (r["outcome"], r["due_ms"], r["lateness_ms"], r["early"])
              for r in classified(rows, window).collect()}
    assert judged == {"req/0/0": ("delivered_once", 1_000, 500, False),
                      "req/0/2": ("delivered_once", 3_000, -1_500, True),
                      "req/0/4": ("delivered_once", 2_500, 100, False)}
    verdicts = {r["origin"]: r["outcome"] for r in reschedule_verdicts(
        settings, rows, said, window).collect()}
    assert verdicts == {"req/0/1": "rescheduled", "req/0/3": "rescheduled",
                        "req/0/5": "rescheduled", "req/0/6": "rescheduled",
                        "req/0/7": "unknown", "req/0/8": "unanswered"}
