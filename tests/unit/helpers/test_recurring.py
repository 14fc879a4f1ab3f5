"""Recurring series: specs, the series header, and what ``kdelay show`` reports; no broker."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from kdelay import recurring
from kdelay.plumbing.clock import ManualClock
from kdelay.recurring import Cron, Every, Series, SeriesError

PARIS = ZoneInfo("Europe/Paris")


def ms(moment: datetime) -> int:
    """Epoch ms of an aware datetime."""
    return int(moment.timestamp() * 1000)


def fire(spec: Cron, clock: ManualClock, times: int) -> list[datetime]:
    """Step a series on ``clock`` as a worker would: each occurrence handled at its due time."""
    instants = []
    due = spec.after(clock.now_ms())
    for _ in range(times):
        clock.set(due)
        instants.append(datetime.fromtimestamp(due / 1000, PARIS))
        due = spec.after(clock.now_ms())
    return instants


def test_every_follows_its_grid_and_skips_missed_instants() -> None:
    spec = Every(1_000, anchor_ms=10_000)
    assert spec.after(0) == 10_000
    assert spec.after(10_000) == 11_000
    assert spec.after(10_999) == 11_000
    assert spec.after(15_500) == 16_000


def test_cron_on_weekdays_in_paris() -> None:
    clock = ManualClock(ms(datetime(2026, 11, 20, 10, 0, tzinfo=PARIS)))  # a Friday
    fired = fire(recurring.cron("0 9 * * MON-FRI", "Europe/Paris"), clock, 3)
    assert [d.isoformat() for d in fired] == [
        "2026-11-23T09:00:00+01:00", "2026-11-24T09:00:00+01:00", "2026-11-25T09:00:00+01:00"]


def test_cron_across_spring_forward_fires_after_the_gap() -> None:
    """02:30 does not exist on 29 March 2026 in Paris: it fires at 03:00 CEST (01:00 UTC)."""
    clock = ManualClock(ms(datetime(2026, 3, 27, 12, 0, tzinfo=PARIS)))
    fired = fire(recurring.cron("30 2 * * *", "Europe/Paris"), clock, 4)
    assert [d.isoformat() for d in fired] == [
        "2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00", "2026-03-31T02:30:00+02:00"]
    assert [ms(d) for d in fired][1] == ms(datetime(2026, 3, 29, 1, 0, tzinfo=ZoneInfo("UTC")))


def test_cron_across_fall_back_fires_at_both_repeated_instants() -> None:
    """02:30 happens twice on 25 October 2026 in Paris; croniter fires at both, an hour apart."""
    clock = ManualClock(ms(datetime(2026, 10, 24, 12, 0, tzinfo=PARIS)))
    fired = fire(recurring.cron("30 2 * * *", "Europe/Paris"), clock, 4)
    assert [d.isoformat() for d in fired] == [
        "2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00",
        "2026-10-26T02:30:00+01:00", "2026-10-27T02:30:00+01:00"]
    assert ms(fired[1]) - ms(fired[0]) == 3_600_000


def test_hourly_cron_across_fall_back_keeps_one_hour_steps() -> None:
    clock = ManualClock(ms(datetime(2026, 10, 25, 0, 30, tzinfo=PARIS)))
    fired = fire(recurring.cron("0 * * * *", "Europe/Paris"), clock, 4)
    assert [ms(b) - ms(a) for a, b in itertools.pairwise(fired)] == [3_600_000] * 3


@pytest.mark.parametrize(("expression", "tz"), [
    ("0 9 * *", "UTC"), ("61 * * * *", "UTC"), ("0 9 * * *", "Mars/Olympus")])
def test_bad_cron_is_refused(expression: str, tz: str) -> None:
    with pytest.raises(SeriesError):
        recurring.cron(expression, tz)


def test_bad_interval_is_refused() -> None:
    with pytest.raises(SeriesError):
        recurring.every("0s", 0)
    with pytest.raises(SeriesError):
        recurring.every("soon", 0)


def test_header_round_trip() -> None:
    for series in (Series("a", Every(5_000, 7), 3, 4, 99, 10, "orders", 2),
                   Series("b", Cron("0 9 * * MON-FRI", "Europe/Paris"), 3)):
        assert recurring.decode(series.encode()) == series


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"id": "a"}', b'{"id":"a","start":1,"n":1,'
                                 b'"every":0,"anchor":0}', b"\xff"])
def test_unreadable_header_is_a_series_error(raw: bytes) -> None:
    with pytest.raises(SeriesError):
        recurring.decode(raw)


def test_following_stops_at_count_and_until() -> None:
    series = Series("a", Every(1_000, 1_000), start_ms=0, n=2, count=3)
    assert series.following(2_000, 2_000) == 3_000
    assert Series("a", Every(1_000, 1_000), 0, n=3, count=3).following(3_000, 3_000) is None
    assert Series("a", Every(1_000, 1_000), 0, until_ms=2_500).following(2_000, 2_000) is None


def test_late_occurrence_schedules_the_first_instant_after_now() -> None:
    series = Series("a", Every(1_000, 1_000), 0)
    assert series.following(due_ms=2_000, now_ms=7_300) == 8_000


def test_describe_a_pending_request() -> None:
    series = Series("daily", Cron("0 9 * * *", "UTC"), start_ms=0, n=2, count=5,
                    target="orders")
    due = ms(datetime(2026, 11, 24, 9, 0, tzinfo=ZoneInfo("UTC")))
    headers = [("trace", b"x"), ("kdelay.series", series.encode()),
               ("kdelay-target", b"kdelay.series"), ("kdelay-due-ms", str(due).encode()),
               ("kdelay-id", b"daily")]
    described = recurring.describe(headers, now_ms=due - 3_600_000)
    assert described is not None
    assert (described.schedule_id, described.n, described.pending_due_ms) == ("daily", 2, due)
    assert described.next_due_ms == due + 86_400_000
    assert described.spec == "cron '0 9 * * *' in UTC"
    assert (described.count, described.target) == (5, "orders")


def test_describe_the_last_occurrence_and_a_plain_request() -> None:
    last = Series("a", Every(1_000, 0), 0, n=3, count=3)
    headers = [("kdelay.series", last.encode()), ("kdelay-due-ms", b"3000")]
    described = recurring.describe(headers, now_ms=0)
    assert described is not None
    assert described.next_due_ms is None
    assert recurring.describe([("kdelay-due-ms", b"3000")], now_ms=0) is None


def test_spec_of_needs_exactly_one_of_every_and_cron() -> None:
    assert recurring.spec_of("5m", None, "UTC", 1_000) == Every(300_000, 301_000)
    assert recurring.spec_of(None, "0 9 * * *", "Europe/Paris", 0) == Cron("0 9 * * *",
                                                                             "Europe/Paris")
    for every, cron in ((None, None), ("5m", "0 9 * * *")):
        with pytest.raises(SeriesError):
            recurring.spec_of(every, cron, "UTC", 0)


def test_occurrences_alternate_between_two_ids() -> None:
    assert [recurring.occurrence_id("s", n) for n in (1, 2, 3, 4)] == ["s", "s~", "s", "s~"]
    assert recurring.occurrence_ids("s") == ("s", "s~")


def test_the_next_fire_times_follow_the_rule_and_stop_with_the_series() -> None:
    hourly = Series("s", recurring.every("1h", 0), start_ms=0)
    assert recurring.upcoming(hourly, 3_600_000, now_ms=0) == [
        3_600_000, 7_200_000, 10_800_000, 14_400_000, 18_000_000]
    assert recurring.upcoming(replace(hourly, n=2, count=3), 7_200_000, now_ms=0) == [
        7_200_000, 10_800_000], "occurrences 2 and 3 of 3"
    assert recurring.upcoming(replace(hourly, until_ms=10_000_000), 3_600_000, now_ms=0) == [
        3_600_000, 7_200_000]
