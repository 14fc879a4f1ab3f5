"""The order of the service loop, with fake clients, real indexes and a manual clock.

The broker tests (tests/integration, tests/e2e) show that the loop works; these
show, call by call, that it does things in the order its guarantees rest on:
what is due goes out before intake writes, and whatever intake's
acknowledgements do (at-least-once), an aborted transaction is read
again (exactly-once), and revoked partitions are drained, settled and
committed before their indexes close (at-least-once).

The fakes keep no logic of their own: every call lands in one shared list of
events, in order; a producer acknowledges what it holds when polled or flushed
(or only when flushed, while ``hold`` is set), failing the records of the
topics in ``failing``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_CREATE_TIME,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from kdelay.engine import availability
from kdelay.engine.commit import _checkpoint as checkpoint
from kdelay.engine.outlook import PARTITION_CHECK_EVERY_MS
from kdelay.engine.service import Service
from kdelay.errors import ServiceError
from kdelay.plumbing import callbacks
from kdelay.plumbing.clients import Consuming, Rebalance, Report, Transacting
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Guarantee, Settings
from kdelay.plumbing.topics import Layout
from kdelay.protocol import codec
from kdelay.protocol.envelope import Headers, cancel_headers, schedule_headers
from kdelay.protocol.forward import id_partition
from kdelay.state.changelog import Replay
from kdelay.state.changes import Changes
from kdelay.state.index import CHANGELOG as INDEX_CHANGELOG
from kdelay.state.index import PartitionIndex
from kdelay.state.originals import Found, Reading
from kdelay.state.statedir import store_path

REQUESTS = "kdelay.requests"
CHANGELOG = "kdelay.changelog"
DLQ = "kdelay.dlq"
T0 = 1_700_000_000_000
Event = tuple[Any, ...]


class Wire:
    """Every call any fake client saw, in order, and the topics whose records fail."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.failing: set[str] = set()

    def kinds(self, *names: str) -> list[Event]:
        """The events whose first field is one of ``names``."""
        return [e for e in self.events if e[0] in names]


class FakeProducer:
    """Records produces; acknowledges them when polled (unless ``hold``) or flushed."""

    def __init__(self, name: str, wire: Wire) -> None:
        self.name = name
        self.wire = wire
        self.hold = False
        # A fatal error: raised by the next poll or flush (as confluent-kafka raises it,
        # instead of calling error_cb), the records held dropped without a report.
        self.fatal: KafkaError | None = None
        # librdkafka's out queue (len) counts its log, error and statistics events too.
        self.events_waiting = 0
        self._queued: list[tuple[str, int, bytes | None, bytes | None, Report | None]] = []
        self.sent: list[tuple[str, bytes | None, bytes | None]] = []
        self._offsets: dict[tuple[str, int], int] = {}

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                partition: int = -1, callback: Report | None = None,
                on_delivery: Report | None = None, timestamp: int = 0,
                headers: Headers | None = None) -> None:
        on_delivery = on_delivery or callback
        self.wire.events.append(("produce", self.name, topic, key))
        self._queued.append((topic, max(partition, 0), key, value, on_delivery))
        self.sent.append((topic, key, value))

    def poll(self, timeout: float = -1) -> int:
        self._raise_fatal()
        return 0 if self.hold else self._report()

    def flush(self, timeout: float = -1) -> int:
        self._raise_fatal()
        self._report()
        return 0

    def _raise_fatal(self) -> None:
        if self.fatal is not None:
            self._queued.clear()
            raise KafkaException(self.fatal)

    def __len__(self) -> int:
        return len(self._queued) + self.events_waiting

    def next_offset(self, topic: str, partition: int) -> int:
        """The offset the next acknowledged record of ``topic``'s ``partition`` gets."""
        return self._offsets.get((topic, partition), 0)

    def list_topics(self, topic: str, timeout: float = -1) -> SimpleNamespace:
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={})})

    def init_transactions(self, timeout: float = -1) -> None:
        self.wire.events.append(("init", self.name))

    def begin_transaction(self) -> None:
        self.wire.events.append(("begin", self.name))

    def send_offsets_to_transaction(self, positions: list[TopicPartition], group_metadata: Any,
                                    timeout: float = -1) -> None:
        self.wire.events.append(("offsets", [(tp.partition, tp.offset) for tp in positions]))

    def commit_transaction(self, timeout: float = -1) -> None:
        self.wire.events.append(("commit", self.name))

    def abort_transaction(self, timeout: float = -1) -> None:
        self.wire.events.append(("abort", self.name))

    def _report(self) -> int:
        queued, self._queued = self._queued, []
        for topic, partition, key, value, callback in queued:
            offset = self._offsets.get((topic, partition), 0)
            self._offsets[(topic, partition)] = offset + 1
            error = (KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied")
                     if topic in self.wire.failing else None)
            self.wire.events.append(("ack", self.name, topic, key, error is None))
            if callback is not None:  # a changelog put that is not its plan's last
                callback(error, Message(topic=topic, partition=partition, offset=offset,
                                        key=key, value=value))
        return len(queued)


class FakeConsumer:
    """Hands out the records of ``log`` from its position; runs rebalances inside consume."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.log: list[Message] = []
        self.position = 0
        self.assign_next: list[int] = [0]
        self.revoke_next: list[int] = []
        self.assigned: list[tuple[int, int]] = []  # the last assignment's starts
        self.committed_offsets: dict[int, int] = {}  # the group's; none: -1001
        self.low = 0  # the low watermark: the records below it are deleted
        self._callbacks: dict[str, Rebalance | None] = {}

    def subscribe(self, topics: list[str], on_assign: Rebalance | None = None,
                  on_revoke: Rebalance | None = None, on_lost: Rebalance | None = None) -> None:
        self._callbacks = {"assign": on_assign, "revoke": on_revoke}

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        self._rebalance("revoke", self.revoke_next)
        self._rebalance("assign", self.assign_next)
        taken = self.log[self.position:self.position + num_messages]
        self.position += len(taken)
        return taken

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.wire.events.append(("assign", [tp.partition for tp in partitions]))
        self.assigned = [(tp.partition, tp.offset) for tp in partitions]

    def committed(self, partitions: list[TopicPartition],
                  timeout: float = -1) -> list[TopicPartition]:
        offsets = self.committed_offsets
        return [TopicPartition(tp.topic, tp.partition, offsets.get(tp.partition, -1001))
                for tp in partitions]

    def seek(self, partition: TopicPartition) -> None:
        self.wire.events.append(("seek", partition.partition, partition.offset))
        self.position = partition.offset

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.wire.events.append(("pause", [tp.partition for tp in partitions]))

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.wire.events.append(("resume", [tp.partition for tp in partitions]))

    def store_offsets(self, message: Message | None = None,
                      offsets: list[TopicPartition] | None = None) -> None:
        self.wire.events.append(("store", [(tp.partition, tp.offset) for tp in offsets or []]))

    def commit(self, *, asynchronous: bool = True) -> list[TopicPartition]:
        self.wire.events.append(("commit-offsets",))
        return []

    def consumer_group_metadata(self) -> object:
        return object()

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        return self.low, len(self.log)

    def close(self) -> None:
        self.wire.events.append(("close",))

    def _rebalance(self, kind: str, partitions: list[int]) -> None:
        callback = self._callbacks.get(kind)
        if partitions and callback is not None:
            chosen = [TopicPartition(REQUESTS, p) for p in partitions]
            partitions.clear()
            callback(self, chosen)


class FakeReader:
    """Has no records: every entry in these tests is adopted from intake."""

    def read(self, wanted: Any) -> dict[int, dict[int, Found]]:
        return {partition: {} for partition in wanted}

    def close(self) -> None:
        pass


class FakeRestorer:
    """A changelog with nothing to replay."""

    def restore(self, index: PartitionIndex, progress: Any = None) -> int:
        return 0

    def begin(self, index: PartitionIndex, progress: Any = None) -> Replay | None:
        return None

    def behind(self, index: PartitionIndex) -> bool:
        self.restore(index)
        return False

    def close(self) -> None:
        pass


class Clients:
    """A ClientFactory of fakes that share one wire."""

    def __init__(self) -> None:
        self.wire = Wire()
        self.group = FakeConsumer(self.wire)
        self.producers: dict[str, FakeProducer] = {}

    def producer(self, name: str, **overrides: str | int | bool) -> Transacting:
        self.producers[name] = FakeProducer(name, self.wire)
        return self.producers[name]

    def consumer(self, name: str, **overrides: str | int | bool) -> Consuming:
        if name == "watermarks":  # the health's asker, on a thread: the log's end, nothing more
            return cast(Consuming, SimpleNamespace(
                get_watermark_offsets=self.group.get_watermark_offsets, close=lambda: None))
        if name == "controls":  # no controls topic: no controls in force
            return cast(Consuming, SimpleNamespace(
                list_topics=lambda topic, timeout=-1: SimpleNamespace(topics={}),
                consume=lambda num_messages=1, timeout=-1: [], close=lambda: None))
        return self.group

    def reader(self) -> Reading:
        return FakeReader()

    def restorer(self) -> FakeRestorer:
        return FakeRestorer()


class Loop:
    """A started service on fakes, a manual clock and real indexes under ``tmp_path``."""

    def __init__(self, tmp_path: Path, guarantee: Guarantee, partitions: int = 1) -> None:
        self.clock = ManualClock(T0)
        self.clients = Clients()
        self.wire = self.clients.wire
        self.settings = Settings(requests_topic=REQUESTS, changelog_topic=CHANGELOG,
                                 dlq_topic=DLQ, state_dir=tmp_path / "state",
                                 guarantee=guarantee)
        self.service = Service(self.settings, self.clock, Layout(partitions, None),
                               clients=self.clients)
        self.service.start()

    def request(self, due_ms: int, *, key: bytes, sid: str | None = None) -> bytes:
        """Append a request to the log; return its due key."""
        offset = len(self.clients.group.log)
        self.clients.group.log.append(Message(
            topic=REQUESTS, partition=0, offset=offset, key=key, value=b"v",
            headers=schedule_headers("orders", due_ms=due_ms, schedule_id=sid),
            timestamp=(TIMESTAMP_CREATE_TIME, self.clock.now_ms())))
        return codec.encode_due_key(due_ms, 0, offset)

    def cancel(self, sid: str) -> None:
        offset = len(self.clients.group.log)
        self.clients.group.log.append(Message(
            topic=REQUESTS, partition=0, offset=offset, key=b"c", value=None,
            headers=cancel_headers(sid), timestamp=(TIMESTAMP_CREATE_TIME, self.clock.now_ms())))

    def step(self) -> list[Event]:
        """Run one step; return the events it caused."""
        before = len(self.wire.events)
        self.service.step(max_wait_ms=0)
        return self.wire.events[before:]

    def pending(self) -> list[bytes]:
        return [entry.key for entry in self.service.indexes[0].entries()]


@pytest.fixture
def alo(tmp_path: Path) -> Iterator[Loop]:
    loop = Loop(tmp_path, Guarantee.AT_LEAST_ONCE)
    yield loop
    loop.service.close()


@pytest.fixture
def eos(tmp_path: Path) -> Iterator[Loop]:
    """Its partition claimed in a transaction of its own."""
    loop = Loop(tmp_path, Guarantee.EXACTLY_ONCE)
    claimed = loop.step()
    assert [e[0] for e in claimed if e[0] in ("assign", "begin", "offsets", "commit")] == [
        "begin", "offsets", "commit", "assign"]
    assert ("offsets", [(0, 0)]) in claimed  # at the low watermark: nothing consumed yet
    yield loop
    loop.service.close()


def produced(events: list[Event]) -> list[tuple[str, bytes | None]]:
    """What the service's own producers produced (the sweeper's tombstones left out)."""
    return [(e[2], e[3]) for e in events if e[0] == "produce" and e[1] != "sweeper"]


# -- at-least-once: the double tick ------------------------------------------------------------


def test_what_is_due_goes_out_before_the_intake_batch_is_written_and_awaited(alo: Loop) -> None:
    early = alo.request(T0 + 1_000, key=b"early")
    alo.step()
    assert alo.pending() == [early]

    alo.clock.set(T0 + 1_000)
    later = alo.request(T0 + 5_000, key=b"later")
    events = alo.step()
    assert produced(events)[:3] == [
        ("orders", b"early"),
        (CHANGELOG, later),
        (CHANGELOG, codec.CONSUMED_MARKER),
    ], "the due record before the batch's changelog records"
    acks = [e for e in events if e[0] == "ack" and e[2] == CHANGELOG]
    stored = events.index(("store", [(0, 2)]))
    assert all(events.index(ack) < stored for ack in acks), (
        "the offset is stored only once the batch's records are acknowledged")


def test_an_adopted_entry_already_due_goes_out_in_the_step_that_took_it_in(alo: Loop) -> None:
    key = alo.request(T0, key=b"now")
    events = alo.step()
    assert produced(events) == [
        (CHANGELOG, key),
        (CHANGELOG, codec.CONSUMED_MARKER),
        ("orders", b"now"),
        (CHANGELOG, codec.WATERMARK_MARKER),
    ], "put, marker, the record (second tick), then its watermark once acknowledged"
    target_ack = events.index(("ack", "targets", "orders", b"now", True))
    mark = events.index(("produce", "changelog", CHANGELOG, codec.WATERMARK_MARKER))
    assert target_ack < mark, "the watermark follows the record's acknowledgement"
    assert alo.pending() == []


def test_an_unacknowledged_record_keeps_its_entry_and_no_tombstone_is_written(
    alo: Loop,
) -> None:
    alo.clients.producers["targets"].hold = True
    key = alo.request(T0, key=b"now")
    alo.step()
    alo.step()
    assert alo.pending() == [key]
    assert [e for e in alo.wire.events if e == ("produce", "changelog", CHANGELOG, key)] == [
        ("produce", "changelog", CHANGELOG, key)], "only the put, no tombstone"


# -- at-least-once: intake does not wait for its acknowledgements ------------------------------


def test_a_step_does_not_wait_for_the_changelog_and_due_entries_still_go_out(alo: Loop) -> None:
    """With the changelog unacknowledged, later batches are still taken in and an adopted
    entry goes out when due; offsets are stored, batch by batch, only once acknowledged,
    and the delivered entry leaves the index only after its put is in it."""
    changelog = alo.clients.producers["changelog"]
    changelog.hold = True
    first = alo.request(T0 + 10, key=b"first")
    alo.step()
    second = alo.request(T0 + 60_000, key=b"second")
    events = alo.step()
    assert (CHANGELOG, second) in produced(events), "the next batch was taken in"
    alo.clock.set(T0 + 10)
    events = alo.step()
    assert ("orders", b"first") in produced(events), "due: out before its put is acknowledged"
    alo.step()
    assert alo.pending() == []
    assert alo.wire.kinds("store") == []

    changelog.hold = False
    alo.step()
    assert [e[1] for e in alo.wire.kinds("store")] == [[(0, 1)], [(0, 2)]], "in order"
    alo.step()
    assert alo.pending() == [second], "first: indexed, then deleted as delivered"
    written = [e[3] for e in alo.wire.kinds("produce")
               if e[1] == "changelog" and e[3] in (first, codec.WATERMARK_MARKER)]
    assert written == [first, codec.WATERMARK_MARKER], "its put, then a watermark"


def test_a_duplicate_id_in_a_later_batch_sees_the_unacknowledged_one(alo: Loop) -> None:
    alo.clients.producers["changelog"].hold = True
    alo.request(T0 + 60_000, key=b"a", sid="order-1")
    alo.step()
    alo.request(T0 + 90_000, key=b"b", sid="order-1")
    alo.step()
    alo.clients.producers["changelog"].hold = False
    alo.step()
    intake = alo.service.metrics.intake.records
    assert intake.labels(outcome="duplicate")._value.get() == 1
    assert len(alo.pending()) == 1


def test_a_cancel_of_an_unacknowledged_schedule_keeps_it_from_going_out(alo: Loop) -> None:
    alo.clients.producers["changelog"].hold = True
    alo.request(T0 + 10, key=b"a", sid="order-1")
    alo.step()
    alo.cancel("order-1")
    alo.step()
    alo.clock.set(T0 + 10)
    alo.step()
    alo.clients.producers["changelog"].hold = False
    alo.step()
    alo.step()
    assert ("orders", b"a") not in produced(alo.wire.events)
    assert alo.pending() == []
    assert alo.service.metrics.intake.records.labels(outcome="cancelled")._value.get() == 1


def test_a_revoke_applies_the_batches_still_awaiting_acknowledgement(alo: Loop) -> None:
    alo.clients.producers["changelog"].hold = True
    key = alo.request(T0 + 60_000, key=b"a")
    alo.step()
    alo.clients.group.revoke_next.append(0)
    events = alo.step()
    store = events.index(("store", [(0, 1)]))
    assert store < events.index(("commit-offsets",)), "stored before the final commit"
    path = store_path(alo.settings.state_dir, REQUESTS, 0)
    index = PartitionIndex(path, 0)
    try:
        assert [e.key for e in index.entries()] == [key]
    finally:
        index.close()


# -- exactly-once: rewind on abort ---------------------------------------------------------------


def test_an_event_arriving_after_the_flush_is_no_record_left_unacknowledged(eos: Loop) -> None:
    # The flush emptied the out queue; a log line librdkafka queued since counts in its
    # length. Taken for a record Kafka never acknowledged, it had the transaction
    # abandoned and a new producer wait ~0.6 s for the old one's abort.
    producer = eos.clients.producers["transactions"]
    first = eos.request(T0 + 60_000, key=b"a")
    producer.events_waiting = 1
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("init", "begin", "abort", "offsets", "commit")] == [
        "begin", "offsets", "commit"]
    assert eos.clients.producers["transactions"] is producer
    assert eos.pending() == [first]


def test_an_aborted_transaction_is_read_again_from_the_batchs_first_record(eos: Loop) -> None:
    eos.wire.failing.add(CHANGELOG)
    first = eos.request(T0 + 60_000, key=b"a")
    second = eos.request(T0 + 60_000, key=b"b")
    events = eos.step()
    kinds = [e[0] for e in events if e[0] in ("begin", "abort", "commit", "offsets", "seek")]
    assert kinds == ["begin", "abort", "seek"]
    assert ("seek", 0, 0) in events
    assert eos.pending() == []

    eos.wire.failing.clear()
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("begin", "abort", "commit", "offsets")] == [
        "begin", "offsets", "commit"]
    assert ("offsets", [(0, 2)]) in events
    assert eos.pending() == [first, second]


def test_a_transaction_kafka_cannot_end_is_ended_by_a_new_producer_once_it_answers(
    eos: Loop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    away = KafkaError(KafkaError._TIMED_OUT, "timed out", retriable=True)
    answers = [False]

    def send_offsets(*_: Any, **__: Any) -> None:
        raise KafkaException(away)

    def init_transactions(producer: FakeProducer, timeout: float = -1) -> None:
        if not answers[0]:
            raise KafkaException(away)
        producer.wire.events.append(("init", producer.name))

    old = eos.clients.producers["transactions"]
    monkeypatch.setattr(old, "send_offsets_to_transaction", send_offsets)
    monkeypatch.setattr(FakeProducer, "init_transactions", init_transactions)
    first = eos.request(T0 + 60_000, key=b"a")
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("begin", "abort", "commit", "seek")] == [
        "begin", "seek"], "neither committed nor aborted: Kafka does not answer"
    new = eos.clients.producers["transactions"]
    assert new is not old
    assert [e for e in eos.step() if e[0] in ("begin", "commit", "init")] == [], (
        "no step produces until the new producer started")

    answers[0] = True
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("init", "begin", "offsets", "commit")] == [
        "init", "begin", "offsets", "commit"]
    assert all(e[1] == "transactions" for e in events if e[0] == "produce")
    assert eos.pending() == [first]


def test_offsets_whose_call_never_answers_are_abandoned_to_a_new_producer(
    eos: Loop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # librdkafka's send_offsets_to_transaction can block past its timeout, and after
    # an outage that replaced the consumer it may never answer while Kafka answers
    # everything else: the step must not wait forever serving nothing.
    monkeypatch.setattr(checkpoint, "ANSWER_POLL_S", 0.01)
    available = eos.service.metrics.cluster.kafka_available
    release = threading.Event()
    old = eos.clients.producers["transactions"]

    def send_offsets(*_: Any, **__: Any) -> None:
        eos.clock.advance(int((checkpoint.TXN_CALL_S + 1) * 1000))
        release.wait(5)

    monkeypatch.setattr(old, "send_offsets_to_transaction", send_offsets)
    first = eos.request(T0 + 60_000, key=b"a")
    try:
        events = eos.step()
    finally:
        release.set()
    assert [e[0] for e in events if e[0] in ("begin", "offsets", "commit", "abort")] == [
        "begin"], "neither committed nor aborted by the stuck producer"
    new = eos.clients.producers["transactions"]
    assert new is not old, "a new producer ends the abandoned transaction"
    assert available._value.get() == 1, "Kafka answers: no outage is reported"
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("begin", "offsets", "commit")] == [
        "begin", "offsets", "commit"], "the step's work is done again, by the new producer"
    assert eos.pending() == [first]


def test_a_stop_while_offsets_wait_for_kafka_ends_the_service_with_a_code(
    eos: Loop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checkpoint, "ANSWER_POLL_S", 0.01)
    release = threading.Event()
    old = eos.clients.producers["transactions"]

    def send_offsets(*_: Any, **__: Any) -> None:
        eos.clock.advance(int((checkpoint.TXN_CALL_S + 1) * 1000))
        eos.service.stop()
        release.wait(5)

    monkeypatch.setattr(old, "send_offsets_to_transaction", send_offsets)
    eos.request(T0 + 60_000, key=b"a")
    try:
        with pytest.raises(ServiceError) as raised:
            eos.step()
    finally:
        release.set()
    assert raised.value.code == "kafka-unreachable"


FENCED = KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)


def test_a_fence_after_an_outage_is_the_coordinators_timeout_and_a_new_producer_goes_on(
    eos: Loop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The coordinator aborts a transaction that outlived transaction.timeout.ms while
    # Kafka was away and bumps the epoch: the waiting producer is fenced, by no one else.
    monkeypatch.setattr(checkpoint, "ANSWER_POLL_S", 0.01)
    available = eos.service.metrics.cluster.kafka_available
    old = eos.clients.producers["transactions"]

    def late_offsets(*_: Any, **__: Any) -> None:
        eos.clock.advance(int((checkpoint.TXN_CALL_S + 1) * 1000))
        deadline = time.monotonic() + 5
        while available._value.get() != 0 and time.monotonic() < deadline:
            time.sleep(0.01)

    def fenced_commit(*_: Any, **__: Any) -> None:
        raise KafkaException(FENCED)

    monkeypatch.setattr(old, "send_offsets_to_transaction", late_offsets)
    monkeypatch.setattr(old, "commit_transaction", fenced_commit)
    first = eos.request(T0 + 60_000, key=b"a")
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("begin", "commit", "seek")] == ["begin", "seek"]
    new = eos.clients.producers["transactions"]
    assert new is not old, "a new transactional producer took over"
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("begin", "offsets", "commit")] == [
        "begin", "offsets", "commit"]
    assert eos.pending() == [first]


def test_a_fence_with_kafka_answering_all_along_ends_the_service(
    eos: Loop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fenced_commit(*_: Any, **__: Any) -> None:
        raise KafkaException(FENCED)

    monkeypatch.setattr(eos.clients.producers["transactions"], "commit_transaction",
                        fenced_commit)
    eos.request(T0 + 60_000, key=b"a")
    with pytest.raises(ServiceError) as raised:
        eos.step()
    assert raised.value.code == "fenced"


def test_a_member_fence_on_the_offsets_after_a_rejoin_ends_the_transaction_not_the_service(
    eos: Loop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A broker killed in a rolling restart moves the group coordinator; the consumer
    # rejoins under its group.instance.id, and offsets sent with the metadata of its old
    # membership are refused as fenced: abortable, not a second process.
    old = eos.clients.producers["transactions"]
    refused = KafkaError(
        KafkaError.FENCED_INSTANCE_ID,
        "Static consumer fenced by other consumer with same group.instance.id",
        txn_requires_abort=True)

    def fenced_offsets(*_: Any, **__: Any) -> None:
        raise KafkaException(refused)

    monkeypatch.setattr(old, "send_offsets_to_transaction", fenced_offsets)
    first = eos.request(T0 + 60_000, key=b"a")
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("begin", "commit", "seek")] == ["begin", "seek"]
    events = eos.step()
    assert [e[0] for e in events if e[0] in ("begin", "offsets", "commit")] == [
        "begin", "offsets", "commit"]
    assert eos.pending() == [first]


def test_a_fenced_begin_ends_the_service_with_its_code_not_a_raw_kafka_error(
    eos: Loop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fenced_begin(*_: Any, **__: Any) -> None:
        raise KafkaException(FENCED)

    monkeypatch.setattr(eos.clients.producers["transactions"], "begin_transaction",
                        fenced_begin)
    eos.request(T0 + 60_000, key=b"a")
    with pytest.raises(ServiceError) as raised:
        eos.step()
    assert raised.value.code == "fenced"


INSTANCE_FENCED = KafkaError(
    KafkaError.FENCED_INSTANCE_ID,
    "Static consumer fenced by other consumer with same group.instance.id", fatal=True)


def outage_then_back(loop: Loop, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kafka goes away (a client reports it, a probe confirms it), then answers again."""
    answers = [False]

    def list_topics(self: FakeProducer, topic: str, timeout: float = -1) -> SimpleNamespace:
        if not answers[0]:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "down"))
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={})})

    monkeypatch.setattr(FakeProducer, "list_topics", list_topics)
    down = KafkaError(KafkaError._ALL_BROKERS_DOWN, "down")
    loop.service._availability.errors.callback("intake")(down)
    loop.step()
    assert loop.service.metrics.cluster.kafka_available._value.get() == 0
    answers[0] = True
    loop.clock.advance(2_000)
    loop.step()
    assert loop.service.metrics.cluster.kafka_available._value.get() == 1


def test_the_requests_partitions_are_checked_only_while_kafka_answers(
        alo: Loop, monkeypatch: pytest.MonkeyPatch) -> None:
    """While Kafka is away only the probes ask for metadata (each bounded by a
    second): the partition check would hold the step for its whole timeout."""
    timeouts: list[float] = []
    answers = [False]

    def list_topics(self: FakeProducer, topic: str, timeout: float = -1) -> SimpleNamespace:
        timeouts.append(timeout)
        if not answers[0]:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "down"))
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={})})

    monkeypatch.setattr(FakeProducer, "list_topics", list_topics)
    down = KafkaError(KafkaError._ALL_BROKERS_DOWN, "down")
    alo.service._availability.errors.callback("intake")(down)
    for _ in range(3):
        alo.clock.advance(PARTITION_CHECK_EVERY_MS)
        alo.step()
    assert timeouts, "Kafka was probed"
    assert set(timeouts) == {availability.PROBE_TIMEOUT_S}
    answers[0] = True
    timeouts.clear()
    alo.clock.advance(2_000)
    alo.step()
    assert [t for t in timeouts if t != availability.PROBE_TIMEOUT_S] == [5], (
        "the check runs as soon as Kafka answers")


@pytest.mark.parametrize("guarantee", [Guarantee.AT_LEAST_ONCE, Guarantee.EXACTLY_ONCE])
@pytest.mark.parametrize("reported", ["error_cb", "consume"])
def test_a_consumer_fenced_by_its_own_rejoin_after_an_outage_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guarantee: Guarantee, reported: str,
) -> None:
    # librdkafka: a static member whose session timed out while the coordinator was
    # away rejoins and is fenced by that rejoin: no second process is involved.
    loop = Loop(tmp_path, guarantee)
    try:
        first = loop.request(T0 + 60_000, key=b"a")
        loop.step()
        outage_then_back(loop, monkeypatch)
        if reported == "error_cb":
            loop.service._availability.errors.callback("intake")(INSTANCE_FENCED)
        else:  # the consumer's own batch ends with the fatal error
            loop.clients.group.log.append(Message(topic=REQUESTS, error=INSTANCE_FENCED))
        events = loop.step()
        assert ("close",) in events, "the fenced consumer is closed"
        assert loop.service.owned() == [], "its partitions went with it"
        loop.clients.group.assign_next.append(0)
        loop.step()
        assert loop.service.owned() == [0], "the new consumer was assigned the partition"
        second = loop.request(T0 + 60_000, key=b"b")
        loop.step()
        loop.step()
        assert loop.pending() == [first, second]
    finally:
        loop.service.close()


@pytest.mark.parametrize("guarantee", [Guarantee.AT_LEAST_ONCE, Guarantee.EXACTLY_ONCE])
def test_a_consumer_fenced_by_its_rejoin_after_its_session_timed_out_is_replaced(
    tmp_path: Path, guarantee: Guarantee,
) -> None:
    # On a cluster: the broker coordinating the group dies, the others answer. The
    # consumer's session times out before the coordinator moves; its rejoin fences it.
    loop = Loop(tmp_path, guarantee)
    try:
        first = loop.request(T0 + 60_000, key=b"a")
        loop.step()
        quiet = loop.service._availability.errors.quiet(logging.getLogger("test"))
        quiet.log(4, "%s [%s] %s", "SESSTMOUT", "rdkafka#consumer-1",
                  "Consumer group session timed out")
        loop.service._availability.errors.callback("intake")(INSTANCE_FENCED)
        events = loop.step()
        assert ("close",) in events, "the fenced consumer is closed"
        loop.clients.group.assign_next.append(0)
        loop.step()
        assert loop.service.owned() == [0], "the new consumer was assigned the partition"
        assert loop.pending() == [first]
    finally:
        loop.service.close()


def test_a_consumer_fenced_with_kafka_answering_all_along_ends_the_service(alo: Loop) -> None:
    alo.step()
    alo.service._availability.errors.callback("intake")(INSTANCE_FENCED)
    with pytest.raises(ServiceError) as raised:
        alo.step()
    assert raised.value.code == "fenced"


def test_a_cancel_in_an_aborted_transaction_gives_its_entry_back(eos: Loop) -> None:
    key = eos.request(T0 + 1_000, key=b"a", sid="order-1")
    eos.step()
    assert eos.pending() == [key]
    eos.wire.failing.add(CHANGELOG)
    eos.cancel("order-1")
    eos.step()
    assert eos.pending() == [key], "the cancel was not applied"

    eos.wire.failing.clear()
    eos.clock.set(T0 + 1_000)
    eos.clients.group.log.clear()  # the cancel is not read again: the entry is due
    eos.clients.group.position = 0
    events = eos.step()
    assert ("orders", b"a") in produced(events), "released: delivered when due"


def test_a_step_without_work_opens_no_transaction(eos: Loop) -> None:
    eos.step()
    events = eos.step()
    assert [e for e in events if e[0] in ("begin", "commit", "abort")] == []


def test_a_due_record_and_its_watermark_share_a_transaction(eos: Loop) -> None:
    eos.request(T0 + 1_000, key=b"a")
    eos.step()
    eos.clock.set(T0 + 1_000)
    events = eos.step()
    begin = events.index(("begin", "transactions"))
    commit = events.index(("commit", "transactions"))
    record = events.index(("produce", "transactions", "orders", b"a"))
    mark = events.index(("produce", "transactions", CHANGELOG, codec.WATERMARK_MARKER))
    assert begin < record < mark < commit
    assert eos.pending() == []


# -- at-least-once: drain on revoke --------------------------------------------------------------


def test_a_revoked_partition_is_drained_settled_and_committed_before_it_closes(
    alo: Loop,
) -> None:
    alo.clients.producers["targets"].hold = True
    key = alo.request(T0, key=b"now")
    alo.step()
    assert alo.pending() == [key], "in flight: the report is held"

    alo.clients.group.revoke_next.append(0)
    events = alo.step()
    ack = events.index(("ack", "targets", "orders", b"now", True))
    mark = events.index(("produce", "changelog", CHANGELOG, codec.WATERMARK_MARKER))
    commit = events.index(("commit-offsets",))
    assert ack < mark < commit
    assert alo.service.owned() == []
    path = store_path(alo.settings.state_dir, REQUESTS, 0)
    index = PartitionIndex(path, 0)
    try:
        assert list(index.entries()) == [], "the delivered entry left the index before close"
    finally:
        index.close()


class BehindRestorer(FakeRestorer):
    """A store the changelog is ahead of, with nothing to replay: restored in a step."""

    def behind(self, index: PartitionIndex) -> bool:
        return True


# librdkafka looks up the committed offset of a partition assigned without one, and a
# request-level NOT_COORDINATOR answer (the coordinator moved in a rolling restart)
# leaves that partition unfetched for good (librdkafka issue 5586): a cluster test
# lost every request after its roll. The service reads the offsets itself.
def test_a_partition_is_assigned_at_an_explicit_start_never_at_the_stored_offset(
    alo: Loop,
) -> None:
    alo.step()
    assert alo.clients.group.assigned == [(0, OFFSET_BEGINNING)], "no commit, an empty store"
    alo.request(T0 + 60_000, key=b"a")
    alo.step()
    alo.step()
    alo.clients.group.revoke_next.append(0)
    alo.step()
    alo.clients.group.assign_next.append(0)
    alo.step()
    assert alo.clients.group.assigned == [(0, 1)], "after the request its store consumed"


def test_a_restoring_partition_is_assigned_at_an_explicit_start_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Clients, "restorer", lambda self: BehindRestorer())
    loop = Loop(tmp_path, Guarantee.AT_LEAST_ONCE)
    try:
        events = loop.step()
        # Not the logical earliest offset: its lookup can be lost to the pause.
        assert loop.clients.group.assigned == [(0, 0)]
        assert ("pause", [0]) in events
        events += loop.step()
        assert events.index(("seek", 0, 0)) < events.index(("resume", [0]))
        assert loop.service.owned() == [0]
        key = loop.request(T0 + 60_000, key=b"a")
        loop.step()
        loop.step()
        assert loop.pending() == [key], "served from the start it was assigned at"
    finally:
        loop.service.close()


def test_a_restoring_partition_without_a_commit_starts_at_its_low_watermark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Clients, "restorer", lambda self: BehindRestorer())
    loop = Loop(tmp_path, Guarantee.AT_LEAST_ONCE)
    keys = [loop.request(T0 + 60_000, key=key) for key in (b"a", b"b", b"c")]
    loop.clients.group.low = 2  # the first two were deleted by retention
    try:
        loop.step()
        assert loop.clients.group.assigned == [(0, 2)]
        events = loop.step()
        assert events.index(("seek", 0, 2)) < events.index(("resume", [0]))
        loop.step()
        loop.step()
        assert loop.pending() == keys[2:]
    finally:
        loop.service.close()


def test_a_restoring_partition_is_assigned_at_its_committed_offset_then_sought(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A seek right after an assignment at the earliest offset can lose to librdkafka's
    # lookup of where that is: the partition would be read again from its start.
    monkeypatch.setattr(Clients, "restorer", lambda self: BehindRestorer())
    loop = Loop(tmp_path, Guarantee.AT_LEAST_ONCE)
    loop.clients.group.committed_offsets[0] = 1
    try:
        loop.step()
        assert loop.clients.group.assigned == [(0, 1)]
        events = loop.step()
        assert ("seek", 0, 1) in events
        assert ("resume", [0]) in events
    finally:
        loop.service.close()


def test_records_below_the_offset_a_partition_was_sought_to_are_dropped_and_it_is_sought_again(
    alo: Loop, caplog: pytest.LogCaptureFixture,
) -> None:
    first = alo.request(T0 + 60_000, key=b"a")
    alo.step()
    alo.step()
    assert alo.service._owned.consumed[0] == 1
    alo.clients.group.position = 0  # librdkafka hands out offset 0 again
    second = alo.request(T0 + 120_000, key=b"b")
    with caplog.at_level("WARNING"):
        events = alo.step()
    assert ("seek", 0, 1) in events
    assert "the consumer read from offset 0, before the offset 1 it was sought to" in caplog.text
    alo.step()
    assert alo.pending() == [first, second], "offset 1 taken in once, offset 0 not again"
    assert [e for e in events if e[0] == "produce" and e[2] == CHANGELOG
            and e[3] == first] == [], "no second put of the first request"


def test_every_phase_of_a_step_with_work_is_timed(alo: Loop) -> None:
    alo.request(T0, key=b"now")
    alo.step()
    registry = alo.service.metrics.registry
    counts = {phase: registry.get_sample_value("kdelay_loop_phase_seconds_count",
                                               {"phase": phase})
              for phase in ("consume", "read-ahead", "dispatch", "write", "commit", "apply",
                            "settle", "sweep", "housekeeping")}
    assert counts == dict.fromkeys(counts, 1.0)


def test_intake_measures_how_late_each_request_arrived(alo: Loop) -> None:
    alo.request(T0 + 60_000, key=b"a")
    alo.clock.advance(250)
    alo.request(T0 + 60_000, key=b"b")
    alo.clock.advance(50)
    alo.step()
    registry = alo.service.metrics.registry
    assert registry.get_sample_value("kdelay_intake_delay_seconds_count") == 2
    assert registry.get_sample_value("kdelay_intake_delay_seconds_sum") == pytest.approx(0.35)
    cumulative = {le: registry.get_sample_value("kdelay_intake_delay_seconds_bucket",
                                                {"le": le})
                  for le in ("0.025", "0.05", "0.25", "0.5")}
    assert cumulative == {"0.025": 0, "0.05": 1, "0.25": 1, "0.5": 2}, "50 and 300 ms late"


def test_an_index_records_a_changelog_position_only_with_the_deletes_behind_it(
    eos: Loop,
) -> None:
    """A transaction carrying a delivery and an intake batch for one partition: its
    watermark confirms a changelog position; whichever index write first records that
    position must also hold the delete. Otherwise a crash before the delete is written
    would restore past the watermark and deliver the entry again."""
    delivered = eos.request(T0 + 1_000, key=b"a")
    eos.step()
    index = eos.service.indexes[0]
    seen: list[tuple[int | None, bool]] = []
    apply = index.apply

    def recording(changes: Changes) -> bytes | None:
        lowest = apply(changes)
        seen.append((changes.changelog, delivered in [e.key for e in index.entries()]))
        return lowest

    index.apply = recording  # type: ignore[method-assign]
    eos.clock.set(T0 + 1_000)
    eos.request(T0 + 60_000, key=b"b")
    events = eos.step()
    assert ("produce", "transactions", CHANGELOG, codec.WATERMARK_MARKER) in events
    mark_offset = 4  # put a, marker, then this step: put b, marker, the watermark over a
    past = [present for position, present in seen
            if position is not None and position > mark_offset]
    assert past, "some index write recorded the position past the watermark"
    assert not any(past), "...and every such write already held the delete"


# -- forwards: an id of another partition -------------------------------------------------------


def off_partition_id() -> str:
    """An id whose partition, of two, is 1: the loop reads partition 0."""
    return next(f"id-{n}" for n in range(100) if id_partition(f"id-{n}", 2) == 1)


@pytest.mark.parametrize("guarantee", [Guarantee.AT_LEAST_ONCE, Guarantee.EXACTLY_ONCE])
def test_a_forward_goes_out_before_the_requests_offset_is_recorded(
    tmp_path: Path, guarantee: Guarantee,
) -> None:
    loop = Loop(tmp_path, guarantee, partitions=2)
    try:
        loop.step()  # assigned (exactly-once: and claimed, in a transaction of its own)
        loop.request(T0 + 60_000, key=b"a", sid=off_partition_id())
        events = loop.step()
        forward = next(i for i, e in enumerate(events) if e[0] == "produce" and e[2] == REQUESTS)
        recorded = next(i for i, e in enumerate(events) if e[0] in ("store", "offsets"))
        assert forward < recorded
        assert loop.pending() == [], "the id's partition indexes it, not this one"
    finally:
        loop.service.close()


def test_a_forward_that_fails_aborts_the_transaction_and_is_read_again(tmp_path: Path) -> None:
    eos = Loop(tmp_path, Guarantee.EXACTLY_ONCE, partitions=2)
    try:
        eos.step()  # assigned and claimed
        eos.wire.failing.add(REQUESTS)
        eos.request(T0 + 60_000, key=b"a", sid=off_partition_id())
        events = eos.step()
        kinds = [e[0] for e in events if e[0] in ("begin", "abort", "commit", "offsets", "seek")]
        assert kinds == ["begin", "abort", "seek"], "the forward's failure arrives in the flush"
        eos.wire.failing.clear()
        events = eos.step()
        assert [e[0] for e in events if e[0] in ("begin", "abort", "commit", "offsets")] == [
            "begin", "offsets", "commit"]
        assert ("produce", "transactions", REQUESTS, None) in events
    finally:
        eos.service.close()


def test_a_forward_that_fails_for_good_stops_the_at_least_once_service(tmp_path: Path) -> None:
    alo = Loop(tmp_path, Guarantee.AT_LEAST_ONCE, partitions=2)
    try:
        alo.wire.failing.add(REQUESTS)
        alo.request(T0 + 60_000, key=b"a", sid=off_partition_id())
        with pytest.raises(ServiceError, match="forward") as raised:
            alo.step()
        assert raised.value.code == "forward-write-failed"
        assert alo.wire.kinds("store") == [], "the request's offset is not stored"
    finally:
        alo.service.close()


def markers(loop: Loop) -> list[int]:
    """The offsets of the consumed markers written so far, in order."""
    producer = loop.clients.producers["changelog"]
    return [codec.decode_offset(value) for topic, key, value in producer.sent
            if topic == CHANGELOG and key == codec.CONSUMED_MARKER and value is not None]


def test_at_least_once_markers_never_pass_a_forward_not_yet_acknowledged(
    tmp_path: Path,
) -> None:
    """A marker acknowledged before the forward would let a restore skip the request."""
    alo = Loop(tmp_path, Guarantee.AT_LEAST_ONCE, partitions=2)
    try:
        internal = alo.clients.producers["internal"]
        internal.hold = True
        alo.request(T0 + 60_000, key=b"a")
        alo.request(T0 + 60_000, key=b"b", sid=off_partition_id())  # offset 1, forwarded
        alo.step()
        alo.request(T0 + 60_000, key=b"c")
        alo.step()
        assert markers(alo) == [1, 1], "both stop at the forwarded request"
        internal.hold = False
        alo.step()
        alo.request(T0 + 60_000, key=b"d")
        alo.step()
        assert markers(alo)[-1] == 4, "once the forward is acknowledged, markers move on"
    finally:
        alo.service.close()


def test_at_least_once_never_records_a_changelog_position_past_a_plan_not_applied(
    tmp_path: Path,
) -> None:
    """A plan's changelog records can be acknowledged while its batch waits for another
    record (a forward here). A seal settled meanwhile must not record a changelog position
    past them: a catch-up after a lost assignment would skip the plan's puts while a later
    plan's marker moved intake past its requests (two requests lost in a chaos run)."""
    alo = Loop(tmp_path, Guarantee.AT_LEAST_ONCE, partitions=2)
    try:
        delivered = alo.request(T0 + 100, key=b"y")
        alo.step()
        changelog = alo.clients.producers["changelog"]
        floor = changelog.next_offset(CHANGELOG, 0)
        internal = alo.clients.producers["internal"]
        internal.hold = True
        alo.request(T0 + 60_000, key=b"b", sid=off_partition_id())  # its forward waits
        kept = alo.request(T0 + 60_000, key=b"c")  # its put is acknowledged at once
        alo.step()
        assert changelog.next_offset(CHANGELOG, 0) > floor, "the plan's records are acknowledged"
        alo.clock.set(T0 + 100)
        for _ in range(12):  # until the delivery of y is sealed and settled
            alo.step()
        index = alo.service.indexes[0]
        assert delivered not in alo.pending()
        assert kept not in alo.pending(), "the plan is not applied yet"
        assert (index.offset(INDEX_CHANGELOG) or 0) <= floor

        internal.hold = False
        for _ in range(12):
            alo.step()
        assert kept in alo.pending()
        assert (index.offset(INDEX_CHANGELOG) or 0) > floor, "the position moves on once applied"
    finally:
        alo.service.close()


# -- a restore Kafka does not answer --------------------------------------------------------


class SilentRestorer(FakeRestorer):
    """A restore whose first ``silent`` requests time out (a broker that just came back)."""

    def __init__(self, silent: int, code: int = KafkaError._TIMED_OUT) -> None:
        self.silent = silent
        self.code = code
        self.calls = 0

    def restore(self, index: PartitionIndex, progress: Any = None) -> int:
        self.calls += 1
        if self.calls <= self.silent:
            raise KafkaException(KafkaError(self.code, "Failed to get watermark offsets"))
        return 0


def silent_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                restorer: SilentRestorer) -> Loop:
    monkeypatch.setattr(availability, "PROBE_EVERY_S", 0.0)
    monkeypatch.setattr(Clients, "restorer", lambda self: restorer)
    return Loop(tmp_path, Guarantee.AT_LEAST_ONCE)


def test_a_restore_kafka_does_not_answer_is_waited_for_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # Right after an outage a broker can take a request and not answer it within its
    # time-out: the restore in the assignment waits for Kafka, the service does not exit.
    restorer = SilentRestorer(silent=3)
    loop = silent_loop(tmp_path, monkeypatch, restorer)
    try:
        with caplog.at_level("WARNING"):
            loop.step()
            assert restorer.calls == 4, "tried again until it answered"
            assert loop.service.owned() == [0], "then the partition serves"
            assert loop.service.metrics.cluster.kafka_available._value.get() == 0
            loop.step()
        assert loop.service.metrics.cluster.kafka_available._value.get() == 1
        lines = [r.getMessage() for r in caplog.records]
        down = [line for line in lines if "Kafka is unreachable" in line]
        assert len(down) == 1, lines
        assert "restoring partition 0: Failed to get watermark offsets" in down[0]
        assert len([line for line in lines if "Kafka answers again" in line]) == 1, lines
        key = loop.request(T0 + 60_000, key=b"a")
        loop.step()
        assert loop.pending() == [key]
    finally:
        loop.service.close()


def test_a_restore_refused_for_another_reason_ends_the_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    restorer = SilentRestorer(silent=1, code=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    loop = silent_loop(tmp_path, monkeypatch, restorer)
    try:
        with pytest.raises(KafkaException):
            loop.step()
        assert restorer.calls == 1, "not tried again"
        assert [type(e) for e in callbacks.drain_errors()] == [KafkaException]
    finally:
        loop.service.close()


def test_a_stop_while_a_restore_waits_for_kafka_ends_the_service_with_a_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    restorer = SilentRestorer(silent=1_000)
    loop = silent_loop(tmp_path, monkeypatch, restorer)
    original = restorer.restore

    def restore(index: PartitionIndex, progress: Any = None) -> int:
        if restorer.calls == 5:
            loop.service.stop()
        return original(index, progress)

    monkeypatch.setattr(restorer, "restore", restore)
    try:
        with pytest.raises(ServiceError) as raised:
            loop.step()
        assert raised.value.code == "kafka-unreachable"
        assert "restoring partition 0" in str(raised.value)
        assert callbacks.drain_errors() == [raised.value]
    finally:
        loop.service.close()


# -- at-least-once: a target producer that failed for good -------------------------------------


OUT_OF_SEQUENCE = KafkaError(KafkaError._INCONSISTENT, "Unable to reconstruct MessageSet",
                             fatal=True)


def test_a_target_producer_that_failed_for_good_is_renewed_and_its_records_go_out_again(
        alo: Loop, caplog: pytest.LogCaptureFixture) -> None:
    """A target refusing writes longer than the produce timeout can leave the idempotent
    target producer out of sequence for good; confluent-kafka raises that from its
    ``poll``. The service renews both target producers instead of ending, and the record
    the old one held goes out again on the new one: the old one's empty queue, its
    reports lost, is not taken for a landing."""
    alo.step()
    old = alo.clients.producers["targets"]
    old.hold = True
    key = alo.request(T0, key=b"a")
    alo.step()
    assert ("produce", "targets", "orders", b"a") in alo.wire.events
    old.fatal = OUT_OF_SEQUENCE
    with caplog.at_level(logging.INFO, logger="kdelay.engine.commit"):
        events = alo.step() + alo.step()
    assert alo.clients.producers["targets"] is not old, "a fresh producer was built"
    assert ("ack", "targets", "orders", b"a", True) in events, "delivered by the fresh one"
    assert alo.pending() == [], "and only then out of the index"
    assert key
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "fresh target producers" in warnings[0].getMessage()


def test_renewals_in_a_row_are_said_once(alo: Loop, caplog: pytest.LogCaptureFixture) -> None:
    alo.step()
    with caplog.at_level(logging.INFO, logger="kdelay.engine.commit"):
        for _ in range(3):
            alo.clients.producers["targets-each"].fatal = OUT_OF_SEQUENCE
            alo.step()
    renewed = [r for r in caplog.records if "renewed" in r.getMessage()
               or "fresh target producers" in r.getMessage()]
    assert [r.levelno for r in renewed] == [logging.WARNING, logging.INFO, logging.INFO]

