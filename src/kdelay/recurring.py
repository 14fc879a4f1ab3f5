"""Recurring schedules: a fixed interval or a cron expression with a time zone.

A series is one kdelay request at a time. Every occurrence is a request due at
the occurrence's instant, under the series id (``kdelay-id``; see
:func:`occurrence_id` for even occurrences), carrying the
``kdelay.series`` header: a JSON object with the series' spec, its start, its
end (``until`` ms, ``count``) and the occurrence number ``n``. The occurrence is
delivered to a worker (``kdelay worker``): a task occurrence to the tasks topic,
where the task runs; a plain record to the series topic, where the series
driver forwards it to its real target. Before the worker commits the
occurrence it schedules the next one (same id, ``n + 1``), acknowledged first,
or in the same transaction as the commit under exactly-once. A crash before
the commit re-reads the occurrence; no occurrence is lost and, under
exactly-once, none is scheduled twice. Under at-least-once the re-written next
occurrence is dropped by kdelay as a duplicate while the first copy is
pending; a restart slower than the interval can run an occurrence twice.

Cancel. ``kdelay cancel ID`` alone can race an occurrence being handled: the
service answers ``already-delivered`` and the worker then schedules the next
one. So :func:`cancel` first writes a marker (key = id, value = cancel time ms)
to the compacted series-cancels topic, waits for its acknowledgement, and only
then sends the kdelay cancel. A worker, after its next occurrences are
acknowledged and before it commits, reads the cancels topic up to its end and
cancels (through kdelay) every series it just continued that has a marker.
Either the worker sees the marker, or the marker was written after the next
occurrence, so the kdelay cancel (sent after the marker) lands behind it on the
same request partition and cancels it; an occurrence delivered anyway is
dropped by the worker, which knows the marker by then. A marker ends the series
that started before it; a new series may reuse the id later.

An occurrence is a new request under an id the series reuses: the service,
which answers any other request repeating an id whose schedule ended as a
duplicate (for the id window), schedules a request carrying ``kdelay.series``
under such an id.

Two ids. The service marks an id delivered only when it settles the delivery
report, so a worker quick enough to schedule the next occurrence under the very
id of the one it is handling could see it refused as a duplicate. Odd
occurrences therefore use the series id and even ones the id plus ``~``
(:func:`occurrence_id`): the next occurrence never meets its predecessor, while
a re-handled occurrence (after a crash) still meets the copy it wrote before
and is deduplicated by kdelay.

Time zones and daylight saving follow croniter: a local time skipped by a
spring-forward change fires at the first instant after the gap (02:30 on the
change day fires at 03:00 new time); a local time repeated by a fall-back
change fires at both instants (02:30 +02:00 and 02:30 +01:00). Missed instants
(a worker down for a while) are not replayed: a late occurrence runs once and
the next is the first instant after the time it ran, like cron.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import orjson
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)
from croniter import CroniterBadCronError, croniter

from kdelay.client import Coordinates, DelayProducer, DeliveryError, Ticket, UserHeaders
from kdelay.errors import KdelayError
from kdelay.plumbing.callbacks import guarded
from kdelay.plumbing.clients import reader_config
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import LayoutError
from kdelay.protocol import envelope
from kdelay.protocol.durations import duration_text, parse_duration_ms
from kdelay.protocol.envelope import AnyHeaders
from kdelay.retry import SERIES

SERIES_TOPIC = "kdelay.series"
CANCELS_TOPIC = "kdelay.series.cancels"


class SeriesError(KdelayError, ValueError):
    """A series that cannot be built or read; ``code`` is stable (``bad-series``)."""

    code = "bad-series"


@dataclass(frozen=True, slots=True)
class Every:
    """Every ``interval_ms``, on a grid anchored at ``anchor_ms`` (the first occurrence)."""

    interval_ms: int
    anchor_ms: int

    def after(self, time_ms: int) -> int:
        """The first grid instant strictly after ``time_ms``."""
        if time_ms < self.anchor_ms:
            return self.anchor_ms
        steps = (time_ms - self.anchor_ms) // self.interval_ms + 1
        return self.anchor_ms + steps * self.interval_ms

    def text(self) -> str:
        """How ``kdelay show`` prints the spec."""
        return f"every {duration_text(self.interval_ms)}"


@dataclass(frozen=True, slots=True)
class Cron:
    """A five-field cron expression in the IANA time zone ``tz``."""

    expression: str
    tz: str

    def after(self, time_ms: int) -> int:
        """The first instant strictly after ``time_ms`` the expression matches in ``tz``."""
        start = datetime.fromtimestamp(time_ms / 1000, tz=ZoneInfo(self.tz))
        found = croniter(self.expression, start).get_next(datetime)
        return math.floor(found.timestamp() * 1000)

    def text(self) -> str:
        """How ``kdelay show`` prints the spec."""
        return f"cron {self.expression!r} in {self.tz}"


Spec = Every | Cron


def every(interval: str | int, anchor_ms: int) -> Every:
    """An interval spec from ``"5m"`` (or ms); SeriesError unless it is at least 1 ms."""
    try:
        interval_ms = parse_duration_ms(interval) if isinstance(interval, str) else interval
    except ValueError as exc:
        raise SeriesError(str(exc)) from None
    if interval_ms < 1:
        raise SeriesError(f"an interval must be at least 1 ms, got {interval!r}")
    return Every(interval_ms, anchor_ms)


def cron(expression: str, tz: str = "UTC") -> Cron:
    """A cron spec; SeriesError for a bad expression or an unknown time zone."""
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise SeriesError(f"unknown time zone {tz!r}; use an IANA name such as Europe/Paris")\
            from None
    if len(expression.split()) != 5:
        raise SeriesError(f"cron expression {expression!r} must have five fields")
    try:
        croniter(expression)
    except CroniterBadCronError as exc:
        raise SeriesError(f"bad cron expression {expression!r}: {exc}") from None
    return Cron(expression, tz)


@dataclass(frozen=True, slots=True)
class Series:
    """One series as its ``kdelay.series`` header holds it.

    ``n`` is the number of the occurrence this header travels with (1 first).
    ``target`` and ``partition`` say where a plain record goes; both are None
    for a task series, which runs where it is delivered. ``start_ms`` is when
    the series was made: a cancel marker ends it only if written later.
    """

    schedule_id: str
    spec: Spec
    start_ms: int
    n: int = 1
    until_ms: int | None = None
    count: int | None = None
    target: str | None = None
    partition: int | None = None

    def following(self, due_ms: int, now_ms: int) -> int | None:
        """Due time of occurrence ``n + 1``, handled at ``now_ms``; None when the series ends."""
        if self.count is not None and self.n >= self.count:
            return None
        next_ms = self.spec.after(max(due_ms, now_ms))
        if self.until_ms is not None and next_ms > self.until_ms:
            return None
        return next_ms

    def encode(self) -> bytes:
        """The ``kdelay.series`` header value (JSON)."""
        body: dict[str, Any] = {"id": self.schedule_id, "start": self.start_ms, "n": self.n}
        if isinstance(self.spec, Every):
            body |= {"every": self.spec.interval_ms, "anchor": self.spec.anchor_ms}
        else:
            body |= {"cron": self.spec.expression, "tz": self.spec.tz}
        optional = {"until": self.until_ms, "count": self.count, "target": self.target,
                    "partition": self.partition}
        body |= {name: value for name, value in optional.items() if value is not None}
        return orjson.dumps(body)


def decode(raw: bytes | str) -> Series:
    """Read a ``kdelay.series`` header value; SeriesError when it is not a valid series."""
    try:
        body = orjson.loads(raw)
        spec: Spec = every(body["every"], body["anchor"]) if "every" in body \
            else cron(body["cron"], body["tz"])
        return Series(str(body["id"]), spec, int(body["start"]), int(body["n"]),
                      _int_or_none(body.get("until")), _int_or_none(body.get("count")),
                      body.get("target"), _int_or_none(body.get("partition")))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SeriesError(f"not a series header: {exc}") from None


def _int_or_none(value: object) -> int | None:
    """``int(value)``, or None for None."""
    return None if value is None else int(str(value))


def pairs(headers: AnyHeaders) -> list[tuple[str, envelope.HeaderValue]]:
    """Headers as (name, value) pairs, whichever form they come in."""
    if headers is None:
        return []
    return list(headers.items() if isinstance(headers, Mapping) else headers)


def header_value(headers: AnyHeaders, name: str) -> bytes | None:
    """The last value of header ``name`` as bytes, or None."""
    found = None
    for key, value in pairs(headers):
        if key == name:
            found = value.encode() if isinstance(value, str) else value
    return found


def series_of(headers: AnyHeaders) -> Series | None:
    """The series a record belongs to, None for a record of no series; SeriesError if unreadable."""
    raw = header_value(headers, SERIES)
    return None if raw is None else decode(raw)


def due_of(headers: AnyHeaders) -> int | None:
    """The ``kdelay-due-ms`` of a request or delivered record (None when absent or unreadable)."""
    raw = header_value(headers, envelope.DUE_MS)
    return int(raw) if raw is not None and raw.isdigit() else None


@dataclass(frozen=True, slots=True)
class Description:
    """What ``kdelay show`` reports about a series from its pending request.

    ``pending_due_ms`` is the due time of the pending occurrence ``n``;
    ``next_due_ms`` the one after it (None when the series ends with ``n``).
    """

    schedule_id: str
    spec: str
    n: int
    pending_due_ms: int
    next_due_ms: int | None
    until_ms: int | None
    count: int | None
    target: str | None


def describe(headers: AnyHeaders, now_ms: int) -> Description | None:
    """Describe the series of a pending request from its headers, as seen at ``now_ms``.

    Returns None for a request that is no series occurrence (no
    ``kdelay.series`` header or no ``kdelay-due-ms``). The next occurrence is
    the one the worker will schedule when it handles the pending one no
    earlier than ``now_ms``. Raises SeriesError for an unreadable series header.
    """
    series = series_of(headers)
    due_ms = due_of(headers)
    if series is None or due_ms is None:
        return None
    return Description(series.schedule_id, series.spec.text(), series.n, due_ms,
                       series.following(due_ms, now_ms), series.until_ms, series.count,
                       series.target)


def upcoming(series: Series, due_ms: int, now_ms: int, count: int = 5) -> list[int]:
    """The due times of the pending occurrence (due at ``due_ms``) and of those after it,
    ``count`` at most, as the worker will schedule them if it handles each on time; fewer
    when the series ends sooner (its ``count`` or ``until``)."""
    times = [due_ms]
    current = series
    while len(times) < count:
        following = current.following(times[-1], now_ms)
        if following is None:
            break
        times.append(following)
        current = next_occurrence(current)
    return times


def occurrence_headers(headers: AnyHeaders, series: Series) -> list[tuple[str, bytes | None]]:
    """User headers for an occurrence request: the record's own, then ``kdelay.series``."""
    kept = [(n, v.encode() if isinstance(v, str) else v)
            for n, v in envelope.user_headers(headers) if n != SERIES]
    return [*kept, (SERIES, series.encode())]


def start(
    producer: DelayProducer, target: str, value: bytes | str | None, spec: Spec, *,
    schedule_id: str, now_ms: int, key: bytes | str | None = None,
    headers: UserHeaders | None = None, until_ms: int | None = None,
    count: int | None = None, series_topic: str = SERIES_TOPIC, task: bool = False,
) -> tuple[Coordinates, int]:
    """Send the first occurrence of a series; return its coordinates and due time.

    A plain record series goes through ``series_topic`` (the driver forwards
    each occurrence to ``target``); a task series (``task=True``) is delivered
    to ``target``, the tasks topic, itself. Raises SeriesError when the series
    would have no occurrence (``count`` < 1, ``until_ms`` before the first).
    """
    if count is not None and count < 1:
        raise SeriesError(f"count must be at least 1, got {count}")
    first_ms = spec.after(now_ms) if isinstance(spec, Cron) else spec.anchor_ms
    if until_ms is not None and first_ms > until_ms:
        raise SeriesError(f"the first occurrence ({first_ms}) is after until ({until_ms})")
    series = Series(schedule_id, spec, now_ms, 1, until_ms, count,
                    None if task else target)
    coordinates = producer.send(target if task else series_topic, value, key=key,
                                headers=occurrence_headers(headers, series), due=first_ms,
                                id=schedule_id)
    return coordinates, first_ms


def occurrence_id(schedule_id: str, n: int) -> str:
    """The kdelay id of occurrence ``n``: the series id when odd, the id plus ``~`` when even."""
    return schedule_id if n % 2 else f"{schedule_id}~"


def occurrence_ids(schedule_id: str) -> tuple[str, str]:
    """Both kdelay ids a series' pending occurrence may have (for ``kdelay show``)."""
    return schedule_id, occurrence_id(schedule_id, 2)


def next_occurrence(series: Series) -> Series:
    """The series header of the occurrence after ``series``'s."""
    return replace(series, n=series.n + 1)


def write_marker(settings: Settings, schedule_id: str, now_ms: int,
                 cancels_topic: str = CANCELS_TOPIC, timeout_s: float = 30.0) -> bool:
    """Write the cancel marker of ``schedule_id``; False when the cancels topic does not exist.

    Without that topic no worker drives series, so there is nothing to mark.
    Raises DeliveryError when the marker is not acknowledged.
    """
    producer = Producer(settings.client_config(**{"enable.idempotence": True,
                                                  "allow.auto.create.topics": False}))
    metadata = producer.list_topics(cancels_topic, timeout=timeout_s).topics.get(cancels_topic)
    if metadata is None or metadata.error is not None:
        return False
    failures: list[DeliveryError] = []

    def on_delivery(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            failures.append(DeliveryError(error, cancels_topic))

    producer.produce(cancels_topic, str(now_ms).encode(), schedule_id.encode(),
                     on_delivery=guarded(on_delivery))
    if producer.flush(timeout_s) or failures:
        raise failures[0] if failures else TimeoutError("the cancel marker was not acknowledged")
    return True


def cancel(settings: Settings, producer: DelayProducer, schedule_id: str, now_ms: int,
           cancels_topic: str = CANCELS_TOPIC) -> Ticket:
    """End the series (or plain schedule) ``schedule_id``: marker first, then the kdelay cancels.

    Returns the ticket of the cancel of ``schedule_id``. When the cancels
    topic exists the even occurrences' id is cancelled too. See the module
    docstring for why the order matters.
    """
    if write_marker(settings, schedule_id, now_ms, cancels_topic):
        producer.cancel(occurrence_id(schedule_id, 2))
    return producer.cancel(schedule_id)


class Cancels:
    """The cancel markers, read from the whole compacted cancels topic.

    :meth:`catch_up` reads up to the high watermark of every partition as it
    is when called, so a marker acknowledged before the call is known after it.
    """

    def __init__(self, settings: Settings, topic: str = CANCELS_TOPIC,
                 timeout_s: float = 30.0) -> None:
        """Assign every partition from the beginning; LayoutError when the topic is missing."""
        self._consumer = Consumer(reader_config(
            settings.client_config(), f"kdelay-cancels-reader-{id(self)}",
            **{"enable.partition.eof": False}))
        metadata = self._consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise LayoutError("topic-missing", f"series cancels topic {topic} does not exist: "
                              "run `kdelay worker --create-topics`")
        self._partitions = [TopicPartition(topic, p, OFFSET_BEGINNING)
                            for p in metadata.partitions]
        self._consumer.assign(self._partitions)
        self._timeout_s = timeout_s
        self._cancelled: dict[str, int] = {}
        self._lock = threading.Lock()

    def catch_up(self) -> None:
        """Read every marker written before this call; TimeoutError if that takes too long."""
        deadline = time.monotonic() + self._timeout_s
        for tp in self._partitions:
            low, high = self._consumer.get_watermark_offsets(tp, timeout=self._timeout_s,
                                                             cached=False)
            while high > low and self._position(tp.partition) < high:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cancel markers not read within {self._timeout_s} s")
                for message in self._consumer.consume(500, timeout=0.1):
                    self._apply(message)

    def _position(self, partition: int) -> int:
        """The consumer's next offset on ``partition`` (negative before the first fetch)."""
        topic = self._partitions[0].topic
        offset: int = self._consumer.position([TopicPartition(topic, partition)])[0].offset
        return offset

    def _apply(self, message: Message) -> None:
        """Remember a marker; a tombstone forgets one."""
        if message.error() is not None:
            return
        key, value = message.key(), message.value()
        if key is None:
            return
        schedule_id = key.decode("utf-8", "replace")
        with self._lock:
            if value is None:
                self._cancelled.pop(schedule_id, None)
            elif value.isdigit():
                self._cancelled[schedule_id] = max(int(value), self._cancelled.get(schedule_id, 0))

    def ends(self, series: Series) -> bool:
        """Whether a known marker ends ``series`` (one written no earlier than its start)."""
        with self._lock:
            cancelled_ms = self._cancelled.get(series.schedule_id)
        return cancelled_ms is not None and cancelled_ms >= series.start_ms

    def close(self) -> None:
        """Release the consumer."""
        self._consumer.close()


def spec_of(every_text: str | None, cron_text: str | None, tz: str, now_ms: int) -> Spec:
    """The spec ``--every`` or ``--cron`` (exactly one) gives; SeriesError otherwise.

    An interval series starts one interval after ``now_ms``.
    """
    if (every_text is None) == (cron_text is None):
        raise SeriesError("give exactly one of --every and --cron")
    if every_text is not None:
        interval = every(every_text, now_ms)
        return Every(interval.interval_ms, now_ms + interval.interval_ms)
    return cron(str(cron_text), tz)


def send_series(
    settings: Settings, target: str, value: bytes | str | None, spec: Spec, *,
    schedule_id: str, now_ms: int, key: bytes | str | None = None,
    headers: UserHeaders | None = None, until_ms: int | None = None, count: int | None = None,
    series_topic: str = SERIES_TOPIC,
) -> tuple[Coordinates, int]:
    """Start a plain record series with a producer of its own (``kdelay send --every``)."""
    with DelayProducer(settings) as producer:
        return start(producer, target, value, spec, schedule_id=schedule_id, now_ms=now_ms,
                     key=key, headers=headers, until_ms=until_ms, count=count,
                     series_topic=series_topic)
