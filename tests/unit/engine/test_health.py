"""Liveness and readiness judged from what the loop knows, on a manual clock."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry, Counter

from kdelay.engine import health
from kdelay.engine.health import (
    ACK_STALL_S,
    ANSWER_FRESH_S,
    JUDGED_S,
    LIVE_S,
    Health,
    HighWatermarks,
    Observation,
)
from kdelay.plumbing.clock import ManualClock

TOPIC = "requests"


class Broker:
    """Answers high watermarks (low 0) by partition, or times out while ``away``."""

    def __init__(self, high: dict[int, int]) -> None:
        self.high = high
        self.away = False
        self.asked: list[bool] = []

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        self.asked.append(cached)
        if self.away:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out"))
        return 0, self.high[partition.partition]


def seen(positions: dict[int, int | None], *, reachable: bool = True, queued: int = 0,
         confirmed: dict[int, int | None] | None = None) -> Observation:
    return Observation(reachable, positions, confirmed or {}, queued)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def judged(clock: ManualClock, broker: Broker, positions: dict[int, int | None]) -> Health:
    """A health whose partitions were assigned and asked for, judged once at ``positions``."""
    marks = HighWatermarks(lambda: broker, TOPIC, clock)
    result = Health(clock, marks)
    result.assigned(positions)
    marks.ask(broker)
    result.judge(seen(positions))
    return result


def test_a_fresh_instance_is_not_ready_until_assigned_and_judged(clock: ManualClock) -> None:
    fresh = Health(clock, HighWatermarks(lambda: Broker({}), TOPIC, clock))
    assert fresh.ready() == (False, ["not judged yet: the service is starting"])
    fresh.judge(seen({}))
    ok, reasons = fresh.ready()
    assert not ok
    assert reasons == ["the consumer group has not assigned partitions yet"]
    fresh.assigned([])
    fresh.judge(seen({}))
    assert fresh.ready() == (True, [])


def test_a_partition_being_restored_is_not_ready(clock: ManualClock) -> None:
    ready = judged(clock, Broker({0: 5}), {0: 5})
    assert ready.ready() == (True, [])
    with ready.restoring():
        ok, reasons = ready.ready()
        assert not ok
        assert reasons == ["1 partition(s) being restored from the changelog"]
        assert ready.live() == (True, [])  # a long restore is no dead loop
    assert ready.ready() == (True, [])


def test_kafka_unreachable_is_not_ready(clock: ManualClock) -> None:
    ready = judged(clock, Broker({0: 5}), {0: 5})
    ready.judge(seen({0: 5}, reachable=False))
    assert ready.ready() == (False, ["Kafka is unreachable"])


def test_intake_that_stands_behind_the_brokers_high_watermark_is_not_ready(
        clock: ManualClock) -> None:
    broker = Broker({0: 10, 1: 3})
    ready = judged(clock, broker, {0: 10, 1: 3})
    assert ready.ready() == (True, [])
    broker.high[0] = 25
    ready.marks.ask(broker)  # type: ignore[union-attr]
    clock.advance(5_000)
    ready.judge(seen({0: 10, 1: 3}))
    ok, reasons = ready.ready()
    assert not ok
    assert reasons == ["partition 0: intake stands at offset 10, the broker's high watermark "
                       "was 25 5 s ago"]
    assert broker.asked == [False] * 4, "every answer is the broker's, never the cache"
    clock.advance(5_000)
    ready.judge(seen({0: 12, 1: 3}))  # it advanced: it fetches, though behind
    assert ready.ready() == (True, [])


def test_an_old_answer_does_not_prove_intake_caught_up(clock: ManualClock) -> None:
    broker = Broker({0: 10})
    ready = judged(clock, broker, {0: 10})
    broker.away = True
    ready.marks.ask(broker)  # type: ignore[union-attr]
    clock.advance(int(ANSWER_FRESH_S * 1000) + 1_000)
    ready.judge(seen({0: 10}))
    ok, reasons = ready.ready()
    assert not ok
    assert reasons == ["partition 0: intake stands at offset 10, the broker's high watermark "
                       "was 10 61 s ago"]


def test_nothing_taken_in_yet_counts_from_the_low_watermark(clock: ManualClock) -> None:
    assert judged(clock, Broker({0: 0}), {0: None}).ready() == (True, [])
    ok, _ = judged(clock, Broker({0: 4}), {0: None}).ready()
    assert not ok


def test_a_producer_holding_records_without_acknowledgements_is_not_ready(
        clock: ManualClock) -> None:
    ready = judged(clock, Broker({0: 5}), {0: 5})
    ready.judge(seen({0: 5}, queued=3, confirmed={0: 7}))
    clock.advance(int(ACK_STALL_S * 1000) - 1_000)
    ready.judge(seen({0: 5}, queued=3, confirmed={0: 7}))
    assert ready.ready() == (True, [])
    clock.advance(1_000)
    ready.judge(seen({0: 5}, queued=3, confirmed={0: 7}))
    assert ready.ready() == (False, ["the changelog producer has held 3 records for 30 s "
                                     "without an acknowledgement"])
    ready.judge(seen({0: 5}, queued=3, confirmed={0: 9}))
    assert ready.ready() == (True, [])


def test_a_loop_that_stops_judging_or_stepping_fails_the_probes(clock: ManualClock) -> None:
    ready = judged(clock, Broker({0: 5}), {0: 5})
    ready.beat(clock.now_ms())
    clock.advance(int(JUDGED_S * 1000))
    assert ready.ready() == (False, ["the service loop has not judged readiness for 30 s"])
    assert ready.live() == (True, [])
    clock.advance(int((LIVE_S - JUDGED_S) * 1000))
    assert ready.live() == (False, ["the service loop has not finished a step for 60 s"])


def test_a_loop_waiting_for_kafka_is_alive(clock: ManualClock) -> None:
    waiting = Health(clock, None, waiting=lambda: True)
    clock.advance(int(LIVE_S * 1000) * 10)
    assert waiting.live() == (True, [])


def test_an_outage_of_the_broker_costs_one_line(clock: ManualClock,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=health.__name__)
    broker = Broker({0: 5, 1: 6})
    marks = HighWatermarks(lambda: broker, TOPIC, clock)
    marks.want([0, 1])
    broker.away = True
    for _ in range(5):
        marks.ask(broker)
    assert len(broker.asked) == 5, "a round stops at its first failure"
    broker.away = False
    marks.ask(broker)
    assert marks.get_watermark_offsets(TopicPartition(TOPIC, 1)) == (0, 6)
    assert marks.get_watermark_offsets(TopicPartition(TOPIC, 2)) == (-1001, -1001)
    lines = [r.getMessage() for r in caplog.records if r.name == health.__name__]
    assert len(lines) == 2, lines
    assert "does not answer" in lines[0]
    assert "answers the requests topic's high watermarks again" in lines[1]


def probe(port: int, path: str) -> tuple[int, bytes]:
    """GET ``path`` on the metrics port: the status and the body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as failed:
        return failed.code, failed.read()


def test_the_metrics_port_answers_with_the_metrics_asked_for(clock: ManualClock) -> None:
    """``?name[]=`` narrows a scrape to the samples named (the bench polls one counter
    20 times a second, and a whole exposition costs more than a thousand requests)."""
    registry = CollectorRegistry()
    Counter("kdelay_taken", "taken", registry=registry).inc(3)
    Counter("kdelay_other", "other", registry=registry).inc()
    port = health.serve(0, registry, judged(clock, Broker({0: 5}), {0: 5}), address="127.0.0.1")
    status, body = probe(port, "/metrics?name[]=kdelay_taken_total")
    assert status == 200
    assert b"kdelay_taken_total 3.0" in body
    assert b"kdelay_other" not in body
    assert b"kdelay_other_total 1.0" in probe(port, "/metrics")[1]


def test_the_metrics_port_serves_the_probes(clock: ManualClock) -> None:
    ready = judged(clock, Broker({0: 5}), {0: 5})
    port = health.serve(0, CollectorRegistry(), ready, address="127.0.0.1")
    assert probe(port, "/readyz") == (200, b"ok\n")
    assert probe(port, "/metrics")[0] == 200
    ready.judge(seen({0: 5}, reachable=False))
    assert probe(port, "/readyz") == (503, b"Kafka is unreachable\n")
    assert probe(port, "/healthz") == (200, b"ok\n")
