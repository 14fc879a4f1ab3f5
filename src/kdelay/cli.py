"""The ``kdelay`` command line (typer).

Commands hold no logic: each builds :class:`~kdelay.settings.Settings` once,
from the common options, and calls a library function. Every option can also
be set by an environment variable named after it: ``--bootstrap-servers`` is
``KDELAY_BOOTSTRAP_SERVERS``, ``--kafka-config`` is ``KDELAY_KAFKA_CONFIG``.

Errors a user can cause (an unreadable ``--kafka-config``, an invalid value,
missing or misconfigured topics) print one line ``error[<code>]: <message>``
to stderr and exit 2; Kafka failures print ``error[kafka]`` (or
``error[delivery-failed]``) and exit 1. Neither shows a traceback. Commands
that talk to Kafka first check that a broker answers: ``error[broker-unreachable]``
(exit 1) or ``error[authentication-failed]`` (exit 2) within seconds.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import orjson
import typer
from confluent_kafka import KafkaError, KafkaException
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kdelay import identity
from kdelay.backlog import DueQuery, backlog, due
from kdelay.changelog import RestoreError, Restorer, rebuild
from kdelay.client import DelayProducer, DeliveryError, parse_due, parse_header
from kdelay.clock import SystemClock
from kdelay.connection import AUTHENTICATION_FAILED, ConnectionFailure, check_connection
from kdelay.display import (
    backlog_json,
    backlog_tables,
    due_json,
    due_table,
    retention_json,
    retention_tables,
    show_json,
    show_renderable,
)
from kdelay.envelope import DEFAULT_LEVELS, parse_duration_ms, parse_levels
from kdelay.index import IndexLocked, store_path
from kdelay.logs import LogFormat
from kdelay.logs import configure as configure_logs
from kdelay.lookup import NotARequest, lookup
from kdelay.pending import Originals, PendingView, ViewBusy
from kdelay.recurring import CANCELS_TOPIC, SERIES_TOPIC
from kdelay.recurring import cancel as cancel_series
from kdelay.retention import check as check_retention
from kdelay.retention import set_retention
from kdelay.settings import Guarantee, Settings, SettingsError, build_settings
from kdelay.tail import follow
from kdelay.topics import LayoutError, admin_client, create_topics

_DEFAULTS = Settings()
_COMMON_PANEL = "Common options"
_WEEK_MS = 7 * 24 * 3_600_000
USER_ERROR_EXIT = 2
KAFKA_ERROR_EXIT = 1

app = typer.Typer(
    name="kdelay",
    help="Delayed and scheduled delivery for Apache Kafka.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # locals can hold SASL passwords
)
topics_app = typer.Typer(help="Manage kdelay's topics.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")


def envvar(option: str) -> str:
    """The environment variable of ``--option``: ``KDELAY_`` + upper snake case."""
    return "KDELAY_" + option.upper().replace("-", "_")


def _option(
    name: str,
    help: str,
    *,
    shown: object = None,
    common: bool = False,
    metavar: str | None = None,
) -> Any:
    """A ``--name`` option also read from :func:`envvar`; ``shown`` is the default shown."""
    return typer.Option(
        f"--{name}",
        envvar=envvar(name),
        help=help,
        show_default=str(shown) if shown is not None else False,
        rich_help_panel=_COMMON_PANEL if common else None,
        metavar=metavar,
    )


def _common(name: str, help: str, shown: object = None) -> Any:
    """A common option: ``None`` when not given, so the settings default applies."""
    return _option(name, help, shown=shown, common=True)


BootstrapServers = Annotated[str | None, _common(
    "bootstrap-servers",
    "Kafka bootstrap servers; wins over bootstrap.servers in --kafka-config.",
    _DEFAULTS.bootstrap_servers)]
RequestsTopic = Annotated[str | None, _common(
    "requests-topic", "Topic producers write delay requests to.", _DEFAULTS.requests_topic)]
ChangelogTopic = Annotated[str | None, _common(
    "changelog-topic", "Compacted topic holding the index.", _DEFAULTS.changelog_topic)]
DlqTopic = Annotated[str | None, _common(
    "dlq-topic", "Topic for records kdelay cannot schedule or deliver.", _DEFAULTS.dlq_topic)]
GroupId = Annotated[str | None, _common(
    "group-id", "Consumer group of the service instances.", _DEFAULTS.group_id)]
StateDir = Annotated[Path | None, _common(
    "state-dir", "Directory of the local RocksDB indexes.", _DEFAULTS.state_dir)]
GuaranteeOpt = Annotated[Guarantee | None, _common(
    "guarantee", "Delivery guarantee.", _DEFAULTS.guarantee.value)]
MetricsPort = Annotated[int | None, _common(
    "metrics-port", "Port of the Prometheus endpoint; none when not given.")]
KafkaConfig = Annotated[Path | None, _common(
    "kafka-config", "A client.properties file with any Kafka client setting (SASL, TLS, ...).")]
Levels = Annotated[str | None, _common(
    "levels", "Delay-level table, level 1 first.", DEFAULT_LEVELS)]
RetentionMarginMs = Annotated[int | None, _common(
    "retention-margin-ms", "Safety margin kept below the requests topic's retention.",
    _DEFAULTS.retention_margin_ms)]
DeliveryAttempts = Annotated[int | None, _common(
    "delivery-attempts", "Attempts per record before it goes to the DLQ as undeliverable; "
    "0: only --delivery-retry-ms limits them.", _DEFAULTS.delivery_attempts)]
DeliveryRetryMs = Annotated[int | None, _common(
    "delivery-retry-ms", "How long a record whose target fails (not created yet, refusing) "
    "is retried after its first failure before it goes to the DLQ as undeliverable.",
    _DEFAULTS.delivery_retry_ms)]
RetryBackoffMs = Annotated[int | None, _common(
    "retry-backoff-ms", "First backoff after a failed delivery.", _DEFAULTS.retry_backoff_ms)]
RetryBackoffMaxMs = Annotated[int | None, _common(
    "retry-backoff-max-ms", "Longest backoff between delivery attempts.",
    _DEFAULTS.retry_backoff_max_ms)]
LookaheadMs = Annotated[int | None, _common(
    "lookahead-ms", "How far ahead due originals are read.", _DEFAULTS.lookahead_ms)]
BatchSize = Annotated[int | None, _common(
    "batch-size", "Most records handled per batch.", _DEFAULTS.batch_size)]
DeliveryTimeoutMs = Annotated[int | None, _common(
    "delivery-timeout-ms", "How long one produce to a target may take before it counts as failed.",
    _DEFAULTS.delivery_timeout_ms)]
InstanceId = Annotated[str | None, _common(
    "instance-id", "Static group member id (group.instance.id); derived from the host name "
    "and the absolute --state-dir when not given. Unique per instance, stable across restarts.")]
TransactionalId = Annotated[str | None, _common(
    "transactional-id", "Transactional id for exactly-once; derived from --group-id and the "
    "instance id when not given.")]
SessionTimeoutMs = Annotated[int | None, _common(
    "session-timeout-ms", "How long the partitions of an instance that died stay unserved "
    "before the group hands them to the others.", _DEFAULTS.session_timeout_ms)]
PartitionerOpt = Annotated[str | None, _common(
    "partitioner", "librdkafka partitioner for keyed records without kdelay-partition; "
    "murmur2_random places keys as a Java producer does.", _DEFAULTS.partitioner)]
AllowedTargets = Annotated[str | None, _common(
    "allowed-targets", "Comma-separated topics requests may target: names, fnmatch globs "
    "(orders.*) or re:REGEX; others go to the DLQ as target-not-allowed. kdelay's own "
    "topics are never targets. Any topic when not given.")]



_COMMON_OPTIONS: dict[str, Any] = {
    "bootstrap_servers": BootstrapServers,
    "requests_topic": RequestsTopic,
    "changelog_topic": ChangelogTopic,
    "dlq_topic": DlqTopic,
    "group_id": GroupId,
    "state_dir": StateDir,
    "guarantee": GuaranteeOpt,
    "metrics_port": MetricsPort,
    "kafka_config": KafkaConfig,
    "levels": Levels,
    "retention_margin_ms": RetentionMarginMs,
    "delivery_attempts": DeliveryAttempts,
    "delivery_retry_ms": DeliveryRetryMs,
    "retry_backoff_ms": RetryBackoffMs,
    "retry_backoff_max_ms": RetryBackoffMaxMs,
    "lookahead_ms": LookaheadMs,
    "batch_size": BatchSize,
    "delivery_timeout_ms": DeliveryTimeoutMs,
    "instance_id": InstanceId,
    "transactional_id": TransactionalId,
    "session_timeout_ms": SessionTimeoutMs,
    "partitioner": PartitionerOpt,
    "allowed_targets": AllowedTargets,
}


def common_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` every common option (keyword-only, after its own parameters).

    typer reads a command's parameters from its signature; the options are
    added there once instead of being repeated in every command. The command
    reads them through :func:`_settings`, not as arguments.
    """
    signature = inspect.signature(command, eval_str=True)
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=alias) for name, alias in _COMMON_OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        for name in _COMMON_OPTIONS:
            kwargs.pop(name, None)
        command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), *extra])
    wrapper.__annotations__ = {
        **{name: p.annotation for name, p in signature.parameters.items()},
        **_COMMON_OPTIONS, "return": None}
    return wrapper


def _settings(ctx: typer.Context) -> Settings:
    """Build the settings from the common options of the running command.

    Every command declares the common options with the aliases above and
    reads them here, from the parsed parameters, so no command passes them by
    hand. Raises :class:`SettingsError` as :func:`build_settings` does.
    """
    params = ctx.params
    common = {name: params[name] for name in _COMMON_OPTIONS if name != "kafka_config"}
    return build_settings(kafka_config_path=params["kafka_config"], **common)


def _connected(ctx: typer.Context) -> Settings:
    """The settings of :func:`_settings`, once a broker answers at their address.

    For commands that talk to Kafka: when no broker answers, the command
    stops at once with one ``error[broker-unreachable]`` line (see
    :func:`kdelay.connection.check_connection`) instead of waiting out
    librdkafka's timeouts.
    """
    settings = _settings(ctx)
    check_connection(settings.client_config("probe"))
    return settings


def _fail(code: str, message: str, exit_code: int) -> NoReturn:
    """Print ``error[code]: message`` to stderr and exit with ``exit_code``."""
    typer.echo(f"error[{code}]: {message}", err=True)
    raise typer.Exit(exit_code)


@contextmanager
def _reported(*, value_errors: bool = True) -> Iterator[None]:
    """Report the errors a user or the cluster causes as one line, without a traceback.

    With ``value_errors`` a plain ValueError counts as a bad argument; the
    ``run`` command turns that off around the service, where a ValueError is
    a bug and keeps its traceback.
    """
    try:
        yield
    except (SettingsError, LayoutError) as exc:
        _fail(exc.code, str(exc), USER_ERROR_EXIT)
    except DeliveryError as exc:
        _fail(exc.code, str(exc), KAFKA_ERROR_EXIT)
    except ConnectionFailure as exc:
        bad_credentials = exc.code == AUTHENTICATION_FAILED
        _fail(exc.code, str(exc), USER_ERROR_EXIT if bad_credentials else KAFKA_ERROR_EXIT)
    except IndexLocked as exc:
        _fail("state-dir-in-use", f"{exc}; stop the service that uses it first",
              USER_ERROR_EXIT)
    except RestoreError as exc:
        _fail("restore-failed", str(exc), KAFKA_ERROR_EXIT)
    except KafkaException as exc:
        _fail("kafka", _kafka_message(exc), KAFKA_ERROR_EXIT)
    except ValueError as exc:
        if not value_errors:
            raise
        _fail("invalid-argument", str(exc), USER_ERROR_EXIT)


def _kafka_message(exc: KafkaException) -> str:
    """The readable part of a KafkaException: its KafkaError's text and name."""
    error = exc.args[0] if exc.args else None
    if isinstance(error, KafkaError):
        return f"{error.str()} ({error.name()})"
    return str(exc)


@app.command()
@common_options
def run(
    ctx: typer.Context,
    check: Annotated[bool, _option(
        "check", "Check the settings and the topic layout, then exit.")] = False,
    log_level: Annotated[str, _option(
        "log-level", "Log level of the service (DEBUG, INFO, WARNING, ERROR).")] = "INFO",
    log_format: Annotated[LogFormat, _option(
        "log-format", "Log lines as text, or as JSON objects (time, level, logger, message).",
        shown=LogFormat.TEXT.value)] = LogFormat.TEXT,
) -> None:
    """Run the delay service: schedule requests and deliver them when due."""
    with _reported():
        settings = _settings(ctx)
        configure_logs(log_level, log_format, identity.of(settings).member_id)
        check_connection(settings.client_config("probe"))
    from kdelay.service import run_service

    with _reported(value_errors=False):
        exit_code = run_service(settings, check=check)
    raise typer.Exit(exit_code)


@topics_app.command("create")
@common_options
def topics_create(
    ctx: typer.Context,
    partitions: Annotated[int, _option(
        "partitions", "Partitions of the requests and changelog topics.", shown=3)] = 3,
    replication_factor: Annotated[int, _option(
        "replication-factor", "Replication factor; -1 is the broker default.", shown=1)] = 1,
    retention_ms: Annotated[int, _option(
        "retention-ms", "retention.ms of the requests topic: bounds the longest delay.",
        shown=_WEEK_MS)] = _WEEK_MS,
    target: Annotated[list[str] | None, _option(
        "target", "Also create this target topic (partitions as above) if missing; "
        "repeatable.")] = None,
) -> None:
    """Create the requests, changelog and dlq topics; existing ones are checked, not changed."""
    with _reported():
        settings = _settings(ctx)
        lines = create_topics(admin_client(settings), settings, partitions=partitions,
                              replication_factor=replication_factor, retention_ms=retention_ms,
                              targets=target or ())
    for line in lines:
        typer.echo(line)


@app.command()
@common_options
def send(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="Topic to deliver the record to.")],
    value: Annotated[str | None, _option("value", "Record value (UTF-8); null if not given.")]
    = None,
    key: Annotated[str | None, _option("key", "Record key (UTF-8).")] = None,
    header: Annotated[list[str] | None, _option(
        "header", "A user header; repeatable.", metavar="NAME=VALUE")] = None,
    delay: Annotated[str | None, _option(
        "delay", "Delay after the record's timestamp: 1500, 1500ms, 30s, 5m, 2h, 1d.")] = None,
    due: Annotated[str | None, _option(
        "due", "Due time: epoch ms or ISO-8601 with a timezone.")] = None,
    level: Annotated[int | None, _option("level", "Delay level, 1-based.")] = None,
    schedule_id: Annotated[str | None, _option(
        "id", "Schedule id: dedupes, and is the handle for cancel.")] = None,
    partition: Annotated[int | None, _option("partition", "Target partition.")] = None,
    every: Annotated[str | None, _option(
        "every", "Recurring: every interval (5m, 1h); needs `kdelay worker`.")] = None,
    cron: Annotated[str | None, _option(
        "cron", "Recurring: a cron expression (\"0 9 * * MON-FRI\"); needs `kdelay worker`.")]
    = None,
    tz: Annotated[str, _option("tz", "Time zone of --cron (IANA name).", shown="UTC")] = "UTC",
    until: Annotated[str | None, _option(
        "until", "Recurring: no occurrence after this time (epoch ms or ISO-8601).")] = None,
    count: Annotated[int | None, _option("count", "Recurring: at most this many times.")]
    = None,
    series_topic: Annotated[str, _option(
        "series-topic", "Recurring: topic the worker reads occurrences from.",
        shown=SERIES_TOPIC)] = SERIES_TOPIC,
) -> None:
    """Send one record to TARGET through kdelay; print its request's topic/partition/offset.

    Give exactly one of --delay, --due and --level; or --every or --cron for a
    recurring record (then print its id and first due time too).
    """
    if every is not None or cron is not None:
        if delay is not None or due is not None or level is not None:
            _fail("invalid-argument", "--every and --cron exclude --delay, --due and --level",
                  USER_ERROR_EXIT)
        _send_series(ctx, target, value, key, header, schedule_id,
                     SeriesOptions(every, cron, tz, until, count, series_topic))
        return
    with _reported():
        settings = _settings(ctx)
        with DelayProducer(settings) as producer:
            coordinates = producer.send(
                target, value, key=key, headers=[parse_header(h) for h in header or ()],
                delay=parse_duration_ms(delay) if delay is not None else None,
                due=parse_due(due) if due is not None else None,
                level=level, partition=partition, id=schedule_id,
            )
    typer.echo(str(coordinates))


@app.command()
@common_options
def cancel(
    ctx: typer.Context,
    schedule_id: Annotated[str, typer.Argument(metavar="ID", help="The schedule id to cancel.")],
    series_cancels_topic: Annotated[str, _option(
        "series-cancels-topic", "Compacted topic of series cancel markers (written when it "
        "exists).", shown=CANCELS_TOPIC)] = CANCELS_TOPIC,
) -> None:
    """Cancel the pending schedule ID, or end the series ID; print the cancel's coordinates."""
    with _reported():
        settings = _connected(ctx)
        with DelayProducer(settings) as producer:
            coordinates = cancel_series(settings, producer, schedule_id, SystemClock().now_ms(),
                                        series_cancels_topic)
    typer.echo(str(coordinates))


@app.command()
@common_options
def restore(
    ctx: typer.Context,
    partition: Annotated[list[int] | None, typer.Option(
        "--partition", envvar=envvar("partition"), show_default=False,
        help="A request partition to rebuild (repeatable); all when not given.")] = None,
    fresh: Annotated[bool, _option(
        "fresh", "Delete the local stores first and rebuild them whole.")] = False,
) -> None:
    """Rebuild the local indexes under --state-dir from the changelog, with progress.

    Run it with the service stopped (it refuses a store the service holds).
    """
    with _reported():
        settings = _connected(ctx)
        with Progress(TextColumn("partition {task.fields[partition]}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as bar:
            tasks: dict[int, TaskID] = {}

            def progress(p: int, done: int, total: int) -> None:
                if p not in tasks:
                    tasks[p] = bar.add_task("restore", total=total, partition=p)
                bar.update(tasks[p], completed=done, total=total)

            stores = functools.partial(store_path, settings.state_dir, settings.requests_topic)
            with Restorer(settings.client_config("restore"), settings.changelog_topic) as restorer:
                replayed = rebuild(restorer, stores, partitions=partition, fresh=fresh,
                                   progress=progress)
    for p, count in sorted(replayed.items()):
        typer.echo(f"partition {p}: {count} changelog records replayed")

# Spark jobs (need the spark extra; kdelay.spark is imported only inside them).
SPARK_MODULES = frozenset({"pyspark", "py4j", "matplotlib", "pandas", "pyarrow"})
AUDIT_FAILED_EXIT = 4

SparkMaster = Annotated[str, _option(
    "master", "Spark master URL: local[*], spark://HOST:7077, yarn, k8s://...",
    shown="local[*]")]
SparkConf = Annotated[list[str] | None, typer.Option(
    "--conf", envvar=envvar("conf"), show_default=False, metavar="KEY=VALUE",
    help="A Spark setting (repeatable), as spark-submit's --conf.")]
CacheDir = Annotated[Path | None, _option(
    "cache-dir", "Where the Kafka connector's jars are kept (fetched with Maven once); "
    "the clone's .cache by default.")]
JsonFlag = Annotated[bool, _option("json", "Print one JSON object instead of tables.")]
OutputDir = Annotated[Path | None, _option(
    "output", "Directory for the Parquet table and PNG charts.", metavar="DIR")]


@contextmanager
def _spark_job() -> Iterator[None]:
    """Report a missing spark extra, unavailable jars and failed Spark jobs as one line."""
    try:
        from pyspark.errors import PySparkException

        from kdelay.spark.jars import JarsError
    except ModuleNotFoundError as exc:
        _fail("spark-missing", f"the Spark jobs need the spark extra ({exc.name} is not "
              "installed): pip install 'kdelay[spark]'", USER_ERROR_EXIT)
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in SPARK_MODULES:
            raise
        _fail("spark-missing", f"the Spark jobs need the spark extra ({exc.name} is not "
              "installed): pip install 'kdelay[spark]'", USER_ERROR_EXIT)
    except JarsError as exc:
        _fail(exc.code, str(exc), USER_ERROR_EXIT)
    except PySparkException as exc:
        _fail("spark", str(exc).strip().splitlines()[0], KAFKA_ERROR_EXIT)


def _spark_options(master: str, conf: list[str] | None, cache_dir: Path | None) -> Any:
    """The session options of a Spark command (a ``kdelay.spark.session.SparkOptions``)."""
    from kdelay.spark.session import SparkOptions, parse_conf

    given = {"cache_dir": cache_dir} if cache_dir is not None else {}
    return SparkOptions(master=master, conf=parse_conf(conf or []), **given)


def _show(report_json: dict[str, Any] | None, tables: Any) -> None:
    """Print a job's report: JSON when given, else its rich tables."""
    if report_json is not None:
        typer.echo(orjson.dumps(report_json, option=orjson.OPT_INDENT_2).decode())
    else:
        Console().print(tables)


@app.command()
@common_options
def audit(
    ctx: typer.Context,
    settle: Annotated[str, _option(
        "settle", "A request due longer ago than this with no trace at all is lost.",
        shown="60s")] = "60s",
    since: Annotated[str | None, _option(
        "since", "Only requests with record time at or after this (epoch ms or ISO-8601).")]
    = None,
    until: Annotated[str | None, _option(
        "until", "Only requests with record time before this (epoch ms or ISO-8601).")] = None,
    targets: Annotated[list[str] | None, typer.Option(
        "--targets", envvar=envvar("targets"), show_default=False,
        help="Target topics to read (repeatable); those the requests name when not given.")]
    = None,
    expect: Annotated[Guarantee, _option(
        "expect", "With exactly-once, a request delivered more than once fails the audit.",
        shown="at-least-once")] = Guarantee.AT_LEAST_ONCE,
    json: JsonFlag = False,
    output: OutputDir = None,
    master: SparkMaster = "local[*]",
    conf: SparkConf = None,
    cache_dir: CacheDir = None,
) -> None:
    """Reconcile every schedule request with its deliveries, DLQ record or pending entry.

    Exit status 4 when a request is lost or delivered early (or, with
    --expect exactly-once, delivered more than once); 0 when clean.
    """
    with _reported(), _spark_job():
        from kdelay.spark.audit import AuditWindow
        from kdelay.spark.jobs import run_audit
        from kdelay.spark.tables import audit_tables

        window = AuditWindow(
            now_ms=SystemClock().now_ms(), settle_ms=parse_duration_ms(settle),
            since_ms=parse_due(since) if since is not None else None,
            until_ms=parse_due(until) if until is not None else None,
            targets=tuple(targets) if targets else None)
        settings = _connected(ctx)
        with Console(stderr=True).status("auditing with Spark"):
            report = run_audit(settings, _spark_options(master, conf, cache_dir), window, output)
    _show(report.to_json() if json else None, audit_tables(report))
    clean = report.clean(exactly_once=expect is Guarantee.EXACTLY_ONCE)
    raise typer.Exit(0 if clean else AUDIT_FAILED_EXIT)


@app.command()
@common_options
def forecast(
    ctx: typer.Context,
    horizon: Annotated[str, _option("horizon", "How far ahead the due curve looks.",
                                    shown="24h")] = "24h",
    bucket: Annotated[str, _option("bucket", "Width of one due-time bucket.", shown="1m")]
    = "1m",
    json: JsonFlag = False,
    output: OutputDir = None,
    master: SparkMaster = "local[*]",
    conf: SparkConf = None,
    cache_dir: CacheDir = None,
) -> None:
    """Forecast the pending backlog: due curve and peaks, targets, retention per partition."""
    with _reported(), _spark_job():
        from kdelay.spark.forecast import ForecastWindow
        from kdelay.spark.jobs import run_forecast
        from kdelay.spark.tables import forecast_tables

        window = ForecastWindow(now_ms=SystemClock().now_ms(),
                                horizon_ms=parse_duration_ms(horizon),
                                bucket_ms=parse_duration_ms(bucket))
        settings = _connected(ctx)
        with Console(stderr=True).status("forecasting with Spark"):
            report = run_forecast(settings, _spark_options(master, conf, cache_dir), window,
                                  output)
    _show(report.to_json() if json else None, forecast_tables(report))


@app.command()
@common_options
def tail(
    ctx: typer.Context,
    topic: Annotated[str, typer.Argument(help="Topic to print records of.")],
    from_beginning: Annotated[bool, _option(
        "from-beginning", "Start at the oldest record instead of the newest.")] = False,
    count: Annotated[int | None, _option("count", "Exit after this many records.")] = None,
) -> None:
    """Print records arriving on TOPIC, one line each, until Ctrl-C (or --count records).

    A line: topic/partition/offset, timestamp (UTC), key, value and headers.
    Reads without a consumer group: commits nothing, disturbs nobody.
    """
    with _reported(), contextlib.suppress(KeyboardInterrupt):
        follow(_settings(ctx), topic, typer.echo, from_beginning=from_beginning, count=count,
               ready=functools.partial(typer.echo, err=True))
# --- operator's view: due, backlog, show, retention check -------------------------------

retention_app = typer.Typer(help="Check the requests topic's retention.", no_args_is_help=True)
app.add_typer(retention_app, name="retention")
_DEFAULT_VIEW_DIR = Path.home() / ".cache" / "kdelay" / "view"
ViewDir = Annotated[Path, _option(
    "view-dir", "Where the operator commands keep their local copy of the changelog "
    "(never the service's --state-dir).", shown="~/.cache/kdelay/view")]
JsonOutput = Annotated[bool, _option("json", "Print JSON instead of tables.")]
_BUCKETS = {"1m": 60_000, "1h": 3_600_000, "1d": 86_400_000}


@contextmanager
def _operator_view(ctx: typer.Context, view_dir: Path) -> Iterator[
        tuple[Settings, PendingView, Originals, int]]:
    """Settings, the synced view, an original reader and "now", with errors reported.

    Progress of the changelog replay and of long reads goes to stderr.
    """
    with _reported():
        settings = _connected(ctx)
        now_ms = SystemClock().now_ms()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True),
                      transient=True) as bar:
            tasks: dict[str, TaskID] = {}

            def progress(what: str, done: int, total: int) -> None:
                if what not in tasks:
                    tasks[what] = bar.add_task(what, total=total)
                bar.update(tasks[what], completed=done, total=total)

            try:
                with PendingView(settings, view_dir, now_ms, progress) as view, \
                        Originals(settings, progress) as originals:
                    yield settings, view, originals, now_ms
            except (ViewBusy, NotARequest) as exc:
                _fail(exc.code, str(exc), USER_ERROR_EXIT)


@app.command("due")
@common_options
def due_command(
    ctx: typer.Context,
    within: Annotated[str, _option("within", "Window ahead of now: 30s, 1m, 2h.")] = "1m",
    overdue: Annotated[bool, _option("overdue", "Only entries already due.")] = False,
    target: Annotated[str | None, _option("target", "Only entries for this target.")] = None,
    partition: Annotated[int | None, _option("partition", "Only this request partition.")]
    = None,
    limit: Annotated[int, _option("limit", "Most entries listed; 0 for all.", shown=100)] = 100,
    as_json: JsonOutput = False,
    view_dir: ViewDir = _DEFAULT_VIEW_DIR,
) -> None:
    """List pending entries that are overdue or due within --within, in due order."""
    with _reported():
        query = DueQuery(parse_duration_ms(within), overdue, target, partition, limit or None)
    with _operator_view(ctx, view_dir) as (settings, view, originals, now_ms):
        listed = due(view, originals, query, now_ms)
    if as_json:
        for line in due_json(listed, settings.requests_topic):
            typer.echo(line)
    else:
        Console().print(due_table(listed, settings.requests_topic, now_ms))


@app.command("backlog")
@common_options
def backlog_command(
    ctx: typer.Context,
    bucket: Annotated[str, _option("bucket", "Due-time bucket: 1m, 1h or 1d.", shown="1h")]
    = "1h",
    by: Annotated[str, _option(
        "by", "Count per partition, or per target (reads every pending original).",
        shown="partition")] = "partition",
    as_json: JsonOutput = False,
    view_dir: ViewDir = _DEFAULT_VIEW_DIR,
) -> None:
    """How much is pending and when it comes due: totals, buckets, per partition or target."""
    if bucket not in _BUCKETS or by not in ("partition", "target"):
        _fail("invalid-argument", "--bucket is one of 1m, 1h, 1d and --by one of "
              "partition, target", USER_ERROR_EXIT)
    with _operator_view(ctx, view_dir) as (_, view, originals, now_ms):
        result = backlog(view, now_ms, _BUCKETS[bucket], originals if by == "target" else None)
    if as_json:
        typer.echo(backlog_json(result))
    else:
        Console().print(backlog_tables(result))


@app.command("show")
@common_options
def show_command(
    ctx: typer.Context,
    reference: Annotated[str, typer.Argument(
        metavar="ID_OR_COORDINATES", help="A schedule id, or topic/partition/offset.")],
    as_json: JsonOutput = False,
    view_dir: ViewDir = _DEFAULT_VIEW_DIR,
) -> None:
    """Show one request: whether it is pending, when and where it goes, and its original."""
    with _operator_view(ctx, view_dir) as (settings, view, originals, now_ms):
        found = lookup(view, originals, reference, settings.requests_topic, now_ms)
    if as_json:
        typer.echo(show_json(found, settings.requests_topic))
    else:
        Console().print(show_renderable(found, settings.requests_topic, now_ms))


@retention_app.command("check")
@common_options
def retention_check(
    ctx: typer.Context,
    as_json: JsonOutput = False,
    view_dir: ViewDir = _DEFAULT_VIEW_DIR,
) -> None:
    """Check that retention keeps every pending original until it is due.

    Exit status 0 when nothing is at risk, 3 when something is.
    """
    with _operator_view(ctx, view_dir) as (settings, view, _, now_ms):
        report = check_retention(settings, view, now_ms)
    if as_json:
        typer.echo(retention_json(report))
    else:
        Console().print(retention_tables(report))
    raise typer.Exit(report.exit_code)


@retention_app.command("set")
@common_options
def retention_set(
    ctx: typer.Context,
    retention: Annotated[str, typer.Argument(
        metavar="RETENTION", help="New retention.ms of the requests topic: ms, 30d, 72h, or -1.")],
) -> None:
    """Set the requests topic's retention.ms (and retention.bytes=-1).

    Restart the kdelay instances afterwards: they read retention at start.
    """
    with _reported():
        new_ms = -1 if retention == "-1" else parse_duration_ms(retention)
        settings = _connected(ctx)
        old = set_retention(settings, new_ms)
    typer.echo(f"{settings.requests_topic}: retention.ms {-1 if old is None else old} -> "
               f"{new_ms}, retention.bytes -1")


# --- Around the service: recurring sends and the task/series worker (issue 14) ---


@dataclass(frozen=True)
class SeriesOptions:
    """The recurring options of ``kdelay send``."""

    every: str | None
    cron: str | None
    tz: str
    until: str | None
    count: int | None
    series_topic: str


def _send_series(ctx: typer.Context, target: str, value: str | None, key: str | None,
                 header: list[str] | None, schedule_id: str | None,
                 options: SeriesOptions) -> None:
    """``kdelay send --every|--cron``: start a plain record series, print where and when."""
    from kdelay import recurring

    with _reported():
        settings = _settings(ctx)
        now_ms = SystemClock().now_ms()
        spec = recurring.spec_of(options.every, options.cron, options.tz, now_ms)
        series_id = schedule_id or f"series-{uuid.uuid4().hex}"
        coordinates, first_ms = recurring.send_series(
            settings, target, value, spec, schedule_id=series_id, now_ms=now_ms, key=key,
            headers=[parse_header(h) for h in header or ()],
            until_ms=parse_due(options.until) if options.until is not None else None,
            count=options.count, series_topic=options.series_topic)
    typer.echo(f"{coordinates} id={series_id} first-due-ms={first_ms}")


@app.command()
@common_options
def worker(
    ctx: typer.Context,
    registry: Annotated[str | None, _option(
        "registry", "The task registry to run, as module:object; plain series only if not "
        "given.", metavar="MODULE:OBJECT")] = None,
    worker_group_id: Annotated[str, _option(
        "worker-group-id", "Consumer group of the workers.", shown="kdelay-worker")]
    = "kdelay-worker",
    tasks_topic: Annotated[str, _option(
        "tasks-topic", "Topic task calls are delivered to.", shown="kdelay.tasks")]
    = "kdelay.tasks",
    series_topic: Annotated[str, _option(
        "series-topic", "Topic plain series occurrences are delivered to.",
        shown=SERIES_TOPIC)] = SERIES_TOPIC,
    series_cancels_topic: Annotated[str, _option(
        "series-cancels-topic", "Compacted topic of series cancel markers.",
        shown=CANCELS_TOPIC)] = CANCELS_TOPIC,
    worker_dlq_topic: Annotated[str, _option(
        "worker-dlq-topic", "Dead-letter topic of failed tasks.", shown="kdelay.tasks.dlq")]
    = "kdelay.tasks.dlq",
    backoff: Annotated[str | None, _option(
        "backoff", "Retry steps of a failed task.", shown="10s 30s 1m ... 1h 2h")] = None,
    create_topics: Annotated[bool, _option(
        "create-topics", "Create the worker's topics if missing, then exit.")] = False,
    partitions: Annotated[int, _option(
        "partitions", "Partitions of the tasks and series topics (--create-topics).",
        shown=3)] = 3,
    log_level: Annotated[str, _option("log-level", "Log level of the worker.")] = "INFO",
) -> None:
    """Run scheduled tasks and drive recurring series until SIGTERM or SIGINT.

    Exactly-once (--guarantee) makes each occurrence's next request, retries
    and offsets commit in one transaction.
    """
    from kdelay import tasks

    topics = tasks.WorkerTopics(tasks_topic, series_topic, series_cancels_topic,
                                worker_dlq_topic)
    with _reported():
        try:
            loaded = tasks.load_registry(registry) if registry is not None else None
        except tasks.RegistryError as exc:
            _fail(exc.code, str(exc), USER_ERROR_EXIT)
        options = tasks.WorkerOptions(worker_group_id, topics,
                                      parse_levels(backoff) if backoff else None)
        settings = _connected(ctx)
        if create_topics:
            for line in tasks.create_worker_topics(admin_client(settings), topics, partitions):
                typer.echo(line)
            return
        logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        typer.echo(f"worker: tasks {loaded.names() if loaded else 'none'}", err=True)
        tasks.run_worker(settings, loaded, options, stop.is_set)


@app.command()
@common_options
def stats(
    ctx: typer.Context,
    url: Annotated[list[str] | None, typer.Option(
        "--url", envvar=envvar("url"), show_default=False,
        help="A metrics endpoint (host:port or URL), repeatable; this host's --metrics-port "
             "when not given.")] = None,
    watch: Annotated[bool, _option("watch", "Refresh until Ctrl-C.")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", envvar=envvar("json"), help="Print JSON (one line per refresh).")] = False,
    interval: Annotated[float, _option(
        "interval", "Seconds between the readings rates are taken from.", shown=2.0)] = 2.0,
) -> None:
    """Summarise running instances from their metrics: rates, lateness, backlog, DLQ, skew."""
    from kdelay.stats import endpoints, show

    with _reported():
        settings = _settings(ctx)
        urls = endpoints(url or [], settings.metrics_port)
    raise typer.Exit(show(urls, console=Console(), watch=watch, as_json=as_json,
                          interval_s=interval))


def main() -> None:
    """Entry point of the ``kdelay`` console script."""
    app()


if __name__ == "__main__":
    main()
