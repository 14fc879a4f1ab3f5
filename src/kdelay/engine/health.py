"""Whether an instance lives and whether it serves: ``/healthz`` and ``/readyz``.

A heartbeat says the loop turns; it does not say the instance serves. A
consumer that stopped fetching keeps the loop turning, and its cached high
watermark stops with it, so the intake lag it shows stays flat while requests
pile up. Three pieces answer the two questions a supervisor asks:

- :class:`HighWatermarks` asks the broker, on a thread of its own and every
  :data:`ASK_EVERY_S`, for the high watermark of each owned request partition
  (each question bounded by :data:`ASK_TIMEOUT_S`). The loop never waits for
  it; an outage costs one log line, and one more when the broker answers again.
  The intake lag gauge is computed from its answers.
- :class:`Health` is what the HTTP endpoints read. The loop beats it every
  step (liveness) and, every housekeeping round, judges readiness from what
  it knows: whether Kafka answers, whether the group assigned partitions and
  none is being restored, whether intake fetches each partition (its position
  advanced since the last round, or the broker's high watermark, asked within
  :data:`ANSWER_FRESH_S`, is no further than it), and whether the changelog
  producer is acknowledged (it held records for :data:`ACK_STALL_S` without a
  confirmed offset moving: not ready).
- :func:`serve` exposes ``/metrics``, ``/healthz`` and ``/readyz`` on one port.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from confluent_kafka import KafkaException, TopicPartition
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from kdelay.engine.factory import ClientFactory
from kdelay.engine.metrics import Metrics
from kdelay.plumbing.clients import Producing, Watermarks
from kdelay.plumbing.clock import Clock
from kdelay.plumbing.settings import Settings

log = logging.getLogger(__name__)

ASK_EVERY_S = 10.0
"""How often the broker is asked for the owned partitions' high watermarks."""
ASK_TIMEOUT_S = 5.0
"""The longest one question for a high watermark waits for the broker."""
ANSWER_FRESH_S = 60.0
"""An answer older than this does not prove intake has caught up."""
ACK_STALL_S = 30.0
"""Records held this long by the changelog producer with no confirmed offset moving:
the producer is not acknowledged."""
LIVE_S = 60.0
"""``/healthz`` fails once the loop has not finished a step for this long (unless it
restores a partition or waits for Kafka, both of which it does by design)."""
JUDGED_S = 30.0
"""``/readyz`` fails once the loop has not judged readiness for this long."""
UNKNOWN = -1001
"""The offset :meth:`HighWatermarks.get_watermark_offsets` returns before an answer."""


@dataclass(frozen=True, slots=True)
class Answer:
    """The broker's low and high watermark of one partition, and when it was asked
    (the service clock's monotonic seconds)."""

    low: int
    high: int
    asked_s: float


class HighWatermarks:
    """The broker's answers for the owned request partitions' watermarks, asked off the loop.

    ``consumer`` builds the group-less consumer the thread asks with (on the
    thread, at its first question). :meth:`want` names the partitions to ask
    for and wakes the thread; :meth:`get_watermark_offsets` returns the last
    answer (``cached`` is ignored: every answer is the broker's), so the
    outlook computes the intake lag from it. Thread-safe.
    """

    def __init__(self, consumer: Callable[[], Watermarks], topic: str, clock: Clock,
                 every_s: float = ASK_EVERY_S, timeout_s: float = ASK_TIMEOUT_S) -> None:
        self._build = consumer
        self._topic = topic
        self._clock = clock
        self._every_s = every_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._wanted: frozenset[int] = frozenset()
        self._answers: dict[int, Answer] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="kdelay-watermarks", daemon=True)

    def start(self) -> None:
        """Start asking (a daemon thread); once only."""
        if self._thread.ident is None:
            self._thread.start()

    def close(self, timeout_s: float = ASK_TIMEOUT_S + 1) -> None:
        """Stop asking; wait up to ``timeout_s`` for the question in flight."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def want(self, partitions: Iterable[int]) -> None:
        """Ask for ``partitions`` from now on (at once when one is new); forget the others."""
        wanted = frozenset(partitions)
        with self._lock:
            new = wanted - self._wanted
            self._wanted = wanted
            self._answers = {p: a for p, a in self._answers.items() if p in wanted}
        if new:
            self._wake.set()

    def answer(self, partition: int) -> Answer | None:
        """The broker's last answer for ``partition``, or None."""
        with self._lock:
            return self._answers.get(partition)

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = True) -> tuple[int, int]:
        """The last answer's ``(low, high)`` for ``partition``; :data:`UNKNOWN` twice before one."""
        found = self.answer(partition.partition)
        return (UNKNOWN, UNKNOWN) if found is None else (found.low, found.high)

    def ask(self, consumer: Watermarks) -> None:
        """Ask the broker once for every wanted partition; stop the round at the first failure
        (the broker is away: the others would each wait out their timeout too)."""
        with self._lock:
            wanted = sorted(self._wanted)
        for partition in wanted:
            asked = self._clock.monotonic()
            try:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(self._topic, partition), timeout=self._timeout_s, cached=False)
            except KafkaException as exc:
                self._failed(exc.args[0].str() if exc.args else str(exc))
                return
            with self._lock:
                if partition in self._wanted:
                    self._answers[partition] = Answer(int(low), int(high), asked)
        if self._failing and wanted:
            self._failing = False
            log.info("the broker answers the requests topic's high watermarks again")

    def _failed(self, why: str) -> None:
        """Say once per outage that the broker does not answer."""
        if not self._failing:
            self._failing = True
            log.warning("the broker does not answer for the high watermarks of %s (%s): "
                        "/readyz reports not ready until it does", self._topic, why)

    def _run(self) -> None:
        consumer: Watermarks | None = None
        try:
            while not self._stop.is_set():
                self._wake.clear()
                try:
                    if consumer is None:
                        consumer = self._build()
                    self.ask(consumer)
                except Exception as exc:  # never end the thread: readiness would freeze
                    self._failed(f"{type(exc).__name__}: {exc}")
                self._wake.wait(self._every_s)
        finally:
            close = getattr(consumer, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()


class Confirming(Protocol):
    """The changelog writer as readiness reads it."""

    @property
    def producer(self) -> Producing:
        """The changelog's producer (its length: the records it holds)."""
        ...

    def position(self, partition: int) -> int | None:
        """The confirmed changelog position of ``partition``."""
        ...


@dataclass(frozen=True, slots=True)
class Observation:
    """What the loop knows at a housekeeping round, for :meth:`Health.judge`.

    ``positions`` holds, per owned partition, the next request offset intake
    takes in (None: none taken in yet); ``confirmed`` the changelog producer's
    confirmed offsets; ``queued`` the records that producer holds.
    """

    reachable: bool
    positions: Mapping[int, int | None]
    confirmed: Mapping[int, int | None]
    queued: int

    @classmethod
    def of(cls, reachable: bool, owned: Iterable[int], consumed: Mapping[int, int],
           writer: Confirming) -> Observation:
        """The observation of the ``owned`` partitions, taken in up to ``consumed``."""
        partitions = sorted(owned)
        return cls(reachable, {p: consumed.get(p) for p in partitions},
                   {p: writer.position(p) for p in partitions}, len(writer.producer))


class Health:
    """Liveness and readiness of one service, for ``/healthz`` and ``/readyz``.

    The loop calls :meth:`beat`, :meth:`assigned`, :meth:`restoring` and
    :meth:`judge`; the HTTP threads call :meth:`live` and :meth:`ready`.
    ``waiting`` says whether the loop waits for Kafka (an outage): a loop
    held by a call that waits for the broker is alive, by design. Given
    ``metrics``, a beat sets ``kdelay_last_step_timestamp_seconds`` and a
    restore counts in ``kdelay_restoring_partitions``.
    """

    def __init__(self, clock: Clock, marks: HighWatermarks | None,
                 waiting: Callable[[], bool] = lambda: False,
                 metrics: Metrics | None = None) -> None:
        self._clock = clock
        self.marks = marks
        self._waiting = waiting
        self._last_step: Gauge | None = None if metrics is None else metrics.loop.last_step
        self._restoring_gauge: Gauge | None = None if metrics is None else metrics.state.restoring
        self._lock = threading.Lock()
        now = clock.monotonic()
        self._beat_s = now
        self._judged_s: float | None = None
        self._reasons: tuple[str, ...] = ()
        self._assigned = False
        self._restoring = 0
        self._positions: dict[int, int | None] = {}
        self._confirmed: dict[int, int | None] = {}
        self._acked_s = now

    @classmethod
    def of(cls, clients: ClientFactory, settings: Settings, clock: Clock, metrics: Metrics,
           waiting: Callable[[], bool]) -> Health:
        """The health of a service: its high watermarks asked by a consumer of ``clients``
        that joins no group (named ``kdelay-reader`` like the reader of originals, so the
        documented ACLs cover it: a consumer finds its group's coordinator)."""
        asker: dict[str, str | int | bool] = {
            "group.id": "kdelay-reader", "enable.auto.commit": False}
        marks = HighWatermarks(lambda: clients.consumer("watermarks", **asker),
                               settings.requests_topic, clock)
        return cls(clock, marks, waiting, metrics)

    def start(self) -> None:
        """Start asking for the high watermarks."""
        if self.marks is not None:
            self.marks.start()

    def close(self) -> None:
        """Stop asking for the high watermarks."""
        if self.marks is not None:
            self.marks.close()

    def beat(self, now_ms: int) -> None:
        """The loop finished a step at ``now_ms`` (service clock)."""
        self._beat_s = self._clock.monotonic()
        if self._last_step is not None:
            self._last_step.set(now_ms / 1000)

    def assigned(self, partitions: Iterable[int]) -> None:
        """The group assigned partitions (any number, none included): ask for their marks."""
        self._assigned = True
        if self.marks is not None:
            self.marks.want(partitions)

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """A partition is being restored from the changelog meanwhile."""
        with self._lock:
            self._restoring += 1
        if self._restoring_gauge is not None:
            self._restoring_gauge.inc()
        try:
            yield
        finally:
            with self._lock:
                self._restoring -= 1
            if self._restoring_gauge is not None:
                self._restoring_gauge.dec()

    def judge(self, seen: Observation) -> None:
        """Judge readiness from ``seen`` (the loop's housekeeping round)."""
        now = self._clock.monotonic()
        reasons: list[str] = []
        if not seen.reachable:
            reasons.append("Kafka is unreachable")
        if not self._assigned:
            reasons.append("the consumer group has not assigned partitions yet")
        if self.marks is not None:
            self.marks.want(seen.positions)
        for partition, position in sorted(seen.positions.items()):
            reason = self._intake(partition, position, now)
            if reason is not None:
                reasons.append(reason)
        self._positions = dict(seen.positions)
        if seen.queued == 0 or dict(seen.confirmed) != self._confirmed:
            self._acked_s = now
        self._confirmed = dict(seen.confirmed)
        if now - self._acked_s >= ACK_STALL_S:
            reasons.append(f"the changelog producer has held {seen.queued} records for "
                           f"{now - self._acked_s:.0f} s without an acknowledgement")
        with self._lock:
            self._reasons = tuple(reasons)
            self._judged_s = now

    def _intake(self, partition: int, position: int | None, now: float) -> str | None:
        """Why intake does not fetch ``partition``, or None when it does (see the module)."""
        answer = None if self.marks is None else self.marks.answer(partition)
        if position is None and answer is not None:
            position = answer.low  # nothing taken in yet: intake starts at the earliest
        previous = self._positions.get(partition)
        if position is not None and previous is not None and position > previous:
            return None
        if answer is None:
            return f"partition {partition}: the broker's high watermark is not known yet"
        age = now - answer.asked_s
        if position is not None and answer.high <= position and age <= ANSWER_FRESH_S:
            return None
        return (f"partition {partition}: intake stands at offset {position}, the broker's "
                f"high watermark was {answer.high} {age:.0f} s ago")

    def live(self) -> tuple[bool, list[str]]:
        """Whether the loop lives, and why not."""
        idle = self._clock.monotonic() - self._beat_s
        with self._lock:
            restoring = self._restoring
        if idle < LIVE_S or restoring or self._waiting():
            return True, []
        return False, [f"the service loop has not finished a step for {idle:.0f} s"]

    def ready(self) -> tuple[bool, list[str]]:
        """Whether the instance serves, and why not (each reason a line)."""
        now = self._clock.monotonic()
        with self._lock:
            reasons = list(self._reasons)
            judged, restoring = self._judged_s, self._restoring
        if restoring:
            reasons.insert(0, f"{restoring} partition(s) being restored from the changelog")
        if judged is None:
            reasons.append("not judged yet: the service is starting")
        elif now - judged >= JUDGED_S:
            reasons.append(f"the service loop has not judged readiness for {now - judged:.0f} s")
        return not reasons, reasons


class _Quiet(WSGIRequestHandler):
    """A request handler that logs nothing: probes come every few seconds."""

    def log_message(self, format: str, *args: Any) -> None:
        """Drop the access line."""


def application(registry: CollectorRegistry, health: Health) -> Callable[..., Iterable[bytes]]:
    """The WSGI application of the metrics port: ``/healthz``, ``/readyz``, else the metrics.

    Each probe answers 200 with ``ok`` or 503 with one reason a line.
    """
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            ok, reasons = health.live()
        elif path == "/readyz":
            ok, reasons = health.ready()
        else:
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        body = ("ok\n" if ok else "".join(f"{reason}\n" for reason in reasons)).encode()
        start_response("200 OK" if ok else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"),
                        ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve(port: int, registry: CollectorRegistry, health: Health,
          address: str = "0.0.0.0") -> int:  # noqa: S104 - a scrape target, as before
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``port`` from a daemon thread;
    return the port bound (``port`` 0 picks a free one)."""
    server = make_server(address, port, application(registry, health), ThreadingWSGIServer,
                         handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="kdelay-http", daemon=True).start()
    return int(server.server_port)
