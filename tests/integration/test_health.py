"""Readiness proves serving: a consumer that stops fetching underneath a running service.

The service runs in-process on the system clock against the real broker, its
loop on a thread of its own, its probes on a free port. A fault hook (the
client factory's intake consumer) pauses every assigned partition, so the
consumer stops fetching while the loop goes on stepping: ``/healthz`` stays
ok, ``/readyz`` fails naming the partition, and the intake lag, computed from
the broker's answer rather than the consumer's cached high watermark, grows
with every request written meanwhile. Resumed, the instance is ready again.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, Message

from kdelay.engine import health
from kdelay.engine.factory import KafkaClients
from kdelay.engine.service import Service
from kdelay.plumbing.clients import Consuming
from kdelay.plumbing.clock import SystemClock
from kdelay.plumbing.settings import Guarantee
from kdelay.plumbing.topics import check_layout
from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.integration.conftest import Deployment, produce

PARTITIONS = 2
HOUR_MS = 3_600_000
# Readiness is judged every housekeeping round (5 s) from answers asked every 10 s.
JUDGED_WITHIN_S = 60.0
LAG = re.compile(r'^kdelay_intake_lag_records\{partition="(\d+)"\} (\S+)$', re.MULTILINE)


class Pausable(Consumer):
    """The intake consumer with a fault hook: while ``stopped``, every assigned partition
    is paused (fetches stop; the loop still consumes, so rebalances still run)."""

    stopped = False
    _paused = False

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        if self.stopped != self._paused:
            (self.pause if self.stopped else self.resume)(self.assignment())
            self._paused = self.stopped
        return super().consume(num_messages, timeout)


class Faulty(KafkaClients):
    """Real clients, the intake consumer a :class:`Pausable`."""

    intake: Pausable | None = None

    def consumer(self, name: str, **overrides: str | int | bool) -> Consuming:
        if name != "intake":
            return super().consumer(name, **overrides)
        self.intake = Pausable(self._config(name, overrides))
        return self.intake


class Instance:
    """A service looping on a thread, its probes served on a free port."""

    def __init__(self, deployment: Deployment) -> None:
        settings = deployment.settings
        self.clients = Faulty(settings)
        self.service = Service(settings, SystemClock(),
                               check_layout(deployment.admin, settings), clients=self.clients)
        self.port = health.serve(0, self.service.metrics.registry, self.service.health,
                                 address="127.0.0.1")
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.service.run()
        except BaseException as exc:
            self.failure = exc

    def get(self, path: str) -> tuple[int, str]:
        assert self.failure is None, self.failure
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=5) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as failed:
            return failed.code, failed.read().decode()

    def lag(self) -> dict[int, float]:
        return {int(p): float(v) for p, v in LAG.findall(self.get("/metrics")[1])}

    def until(self, condition: Callable[[], bool], what: str,
              timeout_s: float = JUDGED_WITHIN_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, (
                f"{what}: not within {timeout_s} s; /readyz says {self.get('/readyz')}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.service.stop()
        self._thread.join(60)


@pytest.fixture
def instance() -> Iterator[Callable[[Deployment], Instance]]:
    made: list[Instance] = []

    def start(deployment: Deployment) -> Instance:
        made.append(Instance(deployment))
        return made[-1]

    yield start
    for each in made:
        each.stop()


def requests(target: str, count: int, start: int) -> list[dict[str, Any]]:
    """``count`` requests due in an hour, on both partitions."""
    return [{"key": f"k{i}".encode(), "value": b"v", "partition": i % PARTITIONS,
             "headers": [(envelope.TARGET, target.encode()),
                         (envelope.DELAY_MS, str(HOUR_MS).encode())]}
            for i in range(start, start + count)]


@pytest.mark.parametrize("guarantee", [Guarantee.AT_LEAST_ONCE])
def test_a_consumer_that_stops_fetching_fails_readiness_and_its_lag_grows(
    deployment_factory: Callable[..., Deployment], instance: Callable[[Deployment], Instance],
    topic_factory: TopicFactory, bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=PARTITIONS)
    target = topic_factory("target", 1)
    running = instance(deployment)
    assert running.get("/readyz")[0] == 503, "a fresh instance is not ready"
    produce(bootstrap, deployment.requests, requests(target, 20, 0))
    running.until(lambda: running.get("/readyz") == (200, "ok\n"), "ready")
    running.until(lambda: running.lag() == {0: 0, 1: 0}, "every request taken in")

    assert running.clients.intake is not None
    running.clients.intake.stopped = True
    time.sleep(1)  # the next step pauses the partitions
    produce(bootstrap, deployment.requests, requests(target, 40, 20))
    stands = "intake stands at offset 10, the broker's high watermark was 30"
    running.until(lambda: running.get("/readyz")[0] == 503 and stands in running.get("/readyz")[1],
                  "not ready once fetches stop, naming the partitions")
    running.until(lambda: running.lag() == {0: 20, 1: 20}, "the lag of what came meanwhile")
    produce(bootstrap, deployment.requests, requests(target, 20, 60))
    running.until(lambda: running.lag() == {0: 30, 1: 30}, "the lag grows")
    assert running.get("/healthz") == (200, "ok\n"), "the loop still steps: alive"

    running.clients.intake.stopped = False
    running.until(lambda: running.get("/readyz") == (200, "ok\n"), "ready again")
    running.until(lambda: running.lag() == {0: 0, 1: 0}, "caught up")
