"""`kdelay restore`: rebuild local indexes from the changelog, from the command line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from typer.testing import CliRunner

from kdelay import envelope
from kdelay.cli import app
from kdelay.clock import ManualClock
from kdelay.index import PartitionIndex, store_path
from tests.conftest import TopicFactory
from tests.integration.conftest import Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]


def _args(deployment: Deployment) -> list[str]:
    s = deployment.settings
    return ["--bootstrap-servers", s.bootstrap_servers, "--requests-topic", s.requests_topic,
            "--changelog-topic", s.changelog_topic, "--dlq-topic", s.dlq_topic,
            "--state-dir", str(s.state_dir)]


def _pending(deployment: Deployment, partition: int) -> list[bytes]:
    s = deployment.settings
    index = PartitionIndex(store_path(s.state_dir, s.requests_topic, partition), partition)
    try:
        return [entry.key for entry in index.entries()]
    finally:
        index.close()


def test_restore_fresh_rebuilds_what_the_service_indexed(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=2)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    records: list[dict[str, Any]] = [
        {"key": f"k{i}".encode(), "value": b"v", "timestamp": clock.now_ms(), "partition": i % 2,
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"3600000")]}
        for i in range(40)]
    produce(bootstrap, deployment.requests, records)
    group = running(deployment, clock)
    service = group.add()
    group.until(lambda: (service.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": "scheduled"}) or 0) >= 40)
    group.close(service)
    before = {p: _pending(deployment, p) for p in (0, 1)}
    assert sum(len(keys) for keys in before.values()) == 40

    result = CliRunner().invoke(app, ["restore", "--fresh", *_args(deployment)])

    assert result.exit_code == 0, result.output
    assert "partition 0:" in result.output
    assert "partition 1:" in result.output
    assert {p: _pending(deployment, p) for p in (0, 1)} == before


def test_restore_refuses_a_store_that_is_in_use(deployment_factory: Make) -> None:
    deployment = deployment_factory(partitions=1)
    s = deployment.settings
    holder = PartitionIndex(store_path(s.state_dir, s.requests_topic, 0), 0)
    try:
        result = CliRunner().invoke(app, ["restore", "--fresh", *_args(deployment)])
        assert result.exit_code == 2
        assert "error[state-dir-in-use]" in result.output
    finally:
        holder.close()
