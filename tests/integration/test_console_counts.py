"""The console's background summary counts what ``kdelay backlog`` counts, on the real broker.

A service schedules requests to two targets, due over two days; the
console's reads, kept current by their background thread, must then give the
backlog, the timeline and the filtered list's total that the view's
own functions (those of ``kdelay backlog`` and ``due``) give on a fresh view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Guarantee
from kdelay.protocol import envelope
from kdelay.view.backlog import backlog
from kdelay.view.listing import Filter, KeyMatch, Order, by_lane, listing, timeline
from kdelay.view.pending import Originals, PendingView
from kdelay.web.reads import HOUR_MS, Reads
from tests.conftest import TopicFactory
from tests.integration.conftest import Deployment, Running, produce

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
COUNT = 90
ORDERS = [Order(sort, descending) for sort in ("due", "id", "target", "request")
          for descending in (False, True)]


def _scheduled(group: Running) -> float:
    value = group.services[0].metrics.registry.get_sample_value(
        "kdelay_intake_records_total", {"outcome": "scheduled"})
    return value or 0.0


@pytest.mark.kafka
@pytest.mark.parametrize("guarantee", [Guarantee.AT_LEAST_ONCE], indirect=True)
def test_the_console_summary_counts_as_backlog_does(
    deployment_factory: Make, running: Run, bootstrap: str, tmp_path: Path,
    topic_factory: TopicFactory,
) -> None:
    deployment = deployment_factory(partitions=3)
    orders, mail = topic_factory("orders", 1), topic_factory("mail", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    group.add()
    records = []
    for n in range(COUNT):
        headers = [(envelope.TARGET, (orders if n % 3 else mail).encode()),
                   (envelope.DUE_MS, str(clock.now_ms() + (n + 1) * 1_900_000).encode()),
                   (envelope.SCHEDULE_ID, f"order-{n}".encode())]
        records.append({"key": f"k{n}".encode(), "value": b"{}", "headers": headers})
    produce(bootstrap, deployment.requests, records)
    group.until(lambda: _scheduled(group) >= COUNT)
    group.close()

    reads = Reads(deployment.settings, tmp_path / "console", clock, audit_topic="unused")
    snapshots = reads.keep_current(interval_s=0.2)
    try:
        deadline = time.monotonic() + 60
        while snapshots.freshness.as_of_ms is None:
            assert time.monotonic() < deadline, snapshots.freshness
            time.sleep(0.1)
        shown = reads.overview()
        shown_timeline = reads.timeline(60_000, Filter(target=orders))
        chosen = Filter(target=orders, due_from_ms=clock.now_ms() + HOUR_MS)
        shown_page = reads.pending(chosen, skip=5, limit=10)
        shown_sorted = {order: reads.pending(chosen, skip=3, limit=20, order=order)
                        for order in ORDERS}
        keyed = reads.pending(Filter(), order=Order("id"), key=KeyMatch(b"k1", prefix=True))
        exact = reads.pending(Filter(), key=KeyMatch(b"k17"))
    finally:
        snapshots.stop()

    now_ms = clock.now_ms()
    with PendingView(deployment.settings, tmp_path / "cli", now_ms) as view, \
            Originals(deployment.settings) as originals:
        counted = backlog(view, now_ms, HOUR_MS, originals)
        lanes = by_lane(view, originals)
        expected_timeline = timeline(view, originals, 60_000, Filter(target=orders))
        expected_page = listing(view, originals, chosen, skip=5, limit=10)
        expected_sorted = {order: listing(view, originals, chosen, skip=3, limit=20,
                                          order=order) for order in ORDERS}
    assert counted.pending == COUNT
    assert shown.backlog == counted
    assert shown.lanes == lanes
    assert shown_timeline == expected_timeline
    assert shown_page.total == expected_page.total
    assert [entry for entry, _ in shown_page.rows] == [entry for entry, _ in expected_page.rows]
    for order in ORDERS:  # the summary's sorts, as the view's own plain sort gives them
        assert shown_sorted[order].total == expected_sorted[order].total, order
        assert [e for e, _ in shown_sorted[order].rows] == [
            e for e, _ in expected_sorted[order].rows], order
    ones = sorted(f"order-{n}" for n in range(COUNT) if f"k{n}".startswith("k1"))
    assert [entry.schedule_id for entry, _ in keyed.rows] == ones
    assert (keyed.total, keyed.capped) == (len(ones), None)
    assert [entry.schedule_id for entry, _ in exact.rows] == ["order-17"]

