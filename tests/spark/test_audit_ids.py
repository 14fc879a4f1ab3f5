"""``kdelay audit --ids-from TABLE`` on the real broker with a running service.

A campaign table names eight reminder ids; the service delivers one, holds one
for a paused target, keeps two for later (one sent twice), refuses one,
cancels one; with the service stopped, one more is written already long due
(lost) and one id is never sent. Every row must get its id's verdict, the
table's own columns kept, and the counts must say exactly that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.protocol import envelope, forward
from kdelay.protocol.envelope import Headers
from kdelay.spark import reconciliation
from tests.conftest import TopicFactory, produce_all
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    Receiver,
    produce_requests,
)
from tests.spark.test_migration import caught_up

pytestmark = pytest.mark.kafka
HOUR_MS = 3_600_000


def _now() -> int:
    return time.time_ns() // 1_000_000


def _at_home(deployment: Deployment, sid: str, headers: Headers) -> dict[str, object]:
    """A request with id ``sid`` on its id's partition, as the protocol wants it."""
    return {"partition": forward.id_partition(sid, deployment.partitions), "value": b"remind",
            "key": sid.encode(), "headers": headers}


def test_each_row_of_a_table_gets_its_ids_verdict(
        spark: SparkSession, deploy: Callable[..., Deployment],
        start_kdelay: Callable[..., KdelayProcess], receiver: Callable[[list[str]], Receiver],
        topic_factory: TopicFactory, tmp_path: Path) -> None:
    deployment = deploy(partitions=2)
    orders, held = topic_factory("ids-orders"), topic_factory("ids-held")
    paused = CliRunner().invoke(app, ["target", "pause", held, "--reason", "test"],
                                env=deployment.env())
    assert paused.exit_code == 0, paused.output
    kdelay = start_kdelay(deployment)
    kdelay.wait_ready()
    far = _now() + HOUR_MS

    def schedule(sid: str, target: str, *, due_ms: int | None = None,
                 delay_ms: int | None = None) -> dict[str, object]:
        return _at_home(deployment, sid, envelope.schedule_headers(
            target, schedule_id=sid, due_ms=due_ms, delay_ms=delay_ms))

    produce_requests(deployment, [
        schedule("r-delivered", orders, delay_ms=200), schedule("r-pending", orders, due_ms=far),
        schedule("r-held", held, delay_ms=200), schedule("r-cancelled", orders, due_ms=far),
        schedule("r-dup", orders, due_ms=far), schedule("r-dup", orders, due_ms=far),
        _at_home(deployment, "r-rejected", [(envelope.TARGET, orders.encode()),
                                            (envelope.DUE_MS, b"soon"),
                                            (envelope.SCHEDULE_ID, b"r-rejected")])])
    produce_requests(deployment, [_at_home(deployment, "r-cancelled",
                                           envelope.cancel_headers("r-cancelled"))])
    out = receiver([orders, deployment.dlq])
    out.until(lambda: len(out.received) >= 2, "one delivery and one refusal")
    caught_up(deployment)
    assert kdelay.terminate() == 0
    produce_all(Producer({"bootstrap.servers": deployment.bootstrap}), deployment.requests, [
        schedule("r-lost", orders, due_ms=_now() - HOUR_MS)])

    ids = ["r-delivered", "r-pending", "r-held", "r-cancelled", "r-dup", "r-rejected", "r-lost",
           "r-never", "r-delivered"]
    table = tmp_path / "campaign.parquet"
    spark.createDataFrame([(sid, f"customer-{i}") for i, sid in enumerate(ids)],
                          "reminder string, customer string").write.parquet(str(table))
    result = CliRunner().invoke(app, [
        "audit", "--ids-from", str(table), "--id-column", "reminder", "--json", "--settle",
        "10m", "--output", str(tmp_path / "out")], env=deployment.env())
    assert result.exit_code == 4, result.output
    assert orjson.loads(result.stdout) == {
        "rows": 9, "delivered": 2, "pending": 3, "cancelled": 1, "rejected": 1, "lost": 1,
        "unknown": 1, "rejected_by_reason": {"bad-time": 1}, "early": 0}
    rows = spark.read.parquet(str(tmp_path / "out" / "ids.parquet")).collect()
    verdicts = {(r["reminder"], r["customer"]): (r["kdelay_verdict"], r["kdelay_outcome"])
                for r in rows}
    assert verdicts == {
        ("r-delivered", "customer-0"): ("delivered", "delivered_once"),
        ("r-pending", "customer-1"): ("pending", "pending"),
        ("r-held", "customer-2"): ("pending", "overdue"),
        ("r-cancelled", "customer-3"): ("cancelled", "cancelled"),
        ("r-dup", "customer-4"): ("pending", "pending"),
        ("r-rejected", "customer-5"): ("rejected", "dead_lettered"),
        ("r-lost", "customer-6"): ("lost", "lost"),
        ("r-never", "customer-7"): ("unknown", None),
        ("r-delivered", "customer-8"): ("delivered", "delivered_once")}
    assert set(reconciliation.ANSWER_COLUMNS) <= set(spark.read.parquet(
        str(tmp_path / "out" / "ids.parquet")).columns)


def test_a_table_without_the_ids_column_is_refused(spark: SparkSession, tmp_path: Path) -> None:
    table = tmp_path / "ids.csv"
    table.write_text("customer,reminder\nc-1,r-1\n")
    result = CliRunner().invoke(app, ["audit", "--ids-from", str(table)])
    assert result.exit_code == 2, result.output
    assert "error[ids-column-missing]" in result.output
    assert reconciliation.format_of("a/b.jsonl", None) == "json"
    assert reconciliation.format_of("a/*.csv", None) == "csv"
    assert reconciliation.format_of("a/dir", None) == "parquet"
