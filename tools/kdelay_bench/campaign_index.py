"""A campaign run twice, checked and indexed in Spark: ``python -m kdelay_bench.campaign_index``.

After ``tools/bench --scenarios campaign --keep-topics``, one pass over the
requests topic counts, per id, its requests and the partitions they are on:
a re-run is de-duplicated only if every copy of an id is on one partition,
where the service answers the later ones ``duplicate``. The same pass then
writes, for each id's first request, the changelog put the service's intake
writes for it (due key, then record time, framed CRC-32, id and target: see
:func:`kdelay.protocol.codec.encode_index_value`), so that ``kdelay export``
has the pending entries of a campaign of any size without waiting for a
service to index it (docs/benchmarks.md, "Spark at 10 M").

Usage: ``PYTHONPATH=src:tools python -m kdelay_bench.campaign_index REQUESTS CHANGELOG``
(the broker from ``KDELAY_BOOTSTRAP_SERVERS``). It prints the placement
counts as JSON, and exits 1 when an id's copies are on two partitions.
"""

from __future__ import annotations

import json
import os
import sys
import time

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.spark import source
from kdelay.spark.migration import framed_crc
from kdelay.spark.session import SparkOptions, new_session

CONF = {"spark.ui.enabled": "false", "spark.driver.memory": "2g"}
"""A larger heap than the jobs' default: the per-id table is cached (spilling to disk)."""


def by_id(spark: SparkSession, settings: Settings) -> DataFrame:
    """Per id: ``n`` requests, ``parts`` distinct partitions, and ``first``, the request at
    the lowest offset (partition, offset, record time, key, value, due, target)."""
    snap = source.snapshot(settings, [settings.requests_topic])
    rows = source.read(spark, settings, snap, [settings.requests_topic]).select(
        "partition", "offset", F.col("ts_ms").alias("ts"), "key", "value",
        source.header(envelope.SCHEDULE_ID).alias("id"),
        source.millis(envelope.DUE_MS).alias("due"), source.header(envelope.TARGET).alias("target"))
    first = F.struct("partition", "offset", "ts", "key", "value", "due", "target")
    return rows.groupBy("id").agg(F.count(F.lit(1)).alias("n"),
                                  F.countDistinct("partition").alias("parts"),
                                  F.min_by(first, "offset").alias("first"))


def placement(ids: DataFrame) -> dict[str, object]:
    """The counts: ids, requests, ids on more than one partition, and ids by copies."""
    totals = ids.agg(F.count(F.lit(1)).alias("ids"), F.sum("n").alias("requests"),
                     F.count_if(F.col("parts") != 1).alias("ids_on_two_partitions")).first()
    copies = {str(row["n"]): row["count"] for row in ids.groupBy("n").count().collect()}
    return {**(totals.asDict() if totals else {}), "ids_by_copies": copies}


def _big_endian(value: Column, width: int) -> Column:
    """A non-negative integer column as ``width`` big-endian bytes."""
    return F.unhex(F.lpad(F.hex(value), 2 * width, "0"))


def changelog_puts(ids: DataFrame) -> DataFrame:
    """The Kafka sink rows of intake's changelog put for each id's first request."""
    first, sid = F.col("first"), F.encode(F.col("id"), "UTF-8")
    key = F.concat(_big_endian(first["due"], 8), _big_endian(first["partition"], 4),
                   _big_endian(first["offset"], 8))
    value = F.concat(_big_endian(first["ts"], 8),
                     _big_endian(framed_crc(first["key"], first["value"]), 4),
                     F.unhex(F.lit("FF")), _big_endian(F.octet_length(sid), 2), sid,
                     F.encode(first["target"], "UTF-8"))
    return ids.select(key.alias("key"), value.alias("value"),
                      first["partition"].alias("partition"))


def main(argv: list[str]) -> int:
    """Check and index the campaign of ``argv`` = [requests topic, changelog topic]."""
    requests, changelog = argv
    settings = Settings(bootstrap_servers=os.environ.get("KDELAY_BOOTSTRAP_SERVERS",
                                                         "127.0.0.1:9092"),
                        requests_topic=requests, changelog_topic=changelog)
    spark = new_session(SparkOptions(conf=CONF), "kdelay-campaign-index", "WARN")
    try:
        started = time.monotonic()
        ids = by_id(spark, settings).cache()
        counts = placement(ids)
        print(json.dumps({**counts, "check_s": round(time.monotonic() - started, 1)}), flush=True)
        changelog_puts(ids).write.format("kafka").options(**{
            "kafka.bootstrap.servers": settings.bootstrap_servers, "topic": changelog,
            "kafka.compression.type": "lz4", "kafka.linger.ms": "20"}).save()
        print(json.dumps({"indexed_s": round(time.monotonic() - started, 1)}), flush=True)
        return 1 if counts.get("ids_on_two_partitions") else 0
    finally:
        spark.stop()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
