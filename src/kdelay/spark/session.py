"""The SparkSession the jobs run in: master, extra ``--conf`` and the connector's jars."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from pyspark.sql import SparkSession

from kdelay.spark.jars import connector_jars, default_cache_dir

DEFAULT_MASTER = "local[*]"


def _no_conf() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SparkOptions:
    """Where a job runs: the master URL, extra Spark settings, and the jars' cache dir."""

    master: str = DEFAULT_MASTER
    conf: Mapping[str, str] = field(default_factory=_no_conf)
    cache_dir: Path = field(default_factory=default_cache_dir)


def parse_conf(pairs: list[str]) -> dict[str, str]:
    """Turn repeated ``k=v`` strings into settings; ValueError for one without ``=``."""
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--conf {pair!r} is not KEY=VALUE")
        conf[key.strip()] = value
    return conf


def builder_conf(options: SparkOptions) -> dict[str, str]:
    """The settings a session is built with: quiet defaults, the jars, then ``--conf``.

    ``spark.jars`` lists the connector's jars (fetched now if need be); a
    ``spark.jars`` given with ``--conf`` is appended to, not replaced.
    """
    jars = ",".join(str(path) for path in connector_jars(options.cache_dir))
    conf = {"spark.ui.showConsoleProgress": "false", "spark.sql.session.timeZone": "UTC"}
    conf.update(options.conf)
    given = options.conf.get("spark.jars")
    conf["spark.jars"] = f"{jars},{given}" if given else jars
    return conf


def quiet_py4j() -> None:
    """Keep py4j's INFO lines out of the logs.

    py4j logs every connection it closes at INFO, even from finalisers at
    interpreter exit, after logging's streams are closed ("--- Logging error ---").
    """
    logging.getLogger("py4j").setLevel(logging.WARNING)


def new_session(options: SparkOptions, app_name: str, log_level: str) -> SparkSession:
    """Build a session on ``options.master`` with the connector's jars and ``options.conf``.

    Raises :class:`~kdelay.spark.jars.JarsError` when the jars cannot be found
    or fetched.
    """
    quiet_py4j()
    builder = SparkSession.builder.master(options.master).appName(app_name)
    for key, value in builder_conf(options).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)
    return session


@contextmanager
def spark_session(options: SparkOptions) -> Iterator[SparkSession]:
    """Yield a session on ``options.master``; stop it at the end if it was made here.

    A session already active in this process (a test's, a notebook's) is used
    as it is and left running. Raises :class:`~kdelay.spark.jars.JarsError`
    when the connector's jars cannot be found or fetched.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    session = new_session(options, "kdelay", "WARN")
    try:
        yield session
    finally:
        session.stop()
