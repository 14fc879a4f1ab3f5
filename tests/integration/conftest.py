"""Fixtures for running the service in-process against the real broker.

The service is stepped by the test on a :class:`ManualClock`: time moves only
when the test says so, so "never early" is checked exactly and no test waits
for a due time on the wall clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Message, Producer

from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Guarantee, Settings
from kdelay.plumbing.topics import check_layout
from tests.conftest import TopicFactory, produce_all

Headers = list[tuple[str, bytes | None]]


@dataclass
class Deployment:
    """Topics and settings for one service deployment under test."""

    settings: Settings
    admin: Any
    partitions: int

    @property
    def requests(self) -> str:
        return self.settings.requests_topic


@pytest.fixture(params=[Guarantee.AT_LEAST_ONCE, Guarantee.EXACTLY_ONCE])
def guarantee(request: pytest.FixtureRequest) -> Guarantee:
    """Every service test runs under both delivery guarantees."""
    value: Guarantee = request.param
    return value


@pytest.fixture
def deployment_factory(
    topic_factory: TopicFactory, admin: Any, bootstrap: str, tmp_path: Path,
    guarantee: Guarantee,
) -> Callable[..., Deployment]:
    """Create requests, changelog, DLQ, outcomes, controls and status topics and the
    settings that name them."""

    def create(partitions: int = 3, retention_ms: int = 7 * 86_400_000,
               changelog_config: dict[str, str] | None = None,
               **overrides: Any) -> Deployment:
        requests = topic_factory("req", partitions,
                                 {"cleanup.policy": "delete", "retention.ms": str(retention_ms)})
        changelog = topic_factory("chg", partitions, {"cleanup.policy": "compact",
                                                      "message.timestamp.type": "LogAppendTime",
                                                      **(changelog_config or {})})
        dlq = topic_factory("dlq", 1)
        outcomes = topic_factory("out", partitions, {"cleanup.policy": "compact,delete",
                                                     "retention.ms": str(retention_ms)})
        controls = topic_factory("ctl", 1, {"cleanup.policy": "compact"})
        status = topic_factory("sts", 1, {"cleanup.policy": "compact"})
        settings = Settings(
            bootstrap_servers=bootstrap, requests_topic=requests, changelog_topic=changelog,
            dlq_topic=dlq, outcomes_topic=outcomes, controls_topic=controls,
            status_topic=status,
            group_id=f"g-{requests}",
            state_dir=tmp_path / "state",
            lookahead_ms=2_000, retry_backoff_ms=100, retry_backoff_max_ms=1_000,
            guarantee=guarantee,
        )
        return Deployment(replace(settings, **overrides), admin, partitions)

    return create


class Running:
    """Service instances of one deployment, stepped by the test on one manual clock."""

    def __init__(self, deployment: Deployment, clock: ManualClock) -> None:
        self.deployment = deployment
        self.clock = clock
        self.services: list[Service] = []

    def add(self, broker_tolerance_ms: int | None = None, **overrides: Any) -> Service:
        """Start a service; the broker-clock guard is off unless ``broker_tolerance_ms``
        is given, since the test's manual clock runs ahead of the broker's."""
        settings = replace(self.deployment.settings, **overrides)
        layout = check_layout(self.deployment.admin, settings)
        service = Service(settings, self.clock, layout, broker_tolerance_ms=broker_tolerance_ms)
        service.start()
        self.services.append(service)
        return service

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            for service in self.services:
                service.step(max_wait_ms=10)

    def close(self, service: Service | None = None) -> None:
        for s in [service] if service else list(self.services):
            s.close()
            self.services.remove(s)

    def until(self, condition: Callable[[], bool], timeout_s: float = 60.0,
              advance_ms: int = 0) -> None:
        """Step every service, moving the clock ``advance_ms`` a round, until ``condition``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout_s}s")
            if advance_ms:
                self.clock.advance(advance_ms)
            self.step()


@pytest.fixture
def running() -> Iterator[Callable[[Deployment, ManualClock], Running]]:
    """Start services on a deployment; close every one when the test ends."""
    made: list[Running] = []

    def make(deployment: Deployment, clock: ManualClock) -> Running:
        made.append(Running(deployment, clock))
        return made[-1]

    yield make
    for r in made:
        r.close()


def produce(bootstrap: str, topic: str, records: list[dict[str, Any]]) -> list[Message]:
    """Produce records (kwargs of ``Producer.produce``) and return their delivery reports."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "linger.ms": 5})
    return produce_all(producer, topic, records)


class Collector:
    """A read_committed consumer of one or more topics that keeps everything it reads."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        self.consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"collector-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest", "enable.auto.commit": False,
            "isolation.level": "read_committed",
        })
        self.consumer.subscribe(topics)
        self.messages: list[Message] = []

    def poll(self, timeout_s: float = 0.005) -> int:
        """Read what has arrived; return how many messages were collected in all."""
        for message in self.consumer.consume(10_000, timeout=timeout_s):
            if message.error() is None:
                self.messages.append(message)
        return len(self.messages)

    def on(self, topic: str) -> list[Message]:
        return [m for m in self.messages if m.topic() == topic]

    def close(self) -> None:
        self.consumer.close()


@pytest.fixture
def collector(bootstrap: str) -> Iterator[Callable[[list[str]], Collector]]:
    """Consumers that collect what lands on topics; closed when the test ends."""
    made: list[Collector] = []

    def make(topics: list[str]) -> Collector:
        made.append(Collector(bootstrap, topics))
        return made[-1]

    yield make
    for c in made:
        c.close()


def header(message: Message, name: str) -> bytes | None:
    """Return the value of the last header called ``name``, or None."""
    headers = message.headers() or []
    assert isinstance(headers, list)
    found = [v for k, v in headers if k == name]
    value = found[-1] if found else None
    return value.encode() if isinstance(value, str) else value
