"""Session options: ``--conf`` pairs and the jars handed over through ``spark.jars``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdelay.spark import session
from kdelay.spark.session import SparkOptions, builder_conf, parse_conf


def test_conf_pairs_split_at_the_first_equals() -> None:
    assert parse_conf(["spark.a=1", "spark.b=x=y"]) == {"spark.a": "1", "spark.b": "x=y"}
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        parse_conf(["spark.a"])


def test_the_connector_jars_come_first_in_spark_jars(monkeypatch: pytest.MonkeyPatch) -> None:
    found = [Path("/c/a.jar"), Path("/c/b.jar")]
    monkeypatch.setattr(session, "connector_jars", lambda _: found)
    conf = builder_conf(SparkOptions(conf={"spark.jars": "/mine.jar", "spark.x": "1"},
                                     cache_dir=Path("/c")))
    assert conf["spark.jars"] == "/c/a.jar,/c/b.jar,/mine.jar"
    assert conf["spark.x"] == "1"
