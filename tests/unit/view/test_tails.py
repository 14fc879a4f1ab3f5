"""Bounded reads of ranges: where they stop, without a broker (a scripted consumer)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from kdelay.view.tails import read_ranges


class Scripted:
    """A consumer that hands out prepared batches, then nothing."""

    def __init__(self, batches: list[list[Message]]) -> None:
        self.batches = batches
        self.assigned: list[TopicPartition] = []
        self.asked = 0

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = partitions

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        self.asked += 1
        return self.batches.pop(0) if self.batches else []


def _record(partition: int, offset: int) -> Message:
    return Message(topic="t", partition=partition, offset=offset, value=b"v")


def _eof(partition: int) -> Message:
    return Message(topic="t", partition=partition, offset=0,
                   error=KafkaError(KafkaError._PARTITION_EOF))


def test_each_range_stops_at_its_end_and_later_records_are_left_out() -> None:
    consumer = Scripted([[_record(0, 3), _record(1, 8)], [_record(0, 4), _record(0, 5)]])
    got = read_ranges(consumer, {("t", 0): 3, ("t", 1): 8},  # type: ignore[arg-type]
                      {("t", 0): 5, ("t", 1): 9}, timeout_s=5)
    assert [(m.partition(), m.offset()) for m in got] == [(0, 3), (1, 8), (0, 4)]
    assert [(tp.partition, tp.offset) for tp in consumer.assigned] == [(0, 3), (1, 8)]


def test_an_end_of_partition_ends_a_range_short_of_its_end() -> None:
    """Under transactions the last offsets are commit markers no reader sees: the
    end-of-partition event ends the read, not the timeout."""
    consumer = Scripted([[_record(0, 3)], [_eof(0)]])
    got = read_ranges(consumer, {("t", 0): 3}, {("t", 0): 6},  # type: ignore[arg-type]
                      timeout_s=30)
    assert [m.offset() for m in got] == [3]
    assert consumer.asked == 2


def test_accept_stops_at_the_first_record_it_takes() -> None:
    consumer = Scripted([[_record(0, 1), _record(0, 2), _record(0, 3)]])
    got = read_ranges(consumer, {("t", 0): 1}, {("t", 0): 9},  # type: ignore[arg-type]
                      timeout_s=5, accept=lambda m: (m.offset() or 0) >= 2)
    assert [m.offset() for m in got] == [2]


def test_other_errors_are_raised() -> None:
    failed = Message(topic="t", partition=0, offset=0,
                     error=KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    with pytest.raises(KafkaException):
        read_ranges(Scripted([[failed]]), {("t", 0): 0}, {("t", 0): 1},  # type: ignore[arg-type]
                    timeout_s=5)
