"""The skew estimate: broker stamp minus service time, warned about at most once a minute."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, KafkaError, Message

from kdelay.engine.metrics import Metrics
from kdelay.engine.skew import PROBE_EVERY_MS, WARN_EVERY_MS, BrokerGuard, ClockSkew
from kdelay.plumbing.clients import Producing
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import codec

NOW = 1_700_000_000_000


def acknowledged(stamp_ms: int, kind: int = TIMESTAMP_LOG_APPEND_TIME,
                 latency_s: float | None = 0.002) -> Message:
    if latency_s is None:  # a report without latency information
        return Message(topic="kdelay.changelog", partition=0, offset=1, timestamp=(kind, stamp_ms))
    return Message(topic="kdelay.changelog", partition=0, offset=1, timestamp=(kind, stamp_ms),
                   latency=latency_s)


def skew_of(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("kdelay_clock_skew_seconds")


def test_a_broker_stamp_sets_the_skew_gauge() -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.cluster.clock_skew)
    skew.observe(acknowledged(NOW - 2_500))
    assert skew.last_ms == -2_500
    assert skew_of(metrics) == -2.5


def test_a_create_time_stamp_says_nothing_about_the_broker() -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.cluster.clock_skew)
    skew.observe(acknowledged(NOW - 90_000, TIMESTAMP_CREATE_TIME))
    assert skew.last_ms is None
    assert skew_of(metrics) == 0.0


def test_a_large_skew_is_warned_about_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.cluster.clock_skew)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        skew.observe(acknowledged(NOW + 5_000))
        clock.advance(1_000)
        skew.observe(acknowledged(clock.now_ms() + 5_000))
        clock.advance(WARN_EVERY_MS - 1)
        skew.observe(acknowledged(clock.now_ms() + 5_000))
        clock.advance(1)
        skew.observe(acknowledged(clock.now_ms() - 5_000))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "5.000 s ahead of" in messages[0]
    assert "5.000 s behind" in messages[1]


def test_one_large_reading_between_small_ones_is_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A report served seconds late (the loop held up by a long assignment) reads the
    # broker as that much behind; the next reading, served in time, shows no skew.
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.cluster.clock_skew)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        skew.observe(acknowledged(NOW - 4_000))
        skew.observe(acknowledged(NOW - 2))
        skew.observe(acknowledged(NOW - 4_000))
    assert caplog.records == []
    assert skew.last_ms == -4_000, "the estimate still errs towards the broker behind"



def test_an_acknowledgement_held_back_is_no_sign_of_skew(caplog: pytest.LogCaptureFixture) -> None:
    # A follower killed: the leader stamps the record, then waits about 10 s for the ISR
    # to shrink before it acknowledges. Every reading then says "10 s behind", but the
    # record was stamped after it was sent, at most the latency before the report.
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.cluster.clock_skew)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        skew.observe(acknowledged(NOW - 10_070, latency_s=10.1))
        skew.observe(acknowledged(NOW - 10_040, latency_s=10.05))
    assert caplog.records == []
    assert skew.last_ms == -10_040, "the estimate still errs towards the broker behind"
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        skew.observe(acknowledged(NOW - 10_040, latency_s=2.0))
        clock.advance(1_000)
        skew.observe(acknowledged(clock.now_ms() - 10_040, latency_s=None))
    assert ["10.040 s behind" in r.getMessage() for r in caplog.records] == [True], \
        "8 s behind even if stamped when sent: a skew"


def test_reports_served_together_after_a_stall_are_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The loop held up 10 s (waiting for a dead leader's acknowledgements): the markers
    # acknowledged meanwhile are served together and all read 10 s behind.
    clock, metrics = ManualClock(NOW), Metrics()
    skew = ClockSkew(clock, metrics.cluster.clock_skew)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        for late_ms in (10_070, 10_050, 10_030):
            skew.observe(acknowledged(NOW - late_ms))
        clock.advance(200)
        skew.observe(acknowledged(clock.now_ms() - 3))
        clock.advance(2_000)
        skew.observe(acknowledged(clock.now_ms() - 4))
    assert caplog.records == []

def test_a_small_skew_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    clock, metrics = ManualClock(NOW), Metrics()
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        ClockSkew(clock, metrics.cluster.clock_skew).observe(acknowledged(NOW - 3))
    assert caplog.records == []


class ProbeProducer:
    """Keeps produced probes; ``poll`` acknowledges them with a broker stamp or an error."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes | None]] = []
        self.pending: list[Callable[[KafkaError | None, Message], None]] = []
        self.answer: int | KafkaError = NOW

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                partition: int = -1,
                callback: Callable[[KafkaError | None, Message], None] | None = None,
                on_delivery: Callable[[KafkaError | None, Message], None] | None = None,
                timestamp: int = 0, headers: object = None) -> None:
        on_delivery = on_delivery or callback
        assert on_delivery is not None
        self.sent.append((topic, key, value))
        self.pending.append(on_delivery)

    def poll(self, timeout: float = 0) -> int:
        del timeout
        reports, self.pending = self.pending, []
        for report in reports:
            if isinstance(self.answer, KafkaError):
                report(self.answer, acknowledged(0))
            else:
                report(None, acknowledged(self.answer))
        return len(reports)

    def flush(self, timeout: float = 0) -> int:
        return self.poll(timeout) and 0


def guard_on(clock: ManualClock) -> tuple[BrokerGuard, ProbeProducer]:
    producer = ProbeProducer()
    skew = ClockSkew(clock, Metrics().cluster.clock_skew)
    return BrokerGuard(skew, cast(Producing, producer), "chg", clock, tolerance_ms=1_000), \
        producer


def test_the_guard_holds_everything_until_the_broker_clock_is_read() -> None:
    clock = ManualClock(NOW)
    guard, producer = guard_on(clock)
    assert guard.release_ms(NOW) is None
    guard.probe()
    guard.probe()  # one probe at a time
    assert producer.sent == [("chg", codec.CLOCK_PROBE, None)], "a tombstone, no data"
    assert guard.release_ms(NOW) is None, "not acknowledged yet"
    guard.poll()
    assert guard.release_ms(NOW) == NOW


def test_a_service_clock_ahead_of_the_broker_releases_by_the_broker_plus_tolerance() -> None:
    clock = ManualClock(NOW + 3_600_000)  # the wall clock stepped an hour forward
    guard, _ = guard_on(clock)
    guard.probe()
    guard.poll()
    assert guard.release_ms(clock.now_ms()) == NOW + 1_000
    clock.advance(60_000)  # a minute passes for both clocks
    assert guard.release_ms(clock.now_ms()) == NOW + 61_000


def test_a_service_clock_behind_the_broker_releases_by_the_service_clock() -> None:
    clock = ManualClock(NOW - 3_600_000)
    guard, _ = guard_on(clock)
    guard.probe()
    guard.poll()
    assert guard.release_ms(clock.now_ms()) == NOW - 3_600_000


def test_a_failed_probe_is_said_once_and_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock(NOW)
    guard, producer = guard_on(clock)
    producer.answer = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.skew"):
        for _ in range(3):
            guard.tick()
            guard.poll()
    assert len(producer.sent) == 3
    assert len([r for r in caplog.records if "cannot read the broker" in r.getMessage()]) == 1
    assert guard.release_ms(NOW) is None
    producer.answer = NOW
    guard.tick()
    guard.poll()
    assert guard.release_ms(NOW) == NOW


def test_the_broker_clock_is_read_again_only_after_a_minute() -> None:
    clock = ManualClock(NOW)
    guard, producer = guard_on(clock)
    guard.tick()
    guard.poll()
    clock.advance(PROBE_EVERY_MS - 1)
    guard.tick()
    assert len(producer.sent) == 1
    clock.advance(1)
    guard.tick()
    assert len(producer.sent) == 2
