"""``kdelay schedule-table`` on the real broker, with the service running.

A table of good and bad rows is scheduled: the good rows become requests with
exactly the client library's headers, each on its id's partition (checked
against the Java client's murmur2), and are delivered no earlier than their
due times; the bad rows are rejected with the protocol's codes. A second run
of the same job writes the requests again and kdelay answers ``duplicate`` to
every one, delivering nothing new.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from pyspark.sql import SparkSession
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.client import request_headers
from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.protocol.idkeys import decode_answer
from kdelay.spark.campaign import Columns, Rejects, Table, deployment_rules, schedule
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver
from tests.spark.test_placement import java_partitions

pytestmark = pytest.mark.kafka
GOOD = 12
DAY_MS = 86_400_000
HOUR_MS = 3_600_000
# Far enough ahead that the job (seconds on a loaded machine) ends before the first is due.
LEAD_MS = 15_000
SCHEMA = ("id string, target string, due bigint, customer string, message string, "
          "lane string, channel string")


def _now() -> int:
    return time.time_ns() // 1_000_000


def _settings(deployment: Deployment) -> Settings:
    return Settings(bootstrap_servers=deployment.bootstrap, requests_topic=deployment.requests,
                    changelog_topic=deployment.changelog, dlq_topic=deployment.dlq,
                    outcomes_topic=deployment.outcomes, controls_topic=deployment.controls)


Row = tuple[object, ...]


def _table(deployment: Deployment, target: str, run: str, base: int) -> list[Row]:
    """Twelve good rows (one without a channel header), then one bad row per reason."""
    good: list[Row] = [(f"rem-{run}-{i}", target, base + LEAD_MS + 100 * i, f"customer-{i}",
                        f"reminder {i}", None, None if i == 0 else "email")
                       for i in range(GOOD)]
    bad: list[Row] = [
        (f"bad-{run}-0", None, base + LEAD_MS, "c", "no target", None, None),
        (f"bad-{run}-1", target, base - 2 * HOUR_MS, "c", "stale", None, None),
        (f"bad-{run}-2", target, base + 30 * DAY_MS, "c", "too long", None, None),
        (f"bad-{run}-3", deployment.requests, base + LEAD_MS, "c", "own topic", None, None),
        (f"bad-{run}-4", target, base + LEAD_MS, "c", "unknown lane", "dev9", None),
        (f"bad-{run}-5", target, base + LEAD_MS, "c", "bad lane", "no lane!", None),
        (None, target, base + LEAD_MS, "c", "no id", None, None),
        (f"bad-{run}-7", target, None, "c", "no time", None, None)]
    return good + bad


EXPECTED_REJECTS = {"no target": "missing-target", "stale": "bad-time",
                    "too long": "delay-too-long", "own topic": "forbidden-target",
                    "unknown lane": "unknown-lane", "bad lane": "bad-header",
                    "no id": "bad-header", "no time": "missing-time"}
COLUMNS = Columns(key="customer", value="message", headers={"channel": "channel"},
                  lane_column="lane")


def _read_requests(deployment: Deployment, expected: int) -> list[Message]:
    """Every record of the requests topic, once ``expected`` schedules are there."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap, "group.id": "st-read",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(deployment.requests, p, OFFSET_BEGINNING)
                     for p in range(deployment.partitions)])
    found: list[Message] = []
    deadline = time.monotonic() + 60
    try:
        while len([m for m in found if _is_schedule(m)]) < expected:
            assert time.monotonic() < deadline, f"{len(found)} requests read, not {expected}"
            found += [m for m in consumer.consume(1_000, timeout=0.2) if m.error() is None]
        return [m for m in found if _is_schedule(m)]
    finally:
        consumer.close()


def _is_schedule(message: Message) -> bool:
    """A request the job wrote (not a forward record the service wrote)."""
    return envelope.TARGET in dict(message.headers() or [])


def test_a_table_is_scheduled_once_per_row_on_its_ids_partitions(
        spark: SparkSession, deploy: Callable[..., Deployment],
        start_kdelay: Callable[..., KdelayProcess], receiver: Callable[[list[str]], Receiver],
        topic_factory: TopicFactory, tmp_path: Path) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("st-orders", 2)
    kdelay = start_kdelay(deployment)
    kdelay.wait_ready()
    settings, run, base = _settings(deployment), f"{_now()}", _now()
    rows = _table(deployment, target, run, base)
    path = tmp_path / "campaign.parquet"
    spark.createDataFrame(rows, SCHEMA).repartition(2).write.parquet(str(path))
    rejects = Rejects(str(tmp_path / "rejects"))

    report = schedule(spark, settings, Table(str(path)), COLUMNS,
                      deployment_rules(settings, base, 600_000), rejects)
    assert report.to_json() == {
        "rows": GOOD + 8, "sent": GOOD, "rejected": 8, "dry_run": False,
        "requests_topic": deployment.requests, "partitions": 3, "rejected_by_reason": {
            "missing-target": 1, "bad-header": 2, "missing-time": 1, "bad-time": 1,
            "delay-too-long": 1, "forbidden-target": 1, "unknown-lane": 1}}
    rejected = spark.read.parquet(rejects.path).collect()
    assert {r["message"]: r["kdelay_reason"] for r in rejected} == EXPECTED_REJECTS
    assert all(r["kdelay_detail"] for r in rejected)

    by_id = {str(row[0]): row for row in rows[:GOOD]}
    written = _read_requests(deployment, GOOD)
    _check_requests(written, by_id, tmp_path)

    out = receiver([target, deployment.outcomes])
    out.until(lambda: len(out.on(target)) >= GOOD, "every good row delivered")
    for received in out.on(target):
        message = received.message
        row = by_id[_id_of(message, written)]
        assert message.timestamp()[1] >= int(str(row[2])), f"{row[0]} delivered early"
        assert (message.key(), message.value()) == (str(row[3]).encode(), str(row[4]).encode())

    again = schedule(spark, settings, Table(str(path)), COLUMNS,
                     deployment_rules(settings, _now(), 600_000), rejects)
    assert (again.sent, again.rejected) == (GOOD, report.rejected)
    out.until(lambda: len(_answers(out, deployment, "duplicate")) >= GOOD,
              "a duplicate answer for every re-sent row")
    assert set(_answers(out, deployment, "duplicate")) == set(by_id)
    out.drain(2.0)
    assert len(out.on(target)) == GOOD, "the re-run delivered something again"
    assert kdelay.terminate() == 0


def _id_of(delivered: Message, written: list[Message]) -> str:
    """The id of the request a delivered record came from, by its ``kdelay-origin``."""
    origin = dict(delivered.headers() or [])[envelope.ORIGIN]
    assert isinstance(origin, bytes)
    for request in written:
        if envelope.origin_of(str(request.topic()), int(request.partition() or 0),
                              int(request.offset() or 0)) == origin.decode():
            found = dict(request.headers() or [])[envelope.SCHEDULE_ID]
            assert isinstance(found, bytes)
            return found.decode()
    pytest.fail(f"no request at {origin!r}")


def _answers(out: Receiver, deployment: Deployment, outcome: str) -> list[str]:
    """The ids the outcomes topic answered ``outcome`` for."""
    answers = [decode_answer(r.message.value() or b"") for r in out.on(deployment.outcomes)]
    return [a.schedule_id for a in answers if a.outcome == outcome]


def _check_requests(written: list[Message], by_id: dict[str, tuple[object, ...]],
                    work_dir: Path) -> None:
    """One request per good row, with the client library's headers, on its id's partition
    as the Java client's murmur2 places it."""
    ids = [dict(m.headers() or [])[envelope.SCHEDULE_ID] for m in written]
    names = [i.decode() for i in ids if isinstance(i, bytes)]
    assert sorted(names) == sorted(by_id)
    java = java_partitions(names, (3,), work_dir)
    assert [m.partition() for m in written] == [p[0] for p in java]
    for message, name in zip(written, names, strict=True):
        row = by_id[name]
        user = [] if row[6] is None else [("channel", str(row[6]))]
        assert message.headers() == request_headers(
            str(row[1]), user, due=int(str(row[2])), schedule_id=name)
        assert (message.key(), message.value()) == (str(row[3]).encode(), str(row[4]).encode())


def test_a_dry_run_counts_and_writes_nothing_and_errors_have_codes(
        spark: SparkSession, deploy: Callable[..., Deployment], topic_factory: TopicFactory,
        tmp_path: Path) -> None:
    deployment = deploy(partitions=2)
    target = topic_factory("st-dry")
    base = _now()
    table = tmp_path / "rows.csv"
    table.write_text("user,send_at,topic\n"
                     f"u1,2099-01-01T00:00:00Z,{target}\n"
                     f"u2,{base + 60_000},{target}\n"
                     "u3,tomorrow,x\n"
                     f"u4,2026-01-01 00:00:00,{target}\n", encoding="utf-8")
    args = ["schedule-table", str(table), "--target-column", "topic", "--due-column", "send_at",
            "--id-from", "user", "--id-prefix", "camp-", "--rejects", str(tmp_path / "r"),
            "--rejects-format", "json", "--dry-run", "--json"]
    result = CliRunner().invoke(app, args, env=deployment.env())
    assert result.exit_code == 4, result.output
    summary = orjson.loads(result.stdout)
    # 2099 is beyond the week of retention; "tomorrow" and a time without a zone are bad-time.
    assert (summary["sent"], summary["rejected_by_reason"], summary["dry_run"]) == (
        1, {"bad-time": 2, "delay-too-long": 1}, True)
    rejected = spark.read.json(str(tmp_path / "r")).collect()
    assert sorted(r["user"] for r in rejected) == ["u1", "u3", "u4"]
    assert all(r["kdelay_id"].startswith("camp-") and len(r["kdelay_id"]) == 37
               for r in rejected)
    assert _read_count(deployment) == 0

    missing = CliRunner().invoke(app, ["schedule-table", str(tmp_path / "nope-*.parquet")],
                                 env=deployment.env())
    assert (missing.exit_code, missing.stderr.split("]")[0]) == (2, "error[table-missing")
    wrong = CliRunner().invoke(app, [*args[:4], "--due-column", "when"], env=deployment.env())
    assert (wrong.exit_code, wrong.stderr.split("]")[0]) == (2, "error[column-missing")
    assert "'when'" in wrong.stderr


def _read_count(deployment: Deployment) -> int:
    """How many records the requests topic holds."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap, "group.id": "st-count"})
    try:
        return sum(consumer.get_watermark_offsets(
            TopicPartition(deployment.requests, p), timeout=30)[1]
            for p in range(deployment.partitions))
    finally:
        consumer.close()
