"""The helpers around the service, end to end: retries, tasks and series through ``kdelay run``.

One ``kdelay run`` (system clock) serves the module. Consumers and the worker
run in the test's thread and are stepped by it, on short delay tables
(hundreds of milliseconds); outcomes are awaited by consuming with deadlines.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay import recurring, tasks
from kdelay.client import DelayProducer
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Guarantee, Settings
from kdelay.recurring import Every
from kdelay.retry import Outgoing, RetryingConsumer, RetryPolicy, attempts_of
from kdelay.tasks import Registry, Tasks, WorkerOptions, WorkerTopics
from tests.conftest import TopicFactory, produce_all
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, run_cli
from tests.integration.conftest import header

kafka = pytest.mark.kafka
DEADLINE_S = 30.0
Receive = Callable[[list[str]], Receiver]


@pytest.fixture(scope="module")
def service(bootstrap: str, admin: AdminClient,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """kdelay's topics and one ``kdelay run`` for the whole module."""
    suffix = uuid.uuid4().hex[:12]
    tmp = tmp_path_factory.mktemp("helpers")
    deployment = Deployment(bootstrap, f"h-req-{suffix}", f"h-chg-{suffix}", f"h-dlq-{suffix}",
                            f"h-g-{suffix}", tmp / "state", 3)
    created = run_cli(deployment.env(), "topics", "create", "--partitions", "3")
    assert created.returncode == 0, created.stderr
    process = KdelayProcess("kdelay-run", deployment.env(), tmp / "run.log")
    try:
        process.wait_ready()
        yield deployment
    finally:
        process.kill()
        admin.delete_topics([deployment.requests, deployment.changelog, deployment.dlq])


def settings_of(deployment: Deployment, guarantee: Guarantee = Guarantee.AT_LEAST_ONCE
                ) -> Settings:
    return Settings(bootstrap_servers=deployment.bootstrap,
                    requests_topic=deployment.requests, changelog_topic=deployment.changelog,
                    dlq_topic=deployment.dlq, guarantee=guarantee)


def step_until(condition: Callable[[], bool], what: str, *steppers: Callable[[], object],
               timeout_s: float = DEADLINE_S) -> None:
    """Step consumers and receivers until ``condition()``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        for step in steppers:
            step()


def read_committed(bootstrap: str, topic: str, partitions: int) -> list[Message]:
    """Every committed record of ``topic``, read to its end."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"r-{uuid.uuid4().hex}",
                         "enable.partition.eof": True, "isolation.level": "read_committed",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    found: list[Message] = []
    ended: set[int | None] = set()
    deadline = time.monotonic() + DEADLINE_S
    while len(ended) < partitions:
        assert time.monotonic() < deadline, f"{topic} not read to its end"
        for message in consumer.consume(100, timeout=0.2):
            error = message.error()
            if error is None:
                found.append(message)
            elif error.code() == KafkaError._PARTITION_EOF:
                ended.add(message.partition())
    consumer.close()
    return found


@dataclass
class Call:
    """One call of a handler: the attempt it saw and the record."""

    attempts: int
    key: bytes | None
    value: bytes | None
    trace: bytes | None
    partition: int | None
    at: float


def recorder(calls: list[Call], fail: Callable[[Message], Exception | None]
             ) -> Callable[[Message], None]:
    """A handler that records each call and raises what ``fail`` returns for it."""

    def handle(message: Message) -> None:
        calls.append(Call(attempts_of(message.headers()), message.key(), message.value(),
                          header(message, "trace"), message.partition(), time.monotonic()))
        error = fail(message)
        if error is not None:
            raise error

    return handle


def consumer_of(deployment: Deployment, topic: str, handler: Callable[[Message], None],
                policy: RetryPolicy, group: str, transactional: bool = False,
                settle: Callable[[], list[Outgoing]] | None = None) -> RetryingConsumer:
    return RetryingConsumer(settings_of(deployment), [topic], handler, policy, group_id=group,
                            transactional=transactional, settle=settle)


def produce_order(bootstrap: str, topic: str, key: bytes) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    produce_all(producer, topic, [{"key": key, "value": b"order " + key, "partition": 1,
                                   "headers": [("trace", b"t-" + key)]}])


@kafka
def test_fails_twice_then_succeeds_on_the_configured_steps(
        service: Deployment, topic_factory: TopicFactory) -> None:
    orders, dlq = topic_factory("orders", 2), topic_factory("orders-dlq", 1)
    calls: list[Call] = []
    policy = RetryPolicy(dlq, backoff=(300, 600, 900))
    consumer = consumer_of(service, orders, recorder(
        calls, lambda m: RuntimeError("flaky") if attempts_of(m.headers()) < 2 else None),
        policy, f"g-{orders}")
    try:
        produce_order(service.bootstrap, orders, b"o1")
        step_until(lambda: len(calls) == 3, "three calls", consumer.step)
    finally:
        consumer.close()
    assert [c.attempts for c in calls] == [0, 1, 2]
    assert {(c.key, c.value, c.trace, c.partition) for c in calls} == {
        (b"o1", b"order o1", b"t-o1", 1)}
    gaps = [b.at - a.at for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.3
    assert gaps[1] >= 0.6


@kafka
def test_always_failing_ends_in_the_dead_letters_with_its_attempts(
        service: Deployment, topic_factory: TopicFactory, receiver: Receive) -> None:
    orders, dlq = topic_factory("orders", 2), topic_factory("orders-dlq", 1)
    calls: list[Call] = []
    policy = RetryPolicy(dlq, backoff=(100, 200), non_retryable=(KeyError,))
    consumer = consumer_of(service, orders, recorder(
        calls, lambda m: KeyError("no such sku") if m.key() == b"fatal" else ValueError("bad")),
        policy, f"g-{orders}")
    dead = receiver([dlq])
    try:
        produce_order(service.bootstrap, orders, b"o2")
        produce_order(service.bootstrap, orders, b"fatal")
        step_until(lambda: dead.poll(0.01) == 2, "two dead letters", consumer.step)
    finally:
        consumer.close()
    by_key = {r.message.key(): r.message for r in dead.received}
    retried, fatal = by_key[b"o2"], by_key[b"fatal"]
    assert (retried.value(), header(retried, "trace")) == (b"order o2", b"t-o2")
    assert [header(retried, n) for n in ("kdelay.error-type", "kdelay.error-message",
                                         "kdelay.attempts")] == [b"ValueError", b"bad", b"3"]
    assert [header(fatal, n) for n in ("kdelay.error-type", "kdelay.attempts")] == [
        b"KeyError", b"1"]
    assert sorted(c.attempts for c in calls if c.key == b"o2") == [0, 1, 2]


class Crash(Exception):
    """The consumer dies between the retry request's acknowledgement and its commit."""


@kafka
@pytest.mark.parametrize("transactional", [False, True], ids=["acks", "transactions"])
def test_a_crash_between_retry_request_and_commit_loses_nothing(
        service: Deployment, topic_factory: TopicFactory, transactional: bool) -> None:
    orders, dlq = topic_factory("orders", 2), topic_factory("orders-dlq", 1)
    calls: list[Call] = []
    handler = recorder(calls, lambda m: RuntimeError("once") if not attempts_of(m.headers())
                       else None)
    policy, group = RetryPolicy(dlq, backoff=(200,)), f"g-{orders}"

    def crash() -> list[Outgoing]:
        raise Crash

    first = consumer_of(service, orders, handler, policy, group, transactional, settle=crash)
    key = orders.encode()
    produce_order(service.bootstrap, orders, key)
    with pytest.raises(Crash):
        step_until(lambda: False, "a crash", first.step)
    first.close()
    second = consumer_of(service, orders, handler, policy, group, transactional)
    try:
        step_until(lambda: any(c.attempts == 1 for c in calls), "the retried record",
                   second.step)
    finally:
        second.close()
    assert [c.attempts for c in calls][:2] == [0, 0]
    assert {(c.key, c.value, c.trace) for c in calls} == {(key, b"order " + key, b"t-" + key)}
    retries = [m for m in read_committed(service.bootstrap, service.requests, 3)
               if m.key() == key]
    assert len(retries) == (1 if transactional else 2)


REGISTRY = Registry()
RUNS: list[tuple[str, int]] = []


@REGISTRY.task("record", schema={"label": str})
def record(label: str) -> None:
    """Note the run and the occurrence it belongs to."""
    series = tasks.context().series
    RUNS.append((label, series.n if series else 0))


@dataclass
class Worked:
    """A worker under test and its topics."""

    consumer: RetryingConsumer
    topics: WorkerTopics
    settings: Settings


@pytest.fixture
def worker_factory(service: Deployment, topic_factory: TopicFactory
                   ) -> Iterator[Callable[..., Worked]]:
    made: list[tuple[RetryingConsumer, recurring.Cancels]] = []

    def make(guarantee: Guarantee = Guarantee.AT_LEAST_ONCE) -> Worked:
        topics = WorkerTopics(topic_factory("tasks", 2), topic_factory("series", 2),
                              topic_factory("cancels", 1, {"cleanup.policy": "compact"}),
                              topic_factory("tasks-dlq", 1))
        settings = settings_of(service, guarantee)
        options = WorkerOptions(f"w-{topics.tasks}", topics, backoff=(200, 400))
        consumer, cancels = tasks.build_worker(settings, REGISTRY, options)
        made.append((consumer, cancels))
        return Worked(consumer, topics, settings)

    RUNS.clear()
    yield make
    for consumer, cancels in made:
        consumer.close()
        cancels.close()


@kafka
def test_tasks_run_once_per_occurrence_and_unknown_ones_are_dead_lettered(
        worker_factory: Callable[..., Worked], receiver: Receive) -> None:
    worked = worker_factory()
    dead = receiver([worked.topics.dead_letters])
    now = SystemClock().now_ms()
    with Tasks(worked.settings, topic=worked.topics.tasks) as client:
        client.schedule("record", {"label": "once"}, delay=300)
        client.schedule("no-such-task", {"label": "x"}, delay=300)
        client.recur("record", {"label": "tick"}, Every(1_000, now + 500),
                     id=f"tick-{uuid.uuid4().hex}", count=3)
    step_until(lambda: len(RUNS) == 4 and dead.poll(0.01) == 1, "four runs, one dead letter",
               worked.consumer.step)
    assert sorted(RUNS) == [("once", 0), ("tick", 1), ("tick", 2), ("tick", 3)]
    [unknown] = dead.received
    assert header(unknown.message, "kdelay.error-code") == b"unknown-task"
    assert header(unknown.message, "kdelay.attempts") == b"1"


def forwarded(receiver: Receiver, target: str, series_id: str) -> list[Message]:
    return [r.message for r in receiver.on(target)
            if header(r.message, "trace") == series_id.encode()]


@kafka
def test_every_second_series_runs_count_times_and_stops_on_cancel(
        worker_factory: Callable[..., Worked], topic_factory: TopicFactory,
        receiver: Receive) -> None:
    worked = worker_factory()
    target = topic_factory("target", 1)
    seen = receiver([target])
    now = SystemClock().now_ms()
    counted, endless = f"counted-{uuid.uuid4().hex}", f"endless-{uuid.uuid4().hex}"
    for series_id, count in ((counted, 3), (endless, None)):
        recurring.send_series(worked.settings, target, b"tick", Every(1_000, now + 500),
                              schedule_id=series_id, now_ms=now, key=series_id,
                              headers=[("trace", series_id)], count=count,
                              series_topic=worked.topics.series)
    step_until(lambda: len(forwarded(seen, target, endless)) >= 3, "three of the endless",
               worked.consumer.step, seen.poll)
    with DelayProducer(worked.settings) as producer:
        recurring.cancel(worked.settings, producer, endless, SystemClock().now_ms(),
                         worked.topics.cancels)
    cancelled_ms = SystemClock().now_ms()
    deadline = time.monotonic() + 3.0  # three intervals: long enough to see it go on
    while time.monotonic() < deadline:
        worked.consumer.step(0.05)
        seen.poll(0.01)
    assert len(forwarded(seen, target, counted)) == 3
    assert {m.value() for m in forwarded(seen, target, counted)} == {b"tick"}
    # At most the occurrence in flight when the cancel was read may still come.
    last_due = max(int(header(m, "kdelay-due-ms") or 0)
                   for m in forwarded(seen, target, endless))
    assert last_due <= cancelled_ms + 1_000


@kafka
def test_a_cancel_racing_an_occurrence_ends_the_series(
        worker_factory: Callable[..., Worked], topic_factory: TopicFactory,
        receiver: Receive, service: Deployment) -> None:
    """The cancel comes while an occurrence is handled: kdelay answers already-delivered.

    The worker has not seen the marker when it schedules the next occurrence;
    it finds it before committing and cancels that occurrence through kdelay,
    in the transaction that commits the handled one.
    """
    topics = worker_factory(Guarantee.EXACTLY_ONCE).topics
    settings = settings_of(service, Guarantee.EXACTLY_ONCE)
    cancels = recurring.Cancels(settings, topics.cancels)
    worker = tasks.Worker(None, topics, service.requests, 3, cancels, SystemClock())
    target = topic_factory("target", 1)
    seen = receiver([target])
    series_id, now = f"race-{uuid.uuid4().hex}", SystemClock().now_ms()
    producer = DelayProducer(settings)

    def cancel_while_handling(message: Message) -> list[Outgoing]:
        recurring.cancel(settings, producer, series_id, SystemClock().now_ms(), topics.cancels)
        return worker.handle(message)

    consumer = RetryingConsumer(settings, [topics.series], cancel_while_handling,
                                RetryPolicy(topics.dead_letters), group_id=f"w-{target}",
                                transactional=True, settle=worker.settle)
    try:
        recurring.send_series(settings, target, b"tick", Every(1_000, now + 300),
                              schedule_id=series_id, now_ms=now, headers=[("trace", series_id)],
                              series_topic=topics.series)
        step_until(lambda: len(forwarded(seen, target, series_id)) == 1, "the first occurrence",
                   consumer.step, seen.poll)
        deadline = time.monotonic() + 2.5  # two and a half intervals
        while time.monotonic() < deadline:
            consumer.step(0.05)
            seen.poll(0.01)
    finally:
        consumer.close()
        cancels.close()
        producer.close()
    assert len(forwarded(seen, target, series_id)) == 1
    kinds: dict[str, list[str]] = {series_id: [], series_id + "~": []}
    for m in read_committed(service.bootstrap, service.requests, 3):
        cancelled, scheduled = header(m, "kdelay-cancel"), header(m, "kdelay-id")
        for name, kind in ((cancelled, "cancel"), (scheduled, "occurrence")):
            if name is not None and name.decode() in kinds:
                kinds[name.decode()].append(kind)
    assert kinds == {series_id: ["occurrence", "cancel"],
                     series_id + "~": ["cancel", "occurrence", "cancel"]}


@kafka
@pytest.mark.parametrize("guarantee", [Guarantee.AT_LEAST_ONCE, Guarantee.EXACTLY_ONCE])
def test_a_series_survives_a_worker_crash_before_its_commit(
        worker_factory: Callable[..., Worked], topic_factory: TopicFactory,
        receiver: Receive, service: Deployment, guarantee: Guarantee) -> None:
    """The worker dies after the next occurrence is acknowledged, before its commit.

    Its successor, back well within the interval, handles the occurrence
    again. Under exactly-once the first attempt left nothing. Under
    at-least-once the occurrence in hand is forwarded twice, but the second
    copy of the next occurrence meets the first, still pending under the same
    id, and kdelay drops it: the series goes on once.
    """
    topics = worker_factory(guarantee).topics
    settings = settings_of(service, guarantee)
    cancels = recurring.Cancels(settings, topics.cancels)
    worker = tasks.Worker(None, topics, service.requests, 3, cancels, SystemClock())
    target = topic_factory("target", 1)
    seen = receiver([target])
    series_id, now = f"crash-{uuid.uuid4().hex}", SystemClock().now_ms()

    def crash() -> list[Outgoing]:
        worker.settle()
        raise Crash

    def consumer(settle: Callable[[], list[Outgoing]]) -> RetryingConsumer:
        return RetryingConsumer(settings, [topics.series], worker.handle,
                                RetryPolicy(topics.dead_letters), group_id=f"w-{target}",
                                transactional=guarantee is Guarantee.EXACTLY_ONCE,
                                settle=settle)

    # Long enough for the successor to be back within it on a loaded machine: with 4 s,
    # a CI run whose load reached 45 had it back after more than 8 s, and the series
    # rightly went on from the next occurrence to come, 12 s after the first.
    interval = 15_000
    recurring.send_series(settings, target, b"tick", Every(interval, now + 300),
                          schedule_id=series_id, now_ms=now, headers=[("trace", series_id)],
                          count=2, series_topic=topics.series)
    first = consumer(crash)
    with pytest.raises(Crash):
        step_until(lambda: False, "a crash", first.step)
    first.close()
    second = consumer(worker.settle)

    def dues() -> list[int]:
        return sorted(int(header(m, "kdelay-due-ms") or 0)
                      for m in forwarded(seen, target, series_id))

    try:
        step_until(lambda: len(set(dues())) == 2, "two occurrences", second.step, seen.poll,
                   timeout_s=DEADLINE_S + interval / 1000)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            second.step(0.05)
            seen.poll(0.01)
    finally:
        second.close()
        cancels.close()
    first_due = now + 300
    expected = [first_due, first_due + interval]
    if guarantee is Guarantee.AT_LEAST_ONCE:
        expected.insert(0, first_due)
    assert dues() == expected


def test_unknown_registry_is_a_clear_error(tmp_path: Path) -> None:
    from tests.e2e.conftest import clean_environment

    result = run_cli(clean_environment(), "worker", "--registry", "no_such_module_q:tasks")
    assert result.returncode == 2
    assert result.stderr.startswith("error[bad-registry]: cannot import module")
