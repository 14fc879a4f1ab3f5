"""The id's partition computed in Spark SQL equals the protocol's and the Java client's.

:func:`kdelay.spark.placement.id_partition` is checked against
:func:`kdelay.protocol.forward.id_partition` (librdkafka's murmur2) and against
``Utils.toPositive(Utils.murmur2(id.getBytes(UTF_8))) % n`` run by ``java``
from the kafka-clients jar Spark's Kafka connector ships with.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pyspark
import pytest
from pyspark.sql import SparkSession

from kdelay.protocol.forward import id_partition
from kdelay.spark import placement
from kdelay.spark.jars import connector_jars
from tests.spark.conftest import cache_dir

PARTITIONS = (1, 3, 7, 12, 64, 1_000)
JAVA = """
import java.io.*;
import java.nio.charset.StandardCharsets;
import org.apache.kafka.common.utils.Utils;

public class Placement {
    public static void main(String[] args) throws IOException {
        BufferedReader in = new BufferedReader(
            new InputStreamReader(System.in, StandardCharsets.UTF_8));
        StringBuilder out = new StringBuilder();
        String id;
        while ((id = in.readLine()) != null) {
            int hash = Utils.toPositive(Utils.murmur2(id.getBytes(StandardCharsets.UTF_8)));
            for (String n : args) out.append(hash % Integer.parseInt(n)).append(' ');
            out.append('\\n');
        }
        System.out.print(out);
    }
}
"""


def sample_ids(count: int) -> list[str]:
    """Ids of every length from 0 to 80 bytes: half ASCII only (the fast path, every
    control and high-bit-free character), half with multi-byte characters."""
    rng = random.Random(48)
    mixed = "abcXYZ019-_:./ éü日本\U0001f600"
    plain = "".join(chr(c) for c in range(1, 128) if chr(c) not in "\r\n")
    fixed = ["", "a", "ab", "abc", "abcd", "abcde", "order-43", "ümlaut-ß-日本語", "\U0001f600x",
             "\x7f\x01~", "reminder-1234567", "c2026-" + "f" * 32]
    return fixed + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
                    for alphabet in (plain, mixed) for _ in range(count // 2)]


def spark_partitions(spark: SparkSession, ids: list[str]) -> list[list[int]]:
    """Each id's partition under every count of :data:`PARTITIONS`, computed by Spark."""
    frame = spark.createDataFrame([(i, sid) for i, sid in enumerate(ids)], "n int, id string")
    rows = frame.select("n", *[placement.id_partition("id", p).alias(f"p{p}")
                               for p in PARTITIONS]).orderBy("n").collect()
    return [[row[f"p{p}"] for p in PARTITIONS] for row in rows]


def test_spark_places_ids_as_the_protocol_does(spark: SparkSession) -> None:
    ids = sample_ids(2_000)
    expected = [[id_partition(sid, p) for p in PARTITIONS] for sid in ids]
    assert spark_partitions(spark, ids) == expected


def java_partitions(ids: list[str], counts: tuple[int, ...], work_dir: Path) -> list[list[int]]:
    """Each id's partition under each of ``counts`` as the Java client computes it.

    Runs ``java`` on a small program (:data:`JAVA`) with the kafka-clients jar
    of Spark's Kafka connector; ids must not hold line breaks.
    """
    kafka = next(j for j in connector_jars(cache_dir()) if j.name.startswith("kafka-clients-"))
    # Utils logs through SLF4J, whose API PySpark ships.
    slf4j = next((Path(pyspark.__file__).parent / "jars").glob("slf4j-api-*.jar"))
    source = work_dir / "Placement.java"
    source.write_text(JAVA, encoding="utf-8")
    command = ["java", "-cp", f"{kafka}:{slf4j}", str(source), *map(str, counts)]
    done = subprocess.run(command, input="\n".join(ids) + "\n", capture_output=True, text=True,
                          encoding="utf-8", timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    found = [[int(p) for p in line.split()] for line in done.stdout.splitlines()]
    assert len(found) == len(ids)
    return found


def test_spark_places_ids_as_the_java_client_does(spark: SparkSession, tmp_path: Path) -> None:
    ids = sample_ids(500)
    assert spark_partitions(spark, ids) == java_partitions(ids, PARTITIONS, tmp_path)


def test_a_null_id_has_no_partition(spark: SparkSession) -> None:
    row = spark.createDataFrame([(None,)], "id string").select(
        placement.id_partition("id", 3).alias("p")).first()
    assert row is not None
    assert row["p"] is None


def test_a_topic_has_at_least_one_partition() -> None:
    with pytest.raises(ValueError, match="at least one partition"):
        placement.id_partition("id", 0)
