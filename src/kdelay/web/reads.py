"""What the console's screens show, read through the operator's view.

Every read catches the console's own :class:`~kdelay.view.pending.PendingView`
(under its view dir, apart from the CLI's, whose lock a running ``kdelay
due`` holds) up with the changelog (incremental: only what was written since
the last read), and answers. The figures are those of ``kdelay backlog`` and
``kdelay due``, from the same functions.

At scale (:meth:`Reads.keep_current`, which ``kdelay web`` turns on), the view
stays open for the console's life with its memory bounded
(:class:`~kdelay.web.snapshots.Copy`), a read waits only for a sync under way,
never for a summary's rebuild, and a background thread keeps the view synced
and a compact :class:`~kdelay.web.summary.Summary` of it: the overview, the
timeline and the pending list's counts and page (without an id prefix) come
from that summary in well under a second, and say how current it is
(:meth:`Reads.freshness`). Without it, every read opens the view, syncs it,
answers and closes it, and reads take turns under one lock (the view's stores
admit one holder).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Message

from kdelay import controls, recurring
from kdelay.plumbing.clock import Clock
from kdelay.plumbing.connection import ConnectionFailure, check_connection
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import requests_retention
from kdelay.protocol import codec, envelope
from kdelay.protocol.controls import Control, Subject
from kdelay.state.budget import StoreBudget
from kdelay.tasks import TASKS_TOPIC
from kdelay.view import deadletters, deliveries, tails
from kdelay.view.backlog import Backlog, HeldBack, backlog, held_back
from kdelay.view.deadletters import DeadLetter
from kdelay.view.deliveries import Lateness, Latest
from kdelay.view.display import utc
from kdelay.view.listing import (
    DUE,
    KEY_SCAN,
    SCAN_DEPTH,
    Filter,
    KeyMatch,
    Listing,
    Order,
    Timeline,
    by_lane,
    listing,
    matching_ids,
    row_order,
    timeline,
)
from kdelay.view.lookup import Lookup, lookup
from kdelay.view.members import Membership, membership
from kdelay.view.pending import Originals, Pending, PendingView, headers_of
from kdelay.view.retention import RetentionReport, check
from kdelay.web.problems import Problem
from kdelay.web.snapshots import INTERVAL_S, Copy, Freshness, Snapshots
from kdelay.web.trace import Ended, Step, audit_steps, end_steps, outcome_steps

PREVIEW_BYTES = 4_096
HOUR_MS = 3_600_000
DEAD_LETTERS_PER_PARTITION = 100
LOADING = "view-loading"
"""The code of the summary's answer before its first read (see :mod:`kdelay.web.snapshots`)."""
REQUESTS_SEEN = 200
"""How many of each requests partition's newest records name the targets the delivery
screens read, besides the targets of pending entries."""
HISTORY_LIMIT = 100
LATENESS_PER_PARTITION = 2_000
RUNS_SHOWN = 10


@dataclass(frozen=True, slots=True)
class ControlRow:
    """A target control in force and what it holds back (see :meth:`Reads.controls`)."""

    subject: Subject
    control: Control
    held: HeldBack


@dataclass(frozen=True, slots=True)
class Overview:
    """The overview screen: the backlog, split by target and lane, the service's group
    (who serves which partitions, intake lag), and whether Kafka answers.

    ``backlog`` and ``lanes`` are None when Kafka does not answer (``kafka_error``).
    """

    now_ms: int
    kafka_error: str | None
    backlog: Backlog | None = None
    lanes: dict[str, int] = field(default_factory=dict)
    group: Membership | None = None

    @property
    def oldest_overdue_ms(self) -> int | None:
        """The due time of the oldest entry already due, None when nothing is."""
        found = self.backlog
        if found is None or found.earliest_due_ms is None:
            return None
        return found.earliest_due_ms if found.earliest_due_ms <= self.now_ms else None


@dataclass(frozen=True, slots=True)
class Preview:
    """A payload shown as ``json`` (pretty), ``text``, ``hex`` or ``redacted`` (not JSON while
    fields are redacted: not shown), at most
    :data:`PREVIEW_BYTES` of it (``cut`` when there was more)."""

    kind: str
    text: str
    size: int
    cut: bool


@dataclass(frozen=True, slots=True)
class Record:
    """The record screen: the lookup, the original's headers and payload, retention and trace.

    ``payload`` is None when the record has no value, was not read, or is
    hidden (``hidden``) from the caller. ``expires_ms`` is when the requests
    topic's retention may delete the original (None: unlimited or unknown).
    """

    found: Lookup
    now_ms: int
    headers: list[tuple[str, str]]
    payload: Preview | None
    hidden: bool
    expires_ms: int | None
    trace: list[Step]

    @property
    def lane(self) -> str | None:
        """The lane of the schedule shown (None: no lane, or nothing pending): actions
        on this page name it, since an id is unique within its lane."""
        return None if self.found.pending is None else self.found.pending.lane

    @property
    def headroom_ms(self) -> int | None:
        """How long the original outlives its due time (negative: it expires first)."""
        if self.expires_ms is None or self.found.pending is None:
            return None
        return self.expires_ms - self.found.pending.due_ms


REDACTED = "***"


@dataclass(frozen=True, slots=True)
class Redaction:
    """Header names and JSON field names whose values are never shown (``--web-redact``),
    lower-cased: a header by its name, a JSON field by its key at any depth."""

    names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: list[str]) -> Redaction:
        """The redaction of ``names``, compared case-insensitively."""
        return cls(frozenset(name.lower() for name in names))

    def header(self, name: str, value: str) -> str:
        """``value``, or :data:`REDACTED` when the header ``name`` is redacted."""
        return REDACTED if name.lower() in self.names else value

    def json(self, value: Any) -> Any:
        """``value`` with every redacted field's value replaced, at any depth."""
        if not self.names:
            return value
        if isinstance(value, dict):
            return {key: REDACTED if str(key).lower() in self.names else self.json(item)
                    for key, item in value.items()}
        if isinstance(value, list):
            return [self.json(item) for item in value]
        return value


def preview(value: bytes, redaction: Redaction = Redaction()) -> Preview:
    """Show ``value`` as pretty JSON (its redacted fields as ``***``), else UTF-8 text, else
    hex, cut at :data:`PREVIEW_BYTES`. Text and hex cannot be redacted field by field:
    with a redaction configured, a payload that is not JSON is not shown."""
    head, cut = value[:PREVIEW_BYTES], len(value) > PREVIEW_BYTES
    if not cut:
        try:
            parsed = redaction.json(orjson.loads(value))
            shown = orjson.dumps(parsed, option=orjson.OPT_INDENT_2)
            return Preview("json", shown.decode(), len(value), cut)
        except orjson.JSONDecodeError:
            pass
    if redaction.names:
        return Preview("redacted", "(not JSON: not shown while fields are redacted)",
                       len(value), cut)
    try:
        return Preview("text", head.decode("utf-8"), len(value), cut)
    except UnicodeDecodeError:
        return Preview("hex", head.hex(" "), len(value), cut)


SERIES_LIMIT = 200


@dataclass(frozen=True, slots=True)
class SeriesRow:
    """A recurring series, from its pending occurrence: the rule, which occurrence is
    pending, its bounds, where it goes, and the next fire times (the pending one first)."""

    schedule_id: str
    rule: str
    n: int
    count: int | None
    until_ms: int | None
    target: str
    upcoming: list[int]
    runs: list[SeriesRun] = field(default_factory=list)


def latest(rows: list[SeriesRow]) -> list[SeriesRow]:
    """One row a series: its latest pending occurrence.

    While a worker hands a series on, the view can hold two of its occurrences
    pending for a moment (the next one written, the one just delivered not yet
    gone from the changelog the view reads); the series is listed once.
    """
    found: dict[str, SeriesRow] = {}
    for row in rows:
        seen = found.get(row.schedule_id)
        if seen is None or row.n > seen.n:
            found[row.schedule_id] = row
    return list(found.values())


@dataclass(frozen=True, slots=True)
class SeriesRun:
    """One delivered occurrence of a series: its number, when it was due and delivered,
    and where it lies on the worker's topic."""

    n: int
    due_ms: int
    delivered_ms: int
    lateness_ms: int
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class LatenessReport:
    """The lateness screen: per target, over the deliveries read since ``since_ms``
    (``capped``: targets where the read's bound left older deliveries of the window
    unread, so the figures cover less than the window)."""

    now_ms: int
    since_ms: int
    rows: list[Lateness]
    capped: set[str]
    targets: list[str]
    hours: list[Lateness] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SeriesList:
    """The series shown, and how many pending occurrences the worker topics hold."""

    rows: list[SeriesRow]
    pending: int


class Reads:
    """The console's reads of one deployment, one at a time.

    Raises what :class:`PendingView` raises (``RestoreError`` when the
    changelog cannot be read, ``ViewBusy``) and KafkaException; the app turns
    them into answers with a stable code.
    """

    _snapshots: Snapshots | None = None
    _copy: Copy | None = None

    def __init__(self, settings: Settings, view_dir: Path, clock: Clock, *,
                 audit_topic: str, redact: Redaction = Redaction()) -> None:
        self._settings = settings
        self._redact = redact
        self._view_dir = view_dir
        self._clock = clock
        self._audit_topic = audit_topic
        self._lock = threading.Lock()

    def keep_current(self, interval_s: float = INTERVAL_S) -> Snapshots:
        """Keep the view synced and summarised in a background thread from now on; the
        overview, timeline and pending list then read the summary."""
        if self._snapshots is None:
            budget = StoreBudget()
            self._copy = Copy(lambda now_ms: PendingView(self._settings, self._view_dir, now_ms,
                                                         budget=budget))
            self._snapshots = Snapshots(
                self._copy, lambda: Originals(self._settings, fetch=budget.originals()),
                self._clock, interval_s=interval_s)
            self._snapshots.start()
        return self._snapshots

    def freshness(self) -> Freshness | None:
        """How current the summary the screens count from is (None: every read syncs)."""
        return None if self._snapshots is None else self._snapshots.freshness

    @property
    def settings(self) -> Settings:
        """The deployment's settings (for the controls' names; never rendered)."""
        return self._settings

    @property
    def requests_topic(self) -> str:
        """The requests topic, which coordinates name."""
        return self._settings.requests_topic

    @contextmanager
    def _opened(self) -> Iterator[tuple[PendingView, Originals, int]]:
        if self._copy is not None:  # kept open: wait for a sync under way, not a rebuild
            now_ms = self._clock.now_ms()
            view, replayed = self._copy.synced(now_ms)
            if self._snapshots is not None and any(replayed.values()):
                self._snapshots.changed()
            # Bounded as the summary's reader is: a key filter reads 10 000 originals.
            with Originals(self._settings, fetch=StoreBudget().originals()) as originals:
                yield view, originals, now_ms
            return
        with self._lock:
            now_ms = self._clock.now_ms()
            with PendingView(self._settings, self._view_dir, now_ms) as view, \
                    Originals(self._settings) as originals:
                yield view, originals, now_ms

    def kafka_error(self) -> str | None:
        """None when a broker answers; else why not (``code: sentence``)."""
        try:
            check_connection(self._settings.client_config("probe"), timeout_s=5.0)
        except ConnectionFailure as exc:
            return f"{exc.code}: {exc}"
        return None

    def overview(self) -> Overview:
        """Totals, ready-now, oldest overdue, furthest due, by target and lane (reads every
        pending original not cached yet, as ``backlog --by target`` does)."""
        problem = self.kafka_error()
        if problem is not None:
            return Overview(self._clock.now_ms(), problem)
        if self._snapshots is not None:
            summary = self._snapshots.summary()
            now_ms = self._clock.now_ms()
            return Overview(now_ms, None, summary.backlog(now_ms, HOUR_MS), summary.lanes(),
                            membership(self._settings))
        with self._opened() as (view, originals, now_ms):
            counted = backlog(view, now_ms, HOUR_MS, originals)
            lanes = by_lane(view, originals)
        return Overview(now_ms, None, counted, lanes, membership(self._settings))

    def pending(self, chosen: Filter, *, skip: int = 0, limit: int = 100, order: Order = DUE,
                key: KeyMatch | None = None) -> Listing:
        """The pending entries ``chosen`` (and ``key``) keeps in ``order``: a page of them
        and the true total.

        From the summary (when kept current and without an id prefix): the total
        as of the summary, and the page's entries read from the view, less any
        delivered or cancelled since (a page may then show fewer rows). By id,
        among the first :data:`SCAN_DEPTH` matches by due time (``capped``). A
        ``key`` looks at the first :data:`KEY_SCAN` matches of the other filters
        (by due time), whose originals it reads (``capped`` when there were more).
        """
        if skip < 0 or limit < 1:
            raise ValueError(f"skip must be >= 0 and limit >= 1, got {skip} and {limit}")
        if key is not None:
            scanned = self.pending(chosen, limit=KEY_SCAN)
            kept = sorted((row for row in scanned.rows if key.matches(row[1].key)),
                          key=row_order(order), reverse=order.descending)
            return Listing(len(kept), kept[skip:skip + limit], skip, limit, order,
                           KEY_SCAN if scanned.total > KEY_SCAN else None, scanned.total)
        if self._snapshots is None or chosen.id_prefix is not None:
            with self._opened() as (view, originals, _):
                return listing(view, originals, chosen, skip=skip, limit=limit, order=order)
        summary = self._snapshots.summary()
        if order.sort == "id":
            total, keys = summary.page(chosen, 0, SCAN_DEPTH)
        else:
            total, keys = summary.page(chosen, skip, limit, order)
        with self._opened() as (view, originals, _):
            entries: dict[tuple[int, int, int], Pending] = {}
            for partition in sorted({index for index, _ in keys}):
                entries.update(((e.due_ms, e.partition, e.offset), e) for e in view.pending(
                    partition, [due_key for index, due_key in keys if index == partition]))
            shown = [found for _, due_key in keys
                     if (found := entries.get(codec.decode_due_key(due_key))) is not None]
            if order.sort == "id":
                shown.sort(key=lambda e: (e.schedule_id is None, e.schedule_id or "", e.due_ms,
                                          e.partition, e.offset), reverse=order.descending)
                shown = shown[skip:skip + limit]
            read = originals.read(shown)
        capped = SCAN_DEPTH if order.sort == "id" and total > SCAN_DEPTH else None
        return Listing(total if capped is None else SCAN_DEPTH,
                       [(e, read[(e.partition, e.offset)]) for e in shown], skip, limit, order,
                       capped, total if capped is not None else None)

    def timeline(self, bucket_ms: int, chosen: Filter | None = None) -> Timeline:
        """Pending entries by due bucket and target (from the summary when kept current
        and without an id prefix)."""
        if self._snapshots is not None and (chosen is None or chosen.id_prefix is None):
            return self._snapshots.summary().timeline(bucket_ms, chosen)
        with self._opened() as (view, originals, _):
            return timeline(view, originals, bucket_ms, chosen)

    def retention(self) -> RetentionReport:
        """The retention check of ``kdelay retention check``: which pending originals
        retention may delete before they are due, per partition."""
        with self._opened() as (view, _, now_ms):
            return check(self._settings, view, now_ms)

    def ids(self, chosen: Filter) -> tuple[list[tuple[str, str | None]], int]:
        """The ids of the pending entries ``chosen`` keeps, each with its lane, in due
        order, and how many entries it keeps without an id."""
        with self._opened() as (view, originals, _):
            return matching_ids(view, originals, chosen)

    def dead_letters(self, *, code: str | None = None,
                     per_partition: int = DEAD_LETTERS_PER_PARTITION) -> list[DeadLetter]:
        """The latest dead letters (of ``code`` only, when given), newest first."""
        return deadletters.latest(self._settings, per_partition=per_partition, code=code)

    def dead_letter(self, partition: int, offset: int) -> Message | None:
        """The DLQ record at ``partition``/``offset``, None when there is none."""
        return deadletters.at(self._settings, partition, offset)

    def _series_run(self, message: Message) -> tuple[str, SeriesRun] | None:
        """The series id and run a worker topic's record is, None for any other record."""
        delivery = deliveries.decode(message, self.requests_topic)
        try:
            series = recurring.series_of(message.headers())
        except recurring.SeriesError:
            return None
        if delivery is None or series is None:
            return None
        return series.schedule_id, SeriesRun(
            series.n, delivery.due_ms, delivery.delivered_ms, delivery.lateness_ms,
            delivery.target, delivery.partition, delivery.offset)

    def delivery_targets(self) -> list[str]:
        """The targets the delivery screens read: those of pending entries, those the
        newest requests name (the last :data:`REQUESTS_SEEN` of each requests partition),
        and the worker topics (series and tasks) when they exist."""
        found: set[str] = {recurring.SERIES_TOPIC, TASKS_TOPIC, *self._pending_targets()}
        named = tails.newest(self._settings.client_config(), [self.requests_topic],
                             lambda message: deliveries.header(message, envelope.TARGET),
                             per_partition=REQUESTS_SEEN, budget=10 * REQUESTS_SEEN,
                             purpose="targets")
        found.update(target for target in named.items if target)
        return sorted(found)

    def _pending_targets(self) -> set[str]:
        """The targets of pending entries; none while the summary is first being read
        (the delivery screens need no view: the newest requests name targets too)."""
        if self._snapshots is None:
            with self._opened() as (view, originals, now_ms):
                return set(backlog(view, now_ms, HOUR_MS, originals).by_target or {})
        try:
            summary = self._snapshots.summary()
        except Problem as exc:
            if exc.code != LOADING:
                raise
            return set()
        return set(summary.backlog(self._clock.now_ms(), HOUR_MS).by_target or {})

    def deliveries(self, target: str | None = None, *,
                   limit: int = HISTORY_LIMIT) -> Latest:
        """The newest ``limit`` deliveries (to ``target`` only, when given), newest first,
        each with the schedule id and lane its request carries."""
        targets = [target] if target else self.delivery_targets()
        found = deliveries.latest(self._settings.client_config(), self.requests_topic,
                                  targets)
        shown = found.deliveries[:limit]
        with Originals(self._settings) as originals:
            requests = originals.records(
                place for d in shown if (place := d.request(self.requests_topic)) is not None)
        return Latest(deliveries.named(shown, self.requests_topic, requests), found.capped)

    def lateness(self, window_ms: int, target: str | None = None, *,
                 per_partition: int = LATENESS_PER_PARTITION) -> LatenessReport:
        """Lateness per target over the deliveries of the last ``window_ms`` (to ``target``
        only, when given), from at most ``per_partition`` records of each target
        partition."""
        now_ms = self._clock.now_ms()
        since_ms = now_ms - window_ms
        targets = [target] if target else self.delivery_targets()
        found = deliveries.latest(self._settings.client_config(), self.requests_topic,
                                  targets, since_ms=since_ms, per_partition=per_partition)
        shown = [d for d in found.deliveries if d.delivered_ms >= since_ms]
        return LatenessReport(now_ms, since_ms, deliveries.lateness(shown), found.capped,
                              targets, deliveries.lateness(shown, by_hour=True))

    def series(self, *, limit: int = SERIES_LIMIT) -> SeriesList:
        """The recurring series with a pending occurrence (on the series topic or the tasks
        topic, the worker's defaults), the first ``limit`` of each topic in due order."""
        rows: list[SeriesRow] = []
        pending = 0
        with self._opened() as (view, originals, now_ms):
            for topic in (recurring.SERIES_TOPIC, TASKS_TOPIC):
                found = listing(view, originals, Filter(target=topic), limit=limit)
                pending += found.total
                rows.extend(row for _, original in found.rows
                            if (row := _series_row(original.record, topic, now_ms)) is not None)
        runs = self._series_runs()
        rows = [replace(row, runs=runs.get(row.schedule_id, [])) for row in latest(rows)]
        return SeriesList(sorted(rows, key=lambda row: row.upcoming[0]), pending)

    def controls(self) -> list[ControlRow]:
        """Every target control in force (read from the controls topic, as
        ``kdelay target list`` reads it), with the due records each holds back: from
        the summary when kept current, else from the view. ``ControlsUnavailable``
        when the topic cannot be read."""
        found = controls.read_controls(self._settings)
        if not found:
            return []
        if self._snapshots is not None:
            held = self._snapshots.summary().held_back(self._clock.now_ms(), found)
        else:
            with self._opened() as (view, originals, now_ms):
                held = held_back(view, originals, now_ms, found)
        return [ControlRow(subject, control, held.get(subject, HeldBack()))
                for subject, control in sorted(found.items(), key=lambda item: str(item[0]))]

    def _series_runs(self) -> dict[str, list[SeriesRun]]:
        """Each series' recent runs: its occurrences among the newest deliveries to the
        worker topics, newest first, at most :data:`RUNS_SHOWN` a series."""
        read = tails.newest(self._settings.client_config(),
                            [recurring.SERIES_TOPIC, TASKS_TOPIC], self._series_run,
                            per_partition=deliveries.PER_PARTITION, budget=deliveries.BUDGET,
                            purpose="series-runs")
        runs: dict[str, list[SeriesRun]] = {}
        for schedule_id, run in read.items:
            runs.setdefault(schedule_id, []).append(run)
        return {schedule_id: sorted(found, key=lambda run: (run.n, run.delivered_ms),
                                    reverse=True)[:RUNS_SHOWN]
                for schedule_id, found in runs.items()}

    def is_pending(self, schedule_id: str, lane: str | None = None) -> bool:
        """Whether the view holds a pending entry for ``schedule_id`` in ``lane`` (None:
        of no lane)."""
        with self._opened() as (view, _, _):
            return view.find_id(schedule_id, lane) is not None

    def record(self, reference: str, *, show_payload: bool, lane: str | None = None) -> Record:
        """One request by id or coordinates, with its trace; the payload only when
        ``show_payload``. An id is looked up in ``lane`` when given, else as ``kdelay
        show`` does: of no lane first, then in each configured lane. Raises
        :class:`~kdelay.view.lookup.NotARequest` for coordinates on another topic."""
        lanes = [lane] if lane is not None else [None, *self._settings.lanes]
        with self._opened() as (view, originals, now_ms):
            found = lookup(view, originals, reference, self._settings.requests_topic, now_ms,
                           lanes, self._settings.levels)
            ended = _ended(view, originals, found, reference, lanes)
        if ended is not None and ended.state.ended_ms is not None:
            found = replace(found, status=f"{ended.state.end.word} at "
                            f"{utc(ended.state.ended_ms)}, as the service recorded the id's "
                            "end (the trace says more)")
        record = None if found.original is None else found.original.record
        headers = [] if record is None else [
            (name, self._redact.header(
                name, "null" if value is None else value.decode("utf-8", "replace")))
            for name, value in headers_of(record)]
        value = None if record is None else record.value()
        payload = preview(value, self._redact) if value is not None and show_payload else None
        return Record(found, now_ms, headers, payload, value is not None and not show_payload,
                      self._expires_ms(found), self._trace(found, reference, lane, ended))

    def _expires_ms(self, found: Lookup) -> int | None:
        if found.pending is None:
            return None
        retention = requests_retention(self._settings.client_config(),
                                       self._settings.requests_topic, timeout=10.0)
        return None if retention is None else found.pending.record_ms + retention

    def _trace(self, found: Lookup, reference: str, lane: str | None,
               ended: Ended | None = None) -> list[Step]:
        """The request and scheduled steps from the view, then the outcomes and the audit
        of the id in its lane (the pending entry's; else ``lane``), and how an ended
        schedule ended (``ended``)."""
        steps: list[Step] = []
        if ended is not None:
            lane = ended.lane
            steps += end_steps(self._settings, ended)
        if found.pending is not None and found.coordinates is not None:
            where = "{}/{}/{}".format(self._settings.requests_topic, *found.coordinates)
            steps.append(Step(found.pending.record_ms, "requested", f"written at {where}"))
            steps.append(Step(found.pending.record_ms, "pending",
                              f"due at {utc(found.pending.due_ms)}"))
        schedule_id = found.pending.schedule_id if found.pending is not None else None
        if schedule_id is not None and found.pending is not None:
            lane = found.pending.lane
        if schedule_id is None and found.coordinates is None:
            schedule_id = reference
        if schedule_id is not None:
            steps += outcome_steps(self._settings, schedule_id, lane)
            steps += audit_steps(self._settings, self._audit_topic, schedule_id, lane)
        return sorted(steps, key=lambda step: step.at_ms)


def _ended(view: PendingView, originals: Originals, found: Lookup, reference: str,
           lanes: list[str | None]) -> Ended | None:
    """The end of the schedule of the id ``reference`` (in the first of ``lanes`` that
    knows one), when nothing is pending under it; None otherwise."""
    if found.pending is not None or found.coordinates is not None:
        return None
    for lane in lanes:
        state = view.ended_id(reference, lane)
        if state is None:
            continue
        request = None
        if state.first_key is not None:
            _, partition, offset = codec.decode_due_key(state.first_key)
            read = originals.read_raw(partition, offset)
            request = read if isinstance(read, Message) else None
        return Ended(lane, state, request)
    return None


def _series_row(record: Message | None, topic: str, now_ms: int) -> SeriesRow | None:
    """The series a pending occurrence's record belongs to; None for a record of no series
    (a one-off task) or with an unreadable series header."""
    if record is None:
        return None
    try:
        series = recurring.series_of(record.headers())
    except recurring.SeriesError:
        return None
    due_ms = recurring.due_of(record.headers())
    if series is None or due_ms is None:
        return None
    return SeriesRow(series.schedule_id, series.spec.text(), series.n, series.count,
                     series.until_ms, series.target or topic,
                     recurring.upcoming(series, due_ms, now_ms))
