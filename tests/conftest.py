"""Fixtures shared by every test layer.

The broker comes from ``KDELAY_BOOTSTRAP_SERVERS`` when set, else from
``tools/kafka start`` (Docker where an engine answers, else Kafka's jars run
with ``java``). With ``KDELAY_TEST_BROKER=testcontainers`` it is a container
started through testcontainers instead (``tools/kafka_container.py``: Docker,
or podman's Docker-compatible socket). Missing infrastructure skips a Kafka
test locally and fails it when ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import kafka_broker  # tools/, on pytest's pythonpath
import kafka_container  # tools/
import pytest
from confluent_kafka import KafkaError, Message, Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from hypothesis import settings

from kdelay.plumbing import callbacks

ROOT = Path(__file__).resolve().parent.parent
TopicFactory = Callable[..., str]

# No per-example deadline: Hypothesis' default (200 ms) is a wall-clock assertion, and
# on a loaded two-core machine a property test's first example took 686 ms (the same
# example 0.05 ms on the replay) and failed as flaky. Speed is measured in tools/bench.
settings.register_profile("kdelay", deadline=None)
settings.load_profile("kdelay")


def _unavailable(reason: str) -> NoReturn:
    """Fail under CI, skip elsewhere: CI must never pass by skipping Kafka tests."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Kafka broker unavailable under CI: {reason}")
    pytest.skip(f"Kafka broker unavailable: {reason}")


@pytest.fixture(scope="session")
def bootstrap() -> Iterator[str]:
    """The bootstrap address of a real broker, started for the session if needed."""
    source = os.environ.get("KDELAY_TEST_BROKER", "tools")
    if source == "testcontainers":
        try:
            container = kafka_container.start()
        except kafka_container.Unavailable as exc:
            _unavailable(str(exc))
        print(f"\nbroker from testcontainers: {container.image} at {container.bootstrap}")
        yield container.bootstrap
        container.stop()
        return
    if source != "tools":
        pytest.fail(f"KDELAY_TEST_BROKER={source!r}: expected tools or testcontainers")
    external = os.environ.get("KDELAY_BOOTSTRAP_SERVERS")
    if external:
        yield external
        return
    started_here = not kafka_broker.running()
    try:
        found = kafka_broker.address()
    except kafka_broker.BrokerUnavailable as exc:
        _unavailable(str(exc))
    yield found
    if started_here:
        subprocess.run([str(ROOT / "tools" / "kafka"), "stop"], check=False)


@pytest.fixture(scope="session")
def admin(bootstrap: str) -> AdminClient:
    """An AdminClient on the session's broker."""
    return AdminClient({"bootstrap.servers": bootstrap})


@pytest.fixture
def topic_factory(admin: AdminClient) -> Iterator[TopicFactory]:
    """Create topics with random names; delete them when the test ends."""
    created: list[str] = []

    def create(
        prefix: str = "t", partitions: int = 1, config: dict[str, str] | None = None
    ) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1,
                      config=config or {})]
        )
        futures[name].result(timeout=30)
        created.append(name)
        wait_visible(admin, name, partitions)
        return name

    yield create
    if created:
        for future in admin.delete_topics(created).values():
            future.result(timeout=30)


def wait_visible(admin: AdminClient, name: str, partitions: int, timeout_s: float = 30) -> None:
    """Wait until metadata shows every partition of a new topic with a leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        topic = admin.list_topics(name, timeout=10).topics.get(name)
        if topic is not None and topic.error is None and len(topic.partitions) == partitions \
                and all(p.leader >= 0 for p in topic.partitions.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"topic {name} not visible in metadata after {timeout_s}s")
        time.sleep(0.1)


def produce_all(producer: Producer, topic: str, records: list[dict[str, Any]]) -> list[Message]:
    """Produce records (kwargs of ``Producer.produce``), flush, and return the delivery
    reports; fail on any delivery error."""
    reports: list[Message] = []
    errors: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            errors.append(error)
        reports.append(message)

    for record in records:
        producer.produce(topic, on_delivery=callbacks.guarded(on_delivery), **record)
        producer.poll(0)
    assert producer.flush(30) == 0
    assert not errors, errors
    return reports


@pytest.fixture(autouse=True)
def _callback_error_guard() -> Iterator[None]:
    """Fail the test when an error raised inside a Kafka callback was latched."""
    callbacks.drain_errors()
    yield
    errors = callbacks.drain_errors()
    if errors:
        pytest.fail(f"errors raised inside Kafka callbacks: {errors!r}")
