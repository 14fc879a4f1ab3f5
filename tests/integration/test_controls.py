"""Target controls against the real broker: pause, restart while paused, resume with a
capped catch-up, a standing cap on one of two targets, a paused lane; both guarantees.

Rates are measured on the injected clock: the republished record's timestamp is the
service clock's time when it went out, and the clock moves only as the test says.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import Message

from kdelay import controls
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from kdelay.protocol.controls import Control, Scope, Subject
from kdelay.protocol.targets import Lanes
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, header, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]
STEP_MS = 10


def _requests(target: str, count: int, due_ms: int, lane: str | None = None,
              tag: str = "") -> list[dict[str, object]]:
    """``count`` requests for ``target``, due one millisecond apart from ``due_ms``."""
    extra = [] if lane is None else [(envelope.LANE, lane.encode())]
    return [{"key": f"{tag}{i}".encode(), "value": b"v", "timestamp": due_ms - 1_000,
             "headers": [(envelope.TARGET, target.encode()),
                         (envelope.DUE_MS, str(due_ms + i).encode()), *extra]}
            for i in range(count)]


def _controls_of(service: Service) -> dict[Subject, Control]:
    return service._started()[1].controls.subjects  # what the instance applies


def _in_force(running: Running, subject: Subject, paused: bool) -> None:
    """Step until every instance applies ``subject``'s control as paused (or not)."""
    def applied() -> bool:
        return all((c := _controls_of(s).get(subject)) is not None
                   and (c.paused is not None) == paused for s in running.services)
    running.until(applied, timeout_s=30)


def _paused(running: Run, deployment: Deployment, subject: Subject,
            reason: str) -> tuple[Running, ManualClock]:
    """A service on ``deployment``, on a manual clock, once every instance applies a pause
    of ``subject``."""
    clock = ManualClock(int(time.time() * 1000))
    service = running(deployment, clock)
    service.add()
    controls.pause(deployment.settings, subject, "test", reason, clock.now_ms())
    _in_force(service, subject, paused=True)
    return service, clock


def _in_due_order(records: list[Message]) -> bool:
    """Whether what went out earlier (by the service clock) was due no later."""
    sent = sorted((m.timestamp()[1], int(header(m, envelope.DUE_MS) or b"0")) for m in records)
    dues = [due for _, due in sent]
    return dues == sorted(dues)


def _checked(records: list[Message]) -> list[int]:
    """The delivery times of ``records``: never early, each origin once; return them."""
    origins = [header(m, envelope.ORIGIN) for m in records]
    assert len(set(origins)) == len(origins), "a record was delivered twice"
    times = []
    for message in records:
        due = int(header(message, envelope.DUE_MS) or b"0")
        at = message.timestamp()[1]
        assert at >= due, f"delivered {due - at} ms early"
        times.append(at)
    return times


def test_a_paused_target_holds_across_a_restart_and_catches_up_at_its_rate(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=2)
    settings = deployment.settings
    orders, billing = topic_factory("orders", 2), topic_factory("billing", 2)
    subject = Subject(Scope.TARGET, orders)
    out = collector([orders, billing, settings.dlq_topic])
    service, clock = _paused(running, deployment, subject, "orders-db maintenance")

    due = clock.now_ms() + 100
    produce(bootstrap, settings.requests_topic,
            _requests(orders, 60, due, tag="o") + _requests(billing, 60, due, tag="b"))
    # Under load the other target flows as before, in due order; the paused one waits.
    service.until(lambda: out.poll() >= 60 and len(out.on(billing)) == 60,
                  advance_ms=STEP_MS)
    for _ in range(100):
        clock.advance(STEP_MS * 3)
        service.step()
    out.poll(0.5)
    assert out.on(orders) == []
    assert out.on(settings.dlq_topic) == []
    _checked(out.on(billing))

    # A restart while paused: the new instance reads the pause before it delivers.
    service.close()
    service.add()
    for _ in range(50):
        clock.advance(STEP_MS * 3)
        service.step()
    out.poll(0.5)
    assert out.on(orders) == []

    controls.resume(settings, subject, "test", clock.now_ms(), catch_up_per_s=20.0)
    service.until(lambda: out.poll() >= 0 and len(out.on(orders)) >= 60, advance_ms=STEP_MS)
    out.poll(0.5)
    held = out.on(orders)
    times = _checked(held)
    assert len(held) == 60
    assert out.on(settings.dlq_topic) == []
    assert _in_due_order(held), "held records go out oldest first"
    # 60 records at 20/s after a burst of 2: about 2.9 s of service clock.
    spread_ms = max(times) - min(times)
    assert 2_500 <= spread_ms <= 4_000, spread_ms


def test_a_cap_on_one_of_two_targets_leaves_the_other_alone(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=2)
    settings = deployment.settings
    orders, billing = topic_factory("orders", 1), topic_factory("billing", 1)
    clock = ManualClock(int(time.time() * 1000))
    subject = Subject(Scope.TARGET, orders)
    out = collector([orders, billing, settings.dlq_topic])
    service = running(deployment, clock)
    service.add()
    controls.limit(settings, subject, "test", clock.now_ms(), 50.0)
    service.until(lambda: subject in _controls_of(service.services[0]))

    due = clock.now_ms() + 100
    produce(bootstrap, settings.requests_topic,
            _requests(orders, 100, due, tag="o") + _requests(billing, 100, due, tag="b"))
    service.until(lambda: out.poll() >= 200, advance_ms=STEP_MS)
    out.poll(0.5)
    capped, free = _checked(out.on(orders)), _checked(out.on(billing))
    assert len(capped) == 100
    assert len(free) == 100
    # 100 at 50/s after a burst of 5: about 1.9 s; the other target's 100 go at once.
    assert 1_700 <= max(capped) - min(capped) <= 3_000, max(capped) - min(capped)
    assert max(free) - (due + 99) <= 1_000
    assert _in_due_order(out.on(orders)), "records over the cap wait their turn in due order"


def test_a_paused_lane_holds_its_targets_and_not_the_others(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    run = uuid.uuid4().hex[:6]
    lane_topic = topic_factory(f"gold{run}", 1)
    deployment = deployment_factory(partitions=1, lanes=Lanes({"gold": f"gold{run}-"}))
    settings = deployment.settings
    plain = topic_factory("plain", 1)
    subject = Subject(Scope.LANE, "gold")
    out = collector([lane_topic, plain, settings.dlq_topic])
    service, clock = _paused(running, deployment, subject, "lane maintenance")

    due = clock.now_ms() + 100
    produce(bootstrap, settings.requests_topic,
            _requests(lane_topic, 20, due, lane="gold", tag="g") + _requests(plain, 20, due))
    service.until(lambda: out.poll() >= 0 and len(out.on(plain)) == 20, advance_ms=STEP_MS)
    for _ in range(50):
        clock.advance(STEP_MS * 3)
        service.step()
    out.poll(0.5)
    assert out.on(lane_topic) == []
    assert out.on(settings.dlq_topic) == []

    controls.resume(settings, subject, "test", clock.now_ms(), catch_up_per_s=None)
    service.until(lambda: out.poll() >= 0 and len(out.on(lane_topic)) == 20,
                  advance_ms=STEP_MS)
    out.poll(0.5)
    assert len(_checked(out.on(lane_topic))) == 20
    assert out.on(settings.dlq_topic) == []


def test_a_paused_target_with_a_long_backlog_never_holds_back_another(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    """More paused records fall due in one partition than its read-ahead holds (20
    batches of the default 1 000): past about a batch they stay shelved in the index,
    and the other target's records due after them go out as before. On resume every
    one goes out once, oldest first."""
    deployment = deployment_factory(partitions=1)
    settings = deployment.settings
    orders, billing = topic_factory("orders", 1), topic_factory("billing", 1)
    subject = Subject(Scope.TARGET, orders)
    out = collector([orders, billing, settings.dlq_topic])
    service, clock = _paused(running, deployment, subject, "orders-db maintenance")

    backlog = 21 * settings.batch_size + 500
    due = clock.now_ms() + 100
    produce(bootstrap, settings.requests_topic,
            _requests(orders, backlog, due, tag="o")
            + _requests(billing, 50, due + backlog, tag="b"))
    service.until(lambda: out.poll() >= 0 and len(out.on(billing)) == 50,
                  advance_ms=STEP_MS * 10)
    assert out.on(orders) == []
    _checked(out.on(billing))

    controls.resume(settings, subject, "test", clock.now_ms(), catch_up_per_s=None)
    service.until(lambda: out.poll() >= 0 and len(out.on(orders)) >= backlog,
                  advance_ms=STEP_MS * 10)
    out.poll(0.5)
    held = out.on(orders)
    _checked(held)
    assert len(held) == backlog
    assert out.on(settings.dlq_topic) == []
    assert _in_due_order(held), "held and shelved records go out oldest first"
