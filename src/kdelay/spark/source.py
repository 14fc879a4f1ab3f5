"""Kafka topics as Spark DataFrames, read between offsets pinned when a job starts.

A job first takes a :class:`Snapshot`: each partition's log start offset and
its last stable offset (the end a ``read_committed`` consumer sees), fetched
with one group-less consumer. Spark's Kafka source then reads exactly that
range with ``kafka.isolation.level=read_committed``, so records produced while
the job runs and transactions still open are left out, and every stage of the
job sees the same records however often Spark recomputes it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from kdelay.plumbing.settings import Settings

Ranges = Mapping[str, Mapping[int, tuple[int, int]]]
"""Per topic, per partition: ``(first offset, end offset)``, the end exclusive."""

_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The offsets a job reads: topics that exist, their ranges, and topics missing."""

    ranges: Ranges
    missing: tuple[str, ...]


def snapshot(settings: Settings, topics: Iterable[str]) -> Snapshot:
    """Pin the readable range of every partition of ``topics``.

    Topics the cluster does not have are reported in ``missing``, not read.
    Raises :class:`confluent_kafka.KafkaException` when the cluster cannot be
    reached within the timeout.
    """
    overrides: dict[str, str | int | bool] = {
        "group.id": f"kdelay-spark-{uuid.uuid4().hex}", "enable.auto.commit": False,
        "isolation.level": "read_committed"}
    consumer = Consumer(settings.client_config(**overrides))
    try:
        wanted = sorted(set(topics))
        metadata = consumer.list_topics(timeout=_TIMEOUT_S).topics
        ranges: dict[str, dict[int, tuple[int, int]]] = {}
        missing: list[str] = []
        for topic in wanted:
            found = metadata.get(topic)
            if found is None or found.error is not None or not found.partitions:
                missing.append(topic)
                continue
            ranges[topic] = {p: _watermarks(consumer, topic, p) for p in sorted(found.partitions)}
        return Snapshot(ranges, tuple(missing))
    finally:
        consumer.close()


def _watermarks(consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
    """Return the partition's log start and, under read_committed, its last stable offset."""
    low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                               timeout=_TIMEOUT_S, cached=False)
    return int(low), int(high)


def offsets_json(ranges: Ranges, end: bool) -> str:
    """The ``startingOffsets`` (``end=False``) or ``endingOffsets`` JSON of ``ranges``."""
    return json.dumps({topic: {str(p): bounds[1 if end else 0] for p, bounds in parts.items()}
                       for topic, parts in ranges.items()})


def read(spark: SparkSession, settings: Settings, snap: Snapshot,
         topics: Iterable[str]) -> DataFrame:
    """Read ``topics`` (those in the snapshot) as one DataFrame, headers included.

    Columns: Spark's ``topic``, ``partition``, ``offset``, ``key``, ``value``,
    ``headers`` (array of key/value structs), and ``ts_ms``, the record
    timestamp in epoch milliseconds. With no topic to read the result is empty.
    ``failOnDataLoss`` is off: an offset gap is a transaction marker, an
    aborted record, or retention moving on; loss is what the audit measures.
    """
    chosen = {t: snap.ranges[t] for t in sorted(set(topics)) if t in snap.ranges}
    if not chosen:
        return _empty(spark)
    reader = (spark.read.format("kafka")
              .option("kafka.bootstrap.servers", settings.bootstrap_servers)
              .option("kafka.isolation.level", "read_committed")
              .option("subscribe", ",".join(chosen))
              .option("startingOffsets", offsets_json(chosen, end=False))
              .option("endingOffsets", offsets_json(chosen, end=True))
              .option("includeHeaders", "true")
              .option("failOnDataLoss", "false"))
    for key, value in settings.kafka_config.items():
        reader = reader.option(f"kafka.{key}", value)
    frame = reader.load()
    return frame.select("topic", "partition", "offset", "key", "value", "headers",
                        F.unix_millis("timestamp").alias("ts_ms"))


def _empty(spark: SparkSession) -> DataFrame:
    """An empty frame with the columns :func:`read` returns."""
    schema = ("topic string, partition int, offset bigint, key binary, value binary, "
              "headers array<struct<key:string,value:binary>>, ts_ms bigint")
    return spark.createDataFrame([], schema)


def header(name: str) -> Column:
    """The last value of header ``name`` as a string, or null when the record has none.

    The last one, because kdelay appends its own headers (``kdelay-origin``,
    ``kdelay-error``) after any the record already carried.
    """
    values = F.filter("headers", lambda h: h["key"] == F.lit(name))
    return F.try_element_at(values, F.lit(-1))["value"].cast("string")


def millis(name: str) -> Column:
    """Header ``name`` as a long, or null when absent or not a number."""
    return header(name).try_cast("bigint")
