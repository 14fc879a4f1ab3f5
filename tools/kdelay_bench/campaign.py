"""``kdelay schedule-table`` against Spark's Kafka sink writing the same rows with nothing else.

A Parquet table of ``n`` reminders (id, customer, message of about 100 bytes,
a due time over the next day) is written once. The plain job reads it and
writes key and value through the Kafka sink to a topic with as many
partitions as the requests topic, with the same producer settings
(:data:`kdelay.spark.campaign.SINK_DEFAULTS`); ``schedule-table`` reads it,
validates every row, writes the (empty) reject output, and writes each
request with its envelope on its id's partition. The ratio of the two times
is what a campaign pays for being a correct, re-runnable one. The job runs a
second time over the same table (a re-run, whose requests kdelay answers
``duplicate``; the service is not run here, so that is not checked: the
tests do). A small table warms the JVM for both jobs before anything is timed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, TopicPartition

from kdelay.plumbing.settings import Settings
from kdelay_bench.broker import Topics
from kdelay_bench.progress import say
from kdelay_bench.report import Result

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from kdelay.spark.campaign import CampaignReport

DAY_MS = 86_400_000
HOUR_MS = 3_600_000
WARM_UP_ROWS = 20_000
BENCH_CONF = {"spark.ui.enabled": "false"}
"""The job's own defaults (local[*], the driver's 1 GB heap), the UI left off."""


def _write_table(spark: SparkSession, path: Path, n: int, now_ms: int) -> None:
    """Write ``n`` reminders as Parquet: id, customer, message, due (epoch ms)."""
    from pyspark.sql import functions as F

    frame = spark.range(n).select(
        F.concat(F.lit("reminder-"), F.col("id").cast("string")).alias("id"),
        F.concat(F.lit("customer-"), (F.col("id") % 100_003).cast("string")).alias("customer"),
        F.concat(F.lit("Your appointment is tomorrow; reply C to cancel. "),
                 F.lpad(F.col("id").cast("string"), 50, "0")).alias("message"),
        (F.lit(now_ms + HOUR_MS) + (F.col("id") * 7_919) % DAY_MS).alias("due"))
    frame.write.mode("overwrite").parquet(str(path))


def _records(bootstrap: str, topic: str) -> int:
    """How many records ``topic`` holds (the sum of its partitions' end offsets)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-campaign"})
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics[topic]
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                   for p in metadata.partitions)
    finally:
        consumer.close()


def run_campaign(topics: Topics, work_dir: Path, n: int, partitions: int) -> list[Result]:
    """Time the plain Kafka sink and ``schedule-table`` (twice) over one table of ``n`` rows."""
    from kdelay.spark import campaign
    from kdelay.spark.session import SparkOptions, spark_session

    settings = topics.deployment("campaign", partitions, work_dir / "campaign-state", 1_000)
    target = topics.create("campaign-target", partitions)
    plain_topic = topics.create("campaign-plain", partitions)
    now = time.time_ns() // 1_000_000
    columns = campaign.Columns(target=target, key="customer", value="message")
    with spark_session(SparkOptions(conf=BENCH_CONF)) as spark:
        table, small = work_dir / "campaign.parquet", work_dir / "campaign-warm.parquet"
        say(f"campaign: writing a table of {n:,} rows")
        _write_table(spark, table, n, now)
        _write_table(spark, small, WARM_UP_ROWS, now)

        def plain(path: Path) -> float:
            started = time.monotonic()
            frame = spark.read.parquet(str(path)).selectExpr(
                "encode(customer, 'UTF-8') as key", "encode(message, 'UTF-8') as value")
            options = {**campaign.sink_options(settings), "topic": plain_topic}
            frame.write.format("kafka").options(**options).save()
            return time.monotonic() - started

        def scheduled(path: Path) -> tuple[float, CampaignReport]:
            started = time.monotonic()
            rules = campaign.deployment_rules(settings, time.time_ns() // 1_000_000, HOUR_MS)
            report = campaign.schedule(spark, settings, campaign.Table(str(path)), columns,
                                       rules, campaign.Rejects(str(work_dir / "rejects")))
            return time.monotonic() - started, report

        say("campaign: warm-up of both jobs")
        plain(small)
        scheduled(small)
        plain_s = plain(table)
        say(f"campaign: plain Kafka sink took {plain_s:.1f}s; schedule-table (twice)")
        schedule_s, report = scheduled(table)
        rerun_s, again = scheduled(table)
    plain_written = _records(settings.bootstrap_servers, plain_topic)
    return [_result(settings, n, (plain_s, plain_written), schedule_s, rerun_s, report, again)]


def _result(settings: Settings, n: int, plain: tuple[float, int], schedule_s: float,
            rerun_s: float, report: CampaignReport, again: CampaignReport) -> Result:
    """The figures, with checks that every row was sent by both runs and nothing else,
    and that the plain sink wrote every row too."""
    plain_s, plain_written = plain
    written = _records(settings.bootstrap_servers, settings.requests_topic)
    result = Result("campaign", {
        "rows": n, "plain_sink_s": round(plain_s, 2), "schedule_table_s": round(schedule_s, 2),
        "rerun_s": round(rerun_s, 2), "plain_rows_per_s": round(n / plain_s),
        "schedule_rows_per_s": round(n / schedule_s),
        "schedule_vs_plain_time": round(schedule_s / plain_s, 2),
        "rejected": sum(report.rejected.values()), "requests_written": written})
    result.check("every row sent by each run", report.sent + again.sent,
                 report.sent == again.sent == n)
    result.check("the requests topic holds both runs' requests", written,
                 written == 2 * n + WARM_UP_ROWS)
    result.check("the plain sink wrote every row", plain_written,
                 plain_written == n + WARM_UP_ROWS)
    return result
