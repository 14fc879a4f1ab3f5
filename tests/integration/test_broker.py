"""What kdelay relies on from a real Kafka broker and librdkafka, proved against one.

Each test pins one behaviour that ``docs/kafka-behaviour.md`` records: reading
one record back by (partition, offset), transactional visibility and the offset
gaps control records leave, what a record the broker refuses does to its
transaction, what an abort does to queued records and their delivery
callbacks, the error a consumer gets below the log start offset, tombstones on
compacted topics, and consumer offsets committed inside a producer transaction.
Nothing here sleeps to let time pass: every wait is a bounded ``poll`` loop on
the broker's answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kafka_broker  # tools/, on pytest's pythonpath
import pytest
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from kdelay.plumbing import callbacks
from kdelay.plumbing.callbacks import guarded

pytestmark = [pytest.mark.kafka, pytest.mark.compat]

TopicFactory = Callable[..., str]  # the conftest fixture topic_factory
TIMEOUT_S = 30.0
OFFSET_INVALID = -1001


def test_the_broker_runs_the_kafka_version_asked_for(bootstrap: str) -> None:
    """A broker of ``tools/kafka`` runs the jars of ``KDELAY_KAFKA_VERSION`` (default 4.1.1).

    The compatibility runs rely on it: each must test the version it names.
    """
    pid = kafka_broker.recorded_pid()
    address = kafka_broker.RUN / "bootstrap"
    if pid is None or not address.exists() or address.read_text().strip() != bootstrap:
        pytest.skip("the broker is not one tools/kafka runs from jars")
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    classpath = Path(command[command.index(b"-cp") + 1].decode().removesuffix("/*"))
    jars = sorted(jar.name for jar in classpath.glob("kafka_2.13-*.jar"))
    assert jars == [f"kafka_2.13-{kafka_broker.VERSION}.jar"]


class Deliveries:
    """A delivery callback that records outcomes and raises on an untolerated failure.

    ``reports`` holds (partition, offset) of delivered records; ``failures``
    holds the codes of failed deliveries whose code is in ``tolerated``.
    """

    def __init__(self, tolerated: frozenset[int] = frozenset()) -> None:
        self.tolerated = tolerated
        self.reports: list[tuple[int, int]] = []
        self.failures: list[int] = []

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        """Record one delivery report; raise a failure so the guard latches it."""
        if err is not None:
            if err.code() not in self.tolerated:
                raise KafkaException(err)
            self.failures.append(err.code())
            return
        partition, offset = msg.partition(), msg.offset()
        assert partition is not None
        assert offset is not None
        self.reports.append((partition, offset))


def make_producer(bootstrap: str, config: dict[str, Any] | None = None) -> Producer:
    """An idempotent producer on ``bootstrap``; ``config`` adds or overrides settings."""
    settings: dict[str, Any] = {"bootstrap.servers": bootstrap, "enable.idempotence": True}
    return Producer(settings | (config or {}))


def make_consumer(bootstrap: str, config: dict[str, Any] | None = None) -> Consumer:
    """A consumer in a fresh group that never commits or stores offsets on its own."""
    settings: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"test-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
    }
    return Consumer(settings | (config or {}))


def flush(producer: Producer) -> None:
    """Flush ``producer`` and fail if anything is left undelivered."""
    assert producer.flush(TIMEOUT_S) == 0


def read_until(consumer: Consumer, tp: TopicPartition, end: int) -> list[Message]:
    """Consume records of the assigned ``tp`` until its position reaches ``end``.

    Stops on the position, not on a count, so a test can prove that records it
    must not see (aborted ones) are skipped rather than merely not yet fetched.
    Message errors fail the test.
    """
    messages: list[Message] = []
    deadline = time.monotonic() + TIMEOUT_S
    while consumer.position([tp])[0].offset < end:
        assert time.monotonic() < deadline, f"position of {tp} never reached {end}"
        for msg in consumer.consume(100, 0.5):
            assert msg.error() is None, msg.error()
            messages.append(msg)
    return messages


def read_until_count(consumer: Consumer, count: int) -> list[Message]:
    """Consume from a subscribed consumer until ``count`` records have arrived."""
    messages: list[Message] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(messages) < count:
        assert time.monotonic() < deadline, f"got {len(messages)} of {count} records"
        for msg in consumer.consume(100, 0.5):
            assert msg.error() is None, msg.error()
            messages.append(msg)
    return messages


def settled_watermarks(consumer: Consumer, tp: TopicPartition, high: int) -> tuple[int, int]:
    """Return ``tp``'s watermarks once the high one is ``high``, or the last seen.

    A transaction's markers land on its partitions shortly after
    ``commit_transaction`` returns, so a read_committed consumer can see the old
    last stable offset for a few milliseconds.
    """
    deadline = time.monotonic() + TIMEOUT_S
    watermarks = consumer.get_watermark_offsets(tp, TIMEOUT_S)
    while watermarks[1] != high and time.monotonic() < deadline:
        watermarks = consumer.get_watermark_offsets(tp, TIMEOUT_S)
    return watermarks


def first_error(consumer: Consumer) -> tuple[Message, KafkaError]:
    """Consume until a message carries an error; return the message and its error."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for msg in consumer.consume(100, 0.5):
            err = msg.error()
            assert err is not None, f"unexpected record at offset {msg.offset()}"
            return msg, err
    pytest.fail("consumer reported no error")


def test_read_one_record_back_by_partition_and_offset(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """A record read back by (partition, offset) keeps key, value, headers, timestamp.

    Duplicate header names keep their order and a None header value stays None.
    """
    topic = topic_factory("exact", partitions=3)
    producer = make_producer(bootstrap)
    deliveries = Deliveries()
    headers: list[tuple[str, str | bytes | None]] = [
        ("kdelay-a", b"1"),
        ("kdelay-a", b"2"),
        ("kdelay-none", None),
        ("kdelay-b", b""),
    ]
    # Close to now: a CreateTime older than retention.ms lets retention delete the record.
    timestamp_ms = int(time.time() * 1000) - 60_000
    for i in range(5):
        producer.produce(
            topic,
            value=b"other-%d" % i,
            key=b"k%d" % i,
            partition=1,
            on_delivery=guarded(deliveries),
        )
    producer.produce(
        topic,
        value=b"\x00payload\xff",
        key=b"the-key",
        partition=1,
        headers=headers,
        timestamp=timestamp_ms,
        on_delivery=guarded(deliveries),
    )
    flush(producer)
    partition, offset = deliveries.reports[-1]
    assert (partition, offset) == (1, 5)

    consumer = make_consumer(bootstrap)
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        messages = read_until(consumer, TopicPartition(topic, partition), offset + 1)
    finally:
        consumer.close()
    assert len(messages) == 1
    msg = messages[0]
    assert (msg.partition(), msg.offset()) == (partition, offset)
    assert msg.key() == b"the-key"
    assert msg.value() == b"\x00payload\xff"
    assert msg.headers() == headers
    assert msg.timestamp() == (TIMESTAMP_CREATE_TIME, timestamp_ms)


def test_produce_by_position_takes_the_report_as_callback(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """``produce(topic, value, key, partition, callback, None, timestamp, headers)``, the
    call kdelay's per-record paths make (``clients.Producing.produce``), reports to
    ``callback`` and writes timestamp and headers; partition -1 and timestamp 0 leave
    the choice to the partitioner and the producer's clock."""
    topic = topic_factory("by-position", partitions=2)
    producer = make_producer(bootstrap)
    deliveries = Deliveries()
    headers: list[tuple[str, str | bytes | None]] = [("kdelay-a", b"1"), ("kdelay-b", None)]
    timestamp_ms = int(time.time() * 1000) - 60_000
    before_ms = int(time.time() * 1000)
    producer.produce(topic, b"v1", b"k1", 1, guarded(deliveries), None, timestamp_ms, headers)
    producer.produce(topic, b"v2", b"k2", -1, guarded(deliveries), None, 0, None)
    flush(producer)
    assert len(deliveries.reports) == 2
    assert deliveries.reports[0] == (1, 0)
    ends = {0: 0, 1: 0}
    for partition, offset in deliveries.reports:
        ends[partition] = max(ends[partition], offset + 1)

    consumer = make_consumer(bootstrap)
    read: dict[bytes | None, Message] = {}
    try:
        for partition, end in ends.items():
            if end:
                consumer.assign([TopicPartition(topic, partition, 0)])
                read.update((m.key(), m) for m in read_until(
                    consumer, TopicPartition(topic, partition), end))
    finally:
        consumer.close()
    first, second = read[b"k1"], read[b"k2"]
    assert (first.partition(), first.value(), first.headers()) == (1, b"v1", headers)
    assert first.timestamp() == (TIMESTAMP_CREATE_TIME, timestamp_ms)
    assert (second.key(), second.value(), second.headers()) == (b"k2", b"v2", None)
    assert second.timestamp()[1] >= before_ms


def test_transactions_hide_aborted_records_and_leave_offset_gaps(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """read_committed skips an aborted transaction; control records take offsets.

    Layout: committed 0-2, commit marker 3, aborted 4-5, abort marker 6,
    committed 7, commit marker 8; the high watermark is 9.
    """
    topic = topic_factory("txn")
    producer = make_producer(bootstrap, {"transactional.id": f"txn-{topic}"})
    deliveries = Deliveries()
    producer.init_transactions(TIMEOUT_S)
    for values, commit in (([b"c0", b"c1", b"c2"], True), ([b"a0", b"a1"], False), ([b"c3"], True)):
        producer.begin_transaction()
        for value in values:
            producer.produce(topic, value=value, on_delivery=guarded(deliveries))
        flush(producer)
        if commit:
            producer.commit_transaction(TIMEOUT_S)
        else:
            producer.abort_transaction(TIMEOUT_S)
    assert [offset for _, offset in deliveries.reports] == [0, 1, 2, 4, 5, 7]

    seen: dict[str, list[tuple[int | None, bytes | None]]] = {}
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = make_consumer(bootstrap, {"isolation.level": isolation})
        try:
            assert settled_watermarks(consumer, TopicPartition(topic, 0), 9) == (0, 9)
            consumer.assign([TopicPartition(topic, 0, 0)])
            messages = read_until(consumer, TopicPartition(topic, 0), 9)
        finally:
            consumer.close()
        seen[isolation] = [(m.offset(), m.value()) for m in messages]
    assert seen["read_committed"] == [(0, b"c0"), (1, b"c1"), (2, b"c2"), (7, b"c3")]
    assert seen["read_uncommitted"] == [
        (0, b"c0"),
        (1, b"c1"),
        (2, b"c2"),
        (4, b"a0"),
        (5, b"a1"),
        (7, b"c3"),
    ]


def test_abort_purges_queued_records_with_purge_queue_reports(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """``abort_transaction`` fails records not yet sent with ``_PURGE_QUEUE``.

    Their delivery reports run inside ``abort_transaction`` before it returns,
    with no offset; the producer can then start the next transaction.
    """
    topic = topic_factory("purge")
    producer = make_producer(bootstrap, {"transactional.id": f"purge-{topic}", "linger.ms": 1000})
    deliveries = Deliveries(tolerated=frozenset({KafkaError._PURGE_QUEUE}))
    producer.init_transactions(TIMEOUT_S)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=b"%d" % i, on_delivery=guarded(deliveries))
    producer.abort_transaction(TIMEOUT_S)
    assert deliveries.failures == [KafkaError._PURGE_QUEUE] * 3
    assert len(producer) == 0
    producer.begin_transaction()
    producer.produce(topic, value=b"next", on_delivery=guarded(deliveries))
    producer.commit_transaction(TIMEOUT_S)
    assert deliveries.reports == [(0, 0)]


def test_a_record_the_broker_refuses_leaves_its_transaction_refusing_until_aborted(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """Once the broker refused a record of the open transaction (here: too large for its
    topic), its report fails and every later ``produce`` raises ``_STATE`` (Erroneous
    state), to any topic, until ``abort_transaction``; the next transaction works."""
    small = topic_factory("refuse-small", 1, {"max.message.bytes": "1024"})
    wide = topic_factory("refuse-wide")
    producer = make_producer(bootstrap, {"transactional.id": f"refuse-{small}"})
    deliveries = Deliveries(tolerated=frozenset({KafkaError.MSG_SIZE_TOO_LARGE}))
    producer.init_transactions(TIMEOUT_S)
    producer.begin_transaction()
    producer.produce(small, value=b"x" * 4_000, on_delivery=guarded(deliveries))
    producer.flush(TIMEOUT_S)
    assert deliveries.failures == [KafkaError.MSG_SIZE_TOO_LARGE]
    with pytest.raises(KafkaException) as refused:
        producer.produce(wide, value=b"later", on_delivery=guarded(deliveries))
    assert refused.value.args[0].code() == KafkaError._STATE
    producer.abort_transaction(TIMEOUT_S)
    producer.begin_transaction()
    producer.produce(wide, value=b"next", on_delivery=guarded(deliveries))
    producer.commit_transaction(TIMEOUT_S)
    assert deliveries.reports == [(0, 0)]


def test_delivery_callback_raising_inside_abort_leaves_the_abort_to_retry(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """A delivery callback that raises interrupts ``abort_transaction``.

    The first purge report's exception propagates out of ``abort_transaction``;
    the other reports stay queued and raise from ``poll``. The abort is left
    unfinished (``begin_transaction`` fails with ``_CONFLICT``) until
    ``abort_transaction`` is called again.
    """
    topic = topic_factory("purge-raise")
    producer = make_producer(
        bootstrap, {"transactional.id": f"purge-raise-{topic}", "linger.ms": 1000}
    )
    deliveries = Deliveries()
    producer.init_transactions(TIMEOUT_S)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=b"%d" % i, on_delivery=guarded(deliveries))
    with pytest.raises(KafkaException):
        producer.abort_transaction(TIMEOUT_S)
    raised_from_poll = 0
    while len(producer) > 0:
        assert raised_from_poll < 10, "purge reports never drained"
        with pytest.raises(KafkaException):
            producer.poll(0)
        raised_from_poll += 1
    assert raised_from_poll == 2
    with pytest.raises(KafkaException) as unfinished:
        producer.begin_transaction()
    assert unfinished.value.args[0].code() == KafkaError._CONFLICT
    producer.abort_transaction(TIMEOUT_S)
    latched = callbacks.drain_errors()
    codes = [exc.args[0].code() if isinstance(exc, KafkaException) else exc for exc in latched]
    assert codes == [KafkaError._PURGE_QUEUE] * 3
    producer.begin_transaction()
    producer.produce(topic, value=b"next", on_delivery=guarded(deliveries))
    producer.commit_transaction(TIMEOUT_S)
    assert deliveries.reports == [(0, 0)]


def test_open_transaction_holds_read_committed_high_watermark_at_lso(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """While a transaction is open, read_committed reports the LSO as high watermark.

    The LSO moves past the transaction when its commit marker lands, which can
    be a few milliseconds after ``commit_transaction`` returns.
    """
    topic = topic_factory("lso")
    plain = make_producer(bootstrap)
    deliveries = Deliveries()
    plain.produce(topic, value=b"plain", on_delivery=guarded(deliveries))
    flush(plain)
    producer = make_producer(bootstrap, {"transactional.id": f"lso-{topic}"})
    producer.init_transactions(TIMEOUT_S)
    producer.begin_transaction()
    producer.produce(topic, value=b"open", on_delivery=guarded(deliveries))
    flush(producer)
    tp = TopicPartition(topic, 0)
    committed = make_consumer(bootstrap, {"isolation.level": "read_committed"})
    uncommitted = make_consumer(bootstrap, {"isolation.level": "read_uncommitted"})
    try:
        assert committed.get_watermark_offsets(tp, TIMEOUT_S) == (0, 1)
        assert uncommitted.get_watermark_offsets(tp, TIMEOUT_S) == (0, 2)
        producer.commit_transaction(TIMEOUT_S)
        assert settled_watermarks(committed, tp, 3) == (0, 3)
    finally:
        committed.close()
        uncommitted.close()


def test_offset_below_log_start_is_an_auto_offset_reset_message_error(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory
) -> None:
    """Below the log start offset, ``auto.offset.reset=error`` yields one message error.

    The error is ``_AUTO_OFFSET_RESET`` on a message from ``consume()`` carrying
    the requested (topic, partition, offset); ``error_cb`` is not called. The
    partition then stops fetching: ``seek`` fails with ``_STATE`` and assigning
    it again at the log start offset resumes reading.
    """
    topic = topic_factory("lso-gone")
    producer = make_producer(bootstrap)
    deliveries = Deliveries()
    for i in range(10):
        producer.produce(topic, value=b"v%d" % i, on_delivery=guarded(deliveries))
    flush(producer)
    tp = TopicPartition(topic, 0)
    futures = admin.delete_records([TopicPartition(topic, 0, 5)])
    assert futures[tp].result(timeout=TIMEOUT_S).low_watermark == 5

    client_errors: list[KafkaError] = []
    consumer = make_consumer(
        bootstrap, {"auto.offset.reset": "error", "error_cb": guarded(client_errors.append)}
    )
    try:
        assert consumer.get_watermark_offsets(tp, TIMEOUT_S) == (5, 10)
        consumer.assign([TopicPartition(topic, 0, 2)])
        msg, err = first_error(consumer)
        assert err.code() == KafkaError._AUTO_OFFSET_RESET
        assert "Offset out of range" in err.str()
        assert not err.fatal()
        assert not err.retriable()
        assert (msg.topic(), msg.partition(), msg.offset()) == (topic, 0, 2)
        assert consumer.position([tp])[0].offset == OFFSET_INVALID
        with pytest.raises(KafkaException) as seek_failure:
            consumer.seek(TopicPartition(topic, 0, 5))
        assert seek_failure.value.args[0].code() == KafkaError._STATE
        consumer.assign([TopicPartition(topic, 0, 5)])
        resumed = read_until(consumer, tp, 10)
    finally:
        consumer.close()
    assert [m.offset() for m in resumed] == [5, 6, 7, 8, 9]
    assert client_errors == []


def test_offset_below_log_start_with_earliest_resets_without_an_error(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory
) -> None:
    """With ``auto.offset.reset=earliest`` the consumer skips to the log start silently.

    No message error and no ``error_cb``: only ``error`` lets code notice that
    the records it asked for are gone.
    """
    topic = topic_factory("lso-earliest")
    producer = make_producer(bootstrap)
    deliveries = Deliveries()
    for i in range(10):
        producer.produce(topic, value=b"v%d" % i, on_delivery=guarded(deliveries))
    flush(producer)
    tp = TopicPartition(topic, 0)
    admin.delete_records([TopicPartition(topic, 0, 5)])[tp].result(timeout=TIMEOUT_S)
    client_errors: list[KafkaError] = []
    consumer = make_consumer(
        bootstrap, {"auto.offset.reset": "earliest", "error_cb": guarded(client_errors.append)}
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 2)])
        messages = read_until(consumer, tp, 10)
    finally:
        consumer.close()
    assert [m.offset() for m in messages] == [5, 6, 7, 8, 9]
    assert client_errors == []


def test_compacted_topic_keeps_tombstones_readable(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    """A keyed record with value None is accepted and read back as a tombstone.

    A record produced without headers reads back with ``headers()`` None, not [].
    """
    topic = topic_factory("compact", config={"cleanup.policy": "compact"})
    producer = make_producer(bootstrap)
    deliveries = Deliveries()
    producer.produce(topic, key=b"k", value=b"live", on_delivery=guarded(deliveries))
    producer.produce(topic, key=b"k", value=None, on_delivery=guarded(deliveries))
    flush(producer)
    assert [offset for _, offset in deliveries.reports] == [0, 1]
    consumer = make_consumer(bootstrap)
    try:
        consumer.assign([TopicPartition(topic, 0, 1)])
        messages = read_until(consumer, TopicPartition(topic, 0), 2)
    finally:
        consumer.close()
    assert [(m.offset(), m.key(), m.value()) for m in messages] == [(1, b"k", None)]
    assert messages[0].headers() is None


def test_offsets_sent_to_a_transaction_commit_only_with_it(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory
) -> None:
    """``send_offsets_to_transaction`` commits the group's offset with the transaction.

    Offsets sent in an aborted transaction are not committed.
    """
    source, target = topic_factory("eos-in"), topic_factory("eos-out")
    plain = make_producer(bootstrap)
    deliveries = Deliveries()
    for i in range(3):
        plain.produce(source, value=b"%d" % i, on_delivery=guarded(deliveries))
    flush(plain)

    group = f"eos-{source}"
    consumer = make_consumer(
        bootstrap,
        {
            "group.id": group,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        },
    )
    producer = make_producer(bootstrap, {"transactional.id": f"eos-{source}"})
    tp = TopicPartition(source, 0)
    try:
        consumer.subscribe([source])
        consumed = read_until_count(consumer, 3)
        assert [m.offset() for m in consumed] == [0, 1, 2]
        producer.init_transactions(TIMEOUT_S)
        metadata = consumer.consumer_group_metadata()

        producer.begin_transaction()
        producer.produce(target, value=b"aborted", on_delivery=guarded(deliveries))
        flush(producer)
        producer.send_offsets_to_transaction([TopicPartition(source, 0, 2)], metadata, TIMEOUT_S)
        producer.abort_transaction(TIMEOUT_S)
        assert consumer.committed([tp], TIMEOUT_S)[0].offset == OFFSET_INVALID

        producer.begin_transaction()
        producer.produce(target, value=b"committed", on_delivery=guarded(deliveries))
        producer.send_offsets_to_transaction(consumer.position([tp]), metadata, TIMEOUT_S)
        producer.commit_transaction(TIMEOUT_S)
        assert consumer.committed([tp], TIMEOUT_S)[0].offset == 3
    finally:
        consumer.close()
    listed = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group)], require_stable=True
    )
    partitions = listed[group].result(timeout=TIMEOUT_S).topic_partitions
    assert [(p.topic, p.partition, p.offset) for p in partitions] == [(source, 0, 3)]


# --- a gapless producer (the at-least-once changelog's) -----------------------------------


@pytest.mark.parametrize("gapless", [True, False])
def test_a_record_failed_for_good_fails_every_later_one_only_when_gapless(
        bootstrap: str, topic_factory: TopicFactory, gapless: bool) -> None:
    """A batch the broker refuses for good (here: larger than the topic's
    ``max.message.bytes``) leaves a gap before the records written after it,
    unless the idempotent producer is gapless. Then its fatal error
    ``_GAPLESS_GUARANTEE`` is raised by the next ``poll`` or ``flush`` (not
    through ``error_cb``) and every later ``produce`` raises ``_FATAL``.
    kdelay's changelog writer asks for the report of a plan's last put only,
    and relies on this (``kdelay.engine.commit._writer``)."""
    topic = topic_factory("gapless", config={"max.message.bytes": "2000"})
    producer = make_producer(bootstrap, {
        "enable.gapless.guarantee": gapless, "message.timeout.ms": 0, "linger.ms": 0})
    reports = Deliveries()

    def raised(call: Callable[[], object]) -> int | None:
        try:
            call()
        except KafkaException as exc:
            return int(exc.args[0].code())
        return None

    producer.produce(topic, key=b"big", value=b"x" * 4000, partition=0)  # no report asked
    first = raised(lambda: producer.flush(TIMEOUT_S))
    later = raised(lambda: producer.produce(topic, key=b"later", value=b"v", partition=0,
                                            on_delivery=reports))
    last = raised(lambda: producer.flush(TIMEOUT_S))
    if gapless:
        assert (first, later) == (KafkaError._GAPLESS_GUARANTEE, KafkaError._FATAL)
        assert reports.reports == [], "nothing after the refused record was written"
    else:
        assert (first, later, last) == (None, None, None)
        assert reports.reports == [(0, 0)], "the later record landed: a gap before it"
