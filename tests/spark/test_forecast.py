"""The forecast over changelog entries with known due times (no service needed).

Requests and changelog records are written straight to the topics, as intake
writes them, so every count, byte and bucket is known in advance.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.spark.forecast import ForecastWindow, cube, forecast
from kdelay.spark.jobs import write_forecast
from tests.conftest import TopicFactory, produce_all

pytestmark = pytest.mark.kafka
DAY_MS = 86_400_000
MARGIN_MS = 1_000


def _request(partition: int, target: str, size: int, ts: int) -> dict[str, object]:
    return {"partition": partition, "value": b"x" * size, "timestamp": ts,
            "headers": envelope.schedule_headers(target, delay_ms=1)}


def _put(partition: int, offset: int, due_ms: int) -> dict[str, object]:
    value = codec.encode_index_value(IndexValue(Fingerprint(0, 0), None))
    return {"partition": partition, "key": codec.encode_due_key(due_ms, partition, offset),
            "value": value}


def test_forecast_counts_buckets_targets_and_retention(
        spark: SparkSession, bootstrap: str, topic_factory: TopicFactory,
        tmp_path: Path) -> None:
    requests = topic_factory("fc-req", 2, {"retention.ms": str(DAY_MS)})
    changelog = topic_factory("fc-chg", 2, {"cleanup.policy": "compact"})
    settings = Settings(bootstrap_servers=bootstrap, requests_topic=requests,
                        changelog_topic=changelog, dlq_topic="fc-unused",
                        retention_margin_ms=MARGIN_MS)
    now = time.time_ns() // 1_000_000 // 60_000 * 60_000
    producer = Producer({"bootstrap.servers": bootstrap})
    wanted = [_request(0, "orders", 10, now - 1_000), _request(0, "orders", 20, now - 2_000),
              _request(0, "refunds", 5, now - 3_000), _request(1, "refunds", 7, now - 4_000),
              _request(1, "orders", 1, now - 500), _request(0, "orders", 3, now - 600)]
    sent = [produce_all(producer, requests, [record])[0] for record in wanted]
    at = [(int(m.partition() or 0), int(m.offset() or 0)) for m in sent]
    due = [now + 30_000, now + 90_000, now + 70_000, now - 5_000, now + DAY_MS + 3_600_000,
           now + 10_000]
    records = [_put(p, o, d) for (p, o), d in zip(at, due, strict=True)]
    tombstone = {**records[5], "value": None}
    gone = _put(1, 999, now + 120_000)
    marker = {"partition": 0, "key": codec.CONSUMED_MARKER, "value": codec.encode_offset(6)}
    produce_all(producer, changelog, [*records, tombstone, gone, marker])

    window = ForecastWindow(now, DAY_MS, 60_000)
    report, table = forecast(spark, settings, window)

    assert (report.pending, report.bytes, report.overdue, report.beyond_horizon,
            report.missing_originals) == (6, 43, 1, 1, 1)
    assert [(b.start_ms - now, b.count, b.bytes) for b in report.curve] == [
        (0, 1, 10), (60_000, 2, 25), (120_000, 1, 0)]
    assert report.peaks[0].start_ms == now + 60_000
    assert [(g.name, g.count, g.bytes) for g in report.by_target] == [
        ("?", 1, 0), ("orders", 3, 31), ("refunds", 2, 12)]
    needs = [(n.partition, n.count, n.bytes, n.needed_ms, n.covered) for n in report.by_partition]
    assert needs == [(0, 3, 35, 92_000 + MARGIN_MS, True),
                     (1, 3, 8, DAY_MS + 3_600_000 + 500 + MARGIN_MS, False)]
    assert report.to_json()["by_partition"]["1"]["retention_ms"] == DAY_MS

    write_forecast(report, cube(table, window), tmp_path)
    table.unpersist()
    assert spark.read.parquet(str(tmp_path / "due.parquet")).count() == 4
    for chart in ("due-curve.png", "targets.png", "retention.png"):
        assert (tmp_path / chart).read_bytes().startswith(b"\x89PNG")
