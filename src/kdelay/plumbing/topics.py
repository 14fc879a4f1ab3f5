"""kdelay's topics: how they are laid out, created and checked.

``requests`` holds the payloads (``cleanup.policy=delete``; its ``retention.ms``
bounds the longest delay), ``changelog`` holds the index (compacted, one
partition per request partition), ``dlq`` holds what could not be scheduled
or delivered (``cleanup.policy=delete``) and ``outcomes`` the outcome of every
request with an id, keyed by id (``compact,delete``, kept for the id window;
optional: without it the service publishes no outcomes). :func:`create_topics` makes them and
is safe to re-run; :func:`check_layout` is what the service runs before it
starts, and says how to fix what it finds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException

# confluent_kafka.admin re-exports these without listing them, which strict mypy rejects.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from kdelay.errors import KdelayError
from kdelay.plumbing.connection import check_connection
from kdelay.plumbing.settings import Settings

log = logging.getLogger(__name__)

CLEANUP_POLICY = "cleanup.policy"
MIN_INSYNC_REPLICAS = "min.insync.replicas"
# ``--replication-factor`` default: choose from the cluster's size (see :func:`replication`).
AUTO_REPLICATION = 0
# The replication a production cluster gives its topics: three copies, two of
# them acknowledged before a write counts (acks=all), so one broker can be
# down (a rolling restart) while writes go on and nothing acknowledged is lost.
CLUSTER_REPLICATION = 3
CLUSTER_MIN_INSYNC = 2
RETENTION_MS = "retention.ms"
# Errors of a client that may not describe a topic's configuration.
_NOT_ALLOWED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED,
                          KafkaError.CLUSTER_AUTHORIZATION_FAILED})
TIMESTAMP_TYPE = "message.timestamp.type"
TARGET = "target"
DELETE_RETENTION_MS = "delete.retention.ms"
# The broker's default delete.retention.ms: how long compaction keeps a tombstone.
DEFAULT_DELETE_RETENTION_MS = 86_400_000
CHANGELOG_CONFIG: Mapping[str, str] = {
    CLEANUP_POLICY: "compact",
    # The broker stamps every changelog record with its own clock, so each
    # acknowledgement tells the service how far its clock is from the broker's.
    TIMESTAMP_TYPE: "LogAppendTime",
    "min.compaction.lag.ms": "0",
    # Only closed segments are compacted: a daily roll lets finished entries go.
    "segment.ms": "86400000",
}
# How long an id's outcome is remembered when the requests topic keeps records forever.
UNLIMITED_ID_WINDOW_MS = 7 * 86_400_000


def id_window_ms(retention_ms: int | None) -> int:
    """How long each id's outcome is remembered: the requests topic's retention, so that
    any request that can still be read again is answered with its first outcome; 7 days
    when the requests topic keeps records forever (``retention_ms`` None)."""
    return UNLIMITED_ID_WINDOW_MS if retention_ms is None else retention_ms


class LayoutError(KdelayError):
    """The topics do not have the layout kdelay needs.

    ``code`` is stable (``requests-missing``, ``changelog-missing``,
    ``dlq-missing``, ``not-copartitioned``, ``changelog-not-compacted``,
    ``requests-compacted``, ``<role>-mismatch``, ``create-failed``,
    ``topic-missing``); the message says what is wrong and how to fix it.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Layout:
    """What the service learns from a valid layout.

    ``partitions`` is the request (and changelog) partition count;
    ``retention_ms`` is the requests topic's ``retention.ms``, ``None`` when
    unlimited. ``broker_time`` tells whether the changelog topic uses
    ``LogAppendTime``, which is what the clock-skew measurement needs.
    ``tombstones_kept_ms`` is the changelog's ``delete.retention.ms``: a local
    store out of step with the changelog for longer may have missed
    tombstones (see :class:`kdelay.state.changelog.Staleness`).
    """

    partitions: int
    retention_ms: int | None
    broker_time: bool = False
    tombstones_kept_ms: int = DEFAULT_DELETE_RETENTION_MS
    # The outcomes topic's partition count; None when it does not exist.
    outcomes: int | None = None
    # Whether the status topic exists (instances publish their status to it).
    status: bool = False


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic as :func:`create_topics` creates it; ``role`` names its part."""

    role: str
    name: str
    partitions: int
    config: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class _Existing:
    """An existing topic's partition count, (described) configuration and replication
    factor (the fewest replicas any of its partitions has)."""

    partitions: int
    config: Mapping[str, str]
    replicas: int = 1

    @property
    def policies(self) -> frozenset[str]:
        """``cleanup.policy`` as a set: ``"compact,delete"`` is both."""
        return frozenset(self.config.get(CLEANUP_POLICY, "delete").split(","))


def admin_client(settings: Settings, **overrides: str | int | bool) -> AdminClient:
    """An AdminClient for the deployment ``settings`` describe (it connects in the background).

    ``overrides`` are client settings on top of the deployment's.
    """
    return AdminClient(settings.client_config("admin", **overrides))


def topic_specs(settings: Settings, *, partitions: int, retention_ms: int) -> list[TopicSpec]:
    """kdelay's topics, requests first, as :func:`create_topics` creates them.

    ``retention.bytes=-1`` is set on requests explicitly so that a broker-wide
    size limit never deletes a pending payload before its time.
    """
    requests = {CLEANUP_POLICY: "delete", RETENTION_MS: str(retention_ms),
                "retention.bytes": "-1"}
    return [
        TopicSpec("requests", settings.requests_topic, partitions, requests),
        TopicSpec("changelog", settings.changelog_topic, partitions, CHANGELOG_CONFIG),
        TopicSpec("dlq", settings.dlq_topic, partitions, {CLEANUP_POLICY: "delete"}),
        TopicSpec("outcomes", settings.outcomes_topic, partitions,
                  {CLEANUP_POLICY: "compact,delete",
                   RETENTION_MS: str(id_window_ms(None if retention_ms < 0 else retention_ms))}),
        # One partition: a handful of records, read whole by every instance.
        TopicSpec("controls", settings.controls_topic, 1, {CLEANUP_POLICY: "compact"}),
        # One partition: the latest status of each instance, read whole by the console;
        # small segments, so compaction keeps it to about a record an instance.
        TopicSpec("status", settings.status_topic, 1,
                  {CLEANUP_POLICY: "compact", "segment.ms": "3600000",
                   "min.cleanable.dirty.ratio": "0.1"}),
    ]


@dataclass(frozen=True, slots=True)
class Replication:
    """How new topics are replicated: ``factor`` copies (-1: the broker's default) and,
    when set, the topics' ``min.insync.replicas``; ``reason`` says why, for the report."""

    factor: int
    min_insync: int | None
    reason: str

    def line(self) -> str:
        """The report line :func:`create_topics` ends with."""
        factor = "the broker's default" if self.factor == -1 else str(self.factor)
        isr = f" and {MIN_INSYNC_REPLICAS}={self.min_insync}" if self.min_insync else ""
        return f"replication: factor {factor}{isr} for new topics ({self.reason})"


def replication(requested: int, brokers: int) -> Replication:
    """The replication of new topics: ``requested`` when given (not
    :data:`AUTO_REPLICATION`), else ``min(3, brokers)``; with three or more
    copies, ``min.insync.replicas=2``, so writes go on with one broker down and
    an acknowledged write survives the loss of any one."""
    if requested == AUTO_REPLICATION:
        factor = min(CLUSTER_REPLICATION, brokers)
        reason = f"chosen for a cluster of {brokers} broker{'s' if brokers != 1 else ''}"
    else:
        factor, reason = requested, "as given"
    min_insync = CLUSTER_MIN_INSYNC if factor >= CLUSTER_REPLICATION else None
    return Replication(factor, min_insync, reason)


def replication_warnings(existing: Mapping[str, _Existing], brokers: int) -> list[str]:
    """One sentence for each topic with fewer copies than the cluster could hold
    (``min(3, brokers)``): losing the one broker that has a partition stops kdelay, and
    losing its disk loses requests."""
    wanted = min(CLUSTER_REPLICATION, brokers)
    return [f"topic {name} has replication factor {found.replicas} on a cluster of "
            f"{brokers} brokers: a broker down stops kdelay and a lost disk loses its records; "
            f"raise it to {wanted} with kafka-reassign-partitions "
            "(docs/operations/clusters.md)"
            for name, found in existing.items() if found.replicas < wanted]


def create_topics(
    admin: AdminClient,
    settings: Settings,
    *,
    partitions: int,
    replication_factor: int,
    retention_ms: int,
    targets: Sequence[str] = (),
    timeout: float = 30.0,
) -> list[str]:
    """Create whichever of kdelay's topics is missing; return one report line per topic.

    ``targets`` names topics to deliver to that are created too when missing
    (with ``partitions`` partitions and the broker's defaults; an existing
    target is left as it is), so a first ``kdelay send`` has somewhere to go.

    Idempotent: a topic that exists with the right layout is reported as
    ``exists`` and left alone (its retention and replication are not changed).
    Before creating anything, every existing topic is compared with the
    request; a different partition count (requests, changelog) or cleanup
    policy raises :class:`LayoutError` ``<role>-mismatch`` saying what differs.
    A broker refusing a creation raises ``create-failed``. ``replication_factor``
    -1 means the broker's default, :data:`AUTO_REPLICATION` (0) ``min(3, brokers)``
    (see :func:`replication`); the last line says what was chosen. Raises
    ValueError for impossible arguments, including a retention shorter than the
    longest level plus the margin, and
    :class:`~kdelay.plumbing.connection.ConnectionFailure` when no broker answers.
    """
    _check_create_args(settings, partitions, replication_factor, retention_ms)
    check_connection(settings.client_config("probe"))
    specs = topic_specs(settings, partitions=partitions, retention_ms=retention_ms)
    specs += [TopicSpec(TARGET, name, partitions, {}) for name in targets]
    existing, brokers = _described(admin, [spec.name for spec in specs], timeout)
    _verify_all(specs, existing)
    chosen = replication(replication_factor, brokers)
    missing = [spec for spec in specs if spec.name not in existing]
    raced = _create(admin, missing, chosen, timeout)
    if raced:
        existing.update(_existing(admin, raced, timeout))
        _verify_all(specs, existing)
    return [_report(spec, existing.get(spec.name)) for spec in specs] + [chosen.line()]


def _check_create_args(
    settings: Settings, partitions: int, replication_factor: int, retention_ms: int
) -> None:
    """Raise ValueError for counts below 1 or a retention too short for the levels."""
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    if replication_factor < 1 and replication_factor not in (-1, AUTO_REPLICATION):
        raise ValueError(f"replication factor must be at least 1 (or -1, or 0 to choose), "
                         f"got {replication_factor}")
    if retention_ms == -1:
        return
    needed = max(settings.levels) + settings.retention_margin_ms
    if retention_ms < needed:
        raise ValueError(
            f"retention.ms {retention_ms} is shorter than the longest delay level "
            f"({max(settings.levels)} ms) plus the safety margin "
            f"({settings.retention_margin_ms} ms); use at least {needed} or -1"
        )


def _verify_all(specs: Iterable[TopicSpec], existing: Mapping[str, _Existing]) -> None:
    """Raise ``<role>-mismatch`` for the first existing topic that differs from its spec."""
    for spec in specs:
        found = existing.get(spec.name)
        differences = _differences(spec, found) if found is not None and spec.role != TARGET \
            else []
        if differences:
            raise LayoutError(
                f"{spec.role}-mismatch",
                f"topic {spec.name} exists with a different layout: {'; '.join(differences)}",
            )


def _differences(spec: TopicSpec, found: _Existing) -> list[str]:
    """Sentences naming how ``found`` differs from ``spec``, each with its fix."""
    differences = []
    if spec.role in ("requests", "changelog") and found.partitions != spec.partitions:
        differences.append(
            f"it has {found.partitions} partitions, {spec.partitions} requested "
            f"(run with --partitions {found.partitions} to keep the existing topics, or "
            f"`kdelay topics grow --partitions {spec.partitions}` to grow them)"
        )
    wanted = frozenset(spec.config[CLEANUP_POLICY].split(","))
    if found.policies != wanted:
        differences.append(
            f"cleanup.policy is {','.join(sorted(found.policies))}, kdelay needs "
            f"{spec.config[CLEANUP_POLICY]} ({_alter_hint(spec.name, spec.config[CLEANUP_POLICY])})"
        )
    return differences


def _alter_hint(topic: str, policy: str) -> str:
    """The kafka-configs command that sets ``topic``'s cleanup policy."""
    return (f"kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
            f"--add-config cleanup.policy={policy}")


def _create(
    admin: AdminClient, specs: list[TopicSpec], chosen: Replication, timeout: float
) -> list[str]:
    """Create ``specs``; return the names another client created first.

    Raises ``create-failed`` with the broker's reason for any other failure.
    """
    if not specs:
        return []
    isr = {MIN_INSYNC_REPLICAS: str(chosen.min_insync)} if chosen.min_insync else {}
    futures = admin.create_topics(
        [NewTopic(spec.name, num_partitions=spec.partitions,
                  replication_factor=chosen.factor, config={**spec.config, **isr})
         for spec in specs],
        operation_timeout=timeout, request_timeout=timeout,
    )
    raced = []
    for name, future in futures.items():
        error = _error_of(future, timeout)
        if error is None:
            continue
        if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise LayoutError("create-failed", f"cannot create topic {name}: {error.str()}")
        raced.append(name)
    return raced


def _error_of(future: Future[None], timeout: float) -> KafkaError | None:
    """Wait for an admin future; return its KafkaError, or None on success."""
    try:
        future.result(timeout=timeout)
    except KafkaException as exc:
        error: KafkaError = exc.args[0]
        return error
    return None


def _report(spec: TopicSpec, found: _Existing | None) -> str:
    """One line: ``created`` or ``exists``, the name, partitions and cleanup settings."""
    state = "exists " if found is not None else "created"
    partitions = found.partitions if found is not None else spec.partitions
    config = found.config if found is not None else spec.config
    keys = [key for key in (CLEANUP_POLICY, RETENTION_MS) if key in spec.config]
    shown = [f"{key}={config[key]}" for key in keys if key in config]
    return f"{state} {spec.name} ({spec.role}): partitions={partitions} {' '.join(shown)}".rstrip()


def check_layout(admin: AdminClient, settings: Settings, timeout: float = 10) -> Layout:
    """Check that the service can run on these topics; return their :class:`Layout`.

    Raises :class:`LayoutError`, checking in this order: ``requests-missing``,
    ``changelog-missing``, ``dlq-missing``, ``not-copartitioned`` (changelog
    and requests partition counts differ), ``changelog-not-compacted`` (its
    cleanup policy is not exactly ``compact``: ``delete`` would drop pending
    entries), ``requests-compacted`` (compaction would drop payloads). Each
    message says how to fix it. Kafka errors (broker unreachable) propagate as
    ``KafkaException``.
    """
    names = [settings.requests_topic, settings.changelog_topic, settings.dlq_topic,
             settings.outcomes_topic]
    existing, brokers = _described(admin, names, timeout)
    requests = _required(existing, settings.requests_topic, "requests", None)
    changelog = _required(existing, settings.changelog_topic, "changelog", requests.partitions)
    _required(existing, settings.dlq_topic, "dlq", requests.partitions)
    _check_copartitioned(settings, requests.partitions, changelog.partitions)
    if changelog.policies != {"compact"}:
        raise LayoutError(
            "changelog-not-compacted",
            f"changelog topic {settings.changelog_topic} has cleanup.policy="
            f"{','.join(sorted(changelog.policies))}; it must be compact: "
            f"{_alter_hint(settings.changelog_topic, 'compact')}",
        )
    if "compact" in requests.policies:
        raise LayoutError(
            "requests-compacted",
            f"requests topic {settings.requests_topic} is compacted, which drops payloads "
            f"before they are due: {_alter_hint(settings.requests_topic, 'delete')}",
        )
    for warning in replication_warnings(existing, brokers):
        log.warning("%s", warning)
    broker_time = changelog.config.get(TIMESTAMP_TYPE) == "LogAppendTime"
    outcomes = existing.get(settings.outcomes_topic)
    return Layout(requests.partitions, _retention(requests.config), broker_time,
                  tombstones_kept_ms(changelog.config),
                  outcomes.partitions if outcomes is not None else None,
                  # Seen, not described: its Write ACL lets the service see it, and no more.
                  settings.status_topic in partition_counts(admin, [settings.status_topic],
                                                            timeout))


def tombstones_kept_ms(config: Mapping[str, str]) -> int:
    """The changelog's ``delete.retention.ms`` from its described configuration."""
    return int(config.get(DELETE_RETENTION_MS, DEFAULT_DELETE_RETENTION_MS))


def _required(
    existing: Mapping[str, _Existing], name: str, role: str, partitions: int | None
) -> _Existing:
    """Return ``existing[name]`` or raise ``<role>-missing`` with the command that fixes it."""
    found = existing.get(name)
    if found is not None:
        return found
    flag = f" --partitions {partitions}" if partitions is not None else " --partitions N"
    raise LayoutError(
        f"{role}-missing",
        f"{role} topic {name} does not exist: run `kdelay topics create{flag}` "
        "(it creates only the missing topics)",
    )


def _check_copartitioned(settings: Settings, requests: int, changelog: int) -> None:
    """Raise ``not-copartitioned`` unless both topics have the same partition count."""
    if requests == changelog:
        return
    if changelog < requests:
        fix = (f"with every instance stopped, run `kdelay topics grow --partitions {requests}`: "
               "it grows the changelog and moves each schedule id to its new home partition")
    else:
        fix = (f"a `kdelay topics grow --partitions {changelog}` did not finish: run it again "
               f"(if instead {settings.changelog_topic} was made for another requests topic, "
               f"delete it and run `kdelay topics create --partitions {requests}`)")
    raise LayoutError(
        "not-copartitioned",
        f"changelog topic {settings.changelog_topic} has {changelog} partitions but requests "
        f"topic {settings.requests_topic} has {requests}; they must match: {fix}",
    )


def retention_ms(admin: AdminClient, topic: str, *, timeout: float = 10) -> int | None:
    """Return ``topic``'s ``retention.ms``, or ``None`` when it is unlimited (-1).

    Raises :class:`LayoutError` ``topic-missing`` when the topic does not exist;
    other Kafka errors propagate as ``KafkaException``.
    """
    return _retention(_configs(admin, [topic], timeout)[topic])


def topic_config(admin: AdminClient, topic: str, *, timeout: float = 10) -> dict[str, str]:
    """Return ``topic``'s effective configuration (``describe_configs``): key -> value.

    Raises :class:`LayoutError` ``topic-missing`` when the topic does not exist.
    """
    return _configs(admin, [topic], timeout)[topic]


def requests_retention(client_config: Mapping[str, str | int | bool], topic: str,
                       timeout: float) -> int | None:
    """The requests topic's ``retention.ms`` (None: unlimited) for a producer-side check.

    Also None when the client may not describe the topic's configuration
    (``TOPIC_AUTHORIZATION_FAILED``, a least-privilege producer): the caller
    then cannot check, and the service still does. Other Kafka errors propagate.
    """
    admin = AdminClient(dict(client_config))
    try:
        return _retention(topic_config(admin, topic, timeout=timeout))
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if isinstance(error, KafkaError) and error.code() in _NOT_ALLOWED:
            return None
        raise


def _retention(config: Mapping[str, str]) -> int | None:
    """Parse ``retention.ms``: -1 (or absent) is ``None``, meaning unlimited."""
    value = int(config.get(RETENTION_MS, "-1"))
    return None if value < 0 else value


def _existing(admin: AdminClient, names: list[str], timeout: float) -> dict[str, _Existing]:
    """Describe whichever of ``names`` exist: partition count and configuration."""
    return _described(admin, names, timeout)[0]


def _described(admin: AdminClient, names: list[str], timeout: float
               ) -> tuple[dict[str, _Existing], int]:
    """Describe whichever of ``names`` exist (partitions, configuration, replication
    factor), and count the cluster's brokers."""
    metadata = admin.list_topics(timeout=timeout)
    present = [name for name in dict.fromkeys(names) if name in metadata.topics]
    configs = _configs(admin, present, timeout)
    found = {}
    for name in present:
        partitions = metadata.topics[name].partitions
        replicas = min((len(p.replicas) for p in partitions.values()), default=1)
        found[name] = _Existing(len(partitions), configs[name], replicas)
    return found, len(metadata.brokers)


def _configs(admin: AdminClient, names: list[str], timeout: float) -> dict[str, dict[str, str]]:
    """``describe_configs`` for topics: name -> {config key: value}."""
    if not names:
        return {}
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in names]
    futures = admin.describe_configs(resources, request_timeout=timeout)
    result = {}
    for resource, future in futures.items():
        try:
            entries = future.result(timeout=timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise
            raise LayoutError("topic-missing", f"topic {resource.name} does not exist") from None
        result[resource.name] = {key: str(entry.value) for key, entry in entries.items()}
    return result


def partition_counts(admin: AdminClient, names: list[str], timeout: float = 10
                     ) -> dict[str, int]:
    """The partition count of whichever of ``names`` exist."""
    metadata = admin.list_topics(timeout=timeout)
    return {name: len(metadata.topics[name].partitions) for name in names
            if name in metadata.topics and metadata.topics[name].error is None}


def add_partitions(admin: AdminClient, topic: str, count: int, timeout: float = 30) -> None:
    """Grow ``topic`` to ``count`` partitions; LayoutError ``grow-failed`` if the broker refuses."""
    future = admin.create_partitions([NewPartitions(topic, count)],
                                     operation_timeout=timeout, request_timeout=timeout)[topic]
    error = _error_of(future, timeout)
    if error is not None:
        raise LayoutError("grow-failed", f"cannot grow topic {topic} to {count} partitions: "
                          f"{error.str()}")


def group_members(admin: AdminClient, group_id: str, timeout: float = 10) -> list[str]:
    """The client ids of the members the consumer group ``group_id`` has now (none when the
    group is empty or unknown)."""
    future = admin.describe_consumer_groups([group_id], request_timeout=timeout)[group_id]
    try:
        description = future.result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
            return []
        raise
    return sorted(f"{member.client_id} ({member.host})" for member in description.members)
