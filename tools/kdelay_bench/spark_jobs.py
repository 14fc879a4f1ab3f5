"""The Spark jobs' throughput: the audit against a plain read of the same topics.

The records are written as kdelay would leave them, without running the
service (a million deliveries would take the service minutes and measure it,
not the audit): ``n`` requests (round-robin over the partitions, so request
``i`` sits at partition ``i % p``, offset ``i // p`` of a fresh topic), one
delivery per request on a target topic carrying its ``kdelay-origin`` and
``kdelay-due-ms``, and one changelog put per request, due over the next day.
The plain job reads the same four topics with the same pinned-offset Kafka
source and touches every value and header; the ratio of the two times is the
cost of reconciling over just reading. Both jobs run once before they are
timed, so the JVM's compiled code is warm for both. The forecast runs over the
``n`` puts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from confluent_kafka import Producer

from kdelay.plumbing.clients import produce
from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.protocol.envelope import Headers
from kdelay_bench.broker import Topics
from kdelay_bench.progress import Progress, say
from kdelay_bench.report import Figure, Result

DAY_MS = 86_400_000
BENCH_CONF = {"spark.driver.memory": "4g", "spark.ui.enabled": "false",
              "spark.sql.shuffle.partitions": "8"}


def _producer(bootstrap: str) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                     "linger.ms": 20, "batch.size": 1_000_000, "compression.type": "lz4"})


class Out(NamedTuple):
    """One record to write: what ``Producer.produce`` takes besides the topic."""

    value: bytes | None
    key: bytes | None = None
    partition: int | None = None
    timestamp: int = 0
    headers: Headers | None = None


def _produce(producer: Producer, topic: str, label: str, n: int,
             record: Callable[[int], Out]) -> None:
    """Produce ``record(i)`` for ``i < n``; fail on any error."""
    errors: list[object] = []

    def report(error: object, _: object) -> None:
        if error is not None:
            errors.append(error)

    progress = Progress(label, n)
    for i in range(n):
        out = record(i)
        produce(producer, topic, value=out.value, key=out.key, partition=out.partition,
                timestamp=out.timestamp, headers=out.headers, on_delivery=report)
        if i % 10_000 == 0:
            producer.poll(0)
            progress.update(i)
    if producer.flush(120) or errors:
        raise RuntimeError(f"producing {label} failed: {errors[:3]}")


def seed(topics: Topics, n: int, partitions: int, work_dir: Path) -> tuple[Settings, str, int]:
    """Write ``n`` requests, their deliveries and changelog puts; return settings, target, now."""
    settings = topics.deployment("spark", partitions, work_dir / "spark-state", 1_000)
    target = topics.create("spark-target", partitions)
    now = time.time_ns() // 1_000_000
    producer = _producer(topics.bootstrap)
    headers = envelope.schedule_headers(target, due_ms=now - 1_000)
    value = b"v" * 100

    def request(i: int) -> Out:
        return Out(value, partition=i % partitions, timestamp=now - 2_000, headers=headers)

    def delivery(i: int) -> Out:
        origin = envelope.origin_of(settings.requests_topic, i % partitions, i // partitions)
        return Out(value, timestamp=now + 5, headers=envelope.delivery_tail(origin, now - 1_000))

    index_value = codec.encode_index_value(IndexValue(Fingerprint(now, 0), None))

    def put(i: int) -> Out:
        key = codec.encode_due_key(now + (i * 7_919) % DAY_MS, i % partitions, i // partitions)
        return Out(index_value, key=key, partition=i % partitions)

    _produce(producer, settings.requests_topic, "requests", n, request)
    _produce(producer, target, "deliveries", n, delivery)
    _produce(producer, settings.changelog_topic, "changelog puts", n, put)
    return settings, target, now


@contextmanager
def _timed() -> Iterator[list[float]]:
    took: list[float] = []
    started = time.monotonic()
    yield took
    took.append(time.monotonic() - started)


def run_spark(topics: Topics, work_dir: Path, n: int, partitions: int) -> list[Result]:
    """Seed, then time the plain read, the audit and the forecast on one local[*] session."""
    from pyspark.sql import functions as F

    from kdelay.spark import audit, forecast, source
    from kdelay.spark.jars import jars_dir, pyspark_version
    from kdelay.spark.session import SparkOptions, spark_session

    settings, target, now = seed(topics, n, partitions, work_dir)
    options = SparkOptions(conf=BENCH_CONF)
    with spark_session(options) as spark:
        every = [settings.requests_topic, target, settings.dlq_topic, settings.changelog_topic]

        def plain() -> int:
            snap = source.snapshot(settings, every)
            frame = source.read(spark, settings, snap, every)
            row = frame.agg(F.count(F.lit(1)).alias("n"), F.sum(F.length("value")),
                            F.sum(F.size("headers"))).first()
            return int(row["n"]) if row is not None else 0

        say("spark: plain read (warm-up)")
        plain()
        with _timed() as read_took:
            records = plain()
        say(f"spark: plain read of {records:,} records took {read_took[0]:.1f}s; auditing "
            "(warm-up, then measured)")
        window = audit.AuditWindow(now_ms=now + 10_000)
        audit.audit(spark, settings, window)[1].unpersist()
        with _timed() as audit_took:
            report, table = audit.audit(spark, settings, window)
        table.unpersist()
        say(f"spark: audit took {audit_took[0]:.1f}s; forecasting")
        with _timed() as forecast_took:
            predicted, pending = forecast.forecast(spark, settings, forecast.ForecastWindow(now))
        pending.unpersist()
    jars = sorted(jars_dir(options.cache_dir, pyspark_version()).glob("*.jar"))
    versions: dict[str, Figure] = {
        "pyspark": metadata.version("pyspark"), "jars": " ".join(j.name for j in jars),
                "jar_bytes": sum(j.stat().st_size for j in jars)}
    result = Result("spark-audit", {
        "requests": n, "records_read": records, "plain_read_s": round(read_took[0], 2),
        "audit_s": round(audit_took[0], 2),
        "audit_requests_per_s": round(n / audit_took[0]),
        "plain_records_per_s": round(records / read_took[0]),
        "audit_vs_plain_time": round(audit_took[0] / read_took[0], 2),
        "delivered_once": report.counts.get(audit.DELIVERED_ONCE, 0), **versions})
    result.check("every seeded request delivered once", report.counts.get(
        audit.DELIVERED_ONCE, 0), report.counts.get(audit.DELIVERED_ONCE, 0) == n)
    fc = Result("spark-forecast", {
        "pending": predicted.pending, "forecast_s": round(forecast_took[0], 2),
        "pending_per_s": round(predicted.pending / forecast_took[0])})
    fc.check("every put counted", predicted.pending, predicted.pending == n)
    return [result, fc]
