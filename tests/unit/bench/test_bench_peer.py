"""The bench's peer and floor, their pure parts: the peer's protocol and configuration,
progress read from metrics text, the floor's arithmetic, the side-by-side table, and
the options that ask for them. No broker, no binary, no sleep."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from kdelay_bench import peer
from kdelay_bench.contender import burst_figures, burst_lead_s, scheduled
from kdelay_bench.floor import floor_result, relate
from kdelay_bench.lateness import Load, Run
from kdelay_bench.options import SCENARIOS, parse_options
from kdelay_bench.report import Result, markdown, side_by_side
from kdelay_bench.served import burst_checks
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kdelay.protocol import envelope


def test_the_peer_is_asked_for_whole_seconds_never_before_kdelay() -> None:
    assert peer.epoch_s(1_700_000_000_000) == 1_700_000_000
    assert peer.epoch_s(1_700_000_000_001) == 1_700_000_001
    assert peer.epoch_s(1_700_000_000_999) == 1_700_000_001


def test_a_schedule_names_its_target_key_epoch_and_the_instant_asked_for() -> None:
    headers = dict(peer.schedule_headers("orders", 1_700_000_000_500, b"k7"))
    assert headers == {peer.EPOCH: b"1700000001", peer.TARGET_TOPIC: b"orders",
                       peer.TARGET_KEY: b"k7", envelope.DUE_MS: b"1700000001000"}


def test_steady_schedules_carry_the_warmup_tag_only_in_the_warmup() -> None:
    warm = dict(peer.steady_headers("t", 1_000, b"k", True))
    cold = dict(peer.steady_headers("t", 1_000, b"k", False))
    assert "bench-warmup" in warm
    assert "bench-warmup" not in cold


def test_the_peer_runs_quiet_on_loopback_with_a_day_of_grace() -> None:
    env = peer.environment("127.0.0.1:9092", peer.PeerTopics("s", "h", "g"), 4001, 4002)
    assert env["LOG_LEVEL"] == "error"
    assert env["METRICS_ADDR"] == "127.0.0.1:4001"
    assert env["SERVER_ADDR"] == "127.0.0.1:4002"
    assert (env["SCHEDULES_TOPICS"], env["HISTORY_TOPIC"], env["GROUP_ID"]) == ("s", "h", "g")
    assert int(env["SCHEDULE_GRACE_INTERVAL"]) == 86_400


def test_only_schedules_due_before_local_midnight_are_due_today() -> None:
    noon = time.mktime((2026, 11, 28, 12, 0, 0, 0, 0, -1))
    before_midnight = time.mktime((2026, 11, 28, 23, 59, 0, 0, 0, -1))
    assert peer.due_today(int(before_midnight * 1000), noon)
    assert not peer.due_today(int((before_midnight + 120) * 1000), noon)


def _events(counts: dict[str, float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("kafka_scheduler_event", "events", ["type"], registry=registry)
    for kind, n in counts.items():
        counter.labels(kind).inc(n)
    return generate_latest(registry).decode()


def test_the_peer_has_taken_in_what_it_planned_and_what_it_sent_as_missed() -> None:
    text = _events({peer.PLANNED: 700, peer.MISSED: 300,
                    "kafka_scheduler_deleted_schedule": 50})
    assert peer.planned(text) == 1_000
    assert peer.planned("") == 0


def test_kdelay_has_taken_in_what_it_scheduled() -> None:
    registry = CollectorRegistry()
    counter = Counter("kdelay_intake_records", "intake", ["outcome"], registry=registry)
    counter.labels("scheduled").inc(42)
    counter.labels("dlq").inc(3)
    assert scheduled(generate_latest(registry).decode()) == 42


def test_the_burst_lead_covers_writing_and_taking_in_the_backlog() -> None:
    assert burst_lead_s(0) == 15.0
    assert burst_lead_s(1_000_000) == pytest.approx(15 + 20 + 50)


def test_a_burst_rate_runs_from_the_due_instant_to_the_last_record() -> None:
    seen: dict[str, object] = {"count": 1_002, "duplicates": 2, "early": 0, "last_s": 105.0}
    figures = burst_figures(seen, 1_000, 100.0, {"within_5s_by_receive": 1_000})
    assert figures["seconds"] == 5.0
    assert figures["records_per_s"] == 200
    assert (figures["lost"], figures["early"], figures["duplicates"]) == (0, 0, 2)
    assert burst_figures({"count": 0}, 10, 100.0, {})["records_per_s"] is None
    short = burst_figures({"count": 900, "last_s": 110.0}, 1_000, 100.0, {})
    assert (short["records_per_s"], short["lost"]) == (90, 100)  # the rate of what came


def test_a_burst_taken_in_after_its_due_instant_also_shows_the_drain_after() -> None:
    seen: dict[str, object] = {"count": 1_000, "last_s": 150.0}
    late = burst_figures(seen, 1_000, 100.0, {}, ready_s=140.0)
    assert late["records_per_s"] == 20  # from the due instant: the intake's lag included
    assert (late["drain_s_after_intake"], late["records_per_s_after_intake"]) == (10.0, 100)
    assert "drain_s_after_intake" not in burst_figures(seen, 1_000, 100.0, {}, ready_s=99.0)


def test_the_burst_lead_is_an_option() -> None:
    assert parse_options([]).burst_lead_s is None
    assert parse_options(["--burst-lead-s", "200"]).burst_lead_s == 200.0


def test_the_burst_is_checked_against_issue_47() -> None:
    result = Result("burst", {"records_per_s": 250_000, "within_5s_by_receive": 899,
                              "service_cpu_us_per_record": 4.0, "early": 0, "lost": 0,
                              "indexed_before_due": True})
    burst_checks(result, 1_000)
    verdicts = {c.target: c.met for c in result.checks}
    assert verdicts["burst >= 200,000/s"] is True
    assert verdicts[">= 90% received within 5 s of due"] is False
    assert verdicts["burst service CPU per record <= 5 µs"] is True
    assert verdicts["burst >= 0.7x pipe"] is None


def test_the_floor_of_a_delivery_is_one_read_and_two_writes() -> None:
    floor = floor_result(1_000_000, 1.4, 1.35, 5.5, 0.8)
    assert floor.figures["produce_cpu_us_per_record"] == 1.4  # 1.35 rounds to 0.1 µs
    assert floor.figures["consume_cpu_us_per_record"] == 0.8
    assert floor.figures["delivery_cpu_us"] == pytest.approx(3.6)
    assert floor.figures["delivery_per_s"] == round(1e6 / 3.6)
    assert floor.figures["produce_per_s"] == round(1_000_000 / 1.4)


def test_the_burst_is_reported_against_the_floor() -> None:
    floor = floor_result(1_000, 0.01, 0.001, 0.01, 0.001)  # 1 + 2 x 1 = 3 µs
    burst = Result("burst", {"records_per_s": 200_000, "service_cpu_us_per_record": 4.5})
    relate([floor, burst])
    assert burst.figures["cpu_ratio_to_floor"] == 1.5
    assert burst.figures["rate_ratio_to_floor"] == pytest.approx(0.6, abs=0.001)


def _pair() -> list[Result]:
    ours = Result("burst", {"records_per_s": 200_000, "service_cpu_us_per_record": 4.0,
                            "rss_mb": 100})
    theirs = Result("peer-burst", {"records_per_s": 40_000, "service_cpu_us_per_record": 16.0,
                                   "rss_mb": 600, "versus": "burst"})
    intake = Result("intake-run", {"requests_per_s": 120_000,
                                   "service_cpu_us_per_record": 5.0, "rss_mb": 80})
    peer_intake = Result("peer-intake", {"requests_per_s": 60_000,
                                         "service_cpu_us_per_record": 10.0, "rss_mb": 400,
                                         "versus": "intake-run"})
    return [ours, theirs, intake, peer_intake]


def test_the_side_by_side_table_puts_each_peer_row_beside_its_kdelay_row() -> None:
    lines = side_by_side(_pair())
    assert len(lines) == 4
    assert lines[2] == ("| burst | 200,000 | 4.0 | 100 | 40,000 | 16.0 | 600 "
                        "| 5.00x | 0.25x | 0.17x |  |")
    assert lines[3].startswith("| intake-run | 120,000 | 5.0 | 80 | 60,000 |")


def test_a_missing_kdelay_row_leaves_its_cells_empty_and_no_peer_no_table() -> None:
    lonely = Result("peer-lateness", {"achieved_rate_per_s": 5_000,
                                      "service_cpu_us_per_record": 30.0, "p99_ms": 73.3,
                                      "versus": "lateness"})
    assert side_by_side([lonely])[2] == ("| lateness | n/a | n/a | n/a | 5,000 | 30.0 | n/a "
                                         "| n/a | n/a | n/a | n/a / 73.3 |")
    assert side_by_side([Result("burst", {"records_per_s": 1})]) == []


def test_the_report_leads_with_the_side_by_side_table() -> None:
    text = markdown(_pair())
    assert text.startswith("| scenario | kdelay rate/s |")
    assert "| burst | figures |" not in text
    assert markdown([Result("pipe", {"records_per_s": 1})]).startswith("| scenario | figures |")


def test_a_steady_run_reports_the_service_peak_rss_when_measured() -> None:
    seen: dict[str, object] = {"count": 100, "duplicates": 0, "early": 0}
    load = Load(rate=10, seconds=10, warmup_seconds=0, delay_ms=500, drain_seconds=5)
    assert Run(1, load, seen, 10.0, {}, "note", rss_mb=42).figures()["rss_mb"] == 42
    assert "rss_mb" not in Run(1, load, seen, 10.0, {}, "note").figures()


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_peer_takes_an_executable_and_the_bench_runs_without_one(tmp_path: Path) -> None:
    binary = _executable(tmp_path / "kafka-message-scheduler")
    assert parse_options(["--peer", str(binary)]).peer == binary.resolve()
    assert parse_options([]).peer is None
    with pytest.raises(SystemExit, match="not an executable"):
        parse_options(["--peer", str(tmp_path / "missing")])
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(SystemExit, match="not an executable"):
        parse_options(["--peer", str(plain)])


def test_floor_is_a_scenario_run_by_default() -> None:
    assert "floor" in SCENARIOS
    assert "floor" in parse_options([]).scenarios
    assert parse_options(["--scenarios", "floor,burst"]).scenarios == ("floor", "burst")


def test_the_peer_is_built_into_a_cache_outside_the_repository(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peer.default_cache() == tmp_path / "kdelay-bench" / "peer"
    built = _executable(tmp_path / peer.BINARY)
    assert peer.build(tmp_path) == built  # already built: returned as it is
