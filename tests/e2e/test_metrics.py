"""A real Prometheus server scrapes a running ``kdelay run`` and stores what it did.

The test drives the service (deliveries, a malformed request, entries held back
because their target topic does not exist, entries due in an hour), then asks
Prometheus's HTTP API for the figures it scraped, until they match or a
deadline passes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TopicFactory
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    Receiver,
    clean_environment,
    produce_requests,
    run_cli,
)
from tests.e2e.prometheus_server import PrometheusServer, free_port

kafka = pytest.mark.kafka
SCRAPE_TIMEOUT_S = 60.0
WEEK_S = 7 * 86_400  # the requests topic's retention, as kdelay topics create sets it
Prometheus = Callable[[list[str]], PrometheusServer]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    """Start Prometheus servers scraping given targets; stop them when the test ends."""
    made: list[PrometheusServer] = []

    def start(targets: list[str]) -> PrometheusServer:
        made.append(PrometheusServer(tmp_path / f"prometheus-{len(made)}", targets))
        return made[-1]

    yield start
    for server in made:
        server.stop()


def request(target: str, delay_ms: int, partition: int, i: int) -> dict[str, Any]:
    return {"key": f"k{i}".encode(), "value": b"v", "partition": partition,
            "headers": [("kdelay-target", target.encode()),
                        ("kdelay-delay-ms", str(delay_ms).encode())]}


def until_stored(server: PrometheusServer, expected: dict[str, float],
                 timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
    """Query until every expression yields its expected value; fail naming the ones that do not."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {expr: server.value(expr) for expr in expected}
        wrong = {expr: (value, expected[expr]) for expr, value in found.items()
                 if value is None or abs(value - expected[expr]) > 1e-6}
        if not wrong:
            return
        assert time.monotonic() < deadline, f"stored (found, expected): {wrong}"
        time.sleep(0.5)


@kafka
def test_prometheus_stores_what_the_service_did(
    deploy: Callable[..., Deployment], start_kdelay: Callable[..., KdelayProcess],
    receiver: Callable[[list[str]], Receiver], topic_factory: TopicFactory,
    prometheus: Prometheus,
) -> None:
    deployment = deploy(partitions=2)
    target = topic_factory("e2e-metrics-target", partitions=1)
    absent = f"e2e-absent-{uuid.uuid4().hex[:12]}"  # never created: delivery is held back
    port = free_port()
    service = start_kdelay(deployment, KDELAY_METRICS_PORT=str(port),
                           KDELAY_DELIVERY_ATTEMPTS="1000", KDELAY_LOG_FORMAT="json")
    server = prometheus([f"127.0.0.1:{port}"])
    service.wait_ready()

    due_now = [request(target, 300, i % 2, i) for i in range(5)]
    held = [request(absent, 0, 0, 10 + i) for i in range(3)]
    later = [request(target, 3_600_000, 1, 20 + i) for i in range(2)]
    malformed = [{"key": b"bad", "value": b"v", "partition": 1,
                  "headers": [("kdelay-delay-ms", b"100")]}]
    reports = produce_requests(deployment, [*due_now, *held, *later, *malformed])
    # Reports come in acknowledgement order, not produce order: find them by key.
    stamps = {r.key(): r.timestamp()[1] for r in reports}
    held_due_s = min(stamps[r["key"]] for r in held) / 1000
    later_due_s = max(stamps[r["key"]] for r in later) / 1000 + 3_600

    out = receiver([target])
    out.until(lambda: len(out.received) >= 5, "five deliveries", timeout_s=60)

    until_stored(server, {
        'up{job="kdelay"}': 1,
        "kdelay_owned_partitions": 2,
        "kdelay_request_partitions": 2,
        "sum(kdelay_delivered_records_total)": 5,
        "sum(kdelay_lateness_seconds_count)": 5,
        'sum(kdelay_intake_records_total{outcome="scheduled"})': 10,
        'sum(kdelay_intake_records_total{outcome="rejected"})': 1,
        'sum(kdelay_dead_lettered_records_total{reason="missing-target"})': 1,
        "sum(kdelay_dead_lettered_records_total)": 1,
        # The three entries for the missing topic are overdue on partition 0.
        'kdelay_overdue_entries{partition="0"}': 3,
        'kdelay_overdue_entries{partition="1"}': 0,
        'kdelay_pending_earliest_due_timestamp_seconds{partition="0"}': held_due_s,
        'kdelay_pending_latest_due_timestamp_seconds{partition="1"}': later_due_s,
        'kdelay_intake_lag_records{partition="0"}': 0,
        'kdelay_intake_lag_records{partition="1"}': 0,
    })
    age = server.value('kdelay_overdue_oldest_age_seconds{partition="0"}')
    assert age is not None
    assert age > 0
    # The held entries' originals stay for the topic's retention (a week) from their timestamp.
    headroom = server.value('kdelay_retention_headroom_seconds{partition="0"}')
    assert headroom is not None
    assert WEEK_S - age - SCRAPE_TIMEOUT_S < headroom <= WEEK_S - age + 0.001
    retries = server.value("sum(kdelay_delivery_retries_total)")
    assert retries is not None
    assert retries > 0
    assert len(out.received) == 5

    # kdelay stats reads the same endpoint.
    shown = run_cli(clean_environment(), "stats", "--url", f"127.0.0.1:{port}", "--json",
                    "--interval", "0.5")
    assert shown.returncode == 0, shown.stderr
    [summary] = json.loads(shown.stdout)
    assert summary["error"] is None
    assert summary["owned_partitions"] == 2
    assert summary["request_partitions"] == 2
    assert summary["overdue"] == 3
    assert summary["oldest_overdue_s"] > 0
    assert summary["intake_lag"] == 0
    assert summary["dead_letters_by_reason"] == {"missing-target": 0.0}  # a rate, /s
    assert summary["lateness_p99_s"] is None  # nothing delivered in the last 0.5 s
    screen = run_cli(clean_environment(COLUMNS="200"), "stats", "--url", f"127.0.0.1:{port}",
                     "--interval", "0.2")
    assert screen.returncode == 0, screen.stderr
    assert f"127.0.0.1:{port} " in screen.stdout
    assert "missing-target" in screen.stdout

    assert service.terminate() == 0
    # With KDELAY_LOG_FORMAT=json every line of the service's own is a JSON object
    # (librdkafka's lines, "%<level>|...", do not go through Python logging).
    own = [line for line in service.log().splitlines() if not line.startswith("%")]
    logged = [json.loads(line) for line in own]
    assert {"time", "level", "logger", "message"} <= set(logged[0])
    assert any(x["message"].startswith("assigned [") for x in logged)
