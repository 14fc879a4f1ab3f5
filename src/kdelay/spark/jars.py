"""The jars of Spark's Kafka source, found in a cache directory or fetched with Maven.

PySpark ships Spark, Scala, Hadoop and the compression and logging jars, but not
the Kafka source. ``tools/maven/spark-kafka.pom.xml`` names the connector
(``spark-sql-kafka-0-10_2.13``) at the installed PySpark's version and copies
only the jars PySpark lacks: the connector, its token provider, kafka-clients
and commons-pool2. They go to ``<cache>/spark-kafka-<version>/`` and are handed
to the session through ``spark.jars``, so nothing is resolved while a job runs.
This module does not import PySpark: the version is read from the installed
distribution's metadata.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from kdelay.errors import KdelayError

ROOT = Path(__file__).resolve().parents[3]
POM = ROOT / "tools" / "maven" / "spark-kafka.pom.xml"
COMPLETE = ".complete"
_VERSION = re.compile(r"<spark\.version>([^<]+)</spark\.version>")


class JarsError(KdelayError):
    """The connector's jars are missing and cannot be fetched; ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def default_cache_dir() -> Path:
    """The repository's ignored ``.cache`` in a clone, else ``~/.cache/kdelay``."""
    if POM.exists():
        return ROOT / ".cache"
    return Path.home() / ".cache" / "kdelay"


def pyspark_version() -> str:
    """Return the installed PySpark's version; :class:`JarsError` when it is absent."""
    try:
        return metadata.version("pyspark")
    except metadata.PackageNotFoundError:
        raise JarsError("spark-missing", "PySpark is not installed: pip install "
                        "'kdelay[spark]'") from None


def pom_version(pom: Path = POM) -> str:
    """Return the Spark version the pom pins the connector to."""
    found = _VERSION.search(pom.read_text(encoding="utf-8"))
    if found is None:
        raise JarsError("spark-jars", f"{pom} names no <spark.version>")
    return found[1]


def jars_dir(cache_dir: Path, version: str) -> Path:
    """The directory holding the connector's jars for Spark ``version``."""
    return cache_dir / f"spark-kafka-{version}"


def connector_jars(cache_dir: Path, *, pom: Path = POM) -> list[Path]:
    """Return the Kafka source's jars for the installed PySpark, fetching them once.

    Cached jars are used when ``<cache>/spark-kafka-<version>/.complete`` exists.
    Otherwise Maven copies them there (the first run downloads about 10 MB).
    Raises :class:`JarsError` when PySpark is missing (``spark-missing``), when
    the pom pins another Spark version than the installed one, or when the jars
    are absent and cannot be fetched (no pom outside a clone, no ``mvn``, or
    Maven failed) (``spark-jars``).
    """
    version = pyspark_version()
    target = jars_dir(cache_dir, version)
    if not (target / COMPLETE).exists():
        _fetch(pom, version, target)
    return sorted(target.glob("*.jar"))


def _fetch(pom: Path, version: str, target: Path) -> None:
    """Copy the connector's runtime jars into ``target`` with Maven, then mark it complete."""
    if not pom.exists():
        raise JarsError("spark-jars", f"no jars in {target} and no pom to fetch them with; "
                        f"copy spark-sql-kafka-0-10_2.13-{version} and its runtime jars there")
    pinned = pom_version(pom)
    if pinned != version:
        raise JarsError("spark-jars", f"{pom} pins Spark {pinned} but PySpark {version} is "
                        "installed; install the pinned PySpark (pip install -e '.[spark]')")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarsError("spark-jars", f"Maven (mvn) is needed to fetch Spark's Kafka source "
                        f"into {target}; install it")
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(  # noqa: S603 - mvn from PATH, fixed arguments
        [mvn, "-B", "-q", "-f", str(pom), "dependency:copy-dependencies",
         f"-DoutputDirectory={target}"],
        capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise JarsError("spark-jars", f"Maven could not fetch the jars: "
                        f"{(done.stdout + done.stderr).strip()[-500:]}")
    (target / COMPLETE).touch()
