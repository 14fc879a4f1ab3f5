"""Pending schedules to Parquet and back, at any number: ``kdelay export --format parquet``
and ``kdelay import`` of such a directory.

**Export.** The changelog's live entries (:func:`kdelay.spark.audit.pending_frame`:
due time, request coordinates, the fingerprint intake stored) are joined in
Spark to their request records, read through Spark's Kafka source between
offsets pinned when the export starts. Nothing per entry reaches the driver:
the executors write the Parquet files, and the counts come back as one
observed aggregate of the same pass (:class:`pyspark.sql.Observation`). An
entry is written when its original is there and matches its fingerprint
(record time and the framed CRC-32 of key and value, computed in Spark SQL);
otherwise it is counted by why, as the JSON-lines export counts it:
``expired`` (below the partition's log start offset), ``absent`` or
``mismatch``.

One row per pending schedule (:data:`COLUMNS`): ``id`` (its ``kdelay-id``,
null without one), ``due_ms`` and ``due`` (UTC timestamp) as the index holds
it (a delay or level already resolved, a reschedule applied), ``target``,
``target_partition`` (the ``kdelay-partition`` it asked for, else null),
``lane``, the request's coordinates ``topic``, ``partition``, ``offset`` and
its ``timestamp_ms``, ``key``, ``headers`` (the user's, every ``kdelay-*`` one
left out, as Spark's Kafka source types them) and ``value`` (left out with
``values=False``).

The directory holds Spark's files and the :class:`Manifest`, ``_kdelay-export.json``
(a leading underscore: Parquet readers skip it). The export is written to
``<dir>.partial`` and moved into place with its manifest, so a directory that
has one is complete.

**Import.** Every row becomes a schedule request again, written with Spark's
Kafka sink to the destination's requests topic: the user's headers, then
``kdelay-target``, the absolute ``kdelay-due-ms``, ``kdelay-partition``, the
id and the lane, as the client library writes them. A row without an id gets
the id :func:`kdelay.view.export.derived_id` gives it (from the source
cluster and coordinates), so every request carries one, and each goes to its
id's partition (murmur2 of the id, :func:`kdelay.protocol.forward.id_partition`).
A second import of the same directory therefore schedules nothing new while
the first import's schedules are pending: the service answers ``duplicate``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from kdelay.errors import KdelayError
from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.spark import source
from kdelay.spark.audit import pending_frame
from kdelay.spark.placement import id_partition
from kdelay.spark.progress import JobProgress, Report
from kdelay.spark.session import SparkOptions, spark_session
from kdelay.spark.source import header

FORMAT = "kdelay-export-parquet"
VERSION = 1
MANIFEST = "_kdelay-export.json"
PARTIAL_SUFFIX = ".partial"
DERIVED_PREFIX = "kdelay-export:"
"""Keep in step with :data:`kdelay.view.export.DERIVED_PREFIX` (the JSON-lines import's)."""
FOUND, EXPIRED, ABSENT, MISMATCH = "found", "expired", "absent", "mismatch"
UNEXPORTED = (EXPIRED, ABSENT, MISMATCH)
COLUMNS = ("id", "due_ms", "due", "target", "target_partition", "lane", "topic", "partition",
           "offset", "timestamp_ms", "key", "headers", "value")
"""The columns of an export, in order; ``value`` only when values are exported."""
_HEAD_BYTES = 12  # the index value's i64 record time | u32 CRC (kdelay.protocol.codec)


class MigrationError(KdelayError):
    """An export directory that cannot be written or read; ``code`` is stable.

    ``export-exists`` (the output is there and is not an export),
    ``export-file-missing``, ``bad-export-file`` (no Parquet of this format),
    ``export-version-unknown`` (a newer kdelay wrote it), ``export-truncated``
    (no manifest: the export did not finish) and ``export-without-values``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Manifest:
    """What an export directory holds: its source, counts and whether values are in it.

    ``pending`` entries were live when the export's offsets were pinned
    (``exported_ms``); ``exported`` of them are in the files, the rest are
    counted in ``unexported`` by why. ``latest_due_ms`` is the latest due
    time written (None when none was).
    """

    requests_topic: str
    cluster_id: str | None
    exported_ms: int
    pending: int
    exported: int
    latest_due_ms: int | None
    values: bool
    unexported: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest file's object (also the export's ``--json`` summary)."""
        return {"format": FORMAT, "version": VERSION, **asdict(self)}


def read_manifest(directory: Path) -> Manifest:
    """The manifest of an export directory; :class:`MigrationError` for anything else."""
    if not directory.is_dir():
        raise MigrationError("export-file-missing", f"no export directory at {directory}")
    path = directory / MANIFEST
    if not path.is_file():
        raise MigrationError("export-truncated", f"{directory} has no {MANIFEST}: the export "
                             "did not finish (or this is not a kdelay export); export again")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MigrationError("bad-export-file", f"{path} is not readable JSON: {exc}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise MigrationError("bad-export-file", f"{path} does not name format {FORMAT!r}")
    if obj.get("version") != VERSION:
        raise MigrationError("export-version-unknown", f"export format version "
                             f"{obj.get('version')!r} is unknown to this kdelay (it reads "
                             f"version {VERSION}); import with the kdelay version that wrote it")
    try:
        return Manifest(**{k: v for k, v in obj.items() if k not in ("format", "version")})
    except TypeError as exc:
        raise MigrationError("bad-export-file", f"{path}: {exc}") from None


def pending_rows(spark: SparkSession, settings: Settings, snap: source.Snapshot) -> DataFrame:
    """Every live changelog entry with its original request (null columns when there is
    none) and ``state``: ``found``, ``expired``, ``absent`` or ``mismatch``."""
    changelog = source.read(spark, settings, snap, [settings.changelog_topic])
    pending = pending_frame(changelog).select(
        "partition", "offset", F.col("pending_due").alias("due_ms"),
        F.conv(F.hex(F.substring("value", 1, 8)), 16, 10).try_cast("bigint").alias("print_ts"),
        F.conv(F.hex(F.substring("value", 9, 4)), 16, 10).try_cast("bigint").alias("print_crc"),
        (F.length("value") >= _HEAD_BYTES).alias("has_head"))
    requests = source.read(spark, settings, snap, [settings.requests_topic]).select(
        "partition", "offset", F.col("ts_ms").alias("timestamp_ms"), "key", "value", "headers",
        F.lit(True).alias("read"))
    starts = F.create_map(*(F.lit(x) for p, (low, _) in sorted(
        snap.ranges.get(settings.requests_topic, {}).items()) for x in (p, low)))
    joined = pending.join(requests, ["partition", "offset"], "left")
    state = (F.when(F.col("read").isNull() & (F.col("offset") < F.coalesce(
                 starts[F.col("partition")], F.lit(0))), EXPIRED)
             .when(F.col("read").isNull(), ABSENT)
             .when(~F.col("has_head") | (F.col("print_ts") != F.col("timestamp_ms"))
                   | (F.col("print_crc") != framed_crc(F.col("key"), F.col("value"))), MISMATCH)
             .otherwise(FOUND))
    return joined.withColumn("state", state)


def framed_crc(key: Column, value: Column) -> Column:
    """The CRC-32 of :func:`kdelay.protocol.codec.framed_crc` in Spark SQL: each field
    framed by a presence byte and, when present, its u32 big-endian length."""
    def framed(data: Column) -> Column:
        length = F.unhex(F.lpad(F.hex(F.length(data)), 8, "0"))
        return F.when(data.isNull(), F.unhex(F.lit("00"))).otherwise(
            F.concat(F.unhex(F.lit("01")), length, data))
    return F.crc32(F.concat(framed(key), framed(value)))


def export_frame(settings: Settings, rows: DataFrame, values: bool) -> DataFrame:
    """The written columns (:data:`COLUMNS`) of the rows whose original was found."""
    found = rows.where(F.col("state") == FOUND)
    user = F.filter("headers", lambda h: ~h["key"].startswith(envelope.PREFIX))
    columns: list[Column | str] = [
        header(envelope.SCHEDULE_ID).alias("id"), "due_ms",
        F.timestamp_millis("due_ms").alias("due"), header(envelope.TARGET).alias("target"),
        header(envelope.PARTITION).try_cast("int").alias("target_partition"),
        header(envelope.LANE).alias("lane"), F.lit(settings.requests_topic).alias("topic"),
        "partition", "offset", "timestamp_ms", "key", user.alias("headers")]
    return found.select(*columns, *([F.col("value")] if values else []))


def export_pending(spark: SparkSession, settings: Settings, output: Path, now_ms: int, *,
                   values: bool = True, cluster_id: str | None = None) -> Manifest:
    """Write every pending schedule of the deployment to the Parquet directory ``output``.

    ``now_ms`` is when the offsets are pinned (the manifest's ``exported_ms``).

    Written under ``<output>.partial`` first, then moved to ``output``, which
    must be absent or an earlier export (replaced). Raises
    :class:`MigrationError` ``export-exists`` when ``output`` is something
    else, :class:`confluent_kafka.KafkaException` when the cluster cannot be
    read, and Spark's own errors when a task fails (the partial directory is
    then removed).
    """
    if output.exists() and not (output / MANIFEST).is_file():
        raise MigrationError("export-exists", f"{output} exists and is not a kdelay export; "
                             "name another directory or remove it")
    snap = source.snapshot(settings, [settings.requests_topic, settings.changelog_topic])
    observed = Observation("kdelay-export")
    rows = pending_rows(spark, settings, snap).observe(
        observed, F.count(F.lit(1)).alias("pending"),
        *(F.count_if(F.col("state") == s).alias(s) for s in (FOUND, *UNEXPORTED)),
        F.max(F.when(F.col("state") == FOUND, F.col("due_ms"))).alias("latest"))
    partial = output.with_name(output.name + PARTIAL_SUFFIX)
    try:
        export_frame(settings, rows, values).write.mode("overwrite").parquet(str(partial))
        counts = observed.get
        manifest = Manifest(settings.requests_topic, cluster_id, now_ms,
                            int(counts["pending"]), int(counts[FOUND]), counts["latest"], values,
                            {s: int(counts[s]) for s in UNEXPORTED if counts[s]})
        (partial / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n",
                                        encoding="utf-8")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if output.exists():
        shutil.rmtree(output)
    partial.replace(output)
    return manifest


def request_frame(table: DataFrame, manifest: Manifest, partitions: int) -> DataFrame:
    """The Kafka sink's rows (``key``, ``value``, ``headers``, ``partition``) of an export.

    Rows without an id get their derived id; ``partition`` is the id's
    (murmur2, as the protocol requires) among the destination's ``partitions``.
    """
    derived = F.concat(F.lit(f"{DERIVED_PREFIX}{manifest.cluster_id or '-'}:"), F.col("topic"),
                       F.lit(":"), F.col("partition").cast("string"), F.lit(":"),
                       F.col("offset").cast("string"))
    sid = F.coalesce(F.col("id"), derived)

    def pair(name: str, text: Column) -> Column:
        return F.when(text.isNotNull(), F.struct(F.lit(name).alias("key"),
                                                 F.encode(text, "UTF-8").alias("value")))

    added = F.filter(F.array(
        pair(envelope.TARGET, F.col("target")),
        pair(envelope.DUE_MS, F.col("due_ms").cast("string")),
        pair(envelope.PARTITION, F.col("target_partition").cast("string")),
        pair(envelope.SCHEDULE_ID, sid), pair(envelope.LANE, F.col("lane"))),
        lambda h: h.isNotNull())
    user = F.coalesce(F.col("headers"), F.array().cast(
        "array<struct<key:string,value:binary>>"))
    value = F.col("value") if "value" in table.columns else F.lit(None).cast("binary")
    rows = table.select("key", value.alias("value"), F.concat(user, added).alias("headers"),
                        sid.alias("_sid"))
    return rows.withColumn("partition", id_partition("_sid", partitions)).drop("_sid")


@dataclass(frozen=True, slots=True)
class ImportSummary:
    """What an import wrote: ``sent`` requests, ``derived`` of them with a derived id."""

    sent: int
    derived: int


def import_export(spark: SparkSession, settings: Settings, directory: Path,
                  manifest: Manifest, *, allow_no_values: bool = False) -> ImportSummary:
    """Write every row of the export ``directory`` to the requests topic with Spark's sink.

    Raises :class:`MigrationError` ``export-without-values`` for an export
    written without values unless ``allow_no_values`` (every request then
    carries a null value), ``bad-export-file`` when the directory's Parquet
    lacks a column; :class:`confluent_kafka.KafkaException` when the cluster
    cannot be reached, and Spark's errors when a write fails (a second import
    is safe: ids still pending are answered ``duplicate``).
    """
    if not manifest.values and not allow_no_values:
        raise MigrationError("export-without-values", f"{directory} was exported with "
                             "--no-values: importing it schedules every record with a null "
                             "value; pass --allow-no-values to do so")
    table = spark.read.parquet(str(directory))
    wanted = set(COLUMNS) - {"value", "due"}
    if not wanted <= set(table.columns):
        raise MigrationError("bad-export-file", f"{directory} lacks the columns "
                             f"{sorted(wanted - set(table.columns))}")
    snap = source.snapshot(settings, [settings.requests_topic])
    partitions = len(snap.ranges.get(settings.requests_topic, {}))
    if not partitions:
        raise MigrationError("bad-export-file", f"no requests topic {settings.requests_topic} "
                             "to import into; create it with kdelay topics create")
    # Counted apart from the write: the Kafka sink's command reports no observed
    # metrics, and a count over the id column alone reads little of the files.
    counts = table.agg(F.count(F.lit(1)).alias("rows"),
                       F.count_if(F.col("id").isNull()).alias("derived")).first()
    writer = request_frame(table, manifest, partitions).write.format("kafka")
    for key, value in sink_options(settings).items():
        writer = writer.option(key, value)
    writer.save()
    return ImportSummary(int(counts["rows"]) if counts else 0,
                         int(counts["derived"]) if counts else 0)


def sink_options(settings: Settings) -> Mapping[str, str]:
    """The Kafka sink's options: the requests topic, every replica's ack, idempotence and
    the deployment's client settings (``kafka.``-prefixed, as the source takes them)."""
    options = {"topic": settings.requests_topic,
               "kafka.bootstrap.servers": settings.bootstrap_servers,
               "kafka.acks": "all", "kafka.enable.idempotence": "true",
               "kafka.linger.ms": "20", "kafka.compression.type": "lz4"}
    options.update({f"kafka.{k}": v for k, v in settings.kafka_config.items()})
    return options


def run_export(settings: Settings, options: SparkOptions, output: Path, now_ms: int,
               report: Report, *, values: bool = True,
               cluster_id: str | None = None) -> Manifest:
    """:func:`export_pending` in a session on ``options.master``, progress to ``report``."""
    with spark_session(options) as spark, JobProgress(spark, report) as progress:
        progress.phase("exporting")
        return export_pending(spark, settings, output, now_ms, values=values,
                              cluster_id=cluster_id)


def run_import(settings: Settings, options: SparkOptions, directory: Path, manifest: Manifest,
               report: Report, *, allow_no_values: bool = False) -> ImportSummary:
    """:func:`import_export` in a session on ``options.master``, progress to ``report``."""
    with spark_session(options) as spark, JobProgress(spark, report) as progress:
        progress.phase("importing")
        return import_export(spark, settings, directory, manifest,
                             allow_no_values=allow_no_values)
