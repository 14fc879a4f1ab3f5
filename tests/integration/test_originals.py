"""Reading originals back by offset from a real broker."""

from __future__ import annotations

import time
from typing import Any, cast

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay.state.originals import Found, Missing, OriginalReader, flat
from tests.conftest import TopicFactory
from tests.integration.conftest import produce


def fill(bootstrap: str, topic: str, partitions: int, per_partition: int) -> None:
    produce(bootstrap, topic, [
        {"key": f"{p}-{i}".encode(), "value": f"v{p}-{i}".encode(), "partition": p}
        for p in range(partitions) for i in range(per_partition)
    ])


def keys(found: dict[tuple[int, int], Found]) -> dict[tuple[int, int], Any]:
    return {k: v if isinstance(v, Missing) else v.key() for k, v in found.items()}


def test_sorted_runs_across_partitions_return_exactly_the_wanted_records(
    topic_factory: TopicFactory, bootstrap: str,
) -> None:
    topic = topic_factory("orig", 2)
    fill(bootstrap, topic, 2, 300)
    reader = OriginalReader({"bootstrap.servers": bootstrap}, topic, max_gap=10)
    try:
        found = flat(reader.read({0: [250, 3, 4, 120], 1: [0, 299, 300, 5000]}))
    finally:
        reader.close()
    assert keys(found) == {
        (0, 3): b"0-3", (0, 4): b"0-4", (0, 120): b"0-120", (0, 250): b"0-250",
        (1, 0): b"1-0", (1, 299): b"1-299", (1, 300): Missing.ABSENT, (1, 5000): Missing.ABSENT,
    }


def test_offsets_below_the_log_start_are_expired(
    topic_factory: TopicFactory, bootstrap: str, admin: AdminClient,
) -> None:
    topic = topic_factory("orig", 1)
    fill(bootstrap, topic, 1, 20)
    cut = TopicPartition(topic, 0, 10)
    admin.delete_records([cut])[cut].result(timeout=30)
    reader = OriginalReader({"bootstrap.servers": bootstrap}, topic)
    try:
        found = flat(reader.read({0: [2, 9, 10, 15]}))
    finally:
        reader.close()
    assert keys(found) == {(0, 2): Missing.EXPIRED, (0, 9): Missing.EXPIRED,
                           (0, 10): b"0-10", (0, 15): b"0-15"}


def test_log_start_moving_under_a_fetch_is_detected_from_the_fetch_error(
    topic_factory: TopicFactory, bootstrap: str, admin: AdminClient,
) -> None:
    """The log start the reader knows is older than the broker's (retention ran since it
    asked): the fetch's out-of-range error tells the offsets below it expired."""
    topic = topic_factory("orig", 1)
    fill(bootstrap, topic, 1, 20)
    reader = OriginalReader({"bootstrap.servers": bootstrap}, topic)
    try:
        assert keys(flat(reader.read({0: [15]}))) == {(0, 15): b"0-15"}, "its watermarks: 0 and 20"
        cut = TopicPartition(topic, 0, 10)
        admin.delete_records([cut])[cut].result(timeout=30)
        found = flat(reader.read({0: [2, 9, 12]}))
    finally:
        reader.close()
    assert keys(found) == {(0, 2): Missing.EXPIRED, (0, 9): Missing.EXPIRED, (0, 12): b"0-12"}


def test_transaction_markers_and_aborted_records_are_absent(
    topic_factory: TopicFactory, bootstrap: str,
) -> None:
    topic = topic_factory("orig", 1)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"a", value=b"1", partition=0)
    producer.commit_transaction(30)  # a: 0, marker: 1
    producer.begin_transaction()
    producer.produce(topic, key=b"b", value=b"2", partition=0)
    assert producer.flush(30) == 0  # written to the log, then aborted
    producer.abort_transaction(30)  # b: 2 (aborted), marker: 3
    producer.begin_transaction()
    producer.produce(topic, key=b"c", value=b"3", partition=0)
    producer.commit_transaction(30)  # c: 4, marker: 5
    reader = OriginalReader({"bootstrap.servers": bootstrap}, topic)
    try:
        found = flat(reader.read({0: [0, 1, 2, 3, 4]}))
    finally:
        reader.close()
    assert keys(found) == {(0, 0): b"a", (0, 1): Missing.ABSENT, (0, 2): Missing.ABSENT,
                           (0, 3): Missing.ABSENT, (0, 4): b"c"}


class _Counting:
    """A consumer that counts how the reader positions it."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer
        self.seeks = 0
        self.assigns = 0

    def seek(self, partition: TopicPartition) -> None:
        self.seeks += 1
        self._consumer.seek(partition)

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self.assigns += 1
        self._consumer.incremental_assign(partitions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def test_consecutive_reads_read_on_without_a_seek_and_a_jump_seeks(
    topic_factory: TopicFactory, bootstrap: str,
) -> None:
    """A burst reads one range after the other: the reader goes on from where it was
    (records fetched past a run are kept for the next read), and seeks only elsewhere."""
    topic = topic_factory("orig", 2)
    fill(bootstrap, topic, 2, 600)
    made: list[_Counting] = []

    def client(config: dict[str, str | int | bool]) -> Consumer:
        made.append(_Counting(Consumer(config)))
        return cast(Consumer, made[-1])

    reader = OriginalReader({"bootstrap.servers": bootstrap}, topic, max_gap=50,
                            client=client)
    try:
        for start in range(0, 400, 100):
            found = flat(reader.read({p: range(start, start + 100) for p in (0, 1)}))
            assert keys(found) == {(p, o): f"{p}-{o}".encode()
                                   for p in (0, 1) for o in range(start, start + 100)}
        [counting] = made
        assert (counting.assigns, counting.seeks) == (1, 0)
        assert keys(flat(reader.read({0: [5]}))) == {(0, 5): b"0-5"}, "back: a seek"
        assert counting.seeks == 1
        assert keys(flat(reader.read({0: [300]}))) == {(0, 300): b"0-300"}
        assert counting.seeks == 2, "far ahead: a seek"
        assert keys(flat(reader.read({1: [599]}))) == {(1, 599): b"1-599"}
        assert counting.assigns == 2, "partition 1, let go by the reads of 0 alone, anew"
        assert keys(flat(reader.read({1: [630, 610]}))) == {(1, 610): Missing.ABSENT,
                                                      (1, 630): Missing.ABSENT}
    finally:
        reader.close()


def test_the_end_of_a_partition_reached_earlier_hides_no_record_written_since(
    topic_factory: TopicFactory, bootstrap: str,
) -> None:
    """The reader stays assigned between reads: an end-of-partition event of an earlier
    read still queued must not make a record written since look absent."""
    topic = topic_factory("orig", 1)
    fill(bootstrap, topic, 1, 10)
    reader = OriginalReader({"bootstrap.servers": bootstrap}, topic)
    try:
        assert keys(flat(reader.read({0: [8, 9]}))) == {(0, 8): b"0-8", (0, 9): b"0-9"}
        time.sleep(0.5)  # the reader's consumer fetches on and reaches the end (offset 10)
        produce(bootstrap, topic, [{"key": f"0-{i}".encode(), "value": b"v", "partition": 0}
                                   for i in range(10, 20)])
        assert keys(flat(reader.read({0: [12, 15]}))) == {(0, 12): b"0-12", (0, 15): b"0-15"}
    finally:
        reader.close()
