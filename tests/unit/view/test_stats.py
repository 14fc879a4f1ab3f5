"""``kdelay stats`` logic on text expositions of a real registry; no endpoint, no sleep."""

from __future__ import annotations

import io
import json

import pytest
from prometheus_client import generate_latest
from rich.console import Console

from kdelay.engine.metrics import Metrics
from kdelay.view.stats import Scrape, Stats, endpoints, parse, quantile, show, summarize

URL = "http://127.0.0.1:9100/metrics"
# A real exposition, as captured from a kdelay instance's endpoint (trimmed).
CAPTURED = """\
# HELP kdelay_delivered_records_total Records republished to their target
# TYPE kdelay_delivered_records_total counter
kdelay_delivered_records_total 120.0
# HELP kdelay_owned_partitions Request partitions this instance serves
# TYPE kdelay_owned_partitions gauge
kdelay_owned_partitions 2.0
# HELP kdelay_overdue_entries Pending entries already due
# TYPE kdelay_overdue_entries gauge
kdelay_overdue_entries{partition="0"} 3.0
kdelay_overdue_entries{partition="1"} 4.0
# HELP kdelay_lateness_seconds Produce time minus due time, by the service clock
# TYPE kdelay_lateness_seconds histogram
kdelay_lateness_seconds_bucket{le="0.01"} 50.0
kdelay_lateness_seconds_bucket{le="0.1"} 100.0
kdelay_lateness_seconds_bucket{le="+Inf"} 120.0
kdelay_lateness_seconds_count 120.0
kdelay_lateness_seconds_sum 9.5
"""


def exposition(delivered: int, late: list[float], dlq: dict[str, int]) -> str:
    """The text a Metrics registry exports after ``delivered`` deliveries and so on."""
    metrics = Metrics()
    metrics.delivery.delivered.inc(delivered)
    metrics.intake.records.labels(outcome="scheduled").inc(delivered * 2)
    # Lateness is by target: the summary sums the targets' buckets up.
    late_ms = [round(seconds * 1000) for seconds in late]
    metrics.delivery.lateness.observe_ms(late_ms[::2], "orders")
    metrics.delivery.lateness.observe_ms(late_ms[1::2], "mail")
    for reason, count in dlq.items():
        metrics.dead_lettered.labels(reason=reason).inc(count)
    metrics.cluster.owned.set(3)
    metrics.outlook.partitions.set(6)
    metrics.outlook.pending.labels(partition="0").set(10)
    metrics.outlook.pending.labels(partition="4").set(5)
    metrics.outlook.overdue.labels(partition="0").set(2)
    metrics.outlook.oldest_overdue.labels(partition="0").set(1.5)
    metrics.outlook.oldest_overdue.labels(partition="4").set(0)
    metrics.outlook.intake_lag.labels(partition="0").set(7)
    metrics.cluster.clock_skew.set(-0.25)
    return generate_latest(metrics.registry).decode()


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.01, 50.0), (0.1, 100.0), (float("inf"), 120.0)]
    assert quantile(0.25, buckets) == pytest.approx(0.01 * 30 / 50)
    assert quantile(0.5, buckets) == pytest.approx(0.01 + 0.09 * 10 / 50)
    # The rank falls in +Inf: the highest finite bound, as histogram_quantile says.
    assert quantile(0.99, buckets) == 0.1
    assert quantile(0.5, [(0.01, 0.0), (float("inf"), 0.0)]) is None


def test_a_captured_exposition_without_a_previous_reading() -> None:
    summary = summarize(None, parse(URL, CAPTURED, 10.0))
    assert summary.owned_partitions == 2
    assert summary.overdue == 7
    assert summary.delivered_rate is None  # one reading: no rate
    assert summary.lateness_p50_s == pytest.approx(0.028)
    assert summary.lateness_p99_s == 0.1


def test_rates_and_lateness_come_from_the_difference_of_two_readings() -> None:
    before = parse(URL, exposition(100, [0.001] * 100, {"bad-time": 4}), 10.0)
    after = parse(URL, exposition(300, [0.001] * 100 + [2.0] * 200,
                                  {"bad-time": 10, "expired": 2}), 12.0)
    summary = summarize(before, after)
    assert summary.delivered_rate == 100.0
    assert summary.intake_rate == 200.0
    assert summary.dead_letter_rate == 4.0
    assert summary.dead_letters_by_reason == {"bad-time": 3.0, "expired": 1.0}
    # Only the 200 observations of 2 s fall in the interval.
    assert summary.lateness_p50_s == pytest.approx(1.0 + 1.5 * 100 / 200)
    assert summary.pending == 15
    assert summary.overdue == 2
    assert summary.oldest_overdue_s == 1.5
    assert summary.intake_lag == 7
    assert summary.owned_partitions == 3
    assert summary.request_partitions == 6
    assert summary.clock_skew_s == -0.25


def restoring(restored: int, remaining: int) -> str:
    """An exposition while partition 1 restores (``restored`` replayed so far)."""
    metrics = Metrics()
    metrics.state.restoring.set(1)
    metrics.state.restored.inc(restored)
    metrics.state.restore_remaining.labels(partition="1").set(remaining)
    metrics.state.restore_total.labels(partition="1").set(restored + remaining)
    for part, size in (("block_cache", 3 << 20), ("pinned", 1 << 20), ("memtables", 2 << 20),
                       ("table_readers", 1 << 20)):
        metrics.state.rocksdb_memory.labels(part=part).set(size)
    metrics.state.rocksdb_budget.labels(part="block_cache").set(256 << 20)
    metrics.state.rocksdb_budget.labels(part="memtables").set(128 << 20)
    return generate_latest(metrics.registry).decode()


def test_restore_progress_and_rocksdb_memory_show() -> None:
    before = parse(URL, restoring(1_000_000, 9_000_000), 10.0)
    after = parse(URL, restoring(3_000_000, 7_000_000), 12.0)
    summary = summarize(before, after)
    assert summary.restoring == 1
    assert (summary.restore_remaining, summary.restore_total) == (7_000_000, 10_000_000)
    assert summary.restore_rate == 1_000_000
    assert summary.rocksdb_bytes == 6 << 20  # pinned is part of the cache
    assert summary.rocksdb_budget_bytes == 384 << 20
    out = io.StringIO()
    show([URL], console=Console(file=out, width=200), interval_s=2.0, sleep=lambda _: None,
         stats=Stats([URL], Replay([restoring(1_000_000, 9_000_000),
                                    restoring(3_000_000, 7_000_000)])))
    screen = out.getvalue()
    assert "7,000,000/10,000,000" in screen
    assert "6 MB" in screen
    assert "384 MB" in screen


def test_a_restarted_instance_never_shows_a_negative_rate() -> None:
    before = parse(URL, exposition(500, [], {}), 10.0)
    after = parse(URL, exposition(20, [], {}), 12.0)
    assert summarize(before, after).delivered_rate == 0.0


def test_an_unreadable_endpoint_is_down_not_an_error() -> None:
    summary = summarize(None, Scrape(URL, 1.0, error="connection refused"))
    assert summary.error == "connection refused"
    with pytest.raises(ValueError, match="float"):
        parse(URL, "this is not { an exposition", 1.0)


def test_endpoints_complete_host_and_port() -> None:
    assert endpoints(["a:9100", "http://b:9100/metrics"], None) == [
        "http://a:9100/metrics", "http://b:9100/metrics"]
    assert endpoints([], 9200) == ["http://127.0.0.1:9200/metrics"]
    with pytest.raises(ValueError, match="--url"):
        endpoints([], None)


class Replay:
    """A reader returning prepared expositions in turn, at times 0, 2, 4, ..."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.reads = 0

    def __call__(self, url: str) -> Scrape:
        text = self.texts[min(self.reads, len(self.texts) - 1)]
        self.reads += 1
        return parse(url, text, 2.0 * self.reads)


def test_show_prints_one_table_from_two_readings() -> None:
    out = io.StringIO()
    reader = Replay([exposition(0, [], {}), exposition(50, [0.02] * 50, {"bad-time": 2})])
    slept: list[float] = []
    code = show([URL], console=Console(file=out, width=200), interval_s=2.0,
                sleep=slept.append, stats=Stats([URL], reader))
    screen = out.getvalue()
    assert code == 0
    assert slept == [2.0]
    assert "25.0" in screen  # delivered/s
    assert "bad-time" in screen
    assert "3/6" in screen  # owned of all partitions
    assert "127.0.0.1:9100 " in screen  # the URL shortened


def test_show_json_and_exit_status_when_all_are_down() -> None:
    out = io.StringIO()
    stats = Stats([URL], lambda url: Scrape(url, 0.0, error="refused"))
    code = show([URL], console=Console(file=out), as_json=True, sleep=lambda _: None,
                stats=stats)
    assert code == 1
    assert json.loads(out.getvalue())[0]["error"] == "refused"


def test_watch_refreshes_until_interrupted() -> None:
    out = io.StringIO()
    reader = Replay([exposition(n, [], {}) for n in (0, 10, 30, 60)])
    calls = [0]

    def sleep(_: float) -> None:
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt

    code = show([URL], console=Console(file=out), as_json=True, watch=True, sleep=sleep,
                stats=Stats([URL], reader))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 0
    assert [line[0]["delivered_rate"] for line in lines] == [5.0, 10.0, 15.0]


def test_a_down_instance_is_named_with_its_reason() -> None:
    out = io.StringIO()
    up, down = URL, "http://127.0.0.1:9101/metrics"
    texts = {up: exposition(5, [], {"expired": 1})}

    def reader(url: str) -> Scrape:
        if url in texts:
            return parse(url, texts[url], 1.0)
        return Scrape(url, 1.0, error="connection refused")

    code = show([up, down], console=Console(file=out, width=200), sleep=lambda _: None,
                stats=Stats([up, down], reader))
    screen = out.getvalue()
    assert code == 0  # one of them answered
    assert "down: 127.0.0.1:9101: connection refused" in screen
    assert "expired" in screen
