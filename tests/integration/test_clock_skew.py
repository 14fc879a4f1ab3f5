"""The service measures its clock against the broker's from changelog acknowledgements."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.integration.conftest import Deployment, Running, produce

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
    produce(bootstrap, deployment.requests, [
        {"value": b"v", "partition": p, "headers": [
            (envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"3600000")]}
        for p in range(3)])
    group = running(deployment, clock)
    service = group.add()
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        group.until(lambda: service.metrics.registry.get_sample_value(
            "kdelay_intake_records_total", {"outcome": "scheduled"}) == 3.0)
        group.step(2)
    skew = service.metrics.registry.get_sample_value("kdelay_clock_skew_seconds")
    assert skew is not None
    # The manual clock stands still while the broker's moves on.
    elapsed_s = time.monotonic() - started
    assert -AHEAD_MS / 1000 - 1 < skew < -AHEAD_MS / 1000 + elapsed_s + 0.1
    assert any("behind this service's clock" in r.getMessage() for r in caplog.records)
