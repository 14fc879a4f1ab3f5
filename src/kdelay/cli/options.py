"""What every ``kdelay`` command shares: options, settings, and how errors are reported.

Every option can also be set by an environment variable named after it
(:func:`envvar`): ``--bootstrap-servers`` is ``KDELAY_BOOTSTRAP_SERVERS``,
``--kafka-config`` is ``KDELAY_KAFKA_CONFIG``. The common options are added to
a command's signature once, by :func:`common_options`, and read back into one
:class:`~kdelay.plumbing.settings.Settings` by :func:`settings_of`.

Errors a user can cause (an unreadable ``--kafka-config``, an invalid value,
missing or misconfigured topics) print one line ``error[<code>]: <message>``
to stderr and exit 2; Kafka failures print ``error[kafka]`` (or
``error[delivery-failed]``) and exit 1. Neither shows a traceback
(:func:`reported`). Commands that talk to Kafka first check that a broker
answers (:func:`connected`): ``error[broker-unreachable]`` (exit 1) or
``error[authentication-failed]`` (exit 2) within seconds.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from confluent_kafka import KafkaError, KafkaException

from kdelay.client import DeliveryError, RequestRefused
from kdelay.errors import KdelayError, ServiceError
from kdelay.outcomes import NO_OUTCOME_EXIT, NoOutcome
from kdelay.plumbing.connection import AUTHENTICATION_FAILED, TLS_FAILED, ConnectionFailure
from kdelay.plumbing.connection import check_connection as check_connection  # tests replace it
from kdelay.plumbing.settings import Guarantee, Settings, SettingsError, build_settings
from kdelay.plumbing.topics import LayoutError
from kdelay.protocol.durations import DEFAULT_LEVELS
from kdelay.state.changelog import RestoreError
from kdelay.state.homes import MoveError
from kdelay.state.statedir import IndexLocked
from kdelay.view.export import ExportError

log = logging.getLogger("kdelay.cli")

_DEFAULTS = Settings()
_COMMON_PANEL = "Common options"
USER_ERROR_EXIT = 2
KAFKA_ERROR_EXIT = 1

def envvar(option: str) -> str:
    """The environment variable of ``--option``: ``KDELAY_`` + upper snake case."""
    return "KDELAY_" + option.upper().replace("-", "_")


def option(
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


def common(name: str, help: str, shown: object = None) -> Any:
    """A common option: ``None`` when not given, so the settings default applies."""
    return option(name, help, shown=shown, common=True)


BootstrapServers = Annotated[str | None, common(
    "bootstrap-servers",
    "Kafka bootstrap servers; wins over bootstrap.servers in --kafka-config.",
    _DEFAULTS.bootstrap_servers)]
RequestsTopic = Annotated[str | None, common(
    "requests-topic", "Topic producers write delay requests to.", _DEFAULTS.requests_topic)]
ChangelogTopic = Annotated[str | None, common(
    "changelog-topic", "Compacted topic holding the index.", _DEFAULTS.changelog_topic)]
DlqTopic = Annotated[str | None, common(
    "dlq-topic", "Topic for records kdelay cannot schedule or deliver.", _DEFAULTS.dlq_topic)]
OutcomesTopic = Annotated[str | None, common(
    "outcomes-topic", "Compacted topic of the outcome records of requests with an id.",
    _DEFAULTS.outcomes_topic)]
ControlsTopic = Annotated[str | None, common(
    "controls-topic", "Compacted topic of the target controls (pause, rate cap); never a "
    "delivery target.", _DEFAULTS.controls_topic)]
StatusTopic = Annotated[str | None, common(
    "status-topic", "Compacted topic where each instance says which request partitions it "
    "serves or restores; never a delivery target.", _DEFAULTS.status_topic)]
SeriesCancelsTopic = Annotated[str | None, common(
    "series-cancels-topic", "Compacted topic of kdelay worker's series cancel markers; never a "
    "delivery target.", _DEFAULTS.series_cancels_topic)]
WorkerDlqTopic = Annotated[str | None, common(
    "worker-dlq-topic", "Dead-letter topic of kdelay worker's failed tasks; never a delivery "
    "target.", _DEFAULTS.worker_dlq_topic)]
GroupId = Annotated[str | None, common(
    "group-id", "Consumer group of the service instances.", _DEFAULTS.group_id)]
StateDir = Annotated[Path | None, common(
    "state-dir", "Directory of the local RocksDB indexes.", _DEFAULTS.state_dir)]
GuaranteeOpt = Annotated[Guarantee | None, common(
    "guarantee", "Delivery guarantee.", _DEFAULTS.guarantee.value)]
MetricsPort = Annotated[int | None, common(
    "metrics-port", "Port of the Prometheus endpoint (/metrics) and the probes /healthz and "
    "/readyz; none when not given.")]
KafkaConfig = Annotated[Path | None, common(
    "kafka-config", "A client.properties file with any Kafka client setting (SASL, TLS, ...).")]
Levels = Annotated[str | None, common(
    "levels", "Delay-level table, level 1 first.", DEFAULT_LEVELS)]
RetentionMarginMs = Annotated[int | None, common(
    "retention-margin-ms", "Safety margin kept below the requests topic's retention.",
    _DEFAULTS.retention_margin_ms)]
DeliveryAttempts = Annotated[int | None, common(
    "delivery-attempts", "Attempts per record before it goes to the DLQ as undeliverable; "
    "0: only --delivery-retry-ms limits them.", _DEFAULTS.delivery_attempts)]
DeliveryRetryMs = Annotated[int | None, common(
    "delivery-retry-ms", "How long a record whose target fails (not created yet, refusing) "
    "is retried after its first failure before it goes to the DLQ as undeliverable.",
    _DEFAULTS.delivery_retry_ms)]
RetryBackoffMs = Annotated[int | None, common(
    "retry-backoff-ms", "First backoff after a failed delivery.", _DEFAULTS.retry_backoff_ms)]
RetryBackoffMaxMs = Annotated[int | None, common(
    "retry-backoff-max-ms", "Longest backoff between delivery attempts.",
    _DEFAULTS.retry_backoff_max_ms)]
LookaheadMs = Annotated[int | None, common(
    "lookahead-ms", "How far ahead due originals are read.", _DEFAULTS.lookahead_ms)]
BatchSize = Annotated[int | None, common(
    "batch-size", "Most records handled per batch.", _DEFAULTS.batch_size)]
DeliveryTimeoutMs = Annotated[int | None, common(
    "delivery-timeout-ms", "How long one produce to a target may take before it counts as failed.",
    _DEFAULTS.delivery_timeout_ms)]
InstanceId = Annotated[str | None, common(
    "instance-id", "Static group member id (group.instance.id); derived from the host name "
    "and the absolute --state-dir when not given. Unique per instance, stable across restarts.")]
TransactionalId = Annotated[str | None, common(
    "transactional-id", "Transactional id for exactly-once; derived from --group-id and the "
    "instance id when not given.")]
SessionTimeoutMs = Annotated[int | None, common(
    "session-timeout-ms", "How long the partitions of an instance that died stay unserved "
    "before the group hands them to the others.", _DEFAULTS.session_timeout_ms)]
PartitionerOpt = Annotated[str | None, common(
    "partitioner", "librdkafka partitioner for keyed records without kdelay-partition; "
    "murmur2_random places keys as a Java producer does.", _DEFAULTS.partitioner)]
AllowedTargets = Annotated[str | None, common(
    "allowed-targets", "Comma-separated topics requests may target: names, fnmatch globs "
    "(orders.*) or re:REGEX; others go to the DLQ as target-not-allowed. kdelay's own "
    "topics are never targets. Any topic when not given.")]
LanesOpt = Annotated[str | None, common(
    "lanes", "Lanes of this deployment, LANE=PREFIX,...: a request whose kdelay-lane header "
    "names a lane may target only topics starting with its prefix; one without a lane only "
    "topics of no lane; others go to the DLQ (wrong-lane, missing-lane, unknown-lane). "
    "No lanes when not given.")]
RocksdbCacheMb = Annotated[int | None, common(
    "rocksdb-cache-mb", "Block cache (MB) the local RocksDB stores share: data, index and "
    "filter blocks.", _DEFAULTS.rocksdb_cache_mb)]
RocksdbWriteBufferMb = Annotated[int | None, common(
    "rocksdb-write-buffer-mb", "Memtables (MB) of all local RocksDB stores together; "
    "RocksDB holds about this plus --rocksdb-cache-mb.", _DEFAULTS.rocksdb_write_buffer_mb)]


COMMON_OPTIONS: dict[str, Any] = {
    "bootstrap_servers": BootstrapServers,
    "requests_topic": RequestsTopic,
    "changelog_topic": ChangelogTopic,
    "dlq_topic": DlqTopic,
    "outcomes_topic": OutcomesTopic,
    "controls_topic": ControlsTopic,
    "status_topic": StatusTopic,
    "series_cancels_topic": SeriesCancelsTopic,
    "worker_dlq_topic": WorkerDlqTopic,
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
    "lanes": LanesOpt,
    "rocksdb_cache_mb": RocksdbCacheMb,
    "rocksdb_write_buffer_mb": RocksdbWriteBufferMb,
}


def common_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` every common option (keyword-only, after its own parameters).

    typer reads a command's parameters from its signature; the options are
    added there once instead of being repeated in every command. The command
    reads them through :func:`settings_of`, not as arguments.
    """
    signature = inspect.signature(command, eval_str=True)
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=alias) for name, alias in COMMON_OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        for name in COMMON_OPTIONS:
            kwargs.pop(name, None)
        command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), *extra])
    wrapper.__annotations__ = {
        **{name: p.annotation for name, p in signature.parameters.items()},
        **COMMON_OPTIONS, "return": None}
    return wrapper


def settings_of(ctx: typer.Context) -> Settings:
    """Build the settings from the common options of the running command.

    Every command declares the common options with the aliases above and
    reads them here, from the parsed parameters, so no command passes them by
    hand. Raises :class:`SettingsError` as :func:`build_settings` does.
    """
    params = ctx.params
    common = {name: params[name] for name in COMMON_OPTIONS if name != "kafka_config"}
    return build_settings(kafka_config_path=params["kafka_config"], **common)


def connected(ctx: typer.Context) -> Settings:
    """The settings of :func:`settings_of`, once a broker answers at their address.

    For commands that talk to Kafka: when no broker answers, the command
    stops at once with one ``error[broker-unreachable]`` line (see
    :func:`kdelay.plumbing.connection.check_connection`) instead of waiting out
    librdkafka's timeouts.
    """
    settings = settings_of(ctx)
    check_connection(settings.client_config("probe"))
    return settings


def fail(code: str, message: str, exit_code: int) -> NoReturn:
    """Print ``error[code]: message`` to stderr and exit with ``exit_code``."""
    typer.echo(f"error[{code}]: {message}", err=True)
    raise typer.Exit(exit_code)


EXITS: Mapping[type[KdelayError], int] = {
    DeliveryError: KAFKA_ERROR_EXIT,
    ExportError: KAFKA_ERROR_EXIT,
    NoOutcome: NO_OUTCOME_EXIT,
    ServiceError: KAFKA_ERROR_EXIT,
}
"""The exit status of each kind of :class:`~kdelay.errors.KdelayError` that is not the
user's to fix (the cluster's, or an outcome that did not come); every other kind, and a
:class:`~kdelay.plumbing.connection.ConnectionFailure` the configuration causes, exits
with :data:`USER_ERROR_EXIT`."""


def exit_code_of(exc: KdelayError) -> int:
    """The exit status of ``exc``: the one table of them (:data:`EXITS`)."""
    if isinstance(exc, ConnectionFailure):
        bad_config = exc.code in (AUTHENTICATION_FAILED, TLS_FAILED)
        return USER_ERROR_EXIT if bad_config else KAFKA_ERROR_EXIT
    kinds = type(exc).__mro__
    return next((EXITS[kind] for kind in kinds if kind in EXITS), USER_ERROR_EXIT)


def failed(exc: KdelayError) -> NoReturn:
    """Print ``error[code]: message`` for ``exc`` and exit with its status."""
    fail(exc.code, str(exc), exit_code_of(exc))


@contextmanager
def reported(*, value_errors: bool = True) -> Iterator[None]:
    """Report the errors a user or the cluster causes as one line, without a traceback.

    The kinds of :class:`~kdelay.errors.KdelayError` a command may raise
    anywhere are reported by their own code, with the status
    :func:`exit_code_of` gives them; any other ValueError (a bad series among
    them) is an ``invalid-argument``.

    With ``value_errors`` a plain ValueError counts as a bad argument; the
    ``run`` command turns that off around the service, where a ValueError is
    a bug and keeps its traceback.
    """
    try:
        yield
    except (SettingsError, LayoutError, RequestRefused, DeliveryError, ConnectionFailure) as exc:
        failed(exc)
    except IndexLocked as exc:
        fail("state-dir-in-use", f"{exc}; stop the service that uses it first",
              USER_ERROR_EXIT)
    except RestoreError as exc:
        fail("restore-failed", str(exc), KAFKA_ERROR_EXIT)
    except MoveError as exc:
        fail("move-failed", str(exc), KAFKA_ERROR_EXIT)
    except KafkaException as exc:
        # Where it escaped from: a service ends on a KafkaException only through a gap in
        # its own handling, which the traceback (at DEBUG, not to scare) points at.
        log.debug("a Kafka call raised %s", kafka_message(exc), exc_info=True)
        fail("kafka", kafka_message(exc), KAFKA_ERROR_EXIT)
    except ValueError as exc:
        if not value_errors:
            raise
        fail("invalid-argument", str(exc), USER_ERROR_EXIT)


def kafka_message(exc: KafkaException) -> str:
    """The readable part of a KafkaException: its KafkaError's text and name."""
    error = exc.args[0] if exc.args else None
    if isinstance(error, KafkaError):
        return f"{error.str()} ({error.name()})"
    return str(exc)


