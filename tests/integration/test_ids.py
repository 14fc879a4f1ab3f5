"""Schedule ids are kept only as long as a request repeating them can still arrive.

A delivered id's marker answers a late cancel with ``already-delivered``
instead of ``unknown``; a request older than the requests topic's retention
can no longer be read, so its marker is dropped after that long (as the
partition's next requests are planned).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kdelay.engine.outlook import HOUSEKEEPING_EVERY_MS
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import codec, envelope, idkeys
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]

RETENTION_MS = 3 * 3_600_000


def ids_held(service: Service) -> int:
    return sum(index.id_count() for index in service.indexes.values())


def with_id(target: str, sid: str, partition: int) -> dict[str, object]:
    return {"key": sid.encode(), "value": b"v", "partition": partition,
            "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"0"),
                        (envelope.SCHEDULE_ID, sid.encode())]}


def delivered_markers(service: Service) -> int:
    """How many of the test's ids the indexes hold as delivered."""
    states = [index.id_state(f"id-{i}") for index in service.indexes.values() for i in range(60)]
    return sum(1 for state in states if state is not None and state.ended_ms is not None)


def with_due(target: str, sid: str, partition: int, due_ms: int) -> dict[str, object]:
    return {"key": sid.encode(), "value": b"v", "partition": partition,
            "headers": [(envelope.TARGET, target.encode()),
                        (envelope.DUE_MS, str(due_ms).encode()),
                        (envelope.SCHEDULE_ID, sid.encode())]}


def cancel(sid: str, partition: int) -> dict[str, object]:
    return {"partition": partition, "headers": [(envelope.CANCEL, sid.encode())]}


def outcomes(service: Service, outcome: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": outcome})
    return value or 0.0


@pytest.mark.kafka
def test_delivered_ids_are_dropped_once_the_requests_retention_has_passed(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=3, retention_ms=RETENTION_MS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    produce(bootstrap, deployment.requests,
            [with_id(target, f"id-{i}", i % 3) for i in range(60)])
    out = collector([target])
    group = running(deployment, clock)
    service = group.add()
    group.until(lambda: out.poll() >= 60, advance_ms=10)
    group.until(lambda: delivered_markers(service) == 60)
    clock.advance(RETENTION_MS - HOUSEKEEPING_EVERY_MS)
    group.step(3)
    assert ids_held(service) == 60, "a marker is kept while its retention lasts"
    produce(bootstrap, deployment.requests, [cancel("id-7", 7 % 3)])
    group.until(lambda: outcomes(service, "already-delivered") == 1)
    clock.advance(2 * HOUSEKEEPING_EVERY_MS)
    group.step(3)
    assert ids_held(service) == 60, "dropped as requests arrive"
    produce(bootstrap, deployment.requests,
            [cancel("id-8", 8 % 3), cancel("other", 0), cancel("other", 1)])
    group.until(lambda: ids_held(service) == 0)
    group.until(lambda: outcomes(service, "unknown") == 3)
    assert service.metrics.registry.get_sample_value("kdelay_schedule_ids_expired_total") == 60
    out.poll(0.5)
    assert len(out.messages) == 60


def answers(out: Collector, topic: str) -> list[idkeys.Answer]:
    return [idkeys.decode_answer(m.value() or b"") for m in out.on(topic)]


def conflicts(service: Service) -> float:
    value = service.metrics.registry.get_sample_value("kdelay_duplicate_conflicts_total")
    return value or 0.0


@pytest.mark.kafka
def test_an_id_delivered_is_never_delivered_again_even_after_a_rebuild(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, tmp_path: Path,
) -> None:
    deployment = deployment_factory(partitions=3)
    answered = deployment.settings.outcomes_topic
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    out = collector([target, answered])
    group = running(deployment, clock)
    service = group.add()
    once = with_due(target, "once", 0, clock.now_ms() - 1_000)
    produce(bootstrap, deployment.requests, [once])
    group.until(lambda: out.poll() > 0 and len(out.on(target)) == 1
                and delivered_markers_of(service, "once"), advance_ms=10)
    changed = {**once, "partition": 1, "value": b"changed"}
    produce(bootstrap, deployment.requests, [once, changed])
    group.until(lambda: outcomes(service, "duplicate") == 2, advance_ms=10)
    assert conflicts(service) == 1, "only the changed payload is a conflict"
    group.close()

    # A new state dir: the index is rebuilt from the changelog and still knows the id.
    group = running(deployment, clock)
    rebuilt = group.add(state_dir=tmp_path / "rebuilt")
    produce(bootstrap, deployment.requests, [{**once, "partition": 2}])
    group.until(lambda: outcomes(rebuilt, "duplicate") == 1, advance_ms=10)
    group.step(20)
    out.poll(0.5)
    assert len(out.on(target)) == 1, "delivered once"
    got = [(a.outcome, a.first, a.differs) for a in answers(out, answered)]
    assert got[0] == ("scheduled", None, False)
    assert sorted(got[1:]) == [("duplicate", "delivered", False)] * 2 + [
        ("duplicate", "delivered", True)], "the same record twice, a changed one once"


def delivered_markers_of(service: Service, sid: str) -> bool:
    states = [index.id_state(sid) for index in service.indexes.values()]
    return any(s is not None and s.end is codec.End.DELIVERED and s.ended_ms for s in states)


@pytest.mark.kafka
def test_a_reschedule_moves_a_pending_schedule_and_never_releases_it_early(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=3)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    out = collector([target])
    group = running(deployment, clock)
    service = group.add()
    start = clock.now_ms()
    produce(bootstrap, deployment.requests,
            [with_due(target, "moved", 1, start + 3_600_000)])  # off its partition or not
    group.until(lambda: outcomes(service, "scheduled") == 1)
    later = start + 60_000
    produce(bootstrap, deployment.requests,
            [{"partition": 2, "headers": envelope.reschedule_headers("moved", due_ms=later)}])
    group.until(lambda: outcomes(service, "rescheduled") == 1)
    assert sum(index.tally.due.total() for index in service.indexes.values()) == 1, "moved"
    clock.set(later - 1)
    group.step(20)
    assert out.poll(0.2) == 0, "not before its new due time"
    clock.set(later)
    group.until(lambda: out.poll() == 1)
    [delivered] = out.messages
    assert dict(delivered.headers() or [])["kdelay-due-ms"] == str(later).encode()
    group.step(20)
    assert out.poll(0.5) == 1, "once"
