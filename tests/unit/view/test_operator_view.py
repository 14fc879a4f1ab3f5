"""Pure parts of the operator's view: references, risk rules, recommendations, formatting."""

from __future__ import annotations

import orjson
import pytest
from rich.console import Console

from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec
from kdelay.view.backlog import Backlog, bucket_counts
from kdelay.view.display import backlog_json, backlog_tables, preview, relative, span, utc
from kdelay.view.lookup import NotARequest, parse_reference
from kdelay.view.pending import Columns, decode_route, encode_route
from kdelay.view.retention import AT_RISK_LISTED, AtRisk, PartitionRetention, count, recommend

HOUR = 3_600_000


def columns(*entries: tuple[int, int, int]) -> Columns:
    """Columns from ``(offset, record_ms, due_ms)`` entries."""
    return Columns([e[2] for e in entries], [e[0] for e in entries], [e[1] for e in entries])


def test_references_are_coordinates_of_the_requests_topic_or_ids() -> None:
    assert parse_reference("kdelay.requests/3/1042", "kdelay.requests") == (3, 1042)
    assert parse_reference("order-42", "kdelay.requests") is None
    assert parse_reference("a/b/c", "kdelay.requests") is None
    with pytest.raises(NotARequest, match="not the requests topic"):
        parse_reference("other/0/1", "kdelay.requests")


def test_an_entry_is_at_risk_when_expired_due_after_retention_or_size_limited() -> None:
    entries = columns((4, 0, HOUR), (6, 0, 3 * HOUR), (7, 0, HOUR))
    figures = PartitionRetention(0, log_start_offset=5)
    assert count(figures, entries, retention_ms=2 * HOUR, size_limited=False) == 3 * HOUR
    assert (figures.pending, figures.expired, figures.at_risk) == (3, 1, 2)
    assert (figures.oldest_pending_offset, figures.oldest_due_ms) == (4, HOUR)
    limited = PartitionRetention(0, log_start_offset=0)
    count(limited, entries, retention_ms=None, size_limited=True)
    assert (limited.at_risk, limited.expired) == (3, 0)


def test_the_at_risk_entries_are_named_soonest_due_first_with_why() -> None:
    entries = columns((6, 0, 3 * HOUR), (4, 0, HOUR), (7, 0, HOUR))
    listed: list[AtRisk] = []
    count(PartitionRetention(2, log_start_offset=5), entries, retention_ms=2 * HOUR,
          size_limited=False, listed=listed)
    assert listed == [AtRisk(2, 4, HOUR, 0, 2 * HOUR, "expired"),
                      AtRisk(2, 6, 3 * HOUR, 0, 2 * HOUR, "retention")]
    many = columns(*((offset, 0, 3 * HOUR + offset) for offset in range(AT_RISK_LISTED + 5)))
    listed = []
    count(PartitionRetention(0, log_start_offset=0), many, retention_ms=None,
          size_limited=True, listed=listed)
    assert [r.offset for r in listed] == list(range(AT_RISK_LISTED))
    assert {r.why for r in listed} == {"size"}


def test_unlimited_retention_puts_nothing_at_risk_by_time() -> None:
    figures = PartitionRetention(0, log_start_offset=0)
    count(figures, columns((0, 0, 1_000 * HOUR)), retention_ms=None, size_limited=False)
    assert figures.at_risk == 0
    assert count(figures, columns(), retention_ms=None, size_limited=False) is None


def test_recommendation_covers_the_longest_delay_or_level_plus_margin_in_hours() -> None:
    settings = Settings()  # levels up to 2 h, margin 1 h
    assert recommend(None, settings) == 3 * HOUR
    assert recommend(30 * 24 * HOUR + 1, settings) == (30 * 24 + 2) * HOUR


def test_due_keys_decode_end_to_end() -> None:
    keys = [codec.encode_due_key(5, 1, 2), codec.encode_due_key(7, 0, 9)]
    assert list(codec.decode_due_keys(b"".join(keys))) == [(5, 1, 2), (7, 0, 9)]
    assert codec.record_times([codec.encode_index_value(
        codec.IndexValue(codec.Fingerprint(-5, 7), "id"))]) == [-5]
    with pytest.raises(ValueError, match="multiple"):
        codec.decode_due_keys(b"x")


def test_times_and_previews_read_well() -> None:
    assert utc(1_795_402_679_322) == "2026-11-23 02:57:59.322Z"
    assert (relative(12_000, 0), relative(0, 3_000), relative(5, 5)) == (
        "in 12 s", "late 3.0 s", "now")
    assert (span(250), span(90_000), span(3 * HOUR), span(36 * HOUR)) == (
        "250 ms", "90 s", "3.0 h", "36 h")
    assert (preview(None), preview(b"k1"), preview(b"\x00\xff")) == ("null", "k1", "0x00ff")
    assert preview(b"x" * 50, chars=10) == "x" * 9 + "…"


def test_buckets_count_sorted_due_times_by_aligned_start() -> None:
    assert bucket_counts([], 10) == []
    assert bucket_counts([3, 9, 10, 10, 35], 10) == [(0, 2), (10, 2), (30, 1)]


def test_a_cached_route_keeps_the_target_and_the_lane() -> None:
    assert decode_route(encode_route("dev1.orders", "dev1")) == ("dev1.orders", "dev1")
    assert decode_route(encode_route("orders", None)) == ("orders", None)
    assert encode_route("orders", None) == b"orders"


def test_a_lanes_backlog_says_which_lane_it_counts() -> None:
    laned = Backlog(0, 1, 0, HOUR, HOUR, HOUR, [(HOUR, 1)], {0: 1}, {"dev1.orders": 1}, "dev1")
    console = Console(width=120, record=True)
    console.print(backlog_tables(laned))
    shown = console.export_text()
    assert "pending in lane dev1 1" in shown
    assert "dev1.orders" in shown
    assert orjson.loads(backlog_json(laned))["lane"] == "dev1"
    assert "lane" not in orjson.loads(backlog_json(Backlog(0, 0, 0, None, None, HOUR, [], {})))
