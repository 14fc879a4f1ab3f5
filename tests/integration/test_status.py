"""Instance status on the real broker: a restoring partition is reported with its progress,
then serving, and the console's reading of the group shows it."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest

from kdelay.engine import service as service_module
from kdelay.engine.status import MIN_GAP_MS
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.topics import admin_client
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.protocol.status import RESTORING, SERVING, InstanceStatus, decode
from kdelay.state import changelog
from kdelay.view import tails
from kdelay.view.members import membership, statuses
from kdelay.view.pending import QUIET
from tests.conftest import TopicFactory
from tests.integration.conftest import Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
ENTRIES = 3_000


def _said(deployment: Deployment) -> list[InstanceStatus]:
    """Every status record on the deployment's status topic, in the order written."""
    found = tails.newest(deployment.settings.client_config(), [deployment.settings.status_topic],
                         lambda message: (message.offset() or 0, decode(message.value())),
                         per_partition=10_000)
    return [status for _, status in sorted(found.items, key=lambda item: item[0])]


def test_a_restoring_partition_is_reported_with_its_progress_then_serving(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small slices, so that partition 1's restore takes several steps.
    monkeypatch.setattr(changelog, "APPLY_EVERY", 500)
    monkeypatch.setattr(changelog, "TAKE", 500)
    monkeypatch.setattr(service_module, "RESTORE_SLICE_S", 0.0)
    deployment = deployment_factory(partitions=2)
    settings = deployment.settings
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    produce(bootstrap, deployment.requests, [
        {"key": b"k", "value": b"v", "timestamp": clock.now_ms(), "partition": 0,
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"600000")]}])
    group = running(deployment, clock)
    service = group.add()
    group.until(lambda: (service.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": "scheduled"}) or 0) >= 1)
    group.close(service)
    far = clock.now_ms() + 86_400_000
    produce(bootstrap, settings.changelog_topic, [
        {"key": codec.encode_due_key(far + i, 1, i),
         "value": codec.encode_index_value(IndexValue(Fingerprint(far, i), None)), "partition": 1}
        for i in range(ENTRIES)])
    shutil.rmtree(settings.state_dir)  # the state dir is lost: both partitions restore
    clock.advance(1)
    restarted_ms = clock.now_ms()  # the first instance's reports (same id) are older
    service = group.add()
    group.until(lambda: service.owned() == [0, 1], timeout_s=120, advance_ms=MIN_GAP_MS)
    clock.advance(MIN_GAP_MS)
    group.step()  # the change to serving is written
    service.metrics  # noqa: B018  (the service runs on; its status producer delivers)
    deadline = time.monotonic() + 30
    while True:
        said = [s for s in _said(deployment) if s.partitions and s.at_ms >= restarted_ms]
        if (said and said[-1].partitions.get(1) is not None and \
                said[-1].partitions[1].state == SERVING) or time.monotonic() > deadline:
            break
        group.step()

    ones = [s.partitions[1] for s in said if 1 in s.partitions]
    restoring = [p for p in ones if p.state == RESTORING]
    assert restoring, "partition 1 was reported restoring"
    progressed = [p for p in restoring if p.total is not None]
    assert progressed
    assert all(p.total == ENTRIES for p in progressed)
    assert any(0 < p.done < ENTRIES for p in progressed), [(p.done, p.total) for p in ones]
    dones = [p.done for p in progressed]
    assert dones == sorted(dones), "progress only grows"
    assert ones[-1].state == SERVING
    last_restoring = max(i for i, p in enumerate(ones) if p.state == RESTORING)
    assert {p.state for p in ones[last_restoring + 1:]} == {SERVING}, "serving after the restore"

    admin = admin_client(settings, log_level=QUIET)
    latest, why = statuses(settings, admin, 10.0)
    assert why is None
    seen = membership(settings)
    assert {p: s.state for p, s in seen.partitions.items()} == {0: SERVING, 1: SERVING}
    assert {s.instance for s in seen.partitions.values()} == set(latest)
    group.close(service)
    stopped = _said(deployment)[-1]
    assert stopped.partitions == {}, "a clean stop says it serves nothing"


def test_without_the_status_topic_the_partitions_are_unknown_not_an_error(
    deployment_factory: Make, running: Run,
) -> None:
    deployment = deployment_factory(partitions=1, status_topic="kdelay-no-such-status-topic")
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    service = group.add()
    group.until(lambda: service.owned() == [0], timeout_s=60)
    seen = membership(deployment.settings)
    assert seen.partitions[0].state == "unknown"
    assert "does not exist" in (seen.partitions[0].why or "")
