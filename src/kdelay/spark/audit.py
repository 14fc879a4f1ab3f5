"""The delivery audit: every schedule request reconciled with what became of it.

Requests are joined to their deliveries on every target topic (by
``kdelay-origin``), to the DLQ (by ``kdelay-origin``) and to the pending
entries of the changelog (by request partition and offset). Each request gets
exactly one outcome, the first that holds:

``delivered_more_than_once`` / ``delivered_once``
    one or more target records carry its origin;
``dead_lettered``
    the DLQ holds it, with its ``kdelay-error`` as the reason (intake rejections
    and delivery failures such as ``expired`` alike);
``pending`` / ``overdue``
    the changelog holds its entry, not yet due / already due (a record a
    target control holds back is overdue: pending, never lost);
``deduplicated``
    it carries a ``kdelay-id`` that an earlier request of the same id's
    partition still held when it arrived: no cancel in between, and the
    earlier one not yet delivered by this one's record time;
``cancelled``
    it carries an id and a cancel for that id follows it on the id's partition;

An id's requests and cancels are ordered where the service orders them: on the
id's partition, where one written elsewhere arrives as its forward record
(``kdelay-forward``). A forward record is not a request of its own.
``pending`` / ``overdue`` / ``lost``
    nothing at all: not yet due, due less than ``settle`` ago (the service may
    still be reading it), or due longer ago: lost.

A request seen only through its traces (a delivery or DLQ record whose request
retention has deleted) is still counted, its time being its due time. Valid
cancel requests are not schedule requests; a malformed cancel is dead-lettered
like any malformed request. A delivery is early when its record time is before
its due time; lateness is the first delivery's record time minus the due time.

A request's lane is its ``kdelay-lane`` header, read from the request or, when
retention has deleted it, from its DLQ copy; deliveries carry no lane, so a
request seen only through its deliveries has none. An audit of one lane keeps
the requests of that lane.

Reschedules. A ``kdelay-reschedule`` request is no schedule: it moves one. A
schedule is judged against its *latest accepted due time*: the new due time of
the last reschedule the service applied to it before its first delivery (any,
while none went out), else its own. Its lateness counts from that time, and
its first delivery is early when it came before it, whatever due time the
delivered record claims. Each reschedule request (not dead-lettered) is
counted apart by what the service answered it: ``rescheduled`` (applied),
``unknown`` (no schedule held the id, or it was cancelled), ``too_late`` (the
schedule was delivered or dead-lettered first) or ``unanswered`` (no answer:
not read yet, the outcomes topic is missing, or compaction dropped it). A
dead-lettered one (``bad-reschedule``, ``delay-too-long``) is a dead-lettered
request like a malformed cancel.

Which reschedules were applied, and in what order, is read from the outcomes
topic: the ``rescheduled`` record the service writes for each one it applies,
naming the reschedule request and the schedule it moved, with the time of the
decision. That record is the service's own decision, taken where the id lives;
the requests alone cannot tell an applied reschedule from one that lost the
race with the due instant (``already-delivered``), and the changelog cannot
either: it keeps a moved entry's due key only until the entry is done and
compacted, while the audit judges deliveries long after. The new time itself is
the reschedule request's (resolved on the forward record for one written off
its id's partition). Where the outcome record is gone (no outcomes topic,
compaction kept a later answer of the id), the schedule is judged as it was
delivered, pending or dead-lettered, by the due time kdelay recorded there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec, envelope, forward
from kdelay.protocol.envelope import ErrorCode
from kdelay.spark import source
from kdelay.spark.source import header, millis

DELIVERED_ONCE = "delivered_once"
DELIVERED_MORE = "delivered_more_than_once"
PENDING = "pending"
OVERDUE = "overdue"
CANCELLED = "cancelled"
DEDUPLICATED = "deduplicated"
DEAD_LETTERED = "dead_lettered"
LOST = "lost"
OUTCOMES = (DELIVERED_ONCE, DELIVERED_MORE, PENDING, OVERDUE, CANCELLED, DEDUPLICATED,
            DEAD_LETTERED, LOST)
RESCHEDULED = "rescheduled"
UNKNOWN = "unknown"
TOO_LATE = "too_late"
UNANSWERED = "unanswered"
RESCHEDULE_OUTCOMES = (RESCHEDULED, UNKNOWN, TOO_LATE, UNANSWERED)
"""What became of a reschedule request (see the module docstring)."""
_ANSWERS = {"rescheduled": RESCHEDULED, "unknown": UNKNOWN, "already-delivered": TOO_LATE,
            "dead-lettered": TOO_LATE}
"""The service's answers to a reschedule (:class:`~kdelay.protocol.idkeys.Answer`), as counted."""
_ANSWER_SCHEMA = "request string, outcome string, schedule string, at_ms bigint"
DELIVERY_FAILURES = frozenset({ErrorCode.MISMATCH, ErrorCode.EXPIRED, ErrorCode.UNDELIVERABLE})
"""DLQ reasons of requests that were scheduled first (the others are intake rejections)."""
DEFAULT_SETTLE_MS = 60_000
_DUE_KEY_BYTES = 20


@dataclass(frozen=True, slots=True)
class AuditWindow:
    """What the audit covers and when it runs.

    ``now_ms`` is the time outcomes are judged at (the snapshot's). ``since_ms``
    and ``until_ms`` bound the requests by record time (``until`` exclusive).
    ``targets`` replaces the target topics named by the requests when given.
    ``lane`` keeps the requests of that lane only (see the module docstring).
    """

    now_ms: int
    settle_ms: int = DEFAULT_SETTLE_MS
    since_ms: int | None = None
    until_ms: int | None = None
    targets: tuple[str, ...] | None = None
    lane: str | None = None


@dataclass(frozen=True, slots=True)
class Lateness:
    """Lateness percentiles in milliseconds; None when nothing was delivered."""

    p50: int | None
    p99: int | None
    max: int | None

    def to_json(self) -> dict[str, int | None]:
        """The JSON form: ``{"p50": …, "p99": …, "max": …}``."""
        return {"p50": self.p50, "p99": self.p99, "max": self.max}


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The audit's summary: counts per outcome, DLQ reasons, copies, earliness, lateness."""

    counts: Mapping[str, int]
    reasons: Mapping[str, int]
    extra_copies: int
    early: int
    lateness: Lateness
    lateness_by_target: Mapping[str, Lateness]
    missing_topics: tuple[str, ...] = field(default=())
    reschedules: Mapping[str, int] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        """How many schedule requests the audit classified."""
        return sum(self.counts.values())

    def clean(self, exactly_once: bool) -> bool:
        """True unless anything is lost or early (or, for exactly-once, delivered twice)."""
        if self.counts.get(LOST, 0) or self.early:
            return False
        return not (exactly_once and self.counts.get(DELIVERED_MORE, 0))

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: one count per outcome, reasons, copies, lateness."""
        counts = {outcome: self.counts.get(outcome, 0) for outcome in OUTCOMES}
        return {
            "requests": self.requests, **counts, "dead_lettered": dict(self.reasons),
            "extra_copies": self.extra_copies, "early": self.early,
            "lateness_ms": self.lateness.to_json(),
            "lateness_ms_by_target": {t: v.to_json() for t, v in self.lateness_by_target.items()},
            "missing_topics": list(self.missing_topics),
            "reschedules": {o: self.reschedules.get(o, 0) for o in RESCHEDULE_OUTCOMES},
        }


def origin_prefix(settings: Settings) -> str:
    """What every ``kdelay-origin`` of this deployment's requests starts with."""
    return f"{settings.requests_topic}/"


def requests_frame(settings: Settings, raw: DataFrame) -> DataFrame:
    """One row per request record: coordinates, time, target, id, cancel, reschedule,
    due (a reschedule's new one), lane and forward."""
    ts = F.col("ts_ms")
    levels = F.array(*(F.lit(level) for level in settings.levels))
    level = header(envelope.LEVEL).try_cast("int")
    level_ms = F.when(level >= 1, F.try_element_at(levels, F.least(level, F.lit(
        len(settings.levels)))))
    due = F.coalesce(millis(envelope.DUE_MS), F.try_add(ts, millis(envelope.DELAY_MS)),
                     F.try_add(ts, level_ms))
    return raw.select(
        F.concat_ws("/", F.lit(settings.requests_topic), "partition", "offset").alias("origin"),
        "partition", "offset", ts.alias("ts_ms"),
        header(envelope.TARGET).alias("target"), header(envelope.SCHEDULE_ID).alias("sid"),
        header(envelope.CANCEL).alias("cancel"), due.alias("due_ms"),
        header(envelope.LANE).alias("lane"), header(forward.FORWARD).alias("forward"),
        header(envelope.RESCHEDULE).alias("reschedule"))


def delivery_traces(settings: Settings, raw: DataFrame) -> DataFrame:
    """One row per target record that carries an origin of this deployment's requests."""
    return raw.select(header(envelope.ORIGIN).alias("origin"), F.col("ts_ms").alias("d_ts"),
                      F.col("topic").alias("d_topic"), millis(envelope.DUE_MS).alias("d_due"),
                      ).where(F.col("origin").startswith(origin_prefix(settings)))


def dead_letter_traces(settings: Settings, raw: DataFrame) -> DataFrame:
    """One row per DLQ record of this deployment's requests: reason, recorded due, lane."""
    return raw.select(header(envelope.ORIGIN).alias("origin"),
                      header(envelope.ERROR).alias("reason"),
                      millis(envelope.DUE_MS).alias("dlq_due"),
                      header(envelope.LANE).alias("dlq_lane")).where(
        F.col("origin").startswith(origin_prefix(settings)))


def answers_frame(settings: Settings, raw: DataFrame) -> DataFrame:
    """The outcomes topic's answers that a reschedule can get, of this deployment's requests.

    Columns: ``request`` (where it was written), ``answer`` (the service's
    word), ``schedule`` (the origin of the schedule it answered for, when one
    held the id) and ``order``, the order the service decided them in: its
    clock, then the offset (one id's answers share a partition). Answers to
    schedules (``scheduled``, ``duplicate``) and ``cancelled`` are left out.
    """
    body = F.from_json(F.col("value").cast("string"), _ANSWER_SCHEMA)
    return raw.select(
        body["request"].alias("request"), body["outcome"].alias("answer"),
        body["schedule"].alias("schedule"),
        F.struct(body["at_ms"].alias("at"), F.col("offset").alias("offset")).alias("order"),
    ).where(F.col("request").startswith(origin_prefix(settings))
            & F.col("answer").isin(*_ANSWERS))


def _asked(settings: Settings) -> Column:
    """The origin of the request a row stands for: where it was written, which for a
    forwarded record is its ``kdelay-forward`` (outcome records name that one)."""
    return F.when(F.col("forward").isNotNull(),
                  F.concat(F.lit(origin_prefix(settings)), F.col("forward"))).otherwise(
        F.col("origin"))


def moves_frame(settings: Settings, requests: DataFrame, answers: DataFrame) -> DataFrame:
    """One row per reschedule the service applied: the schedule's origin and the move
    (``at``, ``offset``: when it was decided; ``due``: the new due time).

    The new due time is the reschedule's own, resolved by intake where it was
    forwarded (the forward record's absolute ``kdelay-due-ms``), else as the
    request states it.
    """
    rows = requests.where(F.col("reschedule").isNotNull())
    news = rows.groupBy(_asked(settings).alias("request")).agg(F.coalesce(
        F.max(F.when(F.col("forward").isNotNull(), F.col("due_ms"))), F.max("due_ms")
    ).alias("due"))
    applied = answers.where((F.col("answer") == "rescheduled") & F.col("schedule").isNotNull())
    return applied.join(news, "request").select(
        F.col("schedule").alias("origin"),
        F.struct(F.col("order.at").alias("at"), F.col("order.offset").alias("offset"),
                 F.col("due").alias("due")).alias("move"))


def pending_frame(raw: DataFrame) -> DataFrame:
    """The changelog's live entries: the latest record per due key, tombstones dropped,
    and those the partition's latest watermark covers.

    A due key is ``u64 due_ms | u32 partition | u64 offset`` (see
    :mod:`kdelay.protocol.codec`); other keys (the consumed-offset marker) are skipped.
    The latest record is taken per changelog partition: offsets of two partitions
    say nothing of which came first, and ``kdelay topics grow`` writes an entry to
    its id's new partition before it tombstones the entry where it was. A put
    older than the partition's latest watermark record, keyed below its bound and
    not among its pending keys, is done (see :class:`~kdelay.protocol.codec.Watermark`):
    delivery writes no tombstone of its own for it.
    """
    latest = raw.where(F.length("key") == _DUE_KEY_BYTES).groupBy(
        F.col("partition").alias("changelog_partition"), "key").agg(
        F.max_by("value", "offset").alias("value"), F.max("offset").alias("at"))
    marks = raw.where(F.col("key") == F.lit(codec.WATERMARK_MARKER)).groupBy(
        F.col("partition").alias("changelog_partition")).agg(
        F.max_by("value", "offset").alias("mark"), F.max("offset").alias("mark_at"))
    live = latest.join(F.broadcast(marks), "changelog_partition", "left").where(
        F.col("value").isNotNull() & ~F.coalesce(_covered(), F.lit(False))
    ).dropDuplicates(["key"])
    return live.select(
        _unsigned(F.substring("key", 9, 4)).cast("int").alias("partition"),
        _unsigned(F.substring("key", 13, 8)).alias("offset"),
        _unsigned(F.substring("key", 1, 8)).alias("pending_due"),
        F.col("value"))


def _covered() -> Column:
    """Whether the row's put (at offset ``at``) is covered by the watermark ``mark``
    (written at ``mark_at``): older, keyed below the bound, not pending. The mark is
    a version byte, the bound and the pending keys, 20 bytes each."""
    bound = F.expr(f"substring(mark, 2, {_DUE_KEY_BYTES})")
    pending = F.expr(f"transform(sequence(1, cast((length(mark) - 1) / {_DUE_KEY_BYTES} AS int)"
                     f" - 1), i -> substring(mark, 2 + i * {_DUE_KEY_BYTES}, {_DUE_KEY_BYTES}))")
    return ((F.col("at") < F.col("mark_at")) & (F.col("key") < bound)
            & ~F.array_contains(pending, F.col("key")))


def _unsigned(raw: Column) -> Column:
    """A big-endian unsigned integer of up to 8 bytes as a long (null past 2**63 - 1)."""
    return F.conv(F.hex(raw), 16, 10).try_cast("bigint")


def pending_traces(settings: Settings, pending: DataFrame) -> DataFrame:
    """One row per live changelog entry, keyed by the origin of its request."""
    origin = F.concat_ws("/", F.lit(settings.requests_topic), "partition", "offset")
    return pending.select(origin.alias("origin"), "pending_due")


def joined(settings: Settings, requests: DataFrame, deliveries: DataFrame,
           dead: DataFrame, pending: DataFrame, moves: DataFrame) -> DataFrame:
    """Every request (and orphan) with its deliveries, DLQ reason, pending entry and
    the due time its reschedules moved it to.

    The five kinds of rows are stacked and grouped by origin once: one shuffle,
    where joins would take one each. An origin with no request row is an
    orphan: its partition and offset come from the origin itself. ``moved_due``
    is the due time of the last move decided before the first delivery (or
    ever, when none went out): the latest accepted due time.
    """
    stacked = requests.unionByName(deliveries, allowMissingColumns=True).unionByName(
        dead, allowMissingColumns=True).unionByName(
        pending_traces(settings, pending), allowMissingColumns=True).unionByName(
        moves, allowMissingColumns=True)
    copies = F.count("d_ts")
    grouped = stacked.groupBy("origin").agg(
        F.max("ts_ms").alias("ts_ms"), F.max("target").alias("target"),
        F.max("sid").alias("sid"), F.max("cancel").alias("cancel"),
        F.max("forward").alias("forward"), F.max("reschedule").alias("reschedule"),
        F.max("due_ms").alias("due_ms"), F.collect_list("move").alias("moves"),
        F.when(copies > 0, copies).alias("copies"), F.min("d_ts").alias("first_ms"),
        F.min_by("d_topic", "d_ts").alias("delivered_to"),
        F.max("d_due").alias("delivered_due"),
        F.sum(F.when(F.col("d_ts") < F.col("d_due"), 1).otherwise(0)).alias("early_copies"),
        F.min("reason").alias("reason"), F.max("dlq_due").alias("dlq_due"),
        F.max("pending_due").alias("pending_due"),
        F.coalesce(F.max("lane"), F.max("dlq_lane")).alias("lane"))
    first = F.col("first_ms")
    in_force = F.filter("moves", lambda move: first.isNull() | (move["at"] <= first))
    grouped = grouped.withColumn("moved_due", F.array_max(in_force)["due"]).drop("moves")
    parts = F.split("origin", "/")
    rejected = F.col("reason").isNotNull() & ~F.col("reason").isin(
        *(code.value for code in DELIVERY_FAILURES))
    due = F.coalesce("moved_due", "delivered_due", "pending_due", "dlq_due", "due_ms")
    evidence = F.col("copies").isNotNull() | F.col("reason").isNotNull() | F.col(
        "pending_due").isNotNull()
    return grouped.select(
        "*", F.element_at(parts, -2).try_cast("int").alias("partition"),
        F.element_at(parts, -1).try_cast("bigint").alias("offset"), due.alias("due"),
        rejected.alias("rejected"), evidence.alias("evidence"),
        F.coalesce("ts_ms", due).alias("time_ms"))


def _at_id_partition(rows: DataFrame) -> DataFrame:
    """The rows of an id's chain where its index sees them: a schedule written off its id's
    partition takes the place of its forward record (``kdelay-forward``) there."""
    forwards = rows.where(F.col("forward").isNotNull() & F.col("cancel").isNull()
                          & F.col("reschedule").isNull()).select(
        F.concat(F.regexp_extract("origin", r"^(.*/)[0-9]+/[0-9]+$", 1),
                 F.col("forward")).alias("origin"),
        F.col("partition").alias("at_partition"), F.col("offset").alias("at_offset"))
    rows = rows.where(F.col("forward").isNull() | F.col("cancel").isNotNull())
    return rows.join(forwards, "origin", "left").withColumns({
        "partition": F.coalesce("at_partition", "partition"),
        "offset": F.coalesce("at_offset", "offset")})


def id_verdicts(rows: DataFrame) -> DataFrame:
    """Per origin of a request with a schedule id and no evidence: deduplicated or cancelled.

    Only accepted schedules and valid cancels that carry an id take part (a
    reschedule moves its schedule, it holds or ends nothing), grouped
    by (partition, id) in offset order, as intake sees them: on the id's
    partition, where a request written elsewhere arrives as its forward.
    """
    sid = F.coalesce("cancel", "sid")
    chain = _at_id_partition(rows).where(
        sid.isNotNull() & ~F.col("rejected") & F.col("reschedule").isNull()).select(
        "origin", "partition", "offset", "ts_ms", "first_ms", "evidence", sid.alias("id"),
        F.col("cancel").isNotNull().alias("is_cancel"))
    order = Window.partitionBy("partition", "id").orderBy("offset")
    before = order.rowsBetween(Window.unboundedPreceding, -1)
    after = order.rowsBetween(1, Window.unboundedFollowing)
    schedule = ~F.col("is_cancel")
    marked = chain.select(
        "*",
        F.max(F.when(F.col("is_cancel"), F.col("offset"))).over(before).alias("cancel_before"),
        F.last(F.when(schedule, F.struct("offset", "first_ms")), ignorenulls=True).over(
            before).alias("holder"),
        F.min(F.when(F.col("is_cancel"), F.col("offset"))).over(after).alias("cancel_after"))
    holder = F.col("holder")
    dedup = (holder.isNotNull()
             & (F.col("cancel_before").isNull() | (F.col("cancel_before") < holder["offset"]))
             & (holder["first_ms"].isNull() | (holder["first_ms"] >= F.col("ts_ms"))))
    return marked.where(schedule & ~F.col("evidence")).select(
        "origin", dedup.alias("deduplicated"),
        (~dedup & F.col("cancel_after").isNotNull()).alias("cancelled"))


def classified(rows: DataFrame, window: AuditWindow) -> DataFrame:
    """Give every schedule request its one outcome (see the module docstring)."""
    rows = rows.join(id_verdicts(rows), "origin", "left")
    due, now = F.coalesce("due", "time_ms"), F.lit(window.now_ms)
    outcome = (F.when(F.col("copies") > 1, DELIVERED_MORE)
               .when(F.col("copies") == 1, DELIVERED_ONCE)
               .when(F.col("reason").isNotNull(), DEAD_LETTERED)
               .when(F.col("pending_due").isNotNull() & (F.col("pending_due") > now), PENDING)
               .when(F.col("pending_due").isNotNull(), OVERDUE)
               .when(F.col("deduplicated"), DEDUPLICATED)
               .when(F.col("cancelled"), CANCELLED)
               .when(due > now, PENDING)
               .when(due > now - window.settle_ms, OVERDUE)
               .otherwise(LOST))
    # A forward record is not a request: its original is one, where it was written.
    # Cancels and reschedules are no schedules, unless dead-lettered.
    schedules = rows.where((F.col("cancel").isNull() & F.col("forward").isNull()
                            & F.col("reschedule").isNull()) | F.col("reason").isNotNull())
    schedules = _bounded(schedules, window)
    return schedules.select(
        "origin", "partition", "offset", "ts_ms", F.coalesce("target", "delivered_to").alias(
            "target"), "lane", F.col("sid").alias("schedule_id"), F.col("due").alias("due_ms"),
        outcome.alias("outcome"), "reason", F.coalesce("copies", F.lit(0)).alias("copies"),
        "first_ms", (F.col("first_ms") - F.col("due")).alias("lateness_ms"),
        ((F.coalesce("early_copies", F.lit(0)) > 0)
         | F.coalesce(F.col("first_ms") < F.col("moved_due"), F.lit(False))).alias("early"))


def reschedule_verdicts(settings: Settings, rows: DataFrame, answers: DataFrame,
                        window: AuditWindow) -> DataFrame:
    """One row per reschedule request (where written) that is not dead-lettered: its
    origin, record time, schedule id and outcome (``rescheduled``, ``unknown``,
    ``too_late`` or ``unanswered``), by the service's last answer to it.

    A dead-lettered one (``bad-reschedule``, ``delay-too-long``, here or at the
    id's partition it was forwarded to) is a dead-lettered request of the
    classified table instead. With a lane, a reschedule counts in the lane of
    the schedule its answer names (one answered ``unknown`` for an id never
    scheduled names none).
    """
    asks = rows.where(F.col("reschedule").isNotNull()).groupBy(
        _asked(settings).alias("origin")).agg(
        F.coalesce(F.max(F.when(F.col("forward").isNull(), F.col("ts_ms"))),
                   F.max("ts_ms")).alias("time_ms"),
        F.max("reschedule").alias("schedule_id"), F.min("reason").alias("reason"))
    latest = answers.groupBy(F.col("request").alias("origin")).agg(
        F.max_by("answer", "order").alias("answer"),
        F.max_by("schedule", "order").alias("schedule"))
    verdict = F.coalesce(F.create_map(*(F.lit(x) for pair in _ANSWERS.items() for x in pair))[
        F.col("answer")], F.lit(UNANSWERED))
    table = asks.where(F.col("reason").isNull()).join(latest, "origin", "left")
    if window.lane is not None:
        lanes = rows.select(F.col("origin").alias("schedule"), "lane")
        table = table.join(lanes, "schedule", "left")
    return _bounded(table, window).select(
        "origin", F.col("time_ms").alias("ts_ms"), "schedule_id", verdict.alias("outcome"),
        "schedule")


def _bounded(rows: DataFrame, window: AuditWindow) -> DataFrame:
    """Keep the requests whose record time (due time for orphans) is in the window.

    With a lane, keep only that lane's requests too.
    """
    if window.lane is not None:
        rows = rows.where(F.col("lane") == window.lane)
    if window.since_ms is not None:
        rows = rows.where(F.col("time_ms") >= window.since_ms)
    if window.until_ms is not None:
        rows = rows.where(F.col("time_ms") < window.until_ms)
    return rows


@dataclass(frozen=True, slots=True)
class Tables:
    """What :func:`request_table` builds: the per-request table, the reschedules'
    verdicts, the frames persisted on the way (unpersist them when done) and the
    topics named but missing."""

    requests: DataFrame
    reschedules: DataFrame
    cached: list[DataFrame]
    missing: tuple[str, ...]


def request_table(spark: SparkSession, settings: Settings, window: AuditWindow) -> Tables:
    """Read the topics; return the per-request table and the reschedules' verdicts.

    The requests, DLQ, changelog and outcomes are pinned first; the target
    topics are pinned once the requests have named them, so a delivery that
    happened in between is seen rather than taken for a loss. The requests (the
    targets are read from them), the reschedules' answers and the joined rows
    (classification reads them twice) are persisted.
    """
    own = [settings.requests_topic, settings.dlq_topic, settings.changelog_topic,
           settings.outcomes_topic]
    snap = source.snapshot(settings, own)
    raw_requests = source.read(spark, settings, snap, [settings.requests_topic])
    requests = requests_frame(settings, raw_requests).persist()
    targets = window.targets if window.targets is not None else _targets(requests)
    target_snap = source.snapshot(settings, targets)
    deliveries = delivery_traces(settings, source.read(spark, settings, target_snap, targets))
    dead = dead_letter_traces(settings, source.read(spark, settings, snap, [settings.dlq_topic]))
    pending = pending_frame(source.read(spark, settings, snap, [settings.changelog_topic]))
    answers = answers_frame(settings, source.read(
        spark, settings, snap, [settings.outcomes_topic])).persist()
    moves = moves_frame(settings, requests, answers)
    rows = joined(settings, requests, deliveries, dead, pending, moves).persist()
    return Tables(classified(rows, window), reschedule_verdicts(settings, rows, answers, window),
                  [requests, answers, rows], (*snap.missing, *target_snap.missing))


def _targets(requests: DataFrame) -> tuple[str, ...]:
    """The distinct target topics the requests name (a handful: collected)."""
    names = requests.where(F.col("target").isNotNull()).select("target").distinct()
    return tuple(sorted(row["target"] for row in names.collect()))


def summarize(table: DataFrame, missing: tuple[str, ...] = (),
              reschedules: DataFrame | None = None) -> AuditReport:
    """Aggregate the per-request table into the report in two passes over it, and
    count the ``reschedules`` (:func:`reschedule_verdicts`) by outcome.

    Only aggregates reach the driver: one row per (outcome, reason) and one
    per target. Persist ``table`` first when it is read from Kafka.
    """
    counts: dict[str, int] = {}
    reasons: dict[str, int] = {}
    extra = early = 0
    for row in table.groupBy("outcome", "reason").agg(
            F.count(F.lit(1)).alias("n"),
            F.sum(F.when(F.col("copies") > 1, F.col("copies") - 1).otherwise(0)).alias("extra"),
            F.count_if(F.col("early")).alias("early")).collect():
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + row["n"]
        extra, early = extra + row["extra"], early + row["early"]
        if row["outcome"] == DEAD_LETTERED:
            reasons[row["reason"]] = row["n"]
    overall, by_target = _lateness(table)
    moved = {} if reschedules is None else {
        row["outcome"]: row["count"] for row in reschedules.groupBy("outcome").count().collect()}
    return AuditReport(counts, dict(sorted(reasons.items())), extra, early, overall, by_target,
                       missing, moved)


def _lateness(table: DataFrame) -> tuple[Lateness, dict[str, Lateness]]:
    """Lateness percentiles of the first delivery, per target and overall (one rollup)."""
    delivered = table.where(F.col("lateness_ms").isNotNull())
    rows = delivered.rollup("target").agg(
        F.percentile_approx("lateness_ms", [0.5, 0.99], 10_000).alias("p"),
        F.max("lateness_ms").alias("max"), F.grouping_id().alias("all")).collect()
    overall = next((_percentiles(r) for r in rows if r["all"]), Lateness(None, None, None))
    per_target = {r["target"]: _percentiles(r) for r in rows if not r["all"]}
    return overall, dict(sorted(per_target.items()))


def _percentiles(row: Any) -> Lateness:
    """A :class:`Lateness` from an aggregate row (``p`` is null when no row was delivered)."""
    p = row["p"]
    if p is None:
        return Lateness(None, None, None)
    return Lateness(int(p[0]), int(p[1]), int(row["max"]))


def audit(spark: SparkSession, settings: Settings,
          window: AuditWindow) -> tuple[AuditReport, DataFrame]:
    """Run the audit; return the report and the per-request table, persisted.

    The caller unpersists the table when done with it. Raises
    :class:`confluent_kafka.KafkaException` when the cluster cannot be read.
    """
    tables = request_table(spark, settings, window)
    table = tables.requests.persist()
    try:
        return summarize(table, tables.missing, tables.reschedules), table
    finally:
        for frame in tables.cached:
            frame.unpersist()
