"""ChangelogWriter against a fake producer whose reports fire only when a test says so."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException, Message

from kdelay.engine.commit._writer import ChangelogWriter
from kdelay.engine.metrics import Metrics
from kdelay.plumbing.clients import Report
from kdelay.protocol import codec
from kdelay.protocol.envelope import Headers

CHANGELOG = "kdelay.changelog"
K1 = codec.encode_due_key(1_000, 0, 1)
K2 = codec.encode_due_key(2_000, 0, 2)


class Producer:
    """Queues produces; :meth:`report` fires their callbacks at chosen offsets."""

    def __init__(self, full: int = 0) -> None:
        self.queued: list[tuple[str, int, bytes | None, bytes | None, Report | None]] = []
        self.full = full
        self.polls = 0
        self.fatal: KafkaError | None = None  # what poll raises once, as a fatal producer does
        self.refuse: KafkaError | None = None  # what produce raises

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                partition: int = -1, callback: Report | None = None,
                on_delivery: Report | None = None, timestamp: int = 0,
                headers: Headers | None = None) -> None:
        on_delivery = on_delivery or callback
        if self.full:
            self.full -= 1
            raise BufferError("queue full")
        if self.refuse is not None:
            raise KafkaException(self.refuse)
        self.queued.append((topic, partition, key, value, on_delivery))

    def poll(self, timeout: float = -1) -> int:
        self.polls += 1
        if self.fatal is not None:
            fatal, self.fatal = self.fatal, None
            raise KafkaException(fatal)
        return 0

    def flush(self, timeout: float = -1) -> int:
        return len(self.queued)

    def __len__(self) -> int:
        return len(self.queued)

    def list_topics(self, topic: str, timeout: float = -1) -> object:
        raise NotImplementedError

    def report(self, offsets: list[int], error: KafkaError | None = None) -> None:
        queued, self.queued = self.queued, []
        for (topic, partition, key, value, callback), offset in zip(queued, offsets, strict=True):
            if callback is not None:  # a record produced without a report
                callback(error, Message(topic=topic, partition=partition, offset=offset, key=key,
                                        value=value))


def writer_with(producer: Producer, observe: Callable[[Message], None] | None = None,
                *, gapless: bool = True) -> tuple[ChangelogWriter, Metrics]:
    metrics = Metrics()
    if observe is None:
        return ChangelogWriter(producer, CHANGELOG, metrics, gapless=gapless), metrics
    return ChangelogWriter(producer, CHANGELOG, metrics, observe, gapless=gapless), metrics


def errors(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("kdelay_changelog_errors_total") or 0.0


def tombstone(writer: ChangelogWriter, partition: int, key: bytes) -> None:
    """A seal of one uncovered key: a tombstone and no watermark."""
    writer.seal(partition, None, [key], [])


def test_a_seal_writes_ends_then_tombstones_then_the_watermark() -> None:
    producer = Producer()
    writer, _ = writer_with(producer)
    mark = codec.Watermark(K2, frozenset({K1}))
    ended = (codec.id_record_key("a"), b"end")
    writer.seal(4, mark, [K2], [ended])
    assert [(p, k, v) for _, p, k, v, _ in producer.queued] == [
        (4, ended[0], b"end"), (4, K2, None), (4, codec.WATERMARK_MARKER,
                                                codec.encode_watermark(mark))]
    producer.report([7, 8, 9])
    assert writer.position(4) == 10, "each confirms its position"


def test_positions_keep_the_highest_next_offset_per_partition() -> None:
    producer = Producer()
    writer, _ = writer_with(producer)
    assert writer.position(0) is None
    tombstone(writer, 0, K1)
    producer.report([5])
    assert writer.position(0) == 6
    tombstone(writer, 0, K2)
    producer.report([3])
    assert writer.position(0) == 6, "a late report never moves the position back"
    tombstone(writer, 1, K1)
    tombstone(writer, 0, K1)
    producer.report([0, 9])
    assert (writer.position(0), writer.position(1), writer.position(2)) == (10, 1, None)


def test_puts_confirm_nothing_and_the_marker_confirms_them_all() -> None:
    producer = Producer()
    seen: list[Message] = []
    writer, _ = writer_with(producer, seen.append)
    acks = writer.acks()
    writer.puts(3, [K1, K2], [b"value", None], acks)
    producer.report([10, 11])
    assert writer.position(3) is None
    writer.mark_consumed(3, 42, acks)
    [(topic, partition, key, value, _)] = producer.queued
    assert (topic, partition, key, value) == (CHANGELOG, 3, codec.CONSUMED_MARKER,
                                               codec.encode_offset(42))
    producer.report([12])
    assert writer.position(3) == 13
    assert [m.offset() for m in seen] == [12], "the marker is observed (clock skew)"


def test_a_failed_record_is_collected_counted_and_confirms_nothing() -> None:
    producer = Producer()
    writer, metrics = writer_with(producer)
    acks = writer.acks()
    writer.puts(0, [K1], [b"v"], acks)
    tombstone(writer, 0, K2)
    writer.mark_consumed(0, 7, acks)
    producer.report([1, 2, 3], KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied"))
    assert writer.position(0) is None
    assert writer.has_failures()
    failures = writer.take_failures()
    assert [(f.topic, f.key) for f in failures] == [
        (CHANGELOG, K1), (CHANGELOG, K2), (CHANGELOG, codec.CONSUMED_MARKER)]
    assert errors(metrics) == 3
    assert not writer.has_failures()
    assert writer.take_failures() == []
    assert acks.done, "reported, if failed: nothing more to wait for"


def test_a_full_queue_is_waited_out_not_dropped() -> None:
    producer = Producer(full=3)
    writer, _ = writer_with(producer)
    tombstone(writer, 1, K1)
    assert producer.polls == 3
    assert [(p, k, v) for _, p, k, v, _ in producer.queued] == [(1, K1, None)]


def test_a_put_waits_out_a_full_queue_and_counts_once() -> None:
    producer = Producer(full=2)
    writer, _ = writer_with(producer)
    acks = writer.acks()
    writer.puts(2, [K1, K2], [b"v", b"w"], acks)
    assert producer.polls >= 1  # served reports to make room
    assert [(p, k, v) for _, p, k, v, _ in producer.queued] == [(2, K1, b"v"), (2, K2, b"w")]
    assert acks.waiting == 1


def test_a_steps_acks_count_its_records_until_each_is_reported() -> None:
    """Intake's records and dead letters count against their step; seals do not."""
    producer = Producer()
    writer, _ = writer_with(producer)
    acks = writer.acks()
    writer.puts(0, [K1], [b"v"], acks)
    tombstone(writer, 0, K2)
    on_dead_letter = acks.dead_letter()
    writer.mark_consumed(0, 7, acks)
    assert acks.waiting == 3
    queued = producer.queued
    producer.queued = [queued[0]]
    producer.report([1])
    assert (acks.waiting, acks.done) == (2, False)
    producer.queued = queued[1:]
    producer.report([2, 3])
    assert acks.waiting == 1
    denied = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "denied")
    on_dead_letter(denied, Message(topic="kdelay.dlq", key=b"bad"))
    assert acks.done
    assert [(f.topic, f.key) for f in acks.dead_letter_failures] == [("kdelay.dlq", b"bad")]
    assert not writer.has_failures(), "a dead letter is not a changelog failure"


def test_only_the_last_put_of_a_plan_asks_for_a_report() -> None:
    """The changelog producer is gapless: the last put's acknowledgement proves the others."""
    producer = Producer()
    writer, _ = writer_with(producer)
    acks = writer.acks()
    writer.puts(1, [K1, K2, K1], [b"v", None, b"w"], acks)
    writer.puts(1, [], [], acks)
    assert [callback is None for *_, callback in producer.queued] == [True, True, False]
    assert acks.waiting == 1
    producer.report([4, 5, 6])
    assert acks.done
    assert writer.position(1) is None, "puts still confirm nothing"


def test_a_fatal_error_of_the_gapless_producer_is_a_failed_write_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A gapless producer that lost a record raises its fatal error from ``poll``, then
    ``_FATAL`` from every ``produce``: both are failed changelog writes, counted; a
    plan's puts stop at the first refusal and leave its step undurable; one log line."""
    producer = Producer()
    writer, metrics = writer_with(producer)
    gap = KafkaError(KafkaError._GAPLESS_GUARANTEE, "Message size too large", fatal=True)
    producer.fatal = gap
    writer.serve()
    producer.refuse = KafkaError(KafkaError._FATAL, "Local: Fatal error")
    acks = writer.acks()
    writer.puts(0, [K1, K2, K1], [b"v", b"w", b"x"], acks)
    tombstone(writer, 0, K2)
    failures = writer.take_failures()
    assert [(f.key, f.error.code()) for f in failures] == [
        (None, KafkaError._GAPLESS_GUARANTEE), (K1, KafkaError._FATAL), (K2, KafkaError._FATAL)]
    assert errors(metrics) == 3
    assert not acks.done, "the step is never counted durable"
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "changelog producer failed for good: Message size too large"]


def test_a_transactional_writers_errors_are_raised_as_before() -> None:
    """Under exactly-once a fatal error (a fence) ends the transaction's own way."""
    producer = Producer()
    writer, _ = writer_with(producer, gapless=False)
    producer.refuse = KafkaError(KafkaError._FENCED, "fenced", fatal=True)
    with pytest.raises(KafkaException):
        writer.puts(0, [K1, K2], [b"v", b"w"], writer.acks())
    producer.refuse = None
    producer.fatal = KafkaError(KafkaError._FENCED, "fenced", fatal=True)
    with pytest.raises(KafkaException):
        writer.serve()


def test_a_transaction_that_must_abort_makes_its_later_writes_failures_not_a_crash(
        caplog: pytest.LogCaptureFixture) -> None:
    """Once the broker refused a record of the open transaction, ``produce`` refuses
    every later one with ``_STATE`` until it is aborted: each is a failed write (the
    commit then aborts the transaction and delivery takes it all back), neither
    counted as a changelog error nor logged, and a plan's puts stop at the first."""
    producer = Producer()
    writer, metrics = writer_with(producer, gapless=False)
    producer.refuse = KafkaError(KafkaError._STATE, "Unable to produce message: Local: "
                                 "Erroneous state")
    acks = writer.acks()
    writer.puts(0, [K1, K2], [b"v", b"w"], acks)
    tombstone(writer, 0, K2)
    writer.mark_consumed(0, 7, acks)
    assert [(f.key, f.error.code()) for f in writer.take_failures()] == [
        (K1, KafkaError._STATE), (K2, KafkaError._STATE),
        (codec.CONSUMED_MARKER, KafkaError._STATE)]
    assert errors(metrics) == 0
    assert not acks.done
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_intake_record_refused_by_a_failed_transaction_fails_the_step() -> None:
    """A dead letter, forward or answer refused with ``_STATE`` keeps the step from
    committing (a forward failure); any other refusal is raised."""
    acks = ChangelogWriter(Producer(), CHANGELOG, Metrics()).acks()
    acks.refused(KafkaException(KafkaError(KafkaError._STATE, "state")), "requests", b"id")
    assert [(f.topic, f.key, f.error.code()) for f in acks.forward_failures] == [
        ("requests", b"id", KafkaError._STATE)]
    with pytest.raises(KafkaException):
        acks.refused(KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True)),
                     "dlq", None)
    assert len(acks.forward_failures) == 1


def test_other_errors_of_produce_and_poll_are_raised() -> None:
    producer = Producer()
    writer, _ = writer_with(producer)
    producer.fatal = KafkaError(KafkaError._TRANSPORT, "not fatal")
    with pytest.raises(KafkaException):
        writer.serve()
    producer.refuse = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large")
    with pytest.raises(KafkaException):
        writer.puts(0, [K1, K2], [b"v", b"w"], writer.acks())
    assert not writer.has_failures()
