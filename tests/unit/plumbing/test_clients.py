"""clients.take and clients.watermarks against fake consumers that record every call.

The fake never waits: a blocking ``consume`` (timeout > 0) finds the records
that "arrive" during the wait queued, so the tests see exactly which calls
block and for how long they are allowed to.
"""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from kdelay.plumbing.clients import take, watermarks


def records(*offsets: int) -> list[Message]:
    return [Message(topic="t", partition=0, offset=o) for o in offsets]


class FakeConsumer:
    """Returns queued records; a blocking call also sees the records arriving meanwhile."""

    def __init__(self, queued: list[Message] | None = None,
                 arriving: list[Message] | None = None) -> None:
        self.queued = list(queued or [])
        self.arriving = list(arriving or [])
        self.calls: list[tuple[int, float]] = []

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        self.calls.append((num_messages, timeout))
        if timeout != 0:
            self.queued += self.arriving
            self.arriving = []
        taken, self.queued = self.queued[:num_messages], self.queued[num_messages:]
        return taken


def offsets(messages: list[Message]) -> list[int | None]:
    return [m.offset() for m in messages]


def take_from(consumer: FakeConsumer, limit: int, timeout_s: float) -> list[Message]:
    return take(consumer, limit, timeout_s)


def test_queued_records_are_returned_without_waiting() -> None:
    consumer = FakeConsumer(records(1, 2, 3), arriving=records(4))
    assert offsets(take_from(consumer, 10, 5.0)) == [1, 2, 3]
    assert consumer.calls == [(10, 0)]


def test_the_limit_is_respected_for_queued_records() -> None:
    consumer = FakeConsumer(records(1, 2, 3, 4, 5))
    assert offsets(take_from(consumer, 2, 5.0)) == [1, 2]
    assert consumer.calls == [(2, 0)]
    assert offsets(consumer.queued) == [3, 4, 5]


def test_with_nothing_queued_it_waits_for_one_then_takes_the_rest_without_waiting() -> None:
    consumer = FakeConsumer(arriving=records(1, 2, 3, 4, 5))
    assert offsets(take_from(consumer, 3, 0.25)) == [1, 2, 3]
    assert consumer.calls == [(3, 0), (1, 0.25), (2, 0)]
    assert offsets(consumer.queued) == [4, 5]


def test_a_wait_that_yields_nothing_returns_nothing_and_asks_no_more() -> None:
    consumer = FakeConsumer()
    assert take_from(consumer, 10, 0.5) == []
    assert consumer.calls == [(10, 0), (1, 0.5)]


def test_a_limit_of_one_waits_for_one_and_stops() -> None:
    consumer = FakeConsumer(arriving=records(1, 2))
    assert offsets(take_from(consumer, 1, 1.0)) == [1]
    assert consumer.calls == [(1, 0), (1, 1.0)]


def test_a_gather_takes_all_that_arrives_within_it_in_one_wait() -> None:
    consumer = FakeConsumer(records(1), arriving=records(2, 3))
    assert offsets(take(consumer, 10, 1.0, gather_s=0.005)) == [1, 2, 3]
    assert consumer.calls == [(10, 0.005)], "not ended by the first record"


def test_a_gather_that_yields_nothing_waits_the_rest_of_the_timeout_for_one() -> None:
    consumer = FakeConsumer()
    assert take(consumer, 10, 0.5, gather_s=0.005) == []
    assert consumer.calls == [(10, 0.005), (1, 0.495)]


def test_a_gather_never_waits_past_the_timeout() -> None:
    consumer = FakeConsumer()
    assert take(consumer, 10, 0.002, gather_s=0.005) == []
    assert consumer.calls == [(10, 0.002)]


@pytest.mark.parametrize("timeout_s", [0, 0.0, -1.0])
def test_a_timeout_of_zero_or_less_never_blocks(timeout_s: float) -> None:
    consumer = FakeConsumer(arriving=records(1))
    assert take_from(consumer, 10, timeout_s) == []
    assert consumer.calls == [(10, 0)]
    assert all(timeout == 0 for _, timeout in consumer.calls)


class FlakyLeader:
    """Answers watermark queries with the errors given, then with (3, 9)."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.asked = 0

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        self.asked += 1
        assert not cached, "watermarks must come from the leader"
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0)))
        return 3, 9


def ask(consumer: FlakyLeader, timeout_s: float) -> tuple[int, int]:
    pauses: list[float] = []
    found = watermarks(consumer, TopicPartition("t", 0), timeout_s,
                       pause=pauses.append)
    assert len(pauses) == consumer.asked - 1
    return found


def test_watermarks_wait_out_a_leader_change() -> None:
    leader = FlakyLeader(KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                         KafkaError._TRANSPORT)
    assert ask(leader, 30) == (3, 9)
    assert leader.asked == 4


def test_watermarks_wait_out_a_new_leader_catching_its_high_watermark_up() -> None:
    # A cluster's rolling restart: the partition's new leader answers before it knows
    # its high watermark, and the query and a leader epoch can cross.
    leader = FlakyLeader(KafkaError.OFFSET_NOT_AVAILABLE, KafkaError.FENCED_LEADER_EPOCH,
                         KafkaError.UNKNOWN_LEADER_EPOCH)
    assert ask(leader, 30) == (3, 9)
    assert leader.asked == 4


def test_watermarks_wait_out_a_broker_handle_destroyed_when_the_broker_died() -> None:
    # librdkafka drops a dead broker's handle mid-request (seen in a broker outage)
    leader = FlakyLeader(KafkaError._DESTROY_BROKER, KafkaError._ALL_BROKERS_DOWN)
    assert ask(leader, 30) == (3, 9)
    assert leader.asked == 3


def test_watermarks_raise_other_errors_at_once() -> None:
    leader = FlakyLeader(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException) as raised:
        ask(leader, 30)
    assert raised.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert leader.asked == 1


def test_watermarks_give_up_when_the_time_is_over() -> None:
    leader = FlakyLeader(*[KafkaError.NOT_LEADER_FOR_PARTITION] * 5)
    with pytest.raises(KafkaException):
        ask(leader, 0)
    assert leader.asked == 1
