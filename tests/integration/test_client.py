"""The client library against a real broker: what ``DelayProducer`` writes, read back.

Every request is read back by the coordinates ``send`` returned and its headers
compared with the envelope. The pure helpers at the top need no broker; the
tests marked ``kafka`` do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from confluent_kafka import Consumer, Message, TopicPartition
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.client import (
    Coordinates,
    DelayProducer,
    DeliveryError,
    RequestRefused,
    delay_ms,
    due_ms,
    id_partition,
    parse_due,
    parse_header,
    request_headers,
)
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import LayoutError
from kdelay.protocol.envelope import CANCEL, DELAY_MS, DUE_MS, LEVEL, PARTITION, SCHEDULE_ID, TARGET
from tests.conftest import TopicFactory

kafka = pytest.mark.kafka
TIMEOUT_S = 30.0
DUE_2030_MS = 1_893_456_000_000  # 2030-01-01T00:00:00Z
WEEK_MS = 7 * 86_400_000

# Kafka's own murmur2 test vectors (Utils.murmur2 in the Java client).
JAVA_MURMUR2 = {"21": -973_932_308, "foobar": -790_332_482,
                "a-little-bit-long-string": -985_981_536, "abc": 479_470_107}


# --- pure helpers (no broker) ----------------------------------------------------------


@pytest.mark.parametrize("partitions", [1, 3, 7, 1000])
def test_id_partition_matches_the_java_default_partitioner(partitions: int) -> None:
    for schedule_id, java_hash in JAVA_MURMUR2.items():
        assert id_partition(schedule_id, partitions) == (java_hash & 0x7FFFFFFF) % partitions


def test_time_conversions() -> None:
    assert delay_ms(timedelta(seconds=1, microseconds=999)) == 1_000
    assert delay_ms(1_500) == 1_500
    assert due_ms(datetime(2030, 1, 1, tzinfo=UTC)) == DUE_2030_MS
    assert due_ms(datetime(2030, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))) == DUE_2030_MS
    assert parse_due("2030-01-01T00:00:00Z") == DUE_2030_MS
    assert parse_due("2030-01-01T01:00:00+01:00") == DUE_2030_MS
    assert parse_due(str(DUE_2030_MS)) == DUE_2030_MS
    assert parse_header("trace=a=b") == ("trace", "a=b")


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: delay_ms(timedelta(seconds=-1)), ValueError),
        (lambda: delay_ms(True), TypeError),
        (lambda: due_ms(datetime(2030, 1, 1)), ValueError),  # noqa: DTZ001 - naive on purpose
        (lambda: due_ms(-1), ValueError),
        (lambda: parse_due("2030-01-01T00:00:00"), ValueError),
        (lambda: parse_header("=x"), ValueError),
        (lambda: request_headers("t"), ValueError),
        (lambda: request_headers("t", delay=1, level=2), ValueError),
        (lambda: request_headers("t", {"KDELAY-TARGET": "x"}, delay=1), ValueError),
        (lambda: request_headers("t", level=0), ValueError),
    ],
)
def test_bad_arguments(call: Callable[[], object], error: type[Exception]) -> None:
    with pytest.raises(error):
        call()


def test_producer_is_lazy_and_validates_before_any_network() -> None:
    producer = DelayProducer(Settings(bootstrap_servers="127.0.0.1:1"))
    with pytest.raises(ValueError, match="exactly one"):
        producer.send("t", b"v", delay=1, due=2)
    with pytest.raises(ValueError, match="reserved"):
        producer.send("t", b"v", delay=1, headers=[("kdelay-id", b"x")])
    producer.close()  # nothing was produced: nothing to flush, no client was created


# --- against the broker ----------------------------------------------------------------


def read_back(bootstrap: str, where: Coordinates) -> Message:
    """Read the one record at ``where``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(where.topic, where.partition, where.offset)])
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                assert (message.partition(), message.offset()) == (where.partition, where.offset)
                return message
        raise AssertionError(f"nothing read at {where} within {TIMEOUT_S} s")
    finally:
        consumer.close()


def headers_of(message: Message) -> list[tuple[str, bytes | None]]:
    """A message's headers with every value as bytes."""
    headers = message.headers() or []
    assert isinstance(headers, list)
    return [(k, v.encode() if isinstance(v, str) else v) for k, v in headers]


@pytest.fixture
def requests_topic(topic_factory: TopicFactory) -> str:
    """A requests topic that keeps records forever, so no due time is too far ahead."""
    return topic_factory("req", 3, {"cleanup.policy": "delete", "retention.ms": "-1"})


@pytest.fixture
def week_topic(topic_factory: TopicFactory) -> str:
    """A requests topic as ``kdelay topics create`` makes it by default: 7 days' retention."""
    return topic_factory("week", 3, {"cleanup.policy": "delete", "retention.ms": str(WEEK_MS)})


@pytest.fixture
def producer(bootstrap: str, requests_topic: str) -> Iterator[DelayProducer]:
    with DelayProducer(Settings(bootstrap_servers=bootstrap,
                                requests_topic=requests_topic)) as made:
        yield made


@kafka
def test_send_with_delay_is_written_once_with_its_envelope(
    producer: DelayProducer, bootstrap: str, requests_topic: str
) -> None:
    where = producer.send("orders", b"payload", key="k1", headers={"trace": "abc"},
                          delay=timedelta(seconds=30))
    assert where.topic == requests_topic
    assert 0 <= where.partition < 3
    assert str(where) == f"{requests_topic}/{where.partition}/{where.offset}"
    message = read_back(bootstrap, where)
    assert (message.key(), message.value()) == (b"k1", b"payload")
    assert headers_of(message) == [("trace", b"abc"), (TARGET, b"orders"), (DELAY_MS, b"30000")]


@kafka
def test_send_with_due_level_and_target_partition(
    producer: DelayProducer, bootstrap: str
) -> None:
    due = producer.send("t", "text", headers=[("h", b"1"), ("h", "2")],
                        due=datetime(2030, 1, 1, tzinfo=UTC))
    assert headers_of(read_back(bootstrap, due)) == [
        ("h", b"1"), ("h", b"2"), (TARGET, b"t"), (DUE_MS, str(DUE_2030_MS).encode()),
    ]
    assert read_back(bootstrap, due).value() == b"text"
    level = producer.send("t", None, level=3, partition=2)
    message = read_back(bootstrap, level)
    assert message.value() is None
    assert headers_of(message) == [(TARGET, b"t"), (LEVEL, b"3"), (PARTITION, b"2")]
    by_int = producer.send("t", b"v", due=DUE_2030_MS)
    assert (DUE_MS, str(DUE_2030_MS).encode()) in headers_of(read_back(bootstrap, by_int))


@kafka
def test_ids_map_to_a_stable_partition_and_cancel_follows(
    producer: DelayProducer, bootstrap: str
) -> None:
    first = producer.send("t", b"v", key="user-key", delay=60_000, id="order-42")
    again = producer.send("t", b"v", key="other-key", delay=1_000, id="order-42")
    assert first.partition == again.partition == id_partition("order-42", 3)
    assert (SCHEDULE_ID, b"order-42") in headers_of(read_back(bootstrap, first))
    assert read_back(bootstrap, first).key() == b"user-key"

    cancel = producer.cancel("order-42").coordinates
    assert cancel.partition == first.partition
    message = read_back(bootstrap, cancel)
    assert (message.key(), message.value()) == (None, b"order-42")
    assert headers_of(message) == [(CANCEL, b"order-42")]

    spread = {producer.send("t", b"v", delay=1, id=f"id-{n}").partition for n in range(30)}
    assert spread == {0, 1, 2}


@kafka
def test_send_async_then_flush(producer: DelayProducer, bootstrap: str) -> None:
    futures = [producer.send_async("t", f"v{n}", delay=n) for n in range(10)]
    producer.flush(TIMEOUT_S)
    written = [future.result(timeout=0) for future in futures]
    assert len(set(written)) == 10
    assert read_back(bootstrap, written[7]).value() == b"v7"


@kafka
def test_producer_from_a_config_dict(bootstrap: str, requests_topic: str) -> None:
    with DelayProducer({"bootstrap.servers": bootstrap}, requests_topic=requests_topic) as made:
        assert made.send("t", b"v", level=1).topic == requests_topic


@kafka
def test_missing_requests_topic(bootstrap: str) -> None:
    with DelayProducer(Settings(bootstrap_servers=bootstrap,
                                requests_topic=f"missing-{uuid.uuid4().hex}")) as made:
        with pytest.raises(LayoutError, match="kdelay topics create") as raised:
            made.send("t", b"v", delay=1)
    assert raised.value.code == "requests-missing"


@kafka
def test_delivery_errors_are_raised_never_dropped(
    bootstrap: str, topic_factory: TopicFactory
) -> None:
    small = topic_factory("small", 1, {"max.message.bytes": "1024"})
    with DelayProducer(Settings(bootstrap_servers=bootstrap, requests_topic=small)) as made:
        with pytest.raises(DeliveryError, match="MSG_SIZE_TOO_LARGE"):
            made.send("t", b"x" * 10_000, delay=1)
        assert made.send("t", b"fits", delay=1).topic == small  # reported once, not latched

        future = made.send_async("t", b"x" * 10_000, delay=1)
        with pytest.raises(DeliveryError):
            made.flush(TIMEOUT_S)
        assert isinstance(future.exception(timeout=0), DeliveryError)
        made.flush(TIMEOUT_S)  # the latched error was raised once


@kafka
def test_send_and_cancel_commands_print_coordinates(bootstrap: str, requests_topic: str) -> None:
    common = ["--bootstrap-servers", bootstrap, "--requests-topic", requests_topic]
    sent = CliRunner().invoke(app, [
        "send", "orders", "--value", "hello", "--key", "k", "--header", "a=1",
        "--delay", "5m", "--id", "cli-id", *common,
    ])
    assert sent.exit_code == 0, sent.output
    topic, partition, offset = sent.stdout.strip().split("/")
    where = Coordinates(topic, int(partition), int(offset))
    assert where.topic == requests_topic
    assert where.partition == id_partition("cli-id", 3)
    message = read_back(bootstrap, where)
    assert (message.key(), message.value()) == (b"k", b"hello")
    assert headers_of(message) == [("a", b"1"), (TARGET, b"orders"), (DELAY_MS, b"300000"),
                                   (SCHEDULE_ID, b"cli-id")]

    due = CliRunner().invoke(app, ["send", "orders", "--due", "2030-01-01T00:00:00Z", *common])
    assert due.exit_code == 0, due.output

    cancelled = CliRunner().invoke(app, ["cancel", "cli-id", *common])
    assert cancelled.exit_code == 0, cancelled.output
    assert cancelled.stdout.strip().split("/")[:2] == [requests_topic, partition]


@kafka
def test_a_delay_past_retention_is_refused_before_it_is_written(
    bootstrap: str, week_topic: str
) -> None:
    """The service would dead-letter it as delay-too-long: the client says so up front."""
    settings = Settings(bootstrap_servers=bootstrap, requests_topic=week_topic)
    with DelayProducer(settings) as made:
        with pytest.raises(RequestRefused, match="retention allows") as refused:
            made.send("t", b"v", delay=timedelta(days=30))
        assert refused.value.code == "delay-too-long"
        with pytest.raises(RequestRefused):
            made.send("t", b"v", due=DUE_2030_MS)
        fits = WEEK_MS - settings.retention_margin_ms - 60_000
        assert made.send("t", b"v", delay=fits).topic == week_topic
    assert _end_offsets(bootstrap, week_topic) == 1  # only the request that fits


@kafka
def test_send_command_refuses_a_delay_past_retention(bootstrap: str, week_topic: str) -> None:
    common = ["--bootstrap-servers", bootstrap, "--requests-topic", week_topic]
    refused = CliRunner().invoke(app, ["send", "orders", "--delay", "30d", *common])
    assert refused.exit_code == 2
    assert refused.stderr.startswith("error[delay-too-long]: due time "), refused.stderr
    assert refused.stdout == ""
    accepted = CliRunner().invoke(app, ["send", "orders", "--delay", "1d", *common])
    assert accepted.exit_code == 0, accepted.output
    assert _end_offsets(bootstrap, week_topic) == 1


def _end_offsets(bootstrap: str, topic: str) -> int:
    """How many records ``topic`` holds over all its partitions."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{uuid.uuid4().hex}"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                   for p in partitions)
    finally:
        consumer.close()
