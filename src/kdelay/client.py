"""The client library: send records through kdelay, cancel them, learn their outcomes.

A :class:`DelayProducer` writes the real record once, to the requests topic,
with the ``kdelay-*`` headers that tell the service where and when to deliver
it; nothing is sent to the target until then. Records that carry a schedule id
are placed on the request partition chosen by :func:`id_partition` (of the id
alone, whatever the lane: the service looks for the id there), so a cancel for
that id lands on the same partition as the schedule it cancels. An id is unique
within its lane: a producer's cancels and reschedules name its lane, and reach
only that lane's schedules.

A request the service would dead-letter for its due time (``delay-too-long``:
later than the requests topic's retention allows, or an unknown level) is
refused before it is written, with :class:`RequestRefused` and the same code.

:meth:`DelayProducer.cancel` and :meth:`DelayProducer.schedule` return a
:class:`Ticket`, whose :meth:`Ticket.outcome` waits for the service's
outcome record of that request (see :mod:`kdelay.outcomes`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import NamedTuple, Self, TypeAlias

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kdelay.errors import KdelayError
from kdelay.outcomes import Mark, NoOutcome, Tracker
from kdelay.plumbing.callbacks import guarded
from kdelay.plumbing.clients import produce
from kdelay.plumbing.clock import Clock, SystemClock
from kdelay.plumbing.connection import check_connection
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import LayoutError, requests_retention
from kdelay.protocol import durations, envelope
from kdelay.protocol.envelope import Headers, HeaderValue
from kdelay.protocol.forward import id_partition as id_partition
from kdelay.protocol.idkeys import Answer

UserHeaders: TypeAlias = Mapping[str, HeaderValue] | Sequence[tuple[str, HeaderValue]]
"""User headers, as a mapping or as (name, value) pairs; str values are UTF-8 encoded."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)
_PRODUCER_CONFIG: Mapping[str, str | int | bool] = {
    "enable.idempotence": True,
    # A metadata request must never create the requests topic with broker defaults.
    "allow.auto.create.topics": False,
}


class Coordinates(NamedTuple):
    """Where a request was written; ``str()`` gives ``topic/partition/offset``."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        """Format as ``kdelay-origin`` does: ``topic/partition/offset``."""
        return f"{self.topic}/{self.partition}/{self.offset}"


class Ticket:
    """A request with an id, written: where (:attr:`coordinates`), and its outcome to come.

    ``str()`` gives the coordinates, as for a plain send.
    """

    def __init__(self, coordinates: Coordinates, schedule_id: str, mark: Mark | NoOutcome,
                 reader: Callable[[], Tracker], lane: str | None = None) -> None:
        self.coordinates = coordinates
        self.schedule_id = schedule_id
        self.lane = lane
        self._mark = mark
        self._reader = reader

    def __str__(self) -> str:
        """The request's ``topic/partition/offset``."""
        return str(self.coordinates)

    def __repr__(self) -> str:
        return f"Ticket({self.schedule_id!r}, {self.coordinates})"

    def outcome(self, timeout: float = 30.0) -> Answer:
        """Wait up to ``timeout`` seconds for the service's outcome of this request.

        ``answer.outcome`` is ``scheduled`` or ``duplicate`` for a schedule,
        ``cancelled``, ``unknown``, ``already-delivered`` or ``dead-lettered``
        for a cancel. Raises :class:`~kdelay.outcomes.NoOutcome`
        (``outcomes-missing``, ``no-outcome``) when there is none to read.
        """
        if isinstance(self._mark, NoOutcome):
            raise self._mark
        with self._reader() as tracker:  # its own: the ticket may outlive its producer
            return tracker.wait(self.schedule_id, str(self.coordinates), self._mark, timeout,
                                self.lane)


class DeliveryError(KdelayError):
    """A request was not written to the requests topic; ``error`` is Kafka's reason."""

    code = "delivery-failed"

    def __init__(self, error: KafkaError, topic: str) -> None:
        super().__init__(f"a request to {topic} was not written: {error.str()} ({error.name()})")
        self.error = error


class RequestRefused(KdelayError, ValueError):
    """The service would dead-letter this request; ``code`` is the ``kdelay-error`` it would
    carry (``delay-too-long``, ``unknown-level``), and nothing was written."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


def delay_ms(delay: timedelta | int) -> int:
    """A relative delay in whole milliseconds (sub-millisecond parts are dropped).

    Raises ValueError for a negative delay, TypeError for a bool or other type.
    """
    if isinstance(delay, timedelta):
        millis = delay // _ONE_MS
    elif isinstance(delay, int) and not isinstance(delay, bool):
        millis = delay
    else:
        raise TypeError(f"delay must be a timedelta or milliseconds, got {delay!r}")
    if millis < 0:
        raise ValueError(f"delay must not be negative, got {delay!r}")
    return millis


def due_ms(due: datetime | int) -> int:
    """An absolute due time in milliseconds since the epoch.

    A datetime must be timezone-aware: a naive one raises ValueError, since
    guessing the zone would shift the due time by hours. A negative epoch time
    raises ValueError; a bool or other type raises TypeError.
    """
    if isinstance(due, datetime):
        if due.utcoffset() is None:
            raise ValueError(
                f"due time {due.isoformat()} has no timezone; give an aware time "
                f"such as {due.isoformat()}+00:00"
            )
        millis = (due - _EPOCH) // _ONE_MS
    elif isinstance(due, int) and not isinstance(due, bool):
        millis = due
    else:
        raise TypeError(f"due must be an aware datetime or epoch milliseconds, got {due!r}")
    if millis < 0:
        raise ValueError(f"due must not be before the Unix epoch, got {due!r}")
    return millis


def parse_due(text: str) -> int:
    """Parse a due time given as epoch milliseconds or ISO-8601 with a timezone.

    ``"1767225600000"``, ``"2026-01-01T00:00:00Z"`` and
    ``"2026-01-01T01:00:00+01:00"`` are the same instant. Raises ValueError for
    anything else, including an ISO time without a timezone.
    """
    stripped = text.strip()
    if stripped.isdigit():
        return int(stripped)
    try:
        parsed = datetime.fromisoformat(stripped)
    except ValueError:
        raise ValueError(
            f"not a due time: {text!r}; expected epoch milliseconds or ISO-8601 "
            "with a timezone, such as 2026-01-01T09:00:00+01:00"
        ) from None
    return due_ms(parsed)


def parse_header(text: str) -> tuple[str, str]:
    """Split ``"name=value"`` at the first ``=``; ValueError without one or a name."""
    name, separator, value = text.partition("=")
    if not separator or not name:
        raise ValueError(f"not a header: {text!r}; expected name=value")
    return name, value


def request_headers(
    target: str,
    headers: UserHeaders | None = None,
    *,
    delay: timedelta | int | None = None,
    due: datetime | int | None = None,
    level: int | None = None,
    partition: int | None = None,
    schedule_id: str | None = None,
    lane: str | None = None,
) -> Headers:
    """The headers of a schedule request: the user's, then the ``kdelay-*`` envelope.

    Raises ValueError unless exactly one of ``delay``, ``due`` and ``level`` is
    given, for a user header named ``kdelay-*`` (any case: the prefix is
    reserved), and for anything the envelope rejects (bad topic name, level
    below 1, negative partition, empty id, a ``lane`` that is not a lane name).
    """
    given = [name for name, value in (("delay", delay), ("due", due), ("level", level))
             if value is not None]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of delay, due and level, got {' and '.join(given) or 'none'}"
        )
    if isinstance(level, bool):
        raise TypeError("level must be an int, got a bool")
    envelope_headers = envelope.schedule_headers(
        target,
        due_ms=due_ms(due) if due is not None else None,
        delay_ms=delay_ms(delay) if delay is not None else None,
        level=level,
        partition=partition,
        schedule_id=schedule_id,
        lane=lane,
    )
    return [*_user_headers(headers), *envelope_headers]


def _user_headers(headers: UserHeaders | None) -> Headers:
    """Normalise user headers to (name, bytes) pairs, rejecting reserved names."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    result: Headers = []
    for name, value in pairs:
        if name.lower().startswith(envelope.PREFIX):
            raise ValueError(f"header {name!r}: names starting with kdelay- are reserved")
        result.append((name, value.encode("utf-8") if isinstance(value, str) else value))
    return result


def _encode(data: bytes | str | None) -> bytes | None:
    """Keys and values: str is UTF-8 encoded, bytes and None pass through."""
    return data.encode("utf-8") if isinstance(data, str) else data


class DelayProducer:
    """Writes delay requests and cancels to the requests topic.

    Lazy: constructing one touches no network; the producer and the requests
    topic's partition count (fetched once, then cached) come with the first
    send. Idempotence is always on and topics are never auto-created.

    Every record has a delivery callback. The first delivery error of an
    asynchronous send is latched and raised by the next ``send``,
    ``send_async``, ``cancel``, ``flush`` or ``close`` (once); a synchronous
    :meth:`send` or :meth:`cancel` raises its own record's error directly.
    Thread-safe, like the librdkafka producer it wraps.
    """

    def __init__(
        self,
        source: Settings | Mapping[str, str | int | bool],
        *,
        requests_topic: str | None = None,
        metadata_timeout: float = 10.0,
        clock: Clock | None = None,
        lane: str | None = None,
    ) -> None:
        """Configure from :class:`Settings`, or from a librdkafka config dict.

        ``requests_topic`` defaults to the settings' (or ``kdelay.requests``
        for a config dict); the level table and the retention margin are the
        settings' (the defaults for a config dict), as the service reads them.
        ``metadata_timeout`` bounds the one partition-count lookup and the one
        retention lookup. ``clock`` (the system clock by default) is "now" for
        the retention check. ``lane`` names the lane of every request this
        producer sends (``kdelay-lane``): a service run with ``--lanes`` then
        delivers them only to that lane's topics. Raises ValueError for a
        ``lane`` that is not a lane name.
        """
        if lane is not None and envelope.LANE_NAME.fullmatch(lane) is None:
            raise ValueError(f"{lane!r} is not a lane name (a letter or digit, then up to 63 "
                             "of A-Z a-z 0-9 . _ -)")
        self._lane = lane
        base = source.client_config("producer") if isinstance(source, Settings) else dict(source)
        settings = source if isinstance(source, Settings) else Settings()
        self._config = {**base, **_PRODUCER_CONFIG}
        self._admin_config = dict(base)
        self._topic = requests_topic or settings.requests_topic
        self._outcomes_topic = settings.outcomes_topic
        self._tracker: Tracker | None = None
        self._levels = settings.levels
        self._margin_ms = settings.retention_margin_ms
        self._clock = clock or SystemClock()
        self._limits: durations.Limits | None = None
        self._metadata_timeout = metadata_timeout
        self._lock = threading.Lock()
        self._producer: Producer | None = None
        self._partitions: int | None = None
        self._error: DeliveryError | None = None
        self._closed = False

    @property
    def requests_topic(self) -> str:
        """The topic requests are written to."""
        return self._topic

    @property
    def lane(self) -> str | None:
        """The lane every request names, or None."""
        return self._lane

    def send(
        self,
        target: str,
        value: bytes | str | None,
        *,
        key: bytes | str | None = None,
        headers: UserHeaders | None = None,
        delay: timedelta | int | None = None,
        due: datetime | int | None = None,
        level: int | None = None,
        partition: int | None = None,
        id: str | None = None,
        lane: str | None = None,
    ) -> Coordinates:
        """Send ``value`` to ``target`` later; wait for the write and return its coordinates.

        ``delay`` (timedelta or ms) counts from the record's timestamp, ``due``
        is an aware datetime or epoch ms, ``level`` a 1-based delay level:
        exactly one. ``partition`` is the target partition (else the target's
        partitioner places ``key``). ``id`` names the schedule, for dedupe and
        :meth:`cancel`. ``lane`` is the request's lane, the producer's when
        None. Raises ValueError/TypeError for bad arguments (before
        any network), :class:`LayoutError` ``requests-missing`` when the
        requests topic does not exist, :class:`DeliveryError` when the write
        fails. Waits as long as librdkafka's ``delivery.timeout.ms``.
        """
        future = self.send_async(target, value, key=key, headers=headers, delay=delay, due=due,
                                 level=level, partition=partition, id=id, lane=lane)
        return self._wait(future)

    def send_async(
        self,
        target: str,
        value: bytes | str | None,
        *,
        key: bytes | str | None = None,
        headers: UserHeaders | None = None,
        delay: timedelta | int | None = None,
        due: datetime | int | None = None,
        level: int | None = None,
        partition: int | None = None,
        id: str | None = None,
        lane: str | None = None,
    ) -> Future[Coordinates]:
        """Like :meth:`send`, but return a future of the coordinates at once.

        The future completes when a later ``send*``, :meth:`poll`,
        :meth:`flush` or :meth:`close` serves the delivery report; it fails
        with :class:`DeliveryError`. Argument errors raise here, not in the
        future.
        """
        record_headers = request_headers(target, headers, delay=delay, due=due, level=level,
                                         partition=partition, schedule_id=id,
                                         lane=lane or self._lane)
        self._check_due(record_headers)
        return self._produce(_encode(value), _encode(key), record_headers, id)

    def schedule(
        self,
        target: str,
        value: bytes | str | None,
        *,
        id: str,
        key: bytes | str | None = None,
        headers: UserHeaders | None = None,
        delay: timedelta | int | None = None,
        due: datetime | int | None = None,
        level: int | None = None,
        partition: int | None = None,
        lane: str | None = None,
    ) -> Ticket:
        """Like :meth:`send` with an ``id``, but return a :class:`Ticket`: its
        :meth:`~Ticket.outcome` says ``scheduled`` or ``duplicate``."""
        mark = self._mark(id)
        future = self.send_async(target, value, key=key, headers=headers, delay=delay, due=due,
                                 level=level, partition=partition, id=id, lane=lane)
        return Ticket(self._wait(future), id, mark, self._new_tracker, lane or self._lane)

    def resend(self, value: bytes | None, key: bytes | None,
               headers: Headers) -> Ticket | Coordinates:
        """Write a request whose headers are the protocol's already (a dead letter sent
        again, see :mod:`kdelay.view.deadletters`): on its id's partition when it has an
        id, and then return its :class:`Ticket` (its outcome says ``scheduled`` or
        ``duplicate``), else its coordinates."""
        found = dict(headers)
        raw_id, raw_lane = found.get(envelope.SCHEDULE_ID), found.get(envelope.LANE)
        if raw_id is None:
            return self._wait(self._produce(value, key, headers, None))
        schedule_id = _text(raw_id)
        lane = None if raw_lane is None else _text(raw_lane)
        mark = self._mark(schedule_id)
        coordinates = self._wait(self._produce(value, key, headers, schedule_id))
        return Ticket(coordinates, schedule_id, mark, self._new_tracker, lane)

    def cancel(self, id: str, *, lane: str | None = None) -> Ticket:
        """Ask the service to cancel the pending schedule ``id`` of ``lane`` (the
        producer's when None); return a :class:`Ticket`.

        The cancel goes to the same request partition as every schedule with
        this id. An id is unique within its lane: the cancel reaches only its
        lane's schedule. Cancelling an id that is not pending is not an error here:
        the ticket's :meth:`~Ticket.outcome` says ``cancelled``, ``unknown``,
        ``already-delivered`` or ``dead-lettered``. Raises as :meth:`send` does.
        """
        lane = lane or self._lane
        return self._ticket(id, envelope.cancel_headers(id, lane), lane)

    def reschedule(self, id: str, *, delay: timedelta | int | None = None,
                   due: datetime | int | None = None, lane: str | None = None) -> Ticket:
        """Ask the service to move the pending schedule ``id`` of ``lane`` (the producer's
        when None) to a new due time (``delay`` after now, or ``due``; exactly one);
        return the request's :class:`Ticket`.

        Its :meth:`~Ticket.outcome` says ``rescheduled``, ``unknown``,
        ``already-delivered`` or ``dead-lettered``. A due time past the
        requests topic's retention after now raises :class:`RequestRefused`
        (``delay-too-long``) before anything is written; the service also
        refuses one past the retention of the original request.
        """
        if (delay is None) == (due is None):
            raise ValueError("give exactly one of delay and due")
        at_ms = due_ms(due) if due is not None else None
        after_ms = delay_ms(delay) if delay is not None else None
        lane = lane or self._lane
        headers = envelope.reschedule_headers(id, due_ms=at_ms, delay_ms=after_ms, lane=lane)
        self._partition_count(self._ensure_producer())
        now = self._clock.now_ms()
        target_ms = at_ms if at_ms is not None else now + (after_ms or 0)
        bound = self._request_limits().max_due_after_ms
        if bound is not None and target_ms > now + bound:
            raise RequestRefused("delay-too-long", f"due time {target_ms} is past the requests "
                                 f"topic's retention bound ({bound} ms after now)")
        return self._ticket(id, headers, lane)

    def _ticket(self, schedule_id: str, headers: Headers, lane: str | None) -> Ticket:
        """Write a cancel or reschedule of ``schedule_id`` in ``lane`` (value: the id) and
        return its ticket, its outcome's place noted first."""
        mark = self._mark(schedule_id)
        coordinates = self._wait(self._produce(schedule_id.encode("utf-8"), None, headers,
                                               schedule_id))
        return Ticket(coordinates, schedule_id, mark, self._new_tracker, lane)

    def _new_tracker(self) -> Tracker:
        return Tracker(self._admin_config, self._outcomes_topic,
                       metadata_timeout=self._metadata_timeout)

    def _mark(self, schedule_id: str) -> Mark | NoOutcome:
        """Where the outcome of a request about to be written will be (before writing it).

        A producer that may not read the outcomes topic (least-privilege ACLs)
        still writes its request; only its ticket cannot answer.
        """
        self._ensure_producer()  # the connection check, once
        if self._tracker is None:
            self._tracker = self._new_tracker()
        try:
            return self._tracker.mark(schedule_id)
        except NoOutcome as missing:
            return missing
        except KafkaException as exc:
            return NoOutcome("outcomes-unreadable", f"the outcomes topic {self._outcomes_topic} "
                             f"cannot be read: {exc.args[0]}; grant Read on it to wait for "
                             "outcomes")

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery reports for up to ``timeout`` seconds; return how many were served."""
        return self._producer.poll(timeout) if self._producer is not None else 0

    def flush(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` seconds for every outstanding record.

        Raises the latched delivery error if there is one, then TimeoutError
        naming how many records are still undelivered.
        """
        remaining = self._producer.flush(timeout) if self._producer is not None else 0
        self._raise_latched()
        if remaining:
            raise TimeoutError(
                f"{remaining} records to {self._topic} still undelivered after {timeout} s"
            )

    def close(self, timeout: float = 30.0) -> None:
        """Flush (raising as :meth:`flush` does), then release the producer; idempotent."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            self._producer = None
            if self._tracker is not None:
                self._tracker.close()
                self._tracker = None

    def __enter__(self) -> Self:
        """Return self; :meth:`close` runs on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close, flushing outstanding records."""
        self.close()

    def _produce(
        self,
        value: bytes | None,
        key: bytes | None,
        headers: Headers,
        schedule_id: str | None,
    ) -> Future[Coordinates]:
        """Write one request; the id, when given, chooses the partition."""
        self._raise_latched()
        producer = self._ensure_producer()
        count = self._partition_count(producer)
        partition = id_partition(schedule_id, count) if schedule_id is not None else -1
        future: Future[Coordinates] = Future()
        future.set_running_or_notify_cancel()
        on_delivery = guarded(functools.partial(self._on_delivery, future))
        try:
            produce(producer, self._topic, value=value, key=key, partition=partition,
                    on_delivery=on_delivery, headers=headers)
        except KafkaException as exc:
            raise DeliveryError(exc.args[0], self._topic) from None
        producer.poll(0)
        return future

    def _on_delivery(
        self, future: Future[Coordinates], error: KafkaError | None, message: Message
    ) -> None:
        """Complete ``future``; latch the first error so it is never lost."""
        if error is not None:
            failure = DeliveryError(error, self._topic)
            with self._lock:
                self._error = self._error or failure
            future.set_exception(failure)
            return
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        if topic is None or partition is None or offset is None:
            raise RuntimeError(f"a delivery report without coordinates: {message!r}")
        future.set_result(Coordinates(topic, partition, offset))

    def _wait(self, future: Future[Coordinates]) -> Coordinates:
        """Poll until ``future`` completes; raise its error, un-latching it as reported."""
        producer = self._ensure_producer()
        while not future.done():
            producer.poll(0.1)
        failure = future.exception()
        if failure is not None:
            self._unlatch(failure)
            raise failure
        return future.result()

    def _unlatch(self, failure: BaseException) -> None:
        """Forget ``failure`` if it is the latched error: its caller has it now."""
        with self._lock:
            if self._error is failure:
                self._error = None

    def _raise_latched(self) -> None:
        """Raise (once) the first delivery error not yet reported."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _ensure_producer(self) -> Producer:
        """Create the librdkafka producer on first use, once a broker has answered.

        Raises :class:`~kdelay.plumbing.connection.ConnectionFailure` within seconds when
        no broker answers or the credentials are refused.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("this DelayProducer is closed")
            if self._producer is None:
                check_connection(self._config)
                self._producer = Producer(self._config)
            return self._producer

    def _check_due(self, headers: Headers) -> None:
        """Raise :class:`RequestRefused` for a request the service would dead-letter for its
        due time, parsing it as the service does with "now" as its record time.

        The record's own timestamp is taken when it is produced, a little after
        "now", so a request this check passes is never refused by the service
        for its due time; one within milliseconds of the bound may be refused
        here that the service would still have taken.
        """
        self._partition_count(self._ensure_producer())
        parsed = envelope.parse(headers, self._clock.now_ms(), self._request_limits())
        if isinstance(parsed, envelope.Rejection):
            raise RequestRefused(parsed.code, parsed.detail)

    def _request_limits(self) -> durations.Limits:
        """The service's limits for this requests topic, from its ``retention.ms`` (read once).

        A producer not allowed to describe the topic's configuration (a
        least-privilege ACL) gets no retention bound here; the service still
        enforces it.
        """
        if self._limits is None:
            retention_ms = requests_retention(self._admin_config, self._topic,
                                              self._metadata_timeout)
            self._limits = durations.limits_for_retention(retention_ms, self._margin_ms,
                                                         self._levels)
        return self._limits

    def _partition_count(self, producer: Producer) -> int:
        """The requests topic's partition count, looked up once.

        Raises :class:`LayoutError` ``requests-missing`` when the topic does
        not exist; a broker that does not answer within ``metadata_timeout``
        raises KafkaException.
        """
        if self._partitions is None:
            metadata = producer.list_topics(self._topic, timeout=self._metadata_timeout)
            topic = metadata.topics.get(self._topic)
            if topic is None or topic.error is not None or not topic.partitions:
                raise LayoutError(
                    "requests-missing",
                    f"requests topic {self._topic} does not exist: run `kdelay topics create`",
                )
            self._partitions = len(topic.partitions)
        return self._partitions


def _text(value: str | bytes) -> str:
    """A header value as text (bytes as UTF-8)."""
    return value if isinstance(value, str) else value.decode("utf-8", "replace")
