"""Pending schedules to Parquet and back on the real broker: ``kdelay export --format
parquet`` and ``kdelay import`` of the directory it writes.

The source deployment is seeded as intake writes it (requests, then their
changelog entries with the fingerprints intake stores), so every pending entry
and every entry that cannot be exported (expired, absent, mismatched) is known.
The destination runs a real service: the import goes through Spark's Kafka
sink, the service takes the requests in, and an export of the destination
must give back the same schedules with the same ids and due times.
"""

from __future__ import annotations

import json
import random
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from pyspark.sql import SparkSession
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec, envelope, forward
from kdelay.spark import migration
from kdelay.spark.placement import id_partition
from tests.conftest import produce_all
from tests.e2e.conftest import Deployment, KdelayProcess, deploy, start_kdelay

__all__ = ["deploy", "start_kdelay"]
pytestmark = pytest.mark.kafka
HOUR_MS = 3_600_000
COMPARED = ("id", "due_ms", "target", "target_partition", "lane", "key", "headers")


def _now() -> int:
    return time.time_ns() // 1_000_000


def _request(target: str, partition: int, index: int, *, due_ms: int,
             schedule_id: str | None, target_partition: int | None = None) -> dict[str, Any]:
    headers = [("trace", f"t-{index}".encode()), ("empty", None),
               *envelope.schedule_headers(target, due_ms=due_ms, schedule_id=schedule_id,
                                          partition=target_partition)]
    return {"partition": partition, "key": f"k-{index}".encode(),
            "value": f"payload {index}".encode() * (index + 1), "headers": headers}


def _put(message: Any, due_ms: int, schedule_id: str | None, target: str, *,
         crc_delta: int = 0) -> dict[str, Any]:
    """The changelog record intake writes for ``message`` (a delivery report)."""
    partition, offset = int(message.partition()), int(message.offset())
    ts, crc = codec.fingerprint(message.key(), message.value(), message.timestamp()[1])
    value = codec.encode_index_value(codec.IndexValue(
        codec.Fingerprint(ts, (crc + crc_delta) % 2**32), schedule_id, target))
    return {"partition": partition, "key": codec.encode_due_key(due_ms, partition, offset),
            "value": value}


def _seed(source: Deployment, admin: AdminClient, target: str) -> dict[str | None, Any]:
    """Six pending entries that export, one cancelled, and one each expired, absent and
    mismatched; return the expected rows by id (None for the one without an id)."""
    base = _now() + HOUR_MS
    producer = Producer({"bootstrap.servers": source.bootstrap})
    doomed = produce_all(producer, source.requests, [
        _request(target, 1, 90, due_ms=base, schedule_id="expired-1")])[0]
    plans = [(0, "order-1", None), (0, "order-2", 2), (1, "order-3", None), (1, None, None),
             (0, "order-5", None), (1, "order-6", 0), (0, "cancelled", None),
             (0, "mismatch", None)]
    sent = [produce_all(producer, source.requests, [_request(
        target, p, i, due_ms=base + i * 1_000, schedule_id=sid, target_partition=tp)])[0]
        for i, (p, sid, tp) in enumerate(plans)]
    puts = [_put(m, base + i * 1_000, plans[i][1], target, crc_delta=int(i == 7))
            for i, m in enumerate(sent)]
    gone = {**_put(sent[0], base, "absent-1", target)}
    gone["key"] = codec.encode_due_key(base, 0, 999)
    cancelled = {**puts[6], "value": None}
    produce_all(producer, source.changelog, [_put(doomed, base, "expired-1", target), *puts,
                                             gone, cancelled])
    cut = TopicPartition(source.requests, 1, int(doomed.offset() or 0) + 1)
    admin.delete_records([cut])[cut].result(timeout=30)
    return {plans[i][1]: {
        "id": plans[i][1], "due_ms": base + i * 1_000, "target": target,
        "target_partition": plans[i][2], "lane": None, "key": m.key(), "value": m.value(),
        "headers": [("trace", f"t-{i}".encode()), ("empty", None)],
        "coordinates": (int(m.partition() or 0), int(m.offset() or 0))}
        for i, m in enumerate(sent[:6])}


def _rows(spark: SparkSession, directory: Path) -> dict[str | None, dict[str, Any]]:
    """The rows of an export directory by id, headers as (name, bytes) pairs."""
    found: dict[str | None, dict[str, Any]] = {}
    for row in spark.read.parquet(str(directory)).collect():
        values = row.asDict()
        values["headers"] = [(h["key"], None if h["value"] is None else bytes(h["value"]))
                             for h in values["headers"] or []]
        for name in ("key", "value"):
            if values.get(name) is not None:
                values[name] = bytes(values[name])
        found[values["id"]] = values
    return found


def caught_up(deployment: Deployment, timeout_s: float = 120) -> None:
    """Wait until the service has taken in every request written so far."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap,
                         "group.id": deployment.group_id, "enable.auto.commit": False})
    parts = [TopicPartition(deployment.requests, p) for p in range(deployment.partitions)]
    deadline = time.monotonic() + timeout_s
    try:
        ends = [consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in parts]
        while time.monotonic() < deadline:
            done = [tp.offset for tp in consumer.committed(parts, timeout=10)]
            if all(d >= e for d, e in zip(done, ends, strict=True)):
                return
            time.sleep(0.2)
        pytest.fail(f"the service did not take in {ends} within {timeout_s}s")
    finally:
        consumer.close()


def _settings(deployment: Deployment) -> Settings:
    return Settings(bootstrap_servers=deployment.bootstrap, requests_topic=deployment.requests,
                    changelog_topic=deployment.changelog, dlq_topic=deployment.dlq,
                    outcomes_topic=deployment.outcomes)


def test_parquet_export_and_import_keep_ids_due_times_and_records(
        spark: SparkSession, deploy: Callable[..., Deployment], admin: AdminClient,
        start_kdelay: Callable[..., KdelayProcess], tmp_path: Path) -> None:
    source, destination = deploy(partitions=2), deploy(partitions=3)
    target = f"mig-orders-{_now()}"
    expected = _seed(source, admin, target)
    out = tmp_path / "pending"

    result = CliRunner().invoke(app, ["export", "--format", "parquet", "--output", str(out)],
                                env=source.env())
    assert result.exit_code == 3, result.output
    assert "exported 6 of 9 pending schedules" in result.stdout
    manifest = json.loads((out / migration.MANIFEST).read_text())
    assert (manifest["pending"], manifest["exported"], manifest["unexported"],
            manifest["values"]) == (9, 6, {"absent": 1, "expired": 1, "mismatch": 1}, True)
    assert manifest["latest_due_ms"] == max(e["due_ms"] for e in expected.values())
    rows = _rows(spark, out)
    assert set(rows) == set(expected)
    for sid, want in expected.items():
        got = rows[sid]
        assert {k: got[k] for k in (*COMPARED, "value")} == {k: want[k] for k in (
            *COMPARED, "value")}, sid
        assert (got["topic"], got["partition"], got["offset"]) == (source.requests,
                                                                   *want["coordinates"])

    kdelay = start_kdelay(destination)
    kdelay.wait_ready()
    imported = CliRunner().invoke(app, ["import", str(out)], env=destination.env())
    assert imported.exit_code == 0, imported.output
    assert "sent 6 requests" in imported.stdout
    assert "1 entries without an id" in imported.stdout
    caught_up(destination)
    again = tmp_path / "again"
    manifest_b = migration.export_pending(spark, _settings(destination), again, _now())
    assert (manifest_b.pending, manifest_b.exported) == (6, 6)
    moved = _rows(spark, again)
    derived = f"kdelay-export:{manifest['cluster_id'] or '-'}:{source.requests}:" \
              f"{expected[None]['coordinates'][0]}:{expected[None]['coordinates'][1]}"
    assert set(moved) == {*(sid for sid in expected if sid is not None), derived}
    for sid, want in expected.items():
        got = moved[sid if sid is not None else derived]
        assert got["partition"] == forward.id_partition(got["id"], 3), "on its id's partition"
        assert {k: got[k] for k in (*COMPARED[1:], "value")} == {k: want[k] for k in (
            *COMPARED[1:], "value")}, sid

    _without_values(spark, source, destination, tmp_path, moved)
    assert kdelay.terminate() == 0


def _without_values(spark: SparkSession, source: Deployment, destination: Deployment,
                    tmp_path: Path, moved: dict[str | None, dict[str, Any]]) -> None:
    """--no-values: no value column; its import is refused unless allowed, and a second
    import of schedules still pending adds nothing (the service answers duplicate)."""
    bare = tmp_path / "bare"
    result = CliRunner().invoke(app, ["export", "--format", "parquet", "--no-values",
                                      "--output", str(bare)], env=source.env())
    assert result.exit_code == 3, result.output
    assert "value" not in spark.read.parquet(str(bare)).columns
    refused = CliRunner().invoke(app, ["import", str(bare)], env=destination.env())
    assert refused.exit_code == 2
    assert "error[export-without-values]" in refused.output
    allowed = CliRunner().invoke(app, ["import", "--allow-no-values", str(bare)],
                                 env=destination.env())
    assert allowed.exit_code == 0, allowed.output
    caught_up(destination)
    check = migration.export_pending(spark, _settings(destination), tmp_path / "check", _now())
    assert (check.pending, check.exported) == (6, 6)
    assert _rows(spark, tmp_path / "check") == moved, "nothing scheduled twice, values kept"


def test_an_unfinished_export_is_not_imported(tmp_path: Path) -> None:
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "part-0.parquet").write_bytes(b"PAR1")
    result = CliRunner().invoke(app, ["import", str(tmp_path / "cut")])
    assert result.exit_code == 2
    assert "error[export-truncated]" in result.output
    (tmp_path / "cut" / migration.MANIFEST).write_text(json.dumps(
        {"format": migration.FORMAT, "version": 99}))
    result = CliRunner().invoke(app, ["import", str(tmp_path / "cut")])
    assert "error[export-version-unknown]" in result.output


JAVA_MURMUR2 = {"21": -973932308, "foobar": -790332482, "abc": 479470107,
                "a-little-bit-long-string": -985981536,
                "a-little-bit-longer-string": -1486304829,
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971}
"""Kafka's own murmur2 test vectors (the Java client's ``Utils.murmur2``)."""


def test_ids_are_placed_by_the_java_clients_murmur2_in_spark_sql(spark: SparkSession) -> None:
    rnd = random.Random(48)
    alphabet = string.printable + "éü€😀"
    ids = [*JAVA_MURMUR2, "", "a", "ab", "abcd", "é€😀", *(
        "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 40))) for _ in range(500))]
    frame = spark.createDataFrame([(sid,) for sid in ids], "sid string")
    for partitions in (1, 3, 64, 2**31 - 1):
        placed = frame.select("sid", id_partition("sid", partitions).alias("p")).collect()
        assert [row["p"] for row in placed] == [
            forward.id_partition(sid, partitions) for sid in ids], partitions
        for row in placed[:len(JAVA_MURMUR2)]:
            assert row["p"] == (JAVA_MURMUR2[row["sid"]] & 0x7FFFFFFF) % partitions
