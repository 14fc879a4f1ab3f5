"""Scheduled tasks: handlers registered by name, called later through kdelay.

A task call is a kdelay request whose value is the JSON object
``{"task": name, "args": {...}}`` (orjson), delivered to the tasks topic.
``kdelay worker --registry module:object`` consumes that topic and calls the
function registered under ``name`` with ``args`` as keyword arguments, once per
delivery; a failure is retried through kdelay on the backoff table
(:mod:`kdelay.retry`). Nothing is ever unpickled and no name taken from a
message is imported: the only import is the registry the operator names.

What cannot run is dead-lettered at once, with ``kdelay.error-code``:
``bad-call`` (not a JSON task call), ``unknown-task`` (no such name in the
registry), ``bad-arguments`` (arguments that do not fit the task's schema) and
``bad-series`` (an unreadable ``kdelay.series`` header).

The same worker drives recurring series (:mod:`kdelay.recurring`): a task
occurrence schedules the next occurrence before it is committed, even when the
task fails (the failed run is retried on its own, outside the series); a plain
record occurrence, read from the series topic, is forwarded to its target.
"""

from __future__ import annotations

import contextvars
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Protocol, Self

import orjson
from confluent_kafka import KafkaError, KafkaException, Message
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from kdelay import client, recurring
from kdelay.client import Coordinates, DelayProducer, Ticket
from kdelay.errors import KdelayError
from kdelay.plumbing.clock import Clock, SystemClock
from kdelay.plumbing.settings import Guarantee, Settings
from kdelay.plumbing.topics import LayoutError
from kdelay.protocol import envelope
from kdelay.protocol.durations import parse_levels
from kdelay.recurring import Cancels, Series, SeriesError, Spec
from kdelay.retry import (
    DEFAULT_BACKOFF,
    SERIES,
    Failed,
    Outgoing,
    RetryingConsumer,
    RetryPolicy,
    attempts_of,
)

TASKS_TOPIC = "kdelay.tasks"
WORKER_DLQ_TOPIC = "kdelay.tasks.dlq"
JSON = Any
"""A value orjson round-trips: dict, list, str, int, float, bool or None."""

_STRICT = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS \
    | orjson.OPT_PASSTHROUGH_SUBCLASS


class TaskRejected(KdelayError):
    """A task call that can never run; dead-lettered at once with ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RegistryError(KdelayError, ValueError):
    """The registry named on the command line cannot be used; ``code`` is stable."""

    code = "bad-registry"


@dataclass(frozen=True, slots=True)
class Task:
    """A registered function and its optional schema: argument name -> JSON type."""

    name: str
    function: Callable[..., object]
    schema: Mapping[str, type] | None = None

    def check(self, args: Mapping[str, JSON]) -> None:
        """Raise TaskRejected ``bad-arguments`` unless ``args`` fits the schema exactly."""
        if self.schema is None:
            return
        missing = sorted(set(self.schema) - set(args))
        extra = sorted(set(args) - set(self.schema))
        wrong = sorted(n for n, t in self.schema.items() if n in args
                       and not _fits(args[n], t))
        if missing or extra or wrong:
            raise TaskRejected("bad-arguments", f"task {self.name!r}: missing {missing}, "
                               f"unexpected {extra}, wrong type {wrong}")


def _fits(value: JSON, kind: type) -> bool:
    """Whether a decoded JSON value is of ``kind`` (an int is a float; a bool is no int)."""
    if isinstance(value, bool) and kind is not bool:
        return False
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


class Registry:
    """Task functions by name: ``@registry.task("send-reminder")``."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}

    def task(self, name: str, *, schema: Mapping[str, type] | None = None
             ) -> Callable[[Callable[..., object]], Callable[..., object]]:
        """Register the decorated function under ``name``; ValueError for a name taken twice."""
        if not name:
            raise ValueError("a task needs a non-empty name")

        def register(function: Callable[..., object]) -> Callable[..., object]:
            if name in self._tasks:
                raise ValueError(f"task {name!r} is registered twice")
            self._tasks[name] = Task(name, function, schema)
            return function

        return register

    def get(self, name: str) -> Task:
        """The task called ``name``; TaskRejected ``unknown-task`` if there is none."""
        task = self._tasks.get(name)
        if task is None:
            raise TaskRejected("unknown-task", f"no task {name!r} in the registry "
                               f"(known: {', '.join(sorted(self._tasks)) or 'none'})")
        return task

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._tasks)


def load_registry(reference: str) -> Registry:
    """Import the registry ``module:object`` names; RegistryError saying what is wrong."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise RegistryError(f"--registry {reference!r} must look like module:object")
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import module {module_name!r}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise RegistryError(f"module {module_name!r} has no {attribute!r}")
        found = getattr(found, part)
    if not isinstance(found, Registry):
        raise RegistryError(f"{reference} is a {type(found).__name__}, not a kdelay Registry")
    return found


def encode_call(name: str, args: Mapping[str, JSON] | None = None) -> bytes:
    """The JSON value of a task call; ValueError for arguments that are not plain JSON.

    Datetimes, dataclasses and subclasses of str/int/dict are refused rather
    than converted, so the task receives exactly what was scheduled.
    """
    if not name:
        raise ValueError("a task call needs a task name")
    if args is not None and not isinstance(args, Mapping):
        raise ValueError(f"task arguments must be a mapping of names to values, got {args!r}")
    try:
        return orjson.dumps({"task": name, "args": dict(args or {})}, option=_STRICT)
    except TypeError as exc:
        raise ValueError(f"task {name!r}: arguments are not JSON-serialisable: {exc}") from None


def decode_call(value: bytes | None) -> tuple[str, dict[str, JSON]]:
    """Read a task call; TaskRejected ``bad-call`` for anything but ``{"task", "args"}``."""
    try:
        body = orjson.loads(value or b"")
    except orjson.JSONDecodeError as exc:
        raise TaskRejected("bad-call", f"the value is not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("task"), str) \
            or not isinstance(body.get("args", {}), dict):
        raise TaskRejected("bad-call", 'a task call is {"task": name, "args": {...}}')
    return body["task"], body.get("args", {})


@dataclass(frozen=True, slots=True)
class Context:
    """What a running task may ask about its call (:func:`context`)."""

    name: str
    origin: str | None
    attempts: int
    series: Series | None


_context: contextvars.ContextVar[Context] = contextvars.ContextVar("kdelay_task")


def context() -> Context:
    """The call of the task running now; LookupError outside a task."""
    return _context.get()


class Tasks:
    """Schedules task calls through kdelay; validates them against a registry when given one."""

    def __init__(self, settings: Settings, *, topic: str = TASKS_TOPIC,
                 registry: Registry | None = None, clock: Clock | None = None,
                 cancels_topic: str = recurring.CANCELS_TOPIC) -> None:
        """Lazy, like :class:`DelayProducer`: no network until the first call."""
        self._settings = settings
        self._producer = DelayProducer(settings)
        self._topic = topic
        self._registry = registry
        self._clock = clock or SystemClock()
        self._cancels_topic = cancels_topic

    def _value(self, name: str, args: Mapping[str, JSON] | None) -> bytes:
        """Encode a call, checking it against the registry's task when there is one."""
        value = encode_call(name, args)
        if self._registry is not None:
            self._registry.get(name).check(decode_call(value)[1])
        return value

    def schedule(self, name: str, args: Mapping[str, JSON] | None = None, *,
                 delay: timedelta | int | None = None, due: datetime | int | None = None,
                 level: int | None = None, id: str | None = None) -> Coordinates:
        """Call task ``name`` with ``args`` once, when due; exactly one of delay, due, level.

        Raises ValueError for arguments that are not JSON, TaskRejected for an
        unknown name or a schema mismatch (with a registry), and as
        :meth:`DelayProducer.send` does.
        """
        return self._producer.send(self._topic, self._value(name, args), delay=delay, due=due,
                                   level=level, id=id)

    def recur(self, name: str, args: Mapping[str, JSON] | None, spec: Spec, *, id: str,
              until_ms: int | None = None, count: int | None = None) -> tuple[Coordinates, int]:
        """Call ``name`` on each occurrence of ``spec``; return the first's coordinates and due."""
        return recurring.start(self._producer, self._topic, self._value(name, args), spec,
                               schedule_id=id, now_ms=self._clock.now_ms(), until_ms=until_ms,
                               count=count, task=True)

    def cancel(self, id: str) -> Ticket:
        """Cancel a scheduled call or end a series (:func:`kdelay.recurring.cancel`)."""
        return recurring.cancel(self._settings, self._producer, id, self._clock.now_ms(),
                                self._cancels_topic)

    def close(self) -> None:
        """Flush and release the producer."""
        self._producer.close()

    def __enter__(self) -> Self:
        """Return self; :meth:`close` runs on exit."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Close."""
        self.close()


@dataclass(frozen=True, slots=True)
class WorkerTopics:
    """The topics of ``kdelay worker``."""

    tasks: str = TASKS_TOPIC
    series: str = recurring.SERIES_TOPIC
    cancels: str = recurring.CANCELS_TOPIC
    dead_letters: str = WORKER_DLQ_TOPIC


def create_worker_topics(admin: AdminClient, topics: WorkerTopics, partitions: int,
                         timeout_s: float = 30.0) -> list[str]:
    """Create whichever worker topic is missing; one report line per topic.

    The cancels topic is compacted with one partition; the others use
    ``cleanup.policy=delete``. Raises LayoutError ``create-failed``.
    """
    wanted = [(topics.tasks, partitions, "delete"), (topics.series, partitions, "delete"),
              (topics.cancels, 1, "compact"), (topics.dead_letters, 1, "delete")]
    new = [NewTopic(name, num_partitions=count, config={"cleanup.policy": policy})
           for name, count, policy in wanted]
    lines = []
    for name, future in admin.create_topics(new, request_timeout=timeout_s).items():
        try:
            future.result(timeout=timeout_s)
            lines.append(f"created {name}")
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise LayoutError("create-failed", f"cannot create {name}: {error.str()}") from None
            lines.append(f"exists  {name}")
    return lines


class Markers(Protocol):
    """What the worker needs of the cancel markers (:class:`kdelay.recurring.Cancels`)."""

    def catch_up(self) -> None:
        """Read every marker written before the call."""
        ...

    def ends(self, series: Series) -> bool:
        """Whether a known marker ends ``series``."""
        ...


@dataclass
class Worker:
    """Handles the records of the tasks and series topics (see the module docstring).

    ``handle`` is a :data:`kdelay.retry.Handler`; ``settle`` the hook that, once
    the batch's next occurrences are acknowledged, cancels those of series a
    marker has ended meanwhile.
    """

    registry: Registry | None
    topics: WorkerTopics
    requests_topic: str
    requests_partitions: int
    cancels: Markers
    clock: Clock
    _continued: list[Series] = field(default_factory=list)

    def handle(self, message: Message) -> list[Outgoing]:
        """Run or forward one record; return the records it sends (next occurrence first)."""
        try:
            series = recurring.series_of(message.headers())
        except SeriesError as exc:
            raise TaskRejected("bad-series", str(exc)) from None
        if series is not None and self.cancels.ends(series):
            return []
        follow = self._follow(message, series) if series is not None else []
        if message.topic() == self.topics.series:
            return [*follow, *self._forward(message, series)]
        try:
            self._run(message, series)
        except Exception as exc:
            if not follow:
                raise
            raise Failed(exc, follow) from exc
        return follow

    def settle(self) -> list[Outgoing]:
        """After the acks: cancel through kdelay every series just continued that a marker ends."""
        if not self._continued:
            return []
        self.cancels.catch_up()
        ended = {recurring.occurrence_id(s.schedule_id, s.n) for s in self._continued
                 if self.cancels.ends(s)}
        self._continued.clear()
        return [self._cancel_request(occurrence) for occurrence in sorted(ended)]

    def _run(self, message: Message, series: Series | None) -> None:
        """Decode, check and call the task; TaskRejected for what can never run."""
        if self.registry is None:
            raise TaskRejected("unknown-task", "this worker runs no tasks (no --registry)")
        name, args = decode_call(message.value())
        task = self.registry.get(name)
        task.check(args)
        origin = recurring.header_value(message.headers(), envelope.ORIGIN)
        token = _context.set(Context(name, origin.decode() if origin else None,
                                     attempts_of(message.headers()), series))
        try:
            task.function(**args)
        finally:
            _context.reset(token)

    def _follow(self, message: Message, series: Series) -> list[Outgoing]:
        """The request of the series' next occurrence, or nothing when the series ends."""
        due_ms = recurring.due_of(message.headers()) or self.clock.now_ms()
        next_ms = series.following(due_ms, self.clock.now_ms())
        if next_ms is None:
            return []
        following = recurring.next_occurrence(series)
        occurrence = recurring.occurrence_id(series.schedule_id, following.n)
        headers = client.request_headers(
            str(message.topic()), recurring.occurrence_headers(message.headers(), following),
            due=next_ms, schedule_id=occurrence)
        self._continued.append(following)
        return [Outgoing(self.requests_topic, message.key(), message.value(), headers,
                         client.id_partition(occurrence, self.requests_partitions))]

    def _forward(self, message: Message, series: Series | None) -> list[Outgoing]:
        """A plain occurrence to its real target, with the delivery headers kdelay gave it."""
        if series is None or series.target is None:
            raise TaskRejected("bad-series", "a record on the series topic without a target")
        headers = [(n, v) for n, v in recurring.pairs(message.headers()) if n != SERIES]
        partition = -1 if series.partition is None else series.partition
        return [Outgoing(series.target, message.key(), message.value(), headers, partition)]

    def _cancel_request(self, schedule_id: str) -> Outgoing:
        """A kdelay cancel for ``schedule_id``, on its request partition."""
        return Outgoing(self.requests_topic, schedule_id.encode(), schedule_id.encode(),
                        envelope.cancel_headers(schedule_id),
                        client.id_partition(schedule_id, self.requests_partitions))


def requests_partitions(settings: Settings, timeout_s: float = 30.0) -> int:
    """The requests topic's partition count; LayoutError ``requests-missing``."""
    admin = AdminClient(dict(settings.client_config()))
    topic = admin.list_topics(settings.requests_topic, timeout=timeout_s).topics.get(
        settings.requests_topic)
    if topic is None or topic.error is not None or not topic.partitions:
        raise LayoutError("requests-missing", f"requests topic {settings.requests_topic} does "
                          "not exist: run `kdelay topics create`")
    return len(topic.partitions)


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """How ``kdelay worker`` runs: its group, topics and retry policy."""

    group_id: str = "kdelay-worker"
    topics: WorkerTopics = field(default_factory=WorkerTopics)
    backoff: tuple[int, ...] | None = None
    batch_size: int = 100


def build_worker(settings: Settings, registry: Registry | None, options: WorkerOptions,
                 clock: Clock | None = None) -> tuple[RetryingConsumer, Cancels]:
    """Make the consumer that runs ``registry``'s tasks and drives series; caller closes both.

    Transactional when ``settings.guarantee`` is exactly-once. The cancel
    markers are read to their end before it returns.
    """
    cancels = Cancels(settings, options.topics.cancels)
    cancels.catch_up()
    worker = Worker(registry, options.topics, settings.requests_topic,
                    requests_partitions(settings), cancels, clock or SystemClock())
    backoff = options.backoff if options.backoff is not None else parse_levels(DEFAULT_BACKOFF)
    policy = RetryPolicy(options.topics.dead_letters, backoff, non_retryable=(TaskRejected,))
    topics = [options.topics.series, *([options.topics.tasks] if registry else [])]
    consumer = RetryingConsumer(
        settings, topics, worker.handle, policy, group_id=options.group_id,
        transactional=settings.guarantee is Guarantee.EXACTLY_ONCE, settle=worker.settle,
        batch_size=options.batch_size)
    return consumer, cancels


def run_worker(settings: Settings, registry: Registry | None, options: WorkerOptions,
               stopped: Callable[[], bool]) -> None:
    """Run the worker until ``stopped()``; leave the group cleanly."""
    consumer, cancels = build_worker(settings, registry, options)
    try:
        consumer.run(stopped)
    finally:
        consumer.close()
        cancels.close()
