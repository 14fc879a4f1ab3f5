"""The service measures its clock against the broker's from changelog acknowledgements."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from kdelay.engine.skew import BROKER_TOLERANCE_MS
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]

AHEAD_MS = 120_000


@pytest.mark.kafka
def test_a_service_clock_two_minutes_ahead_shows_as_skew_and_a_warning(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    deployment = deployment_factory(partitions=3)
    target = topic_factory("target", 1)
    started = time.monotonic()
    clock = ManualClock(time.time_ns() // 1_000_000 + AHEAD_MS)
    requests = [{"value": b"v", "partition": p, "headers": [
        (envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"3600000")]} for p in range(3)]
    produce(bootstrap, deployment.requests, requests)
    group = running(deployment, clock)
    service = group.add()

    def scheduled() -> float | None:
        return service.metrics.registry.get_sample_value(
            "kdelay_intake_records_total", {"outcome": "scheduled"})

    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        group.until(lambda: scheduled() == 3.0)
        # A skew is said once readings a second apart confirm it: one more request, a
        # second later by the service clock, has its consumed-offset marker read again.
        clock.advance(1_000)
        produce(bootstrap, deployment.requests, requests[:1])
        group.until(lambda: scheduled() == 4.0)
        group.step(2)
    skew = service.metrics.registry.get_sample_value("kdelay_clock_skew_seconds")
    assert skew is not None
    # The manual clock stands still (but for the one second) while the broker's moves on.
    elapsed_s = time.monotonic() - started
    assert -AHEAD_MS / 1000 - 2 < skew < -AHEAD_MS / 1000 - 1 + elapsed_s + 0.1
    assert any("behind this service's clock" in r.getMessage() for r in caplog.records)


HOUR_MS = 3_600_000
BEHIND_MS = 10 * 60_000


def _schedule(deployment: Deployment, running: Run, target: str, bootstrap: str,
              now_ms: int, dues: list[int]) -> None:
    """Have an instance schedule one request per due time, then stop it (its state dir
    is kept). Its clock is behind every due time, so it delivers none of them."""
    produce(bootstrap, deployment.requests, [
        {"value": str(due).encode(), "partition": i % 3, "timestamp": now_ms, "headers": [
            (envelope.TARGET, target.encode()), (envelope.DUE_MS, str(due).encode())]}
        for i, due in enumerate(dues)])
    group = running(deployment, ManualClock(min(dues) - BEHIND_MS))
    first = group.add(broker_tolerance_ms=BROKER_TOLERANCE_MS)
    group.until(lambda: first.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": "scheduled"}) == len(dues))
    group.close(first)


def _steps(group: Running, out: Collector, advance_ms: int, rounds: int = 20) -> int:
    """Step ``rounds`` times, moving the clock ``advance_ms`` in all; return the number of
    records the target has."""
    for _ in range(rounds):
        group.clock.advance(advance_ms // rounds)
        group.step()
        out.poll()
    return len(out.messages)


@pytest.mark.kafka
def test_a_wall_clock_stepped_forward_before_a_restart_releases_nothing_early(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    collector: Callable[[list[str]], Collector],
) -> None:
    deployment = deployment_factory(partitions=3)
    target = topic_factory("target", 1)
    now = time.time_ns() // 1_000_000
    due_now, due_later = now - 1_000, now + 30 * 60_000
    _schedule(deployment, running, target, bootstrap, now, [due_now] * 3 + [due_later] * 3)

    # The wall clock jumps an hour ahead while the service is down; it restarts on it.
    group = running(deployment, ManualClock(now + HOUR_MS))
    service = group.add(broker_tolerance_ms=BROKER_TOLERANCE_MS)
    out = collector([target])
    group.until(lambda: out.poll() >= 3)
    _steps(group, out, 20_000)

    assert sorted(int(m.value() or b"0") for m in out.messages) == [due_now] * 3, (
        "only what the broker's clock sees due goes out")
    skew = service.metrics.registry.get_sample_value("kdelay_clock_skew_seconds")
    assert (skew or 0.0) < -3_000, "the broker is seen an hour behind"


@pytest.mark.kafka
def test_a_wall_clock_stepped_back_before_a_restart_delays_but_never_drops(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    collector: Callable[[list[str]], Collector],
) -> None:
    deployment = deployment_factory(partitions=3)
    target = topic_factory("target", 1)
    now = time.time_ns() // 1_000_000
    due = now - 1_000
    _schedule(deployment, running, target, bootstrap, now, [due] * 3)

    group = running(deployment, ManualClock(now - HOUR_MS))
    service = group.add(broker_tolerance_ms=BROKER_TOLERANCE_MS)
    out = collector([target])
    group.until(lambda: len(service.owned()) == 3)
    # Due by the broker's clock, not yet by the service clock's.
    assert _steps(group, out, HOUR_MS - 2 * BEHIND_MS) == 0
    group.until(lambda: out.poll() >= 3, advance_ms=10_000)
    assert len(out.messages) == 3
    assert due <= group.clock.now_ms() < due + 30_000, "out once the service clock says due"
