"""The one settings object kdelay runs on, and the client.properties reader.

:class:`Settings` is built once (by the CLI, from flags, ``KDELAY_*`` variables
and a ``client.properties`` file) and handed to every part of kdelay. Library
code never reads the environment: what it needs arrives here.

Kafka client settings (SASL, TLS, timeouts, ...) travel in
:attr:`Settings.kafka_config`, kept apart from kdelay's own settings, and are
merged into a librdkafka configuration by :meth:`Settings.client_config`.
The file is a Java ``client.properties``: :mod:`kdelay.plumbing.clientconfig` translates
its Java-only keys. No secret of it ever shows in a ``repr`` or an error.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from kdelay.errors import KdelayError
from kdelay.plumbing.clientconfig import (
    ClientConfigError,
    ClientLogger,
    ClientProperties,
    secret_values,
    translate,
)
from kdelay.protocol.durations import DEFAULT_LEVELS, parse_levels
from kdelay.protocol.targets import Lanes, TargetPolicy

BOOTSTRAP_SERVERS = "bootstrap.servers"
DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"
# librdkafka's partitioners; murmur2_random matches a Java producer's default
# (murmur2 of the key; records without a key spread at random).
PARTITIONERS = ("murmur2_random", "murmur2", "consistent_random", "consistent", "fnv1a_random",
                "fnv1a", "random")
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")
#: The default names of the topics ``kdelay worker`` keeps for itself: the series
#: cancel markers and the failed tasks. Never a delivery target, under whatever
#: names the settings give them (:attr:`Settings.reserved_topics`).
WORKER_RESERVED_TOPICS = ("kdelay.series.cancels", "kdelay.tasks.dlq")


#: A confluent-kafka client configuration: librdkafka settings plus the ``logger`` object.
ClientConfig = dict[str, Any]


class SettingsError(KdelayError, ValueError):
    """A setting a user gave is unusable; ``code`` is stable, the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Guarantee(StrEnum):
    """The delivery guarantee the service runs with."""

    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"


def _default_levels() -> tuple[int, ...]:
    return parse_levels(DEFAULT_LEVELS)


def _empty_config() -> Mapping[str, str]:
    return ClientProperties()


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything kdelay is configured with; immutable and validated on creation.

    Durations are integer milliseconds. ``levels`` is the delay-level table in
    milliseconds, level 1 first. ``transactional_id`` stays ``None`` unless
    given: deriving one from ``group_id`` is the service's job.
    ``instance_id`` overrides the static group member id (``group.instance.id``)
    that :mod:`kdelay.plumbing.identity` otherwise derives from the host name and the
    state dir. ``session_timeout_ms`` bounds how long the partitions of an
    instance that died for good stay unserved (6 s: the least a broker accepts by
    default, ``group.min.session.timeout.ms``). ``partitioner`` places keyed
    records that carry no target partition; librdkafka's ``murmur2_random`` is
    what a Java producer's default partitioner does. ``allowed_targets``
    restricts the topics requests may target to these names and patterns (see
    :class:`~kdelay.protocol.targets.TargetPolicy`; a string is split at commas);
    empty allows every topic but kdelay's own (:attr:`reserved_topics`).
    ``lanes`` maps each lane to the prefix of the topics it owns (see
    :class:`~kdelay.protocol.targets.Lanes`; a string ``"dev1=dev1.,dev2=dev2."``
    is parsed); empty: no lanes. ``series_cancels_topic`` and ``worker_dlq_topic``
    are ``kdelay worker``'s internal topics (the series cancel markers, the
    tasks that failed for good): the service refuses them as targets under the
    names given here, so a deployment that renames them tells every command.
    A record whose target fails (a topic not created yet, a refusal) is
    retried for ``delivery_retry_ms`` after its first failure, then
    dead-lettered; ``delivery_attempts`` (0: no limit) can end it sooner.
    ``rocksdb_cache_mb`` bounds the block cache every local store shares (data,
    index and filter blocks) and ``rocksdb_write_buffer_mb`` their memtables
    together (see :mod:`kdelay.state.memory`): RocksDB holds about their sum,
    whatever the pending count.

    Raises :class:`SettingsError` (a ``ValueError``, code ``invalid-setting``)
    whose message names every invalid field.
    """

    bootstrap_servers: str = DEFAULT_BOOTSTRAP_SERVERS
    requests_topic: str = "kdelay.requests"
    changelog_topic: str = "kdelay.changelog"
    dlq_topic: str = "kdelay.dlq"
    outcomes_topic: str = "kdelay.outcomes"
    controls_topic: str = "kdelay.controls"
    status_topic: str = "kdelay.status"
    series_cancels_topic: str = WORKER_RESERVED_TOPICS[0]
    worker_dlq_topic: str = WORKER_RESERVED_TOPICS[1]
    group_id: str = "kdelay"
    state_dir: Path = Path("state")
    guarantee: Guarantee = Guarantee.AT_LEAST_ONCE
    metrics_port: int | None = None
    kafka_config: Mapping[str, str] = field(default_factory=_empty_config)
    levels: tuple[int, ...] = field(default_factory=_default_levels)
    retention_margin_ms: int = 3_600_000
    delivery_attempts: int = 0
    delivery_retry_ms: int = 900_000
    retry_backoff_ms: int = 500
    retry_backoff_max_ms: int = 30_000
    delivery_timeout_ms: int = 30_000
    lookahead_ms: int = 2_000
    batch_size: int = 1_000
    transactional_id: str | None = None
    instance_id: str | None = None
    session_timeout_ms: int = 6_000
    partitioner: str = "murmur2_random"
    allowed_targets: tuple[str, ...] = ()
    lanes: Lanes = field(default_factory=Lanes)
    rocksdb_cache_mb: int = 256
    rocksdb_write_buffer_mb: int = 128

    def __post_init__(self) -> None:
        """Normalise field types, then validate; see the class docstring."""
        object.__setattr__(self, "guarantee", _guarantee(self.guarantee))
        object.__setattr__(self, "state_dir", Path(self.state_dir))
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "kafka_config", ClientProperties(self.kafka_config))
        object.__setattr__(self, "allowed_targets", split_patterns(self.allowed_targets))
        object.__setattr__(self, "lanes", _lanes(self.lanes))
        problems = list(self._problems())
        if problems:
            raise SettingsError("invalid-setting", "; ".join(problems))

    def _problems(self) -> Iterator[str]:
        """Yield one sentence per invalid field, in field order."""
        if not self.bootstrap_servers.strip():
            yield "bootstrap_servers must not be empty"
        yield from _topic_problems("requests, changelog, dlq, outcomes, controls and status",
                                   self.requests_topic, self.changelog_topic, self.dlq_topic,
                                   self.outcomes_topic, self.controls_topic, self.status_topic)
        yield from _topic_problems("series cancels and worker dlq", self.series_cancels_topic,
                                   self.worker_dlq_topic)
        if not self.group_id:
            yield "group_id must not be empty"
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65_535:
            yield f"metrics_port must be between 0 and 65535, got {self.metrics_port}"
        yield from _kafka_config_problems(self.kafka_config, self.bootstrap_servers)
        yield from _level_problems(self.levels)
        yield from _number_problems(self)
        if self.transactional_id is not None and not self.transactional_id:
            yield "transactional_id must be None or a non-empty string"
        if self.instance_id is not None and not self.instance_id:
            yield "instance_id must be None or a non-empty string"
        if self.partitioner not in PARTITIONERS:
            yield (f"partitioner must be one of {', '.join(PARTITIONERS)}, "
                   f"got {self.partitioner!r}")
        try:
            TargetPolicy((), self.allowed_targets)
        except ValueError as exc:
            yield f"allowed_targets: {exc}"

    @property
    def reserved_topics(self) -> tuple[str, ...]:
        """Every topic kdelay itself reads or writes under these settings, never a delivery
        target (see :class:`TargetPolicy`): the service's requests, changelog, DLQ and
        outcomes, controls and status topics and the worker's series cancels and tasks DLQ
        topics."""
        return (self.requests_topic, self.changelog_topic, self.dlq_topic, self.outcomes_topic,
                self.controls_topic, self.status_topic,
                self.series_cancels_topic, self.worker_dlq_topic)

    def target_policy(self) -> TargetPolicy:
        """Return the policy that decides which topics requests may target."""
        return TargetPolicy(self.reserved_topics, self.allowed_targets, self.lanes)

    def client_config(
        self, client: str = "client", /, **overrides: str | int | bool
    ) -> ClientConfig:
        """Return a confluent-kafka configuration for a client of this deployment.

        Precedence, lowest first: ``bootstrap.servers`` from
        :attr:`bootstrap_servers`, then :attr:`kafka_config`, then
        ``overrides`` (pass dotted names with ``**{"enable.idempotence": True}``).
        ``kafka_config`` cannot contradict :attr:`bootstrap_servers` (validation
        rejects that), so the effective bootstrap servers are always the field's.

        ``logger`` routes librdkafka's log lines to the Python logger
        ``kdelay.kafka.<client>`` (see :class:`~kdelay.plumbing.clientconfig.ClientLogger`),
        so name the client (``client_config("targets", ...)``) for readable logs.
        """
        config: ClientConfig = {BOOTSTRAP_SERVERS: self.bootstrap_servers}
        config.update(self.kafka_config)
        config.update(overrides)
        config["logger"] = ClientLogger(client, secret_values(self.kafka_config))
        return config


def split_patterns(value: str | Iterable[str]) -> tuple[str, ...]:
    """Split an allow-list given as one string (``"a, b*"``) at commas; keep a sequence as is."""
    parts = value.split(",") if isinstance(value, str) else value
    return tuple(part.strip() for part in parts if part.strip())


def _guarantee(value: Guarantee | str) -> Guarantee:
    """Accept a guarantee given as its string value."""
    try:
        return Guarantee(value)
    except ValueError:
        choices = ", ".join(g.value for g in Guarantee)
        raise SettingsError(
            "invalid-setting", f"guarantee must be one of {choices}, got {value!r}"
        ) from None


def _lanes(value: Lanes | str) -> Lanes:
    """Accept lanes given as their ``lane=prefix,...`` spec."""
    if isinstance(value, Lanes):
        return value
    try:
        return Lanes.parse(value)
    except ValueError as exc:
        raise SettingsError("invalid-setting", f"lanes {value!r}: {exc}") from None


def _topic_problems(what: str, *topics: str) -> Iterator[str]:
    """Kafka's topic-name rules, plus: kdelay's own topics (``what``) must be distinct."""
    for topic in topics:
        if not _TOPIC_NAME.fullmatch(topic) or topic in {".", ".."}:
            yield (f"{topic!r} is not a valid Kafka topic name "
                   "(1-249 characters from a-z A-Z 0-9 . _ -)")
    if len(set(topics)) != len(topics):
        yield (f"the {what} topics must differ, "
               f"got {', '.join(topics)}")


def _kafka_config_problems(config: Mapping[str, str], bootstrap: str) -> Iterator[str]:
    """A ``bootstrap.servers`` in ``kafka_config`` must agree with the field."""
    configured = config.get(BOOTSTRAP_SERVERS)
    if configured is not None and configured != bootstrap:
        yield (f"kafka_config sets bootstrap.servers={configured} but bootstrap_servers is "
               f"{bootstrap}; give the address once (see resolve_kafka_config)")


def _level_problems(levels: tuple[int, ...]) -> Iterator[str]:
    """The level table is non-empty, positive and strictly ascending."""
    if not levels:
        yield "levels must name at least one delay"
    elif any(level <= 0 for level in levels):
        yield f"every level must be a positive duration, got {levels}"
    elif any(a >= b for a, b in itertools.pairwise(levels)):
        yield f"levels must be strictly ascending, got {levels}"


def _number_problems(settings: Settings) -> Iterator[str]:
    """Bounds on the numeric tuning fields."""
    minimums = {
        "retention_margin_ms": 0,
        "delivery_attempts": 0,
        "delivery_retry_ms": 0,
        "retry_backoff_ms": 1,
        "retry_backoff_max_ms": 1,
        "delivery_timeout_ms": 1,
        "lookahead_ms": 0,
        "batch_size": 1,
        "session_timeout_ms": 1,
        "rocksdb_cache_mb": 1,
        "rocksdb_write_buffer_mb": 1,
    }
    for name, minimum in minimums.items():
        value: int = getattr(settings, name)
        if value < minimum:
            yield f"{name} must be at least {minimum}, got {value}"
    if settings.retry_backoff_max_ms < settings.retry_backoff_ms:
        yield (f"retry_backoff_max_ms ({settings.retry_backoff_max_ms}) must not be below "
               f"retry_backoff_ms ({settings.retry_backoff_ms})")


def resolve_kafka_config(
    path: Path | None, bootstrap_servers: str | None
) -> tuple[str, dict[str, str]]:
    """Return ``(bootstrap servers, kafka config)`` from a properties file and a flag.

    The bootstrap servers come from ``bootstrap_servers`` when it is given (an
    explicit flag or ``KDELAY_BOOTSTRAP_SERVERS`` wins), else from the file's
    ``bootstrap.servers``, else the default. The returned config never holds
    ``bootstrap.servers``, so it cannot contradict the first element.
    The file's Java-only keys are translated (:func:`kdelay.plumbing.clientconfig.translate`).
    Raises :class:`SettingsError` as :func:`load_properties` does, and
    ``kafka-config-unsupported`` / ``kafka-config-malformed`` for keys that
    cannot be translated.
    """
    properties = load_properties(path) if path is not None else {}
    from_file = properties.pop(BOOTSTRAP_SERVERS, None)
    try:
        config = translate(properties)
    except ClientConfigError as exc:
        raise SettingsError(exc.code, f"{path}: {exc}") from None
    return bootstrap_servers or from_file or DEFAULT_BOOTSTRAP_SERVERS, config


def build_settings(
    *,
    kafka_config_path: Path | None = None,
    bootstrap_servers: str | None = None,
    levels: str | None = None,
    **fields: Any,
) -> Settings:
    """Build :class:`Settings` from optional values, as the CLI receives them.

    ``None`` means "not given": the field keeps its default. ``levels`` is a
    spec such as ``"1s 5s 1m"``; the Kafka config is read from
    ``kafka_config_path`` (see :func:`resolve_kafka_config` for which bootstrap
    servers win). Raises :class:`SettingsError` for an unreadable file or an
    invalid value or level spec.
    """
    bootstrap, kafka_config = resolve_kafka_config(kafka_config_path, bootstrap_servers)
    given = {name: value for name, value in fields.items() if value is not None}
    if levels is not None:
        try:
            given["levels"] = parse_levels(levels)
        except ValueError as exc:
            raise SettingsError("invalid-setting", f"levels {levels!r}: {exc}") from None
    return Settings(bootstrap_servers=bootstrap, kafka_config=kafka_config, **given)


def load_properties(path: Path) -> dict[str, str]:
    """Parse a Java ``.properties`` file such as Kafka's ``client.properties``.

    Follows ``java.util.Properties.load``: ``#`` and ``!`` comment lines, blank
    lines, ``key=value``, ``key: value`` and ``key value`` (whitespace around
    the separator ignored), a trailing odd backslash continuing the line, and
    the escapes ``\\t \\n \\r \\f \\uXXXX``. The file is read as UTF-8. A later
    key replaces an earlier one. Unlike Java, trailing whitespace after a value
    is dropped (it is invisible and silently breaks passwords); escape it as
    ``\\ `` to keep it.

    Stricter than Java where Java silently guesses: a line holding a key but
    no separator and no value, a line with an empty key, and a malformed
    ``\\u`` escape raise :class:`SettingsError` (``kafka-config-malformed``)
    naming ``file:line``. A missing or unreadable file raises
    ``kafka-config-missing`` / ``kafka-config-unreadable``.
    """
    properties: dict[str, str] = {}
    for number, line in _logical_lines(_read_text(path)):
        key, value = _parse_property(line, f"{path}:{number}")
        properties[key] = value
    return properties


def _read_text(path: Path) -> str:
    """Read ``path`` as UTF-8, turning OS errors into :class:`SettingsError`."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SettingsError("kafka-config-missing", f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError("kafka-config-unreadable", f"{path}: cannot read: {exc}") from None


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """Yield ``(first line number, logical line)``, joining continued lines.

    Comment and blank lines are skipped; a comment line never continues.
    """
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.lstrip(" \t\f")
        if not pending:
            if not line or line[0] in "#!":
                continue
            start = number
        if _odd_backslashes(line):
            pending.append(line[:-1])
            continue
        yield start, "".join(pending) + line
        pending = []
    if pending:
        yield start, "".join(pending)


def _odd_backslashes(line: str) -> bool:
    """True when ``line`` ends with an odd number of backslashes."""
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def _parse_property(line: str, where: str) -> tuple[str, str]:
    """Split one logical line into an unescaped ``(key, value)``."""
    end = _key_end(line)
    key, rest = line[:end], line[end:]
    stripped = rest.lstrip(" \t\f")
    has_separator = stripped[:1] in {"=", ":"}
    if has_separator:
        stripped = stripped[1:].lstrip(" \t\f")
    if not key:
        raise SettingsError("kafka-config-malformed", f"{where}: empty key; expected key=value")
    if not has_separator and not stripped:
        raise SettingsError(
            "kafka-config-malformed",
            f"{where}: {line.strip()!r} has no value; expected key=value",
        )
    name = _unescape(key, where)
    return name, _unescape(_rstrip_unescaped(stripped), f"{where}: value of {name}")


def _rstrip_unescaped(value: str) -> str:
    """Drop trailing whitespace unless a backslash escapes it (``pass\\ `` keeps one)."""
    stripped = value.rstrip(" \t\f")
    if stripped != value and _odd_backslashes(stripped):
        return value[: len(stripped) + 1]
    return stripped


def _key_end(line: str) -> int:
    """Index of the first unescaped ``=``, ``:`` or whitespace, else ``len(line)``."""
    index = 0
    while index < len(line):
        char = line[index]
        if char == "\\":
            index += 2
            continue
        if char in "=: \t\f":
            return index
        index += 1
    return len(line)


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_ESCAPE = re.compile(r"\\(?:u(?P<hex>.{0,4})|(?P<char>.?))", re.DOTALL)


def _unescape(text: str, where: str) -> str:
    """Resolve backslash escapes; an unknown escape stands for the character itself."""

    def replace(match: re.Match[str]) -> str:
        if match["hex"] is not None:
            return _unicode_escape(match["hex"], where)
        return _ESCAPES.get(match["char"], match["char"])

    return _ESCAPE.sub(replace, text)


def _unicode_escape(digits: str, where: str) -> str:
    """The character for the four hex digits of a ``\\uXXXX`` escape."""
    if len(digits) != 4 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        # The digits are not shown: they may be part of a password.
        raise SettingsError(
            "kafka-config-malformed", f"{where}: malformed \\u escape (four hex digits expected)"
        )
    return chr(int(digits, 16))
