"""The skew estimate: broker stamp minus service time, warned about at most once a minute."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, Message

from kdelay.engine.metrics import Metrics
from kdelay.engine.skew import WARN_EVERY_MS, ClockSkew
from kdelay.plumbing.clock import ManualClock

NOW = 1_700_000_000_000


def acknowledged(stamp_ms: int, kind: int = TIMESTAMP_LOG_APPEND_TIME) -> Message:
    return Message(topic="kdelay.changelog", partition=0, offset=1, timestamp=(kind, stamp_ms))


def skew_of(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("kdelay_clock_skew_seconds")


def test_a_broker_stamp_sets_the_skew_gauge() -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.clock_skew)
    skew.observe(acknowledged(NOW - 2_500))
    assert skew.last_ms == -2_500
    assert skew_of(metrics) == -2.5


def test_a_create_time_stamp_says_nothing_about_the_broker() -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.clock_skew)
    skew.observe(acknowledged(NOW - 90_000, TIMESTAMP_CREATE_TIME))
    assert skew.last_ms is None
    assert skew_of(metrics) == 0.0


def test_a_large_skew_is_warned_about_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.clock_skew)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        skew.observe(acknowledged(NOW + 5_000))
        clock.advance(WARN_EVERY_MS - 1)
        skew.observe(acknowledged(clock.now_ms() + 5_000))
        clock.advance(1)
        skew.observe(acknowledged(clock.now_ms() - 5_000))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "5.000 s ahead of" in messages[0]
    assert "5.000 s behind" in messages[1]


def test_a_small_skew_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        ClockSkew(clock, metrics.clock_skew).observe(acknowledged(NOW - 3))
    assert caplog.records == []
