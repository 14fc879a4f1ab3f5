"""The ``kdelay`` command line (typer).

Commands hold no logic: each builds :class:`~kdelay.settings.Settings` once,
from the common options, and calls a library function. Every option can also
be set by an environment variable named after it: ``--bootstrap-servers`` is
``KDELAY_BOOTSTRAP_SERVERS``, ``--kafka-config`` is ``KDELAY_KAFKA_CONFIG``.

Errors a user can cause (an unreadable ``--kafka-config``, an invalid value,
missing or misconfigured topics) print one line ``error[<code>]: <message>``
to stderr and exit 2; Kafka failures print ``error[kafka]`` (or
``error[delivery-failed]``) and exit 1. Neither shows a traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

from kdelay.changelog import RestoreError, rebuild
from kdelay.client import DelayProducer, DeliveryError, parse_due, parse_header
from kdelay.clock import SystemClock
from kdelay.envelope import DEFAULT_LEVELS, parse_duration_ms
from kdelay.index import IndexLocked
from kdelay.settings import Guarantee, Settings, SettingsError, build_settings
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
    "delivery-attempts", "Attempts per record before it goes to the DLQ as undeliverable.",
    _DEFAULTS.delivery_attempts)]
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
    "instance-id", "Static group member id (group.instance.id): a restart takes the "
    "partitions back at once. Give each instance its own.")]
TransactionalId = Annotated[str | None, _common(
    "transactional-id", "Transactional id for exactly-once; derived from --group-id if not given.")]



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
    "retry_backoff_ms": RetryBackoffMs,
    "retry_backoff_max_ms": RetryBackoffMaxMs,
    "lookahead_ms": LookaheadMs,
    "batch_size": BatchSize,
    "delivery_timeout_ms": DeliveryTimeoutMs,
    "instance_id": InstanceId,
    "transactional_id": TransactionalId,
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
) -> None:
    """Run the delay service: schedule requests and deliver them when due."""
    with _reported():
        settings = _settings(ctx)
        logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
) -> None:
    """Create the requests, changelog and dlq topics; existing ones are checked, not changed."""
    with _reported():
        settings = _settings(ctx)
        lines = create_topics(admin_client(settings), settings, partitions=partitions,
                              replication_factor=replication_factor, retention_ms=retention_ms)
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
) -> None:
    """Send one record to TARGET through kdelay; print its request's topic/partition/offset.

    Give exactly one of --delay, --due and --level.
    """
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
) -> None:
    """Cancel the pending schedule ID; print the cancel request's topic/partition/offset."""
    with _reported():
        settings = _settings(ctx)
        with DelayProducer(settings) as producer:
            coordinates = producer.cancel(schedule_id)
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
        settings = _settings(ctx)
        with Progress(TextColumn("partition {task.fields[partition]}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True)) as bar:
            tasks: dict[int, TaskID] = {}

            def progress(p: int, done: int, total: int) -> None:
                if p not in tasks:
                    tasks[p] = bar.add_task("restore", total=total, partition=p)
                bar.update(tasks[p], completed=done, total=total)

            replayed = rebuild(settings, partitions=partition, fresh=fresh, progress=progress)
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

        settings = _settings(ctx)
        window = AuditWindow(
            now_ms=SystemClock().now_ms(), settle_ms=parse_duration_ms(settle),
            since_ms=parse_due(since) if since is not None else None,
            until_ms=parse_due(until) if until is not None else None,
            targets=tuple(targets) if targets else None)
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

        settings = _settings(ctx)
        window = ForecastWindow(now_ms=SystemClock().now_ms(),
                                horizon_ms=parse_duration_ms(horizon),
                                bucket_ms=parse_duration_ms(bucket))
        with Console(stderr=True).status("forecasting with Spark"):
            report = run_forecast(settings, _spark_options(master, conf, cache_dir), window,
                                  output)
    _show(report.to_json() if json else None, forecast_tables(report))


def main() -> None:
    """Entry point of the ``kdelay`` console script."""
    app()


if __name__ == "__main__":
    main()
