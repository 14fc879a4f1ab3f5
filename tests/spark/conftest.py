"""One SparkSession for every Spark test: local[2], small memory, no UI.

Starting a JVM costs seconds, so the session is made once per test run and
shared; the jobs use it because :func:`kdelay.spark.session.spark_session`
takes over an active session instead of building one. The connector's jars
come from ``KDELAY_CACHE_DIR`` (else the repository's ``.cache``), fetched with
Maven on first use, exactly as the CLI gets them. Without PySpark the whole
directory is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import SparkSession

from kdelay.spark.jars import default_cache_dir
from kdelay.spark.session import SparkOptions, new_session
from tests.e2e.conftest import deploy, receiver, start_kdelay

# A deployment with its running service, and readers of its targets, as the e2e tests have.
__all__ = ["deploy", "receiver", "start_kdelay"]

# The JVMs of the tests (the shared session's driver here, the standalone cluster's
# daemons, drivers and executors in test_cluster.py) compile with C1 alone and
# collect with the serial collector: their jobs are many and tiny, and C2's
# compilations of code that runs a few times and G1's threads were a third of their
# CPU. Flags of the JVM only: the jobs' plans and results are the same.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
TEST_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.driver.memory": "768m",
    "spark.ui.enabled": "false",
    "spark.sql.adaptive.enabled": "true",
    "spark.driver.extraJavaOptions": TEST_JVM_OPTIONS,
}


def cache_dir() -> Path:
    """Where the tests find (or fetch) the connector's jars."""
    given = os.environ.get("KDELAY_CACHE_DIR")
    return Path(given) if given else default_cache_dir()


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The session every Spark test shares; stopped at the end of the run."""
    options = SparkOptions(master="local[2]", conf=TEST_CONF, cache_dir=cache_dir())
    session = new_session(options, "kdelay-tests", "ERROR")
    yield session
    session.stop()
