"""The outlook gauges and the partition and transaction metrics of a real service.

In-process on a manual clock, under both guarantees: housekeeping runs when
the test moves the clock past its 5 s round.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kdelay.engine.outlook import HOUSEKEEPING_EVERY_MS
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Guarantee
from kdelay.view.retention import set_retention
from tests.conftest import TopicFactory
from tests.integration.conftest import Collector, Deployment, Running, produce
from tests.integration.test_service import request

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]


def sample(service: Service, name: str, **labels: str) -> float | None:
    return service.metrics.registry.get_sample_value(name, labels)


def test_outlook_of_a_running_service(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
    bootstrap: str, guarantee: Guarantee,
) -> None:
    deployment = deployment_factory(partitions=2)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    start = clock.now_ms()
    soon = [request(target, i, start, 1_000, partition=i % 2) for i in range(4)]
    later = [request(target, 10 + i, start, 3_600_000, partition=i % 2) for i in range(2)]
    produce(bootstrap, deployment.requests, [*soon, *later])
    out = collector([target])
    service = running(deployment, clock)
    instance = service.add()

    def delivered() -> bool:
        out.poll()
        return len(out.messages) >= len(soon)

    service.until(delivered, timeout_s=60, advance_ms=50)
    clock.advance(HOUSEKEEPING_EVERY_MS)
    service.step()

    assert sample(instance, "kdelay_owned_partitions") == 2
    assert sample(instance, "kdelay_request_partitions") == 2
    assert sample(instance, "kdelay_rebalances_total", kind="assign") == 1
    for partition in ("0", "1"):
        assert sample(instance, "kdelay_overdue_entries", partition=partition) == 0
        assert sample(instance, "kdelay_overdue_oldest_age_seconds", partition=partition) == 0
        assert sample(instance, "kdelay_intake_lag_records", partition=partition) == 0
        assert sample(instance, "kdelay_pending_latest_due_timestamp_seconds",
                      partition=partition) == (start + 3_600_000) / 1000
        # Exact, from the index's tally: one entry due in an hour on each partition.
        assert sample(instance, "kdelay_pending_entries", partition=partition) == 1
        horizons = {h: sample(instance, "kdelay_pending_by_horizon_entries",
                              partition=partition, horizon=h)
                    for h in ("overdue", "1m", "10m", "1h", "1d", "beyond")}
        assert horizons == {"overdue": 0, "1m": 0, "10m": 0, "1h": 1, "1d": 0, "beyond": 0}
        assert sample(instance, "kdelay_retention_at_risk_entries", partition=partition) == 0
    commits = sample(instance, "kdelay_transaction_commit_seconds_count")
    if guarantee is Guarantee.EXACTLY_ONCE:
        assert commits is not None
        assert commits > 0
    else:
        assert commits == 0

    # The hour passes: both entries are overdue until delivery catches up, and
    # the outlook says so at the next round, before the step delivers them.
    clock.advance(3_600_000 + 62_000)  # past the due minute: "overdue" counts by minute
    instance._housekeeping(True)  # the round alone: a step would deliver them first
    overdue = [sample(instance, "kdelay_overdue_entries", partition=p) for p in ("0", "1")]
    assert overdue == [1, 1]
    assert [sample(instance, "kdelay_pending_by_horizon_entries", partition=p,
                   horizon="overdue") for p in ("0", "1")] == [1, 1]
    age = sample(instance, "kdelay_overdue_oldest_age_seconds", partition="0")
    assert age == (clock.now_ms() - start - 3_600_000) / 1000

    service.close(instance)
    assert sample(instance, "kdelay_owned_partitions") == 0


def test_entries_due_after_a_lowered_retention_are_counted_at_risk(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
) -> None:
    deployment = deployment_factory(partitions=1, retention_ms=7 * 86_400_000)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    produce(bootstrap, deployment.requests, [
        request(target, 0, clock.now_ms(), 2 * 86_400_000, partition=0),
        request(target, 1, clock.now_ms(), 3_600_000, partition=0)])
    group = running(deployment, clock)
    first = group.add()
    group.until(lambda: sample(first, "kdelay_intake_records_total", outcome="scheduled") == 2)
    clock.advance(HOUSEKEEPING_EVERY_MS)
    group.step()
    assert sample(first, "kdelay_retention_at_risk_entries", partition="0") == 0
    group.close(first)
    set_retention(deployment.settings, 86_400_000)  # a day: the two-day entry outlives it
    second = group.add()  # reads the new retention at start
    group.until(lambda: sample(second, "kdelay_pending_entries", partition="0") == 2,
                advance_ms=HOUSEKEEPING_EVERY_MS)
    assert sample(second, "kdelay_retention_at_risk_entries", partition="0") == 1
