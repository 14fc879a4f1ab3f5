"""Session options: ``--conf`` pairs and the jars handed over through ``spark.jars``."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from kdelay.cli.options import KAFKA_ERROR_EXIT
from kdelay.cli.spark import spark_job
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


class FakeJavaException:
    """What Py4J hands over of a Java exception: a proxy that answers ``toString``."""

    _target_id = "o1"

    def toString(self) -> str:  # the Java method's name
        return "java.io.FileNotFoundException: File file:/nowhere does not exist\n\tat x.y"


def test_a_refused_spark_setting_is_one_error_line_not_a_java_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    from py4j.protocol import Py4JJavaError

    with pytest.raises(typer.Exit) as exited, spark_job():
        raise Py4JJavaError("An error occurred while calling None.JavaSparkContext.\n",
                            FakeJavaException())
    assert exited.value.exit_code == KAFKA_ERROR_EXIT
    assert capsys.readouterr().err == (
        "error[spark]: java.io.FileNotFoundException: File file:/nowhere does not exist\n")
