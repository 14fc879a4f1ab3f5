"""Retry decisions and the records a failure produces; no broker."""

from __future__ import annotations

import subprocess
import sys
from typing import cast

import confluent_kafka
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from kdelay import retry
from kdelay.plumbing.settings import Settings
from kdelay.protocol import envelope
from kdelay.protocol.durations import Limits
from kdelay.protocol.envelope import Schedule
from kdelay.retry import DeadLetter, Retry, RetryPolicy

POLICY = RetryPolicy("orders.dlq", backoff=(100, 200, 400), non_retryable=(KeyError,))


def failed(headers: list[tuple[str, str | bytes | None]]) -> Message:
    """A delivered record as a consumer sees it, partition 2 offset 7 of ``orders``."""
    return Message(topic="orders", partition=2, offset=7, key=b"k", value=b"v",
                   headers=headers)


def test_default_backoff_is_rocketmqs_sixteen_steps() -> None:
    steps = RetryPolicy("dlq").backoff
    assert len(steps) == 16
    assert (steps[0], steps[2], steps[-1]) == (10_000, 60_000, 7_200_000)


def test_steps_in_order_then_dead_letter() -> None:
    error = RuntimeError("boom")
    decisions = [retry.decide(attempts, error, POLICY) for attempts in range(4)]
    assert decisions == [Retry(100, 1), Retry(200, 2), Retry(400, 3), DeadLetter(4)]


def test_non_retryable_goes_straight_to_the_dead_letters() -> None:
    assert retry.decide(0, KeyError("x"), POLICY) == DeadLetter(1)


def test_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        RetryPolicy("dlq", backoff=(1, -1))


@pytest.mark.parametrize(("headers", "attempts"), [
    ([], 0), ([("kdelay.attempts", b"2")], 2), ([("kdelay.attempts", b"x")], 0),
    ([("kdelay.attempts", b"1"), ("kdelay.attempts", b"3")], 3)])
def test_attempts_header(headers: list[tuple[str, bytes | None]], attempts: int) -> None:
    assert retry.attempts_of(headers) == attempts


def test_retry_request_keeps_the_record_and_returns_to_its_partition() -> None:
    message = failed([("trace", b"t1"), ("kdelay-origin", b"req/0/3"),
                      ("kdelay-due-ms", b"5"), ("kdelay.attempts", b"1"),
                      ("kdelay.series", b"{}")])
    record = retry.failure_record(message, RuntimeError("boom"), POLICY, "kdelay.requests")
    assert (record.topic, record.key, record.value) == ("kdelay.requests", b"k", b"v")
    parsed = envelope.parse(record.headers, 1_000, Limits((1,), None))
    assert parsed == Schedule("orders", 1_200, 2, None)
    assert envelope.user_headers(record.headers) == [("trace", b"t1"),
                                                     ("kdelay.attempts", b"2")]


def test_retry_topic_lets_the_partitioner_choose() -> None:
    policy = RetryPolicy("dlq", backoff=(50,), retry_topic="orders.retry")
    record = retry.failure_record(failed([]), RuntimeError(), policy, "kdelay.requests")
    assert envelope.parse(record.headers, 0, Limits((1,), None)) == Schedule(
        "orders.retry", 50, None, None)


def test_dead_letter_says_what_failed_and_how_often() -> None:
    message = failed([("trace", b"t1"), ("kdelay.attempts", b"3")])
    record = retry.failure_record(message, ValueError("bad order"), POLICY, "kdelay.requests")
    assert (record.topic, record.key, record.value) == ("orders.dlq", b"k", b"v")
    assert record.headers == [("trace", b"t1"), ("kdelay.error-type", b"ValueError"),
                              ("kdelay.error-message", b"bad order"),
                              ("kdelay.attempts", b"4"), ("kdelay.failed-at", b"orders/2/7")]


def test_next_offsets_one_past_the_last_per_partition() -> None:
    messages = [Message(topic="a", partition=0, offset=o) for o in (3, 4)] + \
        [Message(topic="a", partition=1, offset=9)]
    assert {(tp.partition, tp.offset) for tp in retry.next_offsets(messages)} == {(0, 5),
                                                                                  (1, 10)}


# What confluent-kafka 2.15 added: a client without them is what 2.13 and 2.14 are.
SHARE_NAMES = ("ShareConsumer", "AcknowledgeType")


def test_every_command_runs_on_a_confluent_kafka_without_share_groups() -> None:
    """The declared floor has no share consumer: the CLI and the helpers import without it."""
    code = ("import confluent_kafka, sys\n"
            f"for name in {SHARE_NAMES!r}: vars(confluent_kafka).pop(name, None)\n"
            "import kdelay.retry, kdelay.recurring, kdelay.tasks\n"
            "from kdelay.cli import main\n"
            "sys.argv = ['kdelay', 'run', '--help']\n"
            "main()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "Usage: kdelay run" in result.stdout


def test_a_share_consumer_needs_confluent_kafka_2_15(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SHARE_NAMES:
        monkeypatch.delattr(confluent_kafka, name, raising=False)  # absent before 2.15
    with pytest.raises(retry.ShareGroupsUnsupported) as caught:
        retry.RetryingShareConsumer(Settings(), ["orders"], lambda message: None, POLICY,
                                    group_id="shop")
    assert caught.value.code == "share-groups-unsupported"
    assert str(caught.value) == (
        f"share groups need confluent-kafka 2.15 or newer (ShareConsumer), this is "
        f"{confluent_kafka.version()[0]}: pip install 'kdelay[share]'")


class Member:
    """A group member's committed offsets and assignment; ``answers`` False: Kafka away."""

    def __init__(self, committed: dict[int, int], answers: bool = True) -> None:
        self.committed_offsets = committed
        self.answers = answers
        self.assigned: list[tuple[int, int]] = []

    def committed(self, partitions: list[TopicPartition],
                  timeout: float = -1) -> list[TopicPartition]:
        if not self.answers:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to get committed"))
        return [TopicPartition(tp.topic, tp.partition,
                               self.committed_offsets.get(tp.partition, OFFSET_INVALID))
                for tp in partitions]

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = [(tp.partition, tp.offset) for tp in partitions]


# librdkafka's own lookup of a committed offset can leave a partition unfetched for
# good when the coordinator moved (librdkafka issue 5586): the helper reads them first.
def test_an_assignment_starts_at_the_committed_offsets_read_first() -> None:
    member = Member({0: 42})
    retry._assign_explicitly(cast(Consumer, member),
                             [TopicPartition("orders", 0), TopicPartition("orders", 1)])
    assert member.assigned == [(0, 42), (1, OFFSET_BEGINNING)]


def test_an_assignment_kafka_does_not_answer_for_is_left_to_librdkafka(
    caplog: pytest.LogCaptureFixture,
) -> None:
    member = Member({0: 42}, answers=False)
    with caplog.at_level("WARNING"):
        retry._assign_explicitly(cast(Consumer, member), [TopicPartition("orders", 0)])
    assert member.assigned == [(0, OFFSET_INVALID)]
    assert "librdkafka looks them up itself" in caplog.text
