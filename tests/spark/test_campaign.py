"""How ``schedule-table`` reads rows: times, ids, headers and verdicts, without a broker.

The frames of :mod:`kdelay.spark.campaign` are built on the shared session and
collected: every kind of time column, derived ids, the envelope compared with
the client library's, and the target policy's codes.
"""

from __future__ import annotations

import pytest
from pyspark.sql import DataFrame, SparkSession

from kdelay.client import request_headers
from kdelay.plumbing.settings import Settings
from kdelay.protocol.targets import Lanes
from kdelay.spark.campaign import (
    ID,
    REASON,
    CampaignError,
    Columns,
    Rules,
    judge,
    request_parts,
    requests_frame,
    sink_options,
    with_policy,
)

NOW = 1_800_000_000_000
WEEK_MS = 7 * 86_400_000
RULES = Rules(now_ms=NOW, partitions=3, past_tolerance_ms=600_000, max_due_after_ms=WEEK_MS)
SETTINGS = Settings(bootstrap_servers="unused:9092", requests_topic="kd.requests")


def _judged(spark: SparkSession, frame: DataFrame, columns: Columns,
            settings: Settings = SETTINGS) -> DataFrame:
    header, parts = request_parts(frame, columns)
    return judge(with_policy(spark, parts, settings.target_policy(), columns), header, RULES)


def _verdicts(judged: DataFrame, by: str = ID) -> dict[str, tuple[int | None, str | None]]:
    return {row[by]: (row["_time"], row[REASON]) for row in judged.collect()}


def test_due_times_of_every_kind(spark: SparkSession) -> None:
    # NOW is 2027-01-15T08:00:00Z.
    rows = [("ms", str(NOW + 5)), ("iso", "2027-01-16T09:00:00+01:00"),
            ("iso-z", "2027-01-16T08:00:00.250Z"), ("no-zone", "2027-01-16 08:00:00"),
            ("word", "soon"), ("empty", None), ("stale", str(NOW - 600_001)),
            ("recent", str(NOW - 600_000)), ("far", str(NOW + WEEK_MS + 1))]
    frame = spark.createDataFrame(rows, "id string, due string")
    found = _verdicts(_judged(spark, frame, Columns(target="orders")))
    iso = NOW + 86_400_000
    assert found == {
        "ms": (NOW + 5, None), "iso": (iso, None), "iso-z": (iso + 250, None),
        "no-zone": (None, "bad-time"), "word": (None, "bad-time"),
        "empty": (None, "missing-time"), "stale": (NOW - 600_001, "bad-time"),
        "recent": (NOW - 600_000, None), "far": (NOW + WEEK_MS + 1, "delay-too-long")}


def test_timestamp_and_epoch_columns(spark: SparkSession) -> None:
    frame = spark.createDataFrame([("a", NOW + 1_000)], "id string, at bigint").selectExpr(
        "id", "at", "timestamp_millis(at) as ts")
    assert _verdicts(_judged(spark, frame, Columns(target="t", due="ts"))) == {
        "a": (NOW + 1_000, None)}
    assert _verdicts(_judged(spark, frame, Columns(target="t", due="at"))) == {
        "a": (NOW + 1_000, None)}


def test_delays_in_milliseconds_or_with_a_unit(spark: SparkSession) -> None:
    rows = [("plain", "1500"), ("secs", "90s"), ("hours", " 2h "), ("days", "8d"),
            ("minus", "-5"), ("word", "later")]
    frame = spark.createDataFrame(rows, "id string, wait string")
    assert _verdicts(_judged(spark, frame, Columns(target="t", delay="wait"))) == {
        "plain": (1_500, None), "secs": (90_000, None), "hours": (7_200_000, None),
        "days": (8 * 86_400_000, "delay-too-long"), "minus": (None, "bad-time"),
        "word": (None, "bad-time")}


def test_derived_ids_are_the_same_every_run_and_tell_nulls_apart(spark: SparkSession) -> None:
    rows = [("x", None, "m"), (None, "x", "m"), ("x", None, "m"), ("x", "", "m")]
    frame = spark.createDataFrame(rows, "a string, b string, message string")
    columns = Columns(target="t", delay="message", id_from=("a", "b"), id_prefix="c1-")
    _, parts = request_parts(frame, columns)
    ids = [row[ID] for row in parts.collect()]
    assert ids[0] == ids[2]
    assert len({ids[0], ids[1], ids[3]}) == 3
    assert all(i.startswith("c1-") and len(i) == 35 for i in ids)
    _, again = request_parts(frame, columns)
    assert [row[ID] for row in again.collect()] == ids


def test_requests_carry_the_client_librarys_headers(spark: SparkSession) -> None:
    rows = [("r1", "refunds", str(NOW + 60_000), "k1", "v1", "email", None),
            ("r2", "orders", str(NOW + 60_000), None, "v2", None, "dev1"),
            ("r3", None, str(NOW + 60_000), "k3", "v3", "sms", None)]
    frame = spark.createDataFrame(
        rows, "id string, target string, due string, user string, body string, "
        "channel string, lane string")
    columns = Columns(key="user", value="body", headers={"channel": "channel"},
                      lane_column="lane")
    settings = Settings(bootstrap_servers="unused:9092", lanes=Lanes.parse("dev1=orders"))
    header, parts = request_parts(frame, columns)
    judged = judge(with_policy(spark, parts, settings.target_policy(), columns), header, RULES)
    sent = requests_frame(judged, header, 3).collect()
    assert [(r["key"], r["value"]) for r in sent] == [(b"k1", b"v1"), (None, b"v2")]
    assert [[(h["key"], h["value"]) for h in r["headers"]] for r in sent] == [
        request_headers("refunds", [("channel", "email")], due=NOW + 60_000, schedule_id="r1"),
        request_headers("orders", due=NOW + 60_000, schedule_id="r2", lane="dev1")]
    assert sorted((r[ID], r[REASON]) for r in judged.collect()) == [
        ("r1", None), ("r2", None), ("r3", "missing-target")]


def test_the_target_policy_refuses_as_the_service_does(spark: SparkSession) -> None:
    settings = Settings(bootstrap_servers="unused:9092", requests_topic="kd.requests",
                        lanes=Lanes.parse("dev1=dev1."), allowed_targets=("orders*", "dev1.*"))
    rows = [("own", "kd.requests", None), ("internal", "__consumer_offsets", None),
            ("ok", "orders.eu", None), ("not-allowed", "refunds", None),
            ("laned", "dev1.orders", "dev1"), ("wrong", "orders.eu", "dev1"),
            ("missing", "dev1.orders", None), ("unknown", "orders.eu", "dev9"),
            ("bad-name", "no topic!", None)]
    frame = spark.createDataFrame(rows, "id string, target string, lane string").selectExpr(
        "*", f"'{NOW}' as due")
    found = _judged(spark, frame, Columns(lane_column="lane"), settings)
    assert {k: v[1] for k, v in _verdicts(found).items()} == {
        "own": "forbidden-target", "internal": "forbidden-target", "ok": None,
        "not-allowed": "target-not-allowed", "laned": None, "wrong": "wrong-lane",
        "missing": "missing-lane", "unknown": "unknown-lane", "bad-name": "bad-header"}
    fixed = spark.createDataFrame([("a", str(NOW))], "id string, due string")
    assert _verdicts(_judged(spark, fixed, Columns(target="kd.requests"), settings)) == {
        "a": (NOW, "forbidden-target")}


def test_mapping_errors_have_codes(spark: SparkSession) -> None:
    frame = spark.createDataFrame([("a", True)], "id string, due boolean")
    with pytest.raises(CampaignError) as missing:
        request_parts(frame, Columns(target="t", delay="id", key="customer"))
    assert missing.value.code == "column-missing"
    assert "id, due" in str(missing.value)
    with pytest.raises(CampaignError) as typed:
        request_parts(frame, Columns(target="t"))
    assert typed.value.code == "column-type"
    for wrong in ({"target": "t", "target_column": "c"}, {"due": "a", "delay": "b"},
                  {"headers": {"Kdelay-Target": "c"}}):
        with pytest.raises(CampaignError) as mapping:
            Columns(**wrong)
        assert mapping.value.code == "bad-mapping"


def test_the_sink_compresses_unless_the_client_config_says_otherwise() -> None:
    assert sink_options(SETTINGS)["kafka.compression.type"] == "lz4"
    own = Settings(bootstrap_servers="unused:9092", kafka_config={"compression.type": "zstd"})
    assert sink_options(own)["kafka.compression.type"] == "zstd"
