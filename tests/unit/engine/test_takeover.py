"""Ending the transaction a dead owner left open, with fake clients (the rules only).

tests/e2e/test_takeover.py shows the same against a broker: an instance that
died inside a transaction no longer holds its partitions for its transaction
time-out.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, cast

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay.engine.commit import _takeover as takeover
from kdelay.engine.commit._takeover import Takeover, owned, owner_metadata, owner_of
from kdelay.plumbing.clients import Consuming, Transacting

GROUP = "kdelay"
REQUESTS = "kdelay.requests"
ME = "kdelay-kdelay-host-b"
PARTITIONS = [TopicPartition(REQUESTS, p) for p in range(3)]


def done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class Group:
    """The group as the fakes see it: stable offsets' metadata, members, open transactions."""

    def __init__(self, owners: dict[int, str], members: list[str], open_by: str | None) -> None:
        self.owners = owners  # partition -> offset metadata
        self.members = members
        self.open_by = open_by  # the transactional id whose open transaction holds the offsets
        self.fenced: list[str] = []
        self.admins = 0
        self.away = False


class FakeConsumer:
    """committed() times out while a transaction holds the offsets."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.reads = 0

    def committed(self, partitions: list[TopicPartition],
                  timeout: float = -1) -> list[TopicPartition]:
        self.reads += 1
        assert timeout == takeover.PROBE_S
        if self.group.open_by is not None or self.group.away:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to get committed"))
        return [TopicPartition(tp.topic, tp.partition, 7) for tp in partitions]


class FakeAdmin:
    def __init__(self, group: Group) -> None:
        self.group = group

    def list_consumer_group_offsets(self, requests: list[ConsumerGroupTopicPartitions],
                                    **_: Any) -> dict[str, Future[Any]]:
        if self.group.away:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer"))
        (request,) = requests
        found = [TopicPartition(tp.topic, tp.partition, 5, self.group.owners.get(tp.partition, ""))
                 for tp in request.topic_partitions or []]
        return {request.group_id: done(ConsumerGroupTopicPartitions(request.group_id, found))}

    def describe_consumer_groups(self, group_ids: list[str], **_: Any) -> dict[str, Future[Any]]:
        members = [SimpleNamespace(group_instance_id=m) for m in self.group.members]
        return {group_ids[0]: done(SimpleNamespace(members=members))}


class FenceProducer:
    def __init__(self, group: Group, transactional_id: str) -> None:
        self.group = group
        self.transactional_id = transactional_id

    def init_transactions(self, timeout: float = -1) -> None:
        self.group.fenced.append(self.transactional_id)
        if self.group.open_by == self.transactional_id:
            self.group.open_by = None  # InitProducerId aborted it


def made(group: Group) -> tuple[Takeover, Consuming]:
    def admin() -> AdminClient:
        group.admins += 1
        return cast(AdminClient, FakeAdmin(group))

    def producer(name: str, **config: Any) -> Transacting:
        assert name == "fence"
        return cast(Transacting, FenceProducer(group, config["transactional.id"]))

    return Takeover(GROUP, ME, admin, producer), cast(Consuming, FakeConsumer(group))


def test_owner_metadata_names_the_member_and_the_transactional_id() -> None:
    metadata = owner_metadata("host-a", "kdelay-kdelay-host-a")
    assert owner_of(metadata) == ("host-a", "kdelay-kdelay-host-a")
    assert [tp.metadata for tp in owned(PARTITIONS, metadata)] == [metadata] * 3
    assert owner_of(None) is None
    assert owner_of("") is None
    assert owner_of("written by another tool") is None
    assert owner_of(takeover.OWNER_PREFIX + "host-a") is None


def test_offsets_that_answer_need_no_lookup() -> None:
    group = Group({}, [], open_by=None)
    reader, consumer = made(group)
    offsets = reader.committed(consumer, PARTITIONS, lambda: False)
    assert [tp.offset for tp in offsets] == [7, 7, 7]
    assert group.admins == 0


def test_a_dead_owners_open_transaction_is_ended_and_the_offsets_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = owner_metadata("host-a", "kdelay-kdelay-host-a")
    group = Group({0: dead, 1: dead, 2: owner_metadata("host-b", ME)}, ["host-b"],
                  open_by="kdelay-kdelay-host-a")
    reader, consumer = made(group)
    with caplog.at_level("WARNING"):
        offsets = reader.committed(consumer, PARTITIONS, lambda: False)
    assert [tp.offset for tp in offsets] == [7, 7, 7]
    assert group.fenced == ["kdelay-kdelay-host-a"], "its own id is never taken"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "partitions [0, 1]" in line
    assert "host-a" in line


def test_an_owner_still_in_the_group_is_never_fenced(caplog: pytest.LogCaptureFixture) -> None:
    alive = owner_metadata("host-a", "kdelay-kdelay-host-a")
    group = Group({0: alive}, ["host-a", "host-b"], open_by="kdelay-kdelay-host-c")
    reader, consumer = made(group)
    rounds = [0]

    def stopping() -> bool:
        rounds[0] += 1
        return rounds[0] > 3

    with caplog.at_level("WARNING"), pytest.raises(KafkaException):
        reader.committed(consumer, PARTITIONS, stopping)
    assert group.fenced == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, "said once, however long it waits"
    assert "waiting until the transaction coordinator ends it" in lines[0]
    assert consumer.reads == 4  # type: ignore[attr-defined]


def test_a_kafka_that_does_not_answer_the_lookup_is_an_outage() -> None:
    group = Group({}, [], open_by=None)
    group.away = True
    reader, consumer = made(group)
    with pytest.raises(KafkaException) as raised:
        reader.committed(consumer, PARTITIONS, lambda: False)
    assert raised.value.args[0].code() == KafkaError._TIMED_OUT
    assert group.fenced == []


def test_at_least_once_reads_the_offsets_with_one_plain_call() -> None:
    group = Group({0: owner_metadata("host-a", "kdelay-kdelay-host-a")}, [], open_by=None)
    calls: list[float] = []

    class Plain:
        def committed(self, partitions: list[TopicPartition],
                      timeout: float = -1) -> list[TopicPartition]:
            calls.append(timeout)
            return partitions

    reader = Takeover(GROUP, ME, lambda: cast(AdminClient, FakeAdmin(group)),
                      lambda *_, **__: cast(Transacting, None), transactions=False)
    assert reader.committed(cast(Consuming, Plain()), PARTITIONS, lambda: False) == PARTITIONS
    assert calls == [takeover.CALL_S]
    assert group.fenced == []


class Marks:
    """Low watermarks by partition; a partition missing from ``low`` does not answer."""

    def __init__(self, low: dict[int, int], code: int = KafkaError.TOPIC_AUTHORIZATION_FAILED):
        self.low = low
        self.code = code

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        if partition.partition not in self.low:
            raise KafkaException(KafkaError(self.code, "Failed to get watermark offsets"))
        return self.low[partition.partition], self.low[partition.partition] + 10


def test_a_partition_is_claimed_at_its_offset_or_else_where_the_consumer_starts() -> None:
    assigned = [TopicPartition(REQUESTS, 0, 42), TopicPartition(REQUESTS, 1, -1001),
                TopicPartition(REQUESTS, 2, 0)]
    claimed = takeover.positioned(Marks({0: 5, 1: 3, 2: 9}), assigned)
    assert [(tp.partition, tp.offset) for tp in claimed] == [(0, 42), (1, 3), (2, 0)]
    assert [tp.offset for tp in assigned] == [42, -1001, 0], "the assignment is left as it is"


def test_a_claim_whose_start_is_not_known_is_given_up_with_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    assigned = [TopicPartition(REQUESTS, 0, -1001), TopicPartition(REQUESTS, 1, -1001)]
    assert takeover.positioned(Marks({0: 5}), assigned) == []
    assert [r.getMessage() for r in caplog.records] == [
        "partitions [0, 1]: their owner is not named before their first transaction: "
        "Failed to get watermark offsets"]
