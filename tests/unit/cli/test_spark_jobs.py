"""The Spark jobs' pure parts: jar lookup, options, the CLI without PySpark, core isolation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.spark import jars
from kdelay.spark.jars import JarsError, connector_jars, jars_dir, pom_version


def test_the_pom_pins_the_installed_pyspark() -> None:
    pytest.importorskip("pyspark")
    assert pom_version() == jars.pyspark_version()


def test_cached_jars_are_used_without_maven(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jars, "pyspark_version", lambda: "9.9.9")
    cached = jars_dir(tmp_path, "9.9.9")
    cached.mkdir()
    for name in ("b.jar", "a.jar"):
        (cached / name).write_bytes(b"")
    (cached / jars.COMPLETE).touch()
    assert connector_jars(tmp_path, pom=tmp_path / "absent.pom.xml") == [
        cached / "a.jar", cached / "b.jar"]


def test_a_pom_for_another_spark_version_is_refused(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jars, "pyspark_version", lambda: "9.9.9")
    pom = tmp_path / "pom.xml"
    pom.write_text("<project><properties><spark.version>4.0.0</spark.version></properties>"
                   "</project>")
    with pytest.raises(JarsError, match=re.escape("pins Spark 4.0.0 but PySpark 9.9.9")):
        connector_jars(tmp_path, pom=pom)


def test_without_jars_or_pom_the_error_says_what_to_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jars, "pyspark_version", lambda: "9.9.9")
    with pytest.raises(JarsError, match=re.escape("spark-sql-kafka-0-10_2.13-9.9.9")) as caught:
        connector_jars(tmp_path, pom=tmp_path / "absent.pom.xml")
    assert caught.value.code == "spark-jars"


@pytest.mark.parametrize("command", ["audit", "forecast"])
def test_without_pyspark_the_commands_say_spark_missing(
        command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)
    monkeypatch.setitem(sys.modules, "pyspark.errors", None)
    result = CliRunner().invoke(app, [command])
    assert result.exit_code == 2
    assert result.stderr.startswith("error[spark-missing]: ")


def test_the_core_never_imports_pyspark() -> None:
    code = ("import sys, kdelay.cli, kdelay.engine.service, kdelay.client, kdelay.spark.jars; "
            "sys.exit('pyspark' in sys.modules or 'matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
