"""``kdelay schedule-table``: a table of rows becomes protocol requests, once per row.

Each row is read through :class:`Columns` (which column holds the target,
the due time or delay, the id, key, value and headers) and becomes one
schedule request with exactly the headers the client library writes
(:func:`kdelay.protocol.envelope.schedule_headers`): the user's headers, then
``kdelay-target``, ``kdelay-due-ms`` or ``kdelay-delay-ms``, ``kdelay-id`` and,
with a lane, ``kdelay-lane``. Every request carries an id, given or derived
from chosen columns, and goes to its id's partition
(:func:`kdelay.spark.placement.id_partition`), so a re-run's request meets
the first one where the id lives and kdelay answers ``duplicate``.

A row that cannot become a request the service accepts is not written: it goes
to the reject output with the protocol's code (:class:`ErrorCode`) and a
sentence, the first that holds in the service's order: target, time, id, lane,
then the target policy (own topics, lanes, allow-list). A due time more than
the tolerance before the job started is ``bad-time`` (the service would
deliver it at once: a stale table is more likely a mistake than an intent).

The job reads the table twice, both times as Spark SQL: once to write the
rejects and count every row by reason (a Spark ``Observation``, no extra
aggregation), once to write the accepted rows through Spark's Kafka sink. With
a target or lane taken from a column, one more pass collects the distinct
(target, lane) pairs, which the service's own :class:`TargetPolicy` judges.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from types import MappingProxyType

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from kdelay.errors import KdelayError
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import LayoutError, admin_client, partition_counts, requests_retention
from kdelay.protocol import envelope
from kdelay.protocol.durations import limits_for_retention
from kdelay.protocol.envelope import ErrorCode
from kdelay.protocol.targets import TargetPolicy
from kdelay.spark.placement import id_partition

FORMATS = ("parquet", "csv", "json")
REJECT_FORMATS = ("parquet", "json")
ID = "kdelay_id"
REASON = "reason"
DETAIL = "detail"
REASONS = (ErrorCode.MISSING_TARGET, ErrorCode.BAD_HEADER, ErrorCode.MISSING_TIME,
           ErrorCode.BAD_TIME, ErrorCode.DELAY_TOO_LONG, ErrorCode.FORBIDDEN_TARGET,
           ErrorCode.UNKNOWN_LANE, ErrorCode.WRONG_LANE, ErrorCode.MISSING_LANE,
           ErrorCode.TARGET_NOT_ALLOWED)
"""Every reason a row can be rejected for, in the order they are checked."""
ID_HEX_DIGITS = 32
"""A derived id is this many hex digits of the SHA-256 of its columns (128 bits)."""
POLICY_PAIRS_LIMIT = 100_000
"""The most distinct (target, lane) pairs a table may name when taken from columns."""
SINK_DEFAULTS = MappingProxyType({"kafka.linger.ms": "20", "kafka.batch.size": "262144",
                                  "kafka.compression.type": "lz4"})
"""Producer settings of the Kafka sink, unless ``--kafka-config`` sets them. LZ4: a
campaign's rows share most of their bytes (headers, a message template), and 10 M
uncompressed requests take several GB of broker disk."""

_TOPIC = r"^[A-Za-z0-9._-]{1,249}$"
_DIGITS = r"^[0-9]{1,18}$"
_ZONED = r"(Z|[+-][0-9]{2}(:?[0-9]{2})?)$"
_DURATION = r"^([0-9]{1,15})(ms|s|m|h|d)?$"
_UNIT_MS = {"": 1, "ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_TIMEOUT_S = 30.0
_ROW = "__kdelay_row"


class CampaignError(KdelayError):
    """A table or a column mapping the job cannot use; ``code`` is stable.

    ``table-missing``: the path or glob matches nothing; ``table-unreadable``:
    Spark cannot read it in the format given; ``column-missing``: a mapped
    column is not in the table; ``column-type``: a column's type cannot hold
    what it is mapped to; ``bad-mapping``: options that contradict each other;
    ``too-many-targets``: more distinct (target, lane) pairs than
    :data:`POLICY_PAIRS_LIMIT`.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _no_headers() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Columns:
    """Which column (or fixed value) gives each part of a request.

    ``target`` / ``lane`` are fixed values for every row; ``target_column`` /
    ``lane_column`` read them per row (one of each pair at most; without
    either a request has no lane, and the target is read from column
    ``target``). Exactly one of ``due`` (a timestamp, epoch milliseconds or
    ISO-8601 text with a zone) and ``delay`` (milliseconds, or text such as
    ``90s``, ``2h``) names the time column; without either, column ``due``.
    The id is ``id_column`` as text; else derived from ``id_from`` (every
    column when empty, or column ``id`` when the table has one and neither is
    given): ``id_prefix`` + 32 hex digits of the SHA-256 of the columns'
    values, so the same row gets the same id in every run. ``key`` and
    ``value`` are columns (binary as is, text as UTF-8, anything else as its
    JSON or text); without ``value`` the value is the whole row as JSON.
    ``headers`` maps a header name to the column whose text it carries (a
    null leaves the header out).
    """

    target: str | None = None
    target_column: str | None = None
    due: str | None = None
    delay: str | None = None
    id_column: str | None = None
    id_from: tuple[str, ...] = ()
    id_prefix: str = ""
    key: str | None = None
    value: str | None = None
    headers: Mapping[str, str] = field(default_factory=_no_headers)
    lane: str | None = None
    lane_column: str | None = None

    def __post_init__(self) -> None:
        """Raise :class:`CampaignError` ``bad-mapping`` for options that exclude each other."""
        pairs = (("target", self.target, self.target_column), ("due", self.due, self.delay),
                 ("id", self.id_column, self.id_from or None),
                 ("lane", self.lane, self.lane_column))
        for what, one, other in pairs:
            if one is not None and other is not None:
                raise CampaignError("bad-mapping", f"give one way to find the {what}, not two")
        reserved = [name for name in self.headers if name.lower().startswith(envelope.PREFIX)]
        if reserved:
            raise CampaignError("bad-mapping", f"header {reserved[0]!r}: names starting with "
                                "kdelay- are reserved for the protocol")
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))


@dataclass(frozen=True, slots=True)
class Table:
    """Where the rows are: a path or glob (local, or any URI Spark reads) and a format.

    ``format`` is ``parquet``, ``csv`` or ``json``; None infers it from the
    path's extension. CSV is read with a header line, every column as text.
    """

    path: str
    format: str | None = None

    def resolved_format(self) -> str:
        """The format to read with; :class:`CampaignError` ``table-unreadable`` if unknown."""
        if self.format is not None:
            if self.format not in FORMATS:
                raise CampaignError("table-unreadable", f"format {self.format!r} is not one of "
                                    f"{', '.join(FORMATS)}")
            return self.format
        suffix = Path(self.path.rstrip("/*")).suffix.lstrip(".").lower()
        found = {"parquet": "parquet", "csv": "csv", "json": "json", "jsonl": "json",
                 "ndjson": "json"}.get(suffix)
        if found is None:
            raise CampaignError("table-unreadable", f"cannot tell the format of {self.path} "
                                "from its name: give --format parquet, csv or json")
        return found


@dataclass(frozen=True, slots=True)
class Rules:
    """What a row is checked against: the job's clock and the deployment's limits.

    ``now_ms`` is when the job started (by its clock); a due time more than
    ``past_tolerance_ms`` before it is rejected. ``max_due_after_ms`` is the
    requests topic's bound (retention minus margin; None: unlimited), measured
    from ``now_ms`` as the record's timestamp will be a moment later.
    ``partitions`` is the requests topic's partition count.
    """

    now_ms: int
    partitions: int
    past_tolerance_ms: int = 600_000
    max_due_after_ms: int | None = None


@dataclass(frozen=True, slots=True)
class CampaignReport:
    """What a run did: rows read, requests written (or, in a dry run, that would be),
    and rejected rows by reason (only reasons that occurred)."""

    rows: int
    sent: int
    rejected: Mapping[str, int]
    dry_run: bool
    requests_topic: str
    partitions: int

    def to_json(self) -> dict[str, object]:
        """The ``--json`` summary."""
        return {"rows": self.rows, "sent": self.sent, "rejected": sum(self.rejected.values()),
                "rejected_by_reason": dict(self.rejected), "dry_run": self.dry_run,
                "requests_topic": self.requests_topic, "partitions": self.partitions}


def read_table(spark: SparkSession, table: Table) -> DataFrame:
    """Load ``table``; :class:`CampaignError` when it is missing or unreadable."""
    reader = spark.read.format(table.resolved_format())
    if table.resolved_format() == "csv":
        reader = reader.option("header", "true").option("inferSchema", "false")
    try:
        frame = reader.load(table.path)
        frame.schema  # noqa: B018 - resolving the schema is what fails for a bad table
    except AnalysisException as exc:
        condition = exc.getCondition() or ""
        if "PATH_NOT_FOUND" in condition or "UNABLE_TO_INFER_SCHEMA" in condition:
            raise CampaignError("table-missing", f"no table at {table.path}: "
                                f"{_first_line(exc)}") from None
        raise CampaignError("table-unreadable", f"cannot read {table.path} as "
                            f"{table.resolved_format()}: {_first_line(exc)}") from None
    if _ROW in frame.columns:
        raise CampaignError("bad-mapping", f"the table has a column named {_ROW}, which the "
                            "job uses itself")
    return frame


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0]


def deployment_rules(settings: Settings, now_ms: int, past_tolerance_ms: int) -> Rules:
    """Read the requests topic's partition count and retention bound from the cluster.

    Raises :class:`LayoutError` ``requests-missing`` when the topic does not
    exist, and KafkaException when the cluster does not answer.
    """
    topic = settings.requests_topic
    counts = partition_counts(admin_client(settings), [topic], timeout=_TIMEOUT_S)
    if topic not in counts:
        raise LayoutError("requests-missing",
                          f"requests topic {topic} does not exist: run `kdelay topics create`")
    retention = requests_retention(settings.client_config("admin"), topic, _TIMEOUT_S)
    limits = limits_for_retention(retention, settings.retention_margin_ms, settings.levels)
    return Rules(now_ms, counts[topic], past_tolerance_ms, limits.max_due_after_ms)


def _column(frame: DataFrame, name: str, what: str) -> T.StructField:
    """The field ``name`` of ``frame``; :class:`CampaignError` ``column-missing`` if absent."""
    for found in frame.schema.fields:
        if found.name == name:
            return found
    raise CampaignError("column-missing", f"{what} column {name!r} is not in the table; its "
                        f"columns: {', '.join(frame.columns)}")


def _text(frame: DataFrame, name: str, what: str) -> Column:
    """Column ``name`` as text (binary decoded as UTF-8)."""
    kind = _column(frame, name, what).dataType
    column = F.col(f"`{name}`")
    if isinstance(kind, T.BinaryType):
        return F.decode(column, "UTF-8")
    return column.cast("string")


def _bytes(frame: DataFrame, name: str, what: str) -> Column:
    """Column ``name`` as bytes: binary as is, text as UTF-8, nested types as JSON."""
    kind = _column(frame, name, what).dataType
    column = F.col(f"`{name}`")
    if isinstance(kind, T.BinaryType):
        return column
    if isinstance(kind, T.StructType | T.ArrayType | T.MapType):
        return F.encode(F.to_json(column), "UTF-8")
    return F.encode(column.cast("string"), "UTF-8")


def _due_ms(frame: DataFrame, name: str) -> tuple[Column, Column]:
    """The due time in epoch ms (null when unreadable), and whether the cell was null."""
    kind = _column(frame, name, "due").dataType
    column = F.col(f"`{name}`")
    if isinstance(kind, T.TimestampType | T.TimestampNTZType | T.DateType):
        parsed = F.unix_millis(column.cast("timestamp"))
    elif isinstance(kind, T.IntegralType | T.DecimalType | T.DoubleType | T.FloatType):
        parsed = column.try_cast("bigint")
    elif isinstance(kind, T.StringType):
        text = F.trim(column)
        parsed = (F.when(text.rlike(_DIGITS), text.try_cast("bigint"))
                  .when(text.rlike(_ZONED), F.unix_millis(F.try_to_timestamp(text))))
    else:
        raise CampaignError("column-type", f"due column {name!r} is {kind.simpleString()}; "
                            "give a timestamp, epoch milliseconds or ISO-8601 text")
    return parsed, column.isNull()


def _delay_ms(frame: DataFrame, name: str) -> tuple[Column, Column]:
    """The delay in ms (null when unreadable), and whether the cell was null."""
    kind = _column(frame, name, "delay").dataType
    column = F.col(f"`{name}`")
    if isinstance(kind, T.IntegralType | T.DecimalType | T.DoubleType | T.FloatType):
        parsed = column.try_cast("bigint")
    elif isinstance(kind, T.StringType):
        text = F.trim(column)
        amount = F.regexp_extract(text, _DURATION, 1).try_cast("bigint")
        unit = F.regexp_extract(text, _DURATION, 2)
        factor = reduce(lambda chain, item: chain.when(unit == item[0], F.lit(item[1])),
                        list(_UNIT_MS.items())[1:], F.when(unit == "", F.lit(1)))
        parsed = F.when(text.rlike(_DURATION), amount * factor)
    else:
        raise CampaignError("column-type", f"delay column {name!r} is {kind.simpleString()}; "
                            "give milliseconds or a duration such as 90s or 2h")
    return parsed, column.isNull()


def _derived_id(frame: DataFrame, names: tuple[str, ...], prefix: str) -> Column:
    """``prefix`` + the first 32 hex digits of SHA-256 over the columns' texts.

    Each value is written as ``<length>:<text>`` (a null as ``~``), joined with
    commas, so no two different rows give the same input.
    """
    parts = [F.coalesce(F.concat(F.length(text).cast("string"), F.lit(":"), text), F.lit("~"))
             for text in (_text(frame, name, "id") for name in names)]
    digest = F.substring(F.sha2(F.concat_ws(",", *parts), 256), 1, ID_HEX_DIGITS)
    return F.concat(F.lit(prefix), digest)


def _schedule_id(frame: DataFrame, columns: Columns) -> Column:
    """The id of each row, as :class:`Columns` describes."""
    if columns.id_column is not None:
        return _text(frame, columns.id_column, "id")
    if columns.id_from:
        return _derived_id(frame, columns.id_from, columns.id_prefix)
    if "id" in frame.columns:
        return _text(frame, "id", "id")
    return _derived_id(frame, tuple(frame.columns), columns.id_prefix)


def _choice(frame: DataFrame, fixed: str | None, column: str | None, what: str,
            default: str | None) -> Column:
    """A fixed value for every row, a column's text, or (neither given) ``default``'s."""
    if fixed is not None:
        return F.lit(fixed)
    name = column if column is not None else default
    return F.lit(None).cast("string") if name is None else _text(frame, name, what)


def _time_parts(frame: DataFrame, columns: Columns) -> tuple[str, list[Column]]:
    """The time header's name and the columns ``_time`` (ms, null when unreadable),
    ``_time_empty`` (the cell was null) and ``_time_text`` (the cell as text)."""
    absolute = columns.delay is None
    name = columns.delay if columns.delay is not None else columns.due or "due"
    amount, empty = _due_ms(frame, name) if absolute else _delay_ms(frame, name)
    return (envelope.DUE_MS if absolute else envelope.DELAY_MS,
            [amount.alias("_time"), empty.alias("_time_empty"),
             F.col(f"`{name}`").cast("string").alias("_time_text")])


Check = tuple[Column, ErrorCode, Column]
"""A rejection rule: when it holds, the code and the detail sentence."""


def _time_checks(header: str, rules: Rules) -> list[Check]:
    """The checks of ``_time``: present, readable, not too far past, within retention."""
    amount = F.col("_time")
    absolute = header == envelope.DUE_MS
    shown = F.concat(F.lit("time "), F.coalesce(F.col("_time_text"), F.lit("null")))
    checks: list[Check] = [
        (F.col("_time_empty"), ErrorCode.MISSING_TIME, F.lit("the time column is empty")),
        (amount.isNull() | (amount < 0), ErrorCode.BAD_TIME, F.concat(shown, F.lit(
            " is not a timestamp, epoch ms or ISO-8601 time with a zone" if absolute
            else " is not a non-negative delay (ms, or such as 90s, 2h)")))]
    if absolute:
        checks.append((amount < rules.now_ms - rules.past_tolerance_ms, ErrorCode.BAD_TIME,
                       F.concat(F.lit("due "), amount.cast("string"), F.lit(" is "),
                                (F.lit(rules.now_ms) - amount).cast("string"),
                                F.lit(" ms before the job started, beyond the tolerance of "
                                      f"{rules.past_tolerance_ms} ms"))))
    bound = rules.max_due_after_ms
    if bound is not None:
        after = amount - rules.now_ms if absolute else amount
        checks.append((after > bound, ErrorCode.DELAY_TOO_LONG, F.concat(
            F.lit("due "), after.cast("string"), F.lit(
                f" ms after now; the requests topic's retention allows at most {bound} ms"))))
    return checks


def _row_checks(header: str, rules: Rules) -> list[Check]:
    """Every rule in the service's order: target, time, id, lane, then the target policy."""
    target, lane, schedule_id = F.col("_target"), F.col("_lane"), F.col(ID)
    return [
        (target.isNull() | (target == ""), ErrorCode.MISSING_TARGET, F.lit("the row names no "
                                                                           "target")),
        (~target.rlike(_TOPIC) | target.isin(".", ".."), ErrorCode.BAD_HEADER,
         F.concat(F.lit("target "), target, F.lit(" is not a valid topic name"))),
        *_time_checks(header, rules),
        (schedule_id.isNull() | (schedule_id == ""), ErrorCode.BAD_HEADER,
         F.lit("the row has no id (its id column is empty)")),
        (lane.isNotNull() & ~lane.rlike(f"^{envelope.LANE_NAME.pattern}$"),
         ErrorCode.BAD_HEADER, F.concat(F.lit("lane "), lane, F.lit(" is not a lane name"))),
        (F.col("_policy_reason").isNotNull(), ErrorCode.FORBIDDEN_TARGET,
         F.col("_policy_detail"))]


def _verdict(checks: list[Check]) -> tuple[Column, Column]:
    """The reason and detail of the first check that holds; null and null when none does.

    The policy's own code stands for its check (``_policy_reason``), so that
    lanes and the allow-list keep their codes.
    """
    reason: Column = F.lit(None).cast("string")
    detail: Column = F.lit(None).cast("string")
    for condition, code, sentence in reversed(checks):
        holds = F.coalesce(condition, F.lit(False))
        named = F.col("_policy_reason") if code is ErrorCode.FORBIDDEN_TARGET else F.lit(
            code.value)
        reason = F.when(holds, named).otherwise(reason)
        detail = F.when(holds, sentence).otherwise(detail)
    return reason, detail


def request_parts(frame: DataFrame, columns: Columns) -> tuple[str, DataFrame]:
    """Each row's request parts (no verdict yet) and the time header they use.

    Columns: ``__kdelay_row`` (the original row, for the reject output),
    ``_target``, ``_lane``, ``kdelay_id``, the time columns of
    :func:`_time_parts`, ``_key``, ``_value`` and ``_headers`` (the user's).
    Raises :class:`CampaignError` for a column that is missing or of a type
    that cannot hold what it is mapped to.
    """
    header, time_columns = _time_parts(frame, columns)
    key = F.lit(None).cast("binary") if columns.key is None else _bytes(frame, columns.key, "key")
    parts = frame.select(
        F.struct(*[F.col(f"`{name}`") for name in frame.columns]).alias(_ROW),
        _choice(frame, columns.target, columns.target_column, "target", "target")
        .alias("_target"),
        _choice(frame, columns.lane, columns.lane_column, "lane", None).alias("_lane"),
        _schedule_id(frame, columns).alias(ID), *time_columns, key.alias("_key"),
        _value(frame, columns).alias("_value"), _user_headers(frame, columns).alias("_headers"))
    return header, parts


def judge(parts: DataFrame, header: str, rules: Rules) -> DataFrame:
    """``parts`` (with the policy's columns, :func:`with_policy`) plus ``reason`` and
    ``detail``: both null for a row that becomes a request."""
    reason, detail = _verdict(_row_checks(header, rules))
    return parts.withColumn(REASON, reason).withColumn(DETAIL, detail)


def with_policy(spark: SparkSession, parts: DataFrame, policy: TargetPolicy,
                columns: Columns) -> DataFrame:
    """``parts`` plus ``_policy_reason`` / ``_policy_detail``: the target policy's refusal.

    The service's own :class:`TargetPolicy` judges each distinct (target,
    lane) pair on the driver: one pair when both are fixed, else the pairs the
    table names, collected in one pass (:class:`CampaignError`
    ``too-many-targets`` beyond :data:`POLICY_PAIRS_LIMIT`). Refused pairs are
    joined back as a broadcast table.
    """
    if columns.target_column is None and columns.lane_column is None and columns.target:
        refused = policy.refusal(columns.target, columns.lane)
        return parts.withColumns({
            "_policy_reason": F.lit(None if refused is None else refused.code.value)
            .cast("string"),
            "_policy_detail": F.lit(None if refused is None else refused.detail)
            .cast("string")})
    pairs = parts.select("_target", "_lane").where(F.col("_target").rlike(_TOPIC)).distinct()
    found = pairs.limit(POLICY_PAIRS_LIMIT + 1).collect()
    if len(found) > POLICY_PAIRS_LIMIT:
        raise CampaignError("too-many-targets", f"the table names more than "
                            f"{POLICY_PAIRS_LIMIT:,} distinct (target, lane) pairs")
    rows = [(row["_target"], row["_lane"], refused.code.value, refused.detail)
            for row in found if (refused := policy.refusal(row["_target"], row["_lane"]))]
    schema = "_pt string, _pl string, _policy_reason string, _policy_detail string"
    refusals = F.broadcast(spark.createDataFrame(rows, schema))
    joined = parts.join(refusals, (parts["_target"] == refusals["_pt"])
                        & parts["_lane"].eqNullSafe(refusals["_pl"]), "left")
    return joined.drop("_pt", "_pl")


def requests_frame(judged: DataFrame, header: str, partitions: int) -> DataFrame:
    """The accepted rows as Kafka sink rows: ``partition`` (the id's), ``key``, ``value``,
    ``headers`` (the user's, then the envelope the client library writes)."""
    def named(name: str, value: Column) -> Column:
        return F.struct(F.lit(name).alias("key"), F.encode(value, "UTF-8").alias("value"))

    common = [named(envelope.TARGET, F.col("_target")),
              named(header, F.col("_time").cast("string")), named(envelope.SCHEDULE_ID, F.col(ID))]
    laned = F.array(*common, named(envelope.LANE, F.col("_lane")))
    envelope_headers = F.when(F.col("_lane").isNull(), F.array(*common)).otherwise(laned)
    return judged.where(F.col(REASON).isNull()).select(
        id_partition(ID, partitions).alias("partition"), F.col("_key").alias("key"),
        F.col("_value").alias("value"),
        F.concat(F.col("_headers"), envelope_headers).alias("headers"))


def rejects_frame(judged: DataFrame) -> DataFrame:
    """The rejected rows: the table's own columns, then ``kdelay_id``, ``kdelay_reason``
    and ``kdelay_detail``."""
    return judged.where(F.col(REASON).isNotNull()).select(
        f"{_ROW}.*", F.col(ID), F.col(REASON).alias("kdelay_reason"),
        F.col(DETAIL).alias("kdelay_detail"))


def _value(frame: DataFrame, columns: Columns) -> Column:
    """The record's value: the mapped column's bytes, or the whole row as JSON."""
    if columns.value is not None:
        return _bytes(frame, columns.value, "value")
    return F.encode(F.to_json(F.struct(*[F.col(f"`{n}`") for n in frame.columns])), "UTF-8")


def _user_headers(frame: DataFrame, columns: Columns) -> Column:
    """The user's headers, in the order mapped, leaving out those whose cell is null."""
    pairs = [F.struct(F.lit(name).alias("key"), _bytes(frame, column, "header").alias("value"))
             for name, column in columns.headers.items()]
    if not pairs:
        return F.array().cast("array<struct<key:string,value:binary>>")
    return F.filter(F.array(*pairs), lambda h: h["value"].isNotNull())


@dataclass(frozen=True, slots=True)
class Rejects:
    """Where rejected rows go: a directory (overwritten) and its format, parquet or json."""

    path: str
    format: str = "parquet"

    def __post_init__(self) -> None:
        """Raise :class:`CampaignError` ``bad-mapping`` for a format other than parquet, json."""
        if self.format not in REJECT_FORMATS:
            raise CampaignError("bad-mapping", f"reject format {self.format!r} is not one of "
                                f"{', '.join(REJECT_FORMATS)}")


def sink_options(settings: Settings) -> dict[str, str]:
    """The Kafka sink's options: brokers, the requests topic, producer defaults, then every
    ``--kafka-config`` entry as ``kafka.<key>`` (so SASL and TLS work unchanged)."""
    options = {"kafka.bootstrap.servers": settings.bootstrap_servers,
               "topic": settings.requests_topic, **SINK_DEFAULTS}
    options.update({f"kafka.{key}": value for key, value in settings.kafka_config.items()})
    return options


def schedule(spark: SparkSession, settings: Settings, table: Table, columns: Columns,
             rules: Rules, rejects: Rejects, *, dry_run: bool = False,
             phase: Callable[[str], None] = lambda _: None) -> CampaignReport:
    """Validate every row of ``table``, write the rejects, then (unless ``dry_run``) the
    requests through Spark's Kafka sink; return the counts.

    The rejects are written in every run, a dry run included (an empty output
    when no row is rejected), so that they always belong to the last run.
    ``phase`` is told what the job does next. Raises :class:`CampaignError`
    for a table or mapping the job cannot use, and PySpark's exceptions when
    Spark or the sink fails (the requests written until then stay written; a
    re-run completes them and kdelay answers ``duplicate`` to the others).
    """
    header, parts = request_parts(read_table(spark, table), columns)
    phase("checking targets against the target policy")
    judged = judge(with_policy(spark, parts, settings.target_policy(), columns), header, rules)
    observation = Observation("schedule-table")
    counted = judged.observe(observation, F.count(F.lit(1)).alias("rows"), *[
        F.count_if(F.col(REASON) == code.value).alias(code.value) for code in REASONS])
    phase("validating rows and writing the rejects")
    rejects_frame(counted).write.mode("overwrite").format(rejects.format).save(rejects.path)
    found = observation.get
    rejected = {code.value: int(found[code.value]) for code in REASONS if found[code.value]}
    sent = int(found["rows"]) - sum(rejected.values())
    if not dry_run and sent:
        phase(f"writing {sent:,} requests to {settings.requests_topic}")
        writer = requests_frame(judged, header, rules.partitions).write.format("kafka")
        writer.options(**sink_options(settings)).save()
    return CampaignReport(int(found["rows"]), sent, rejected, dry_run, settings.requests_topic,
                          rules.partitions)
