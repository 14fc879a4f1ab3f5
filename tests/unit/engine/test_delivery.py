"""Delivery against a real index, a fake producer and a fake original reader, on a manual clock.

The fakes hold no logic of their own: the producer records every ``produce`` and
fires delivery callbacks only when a test says so; the reader answers from a
dict of records. Time moves only through :class:`ManualClock`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    KafkaError,
    KafkaException,
    Message,
)

from kdelay.engine.commit._durability import Acknowledged, Transacted
from kdelay.engine.commit._writer import ChangelogWriter
from kdelay.engine.delivery import _delivery as delivery_module
from kdelay.engine.delivery._controls import SHELF_AT
from kdelay.engine.delivery._delivery import (
    IN_FLIGHT_WAIT_MS,
    MAX_RETRYING_BATCHES,
    MAX_WAIT_MS,
    Delivery,
    DeliveryConfig,
    Release,
    by_service_clock,
)
from kdelay.engine.delivery._failures import TopicCheck, backoff_ms
from kdelay.engine.delivery._flights import STALL_S
from kdelay.engine.delivery._readahead import AHEAD_BATCHES, MAX_HELD_BATCHES
from kdelay.engine.delivery._sealing import RANGE_DELETE_MIN, SEAL_EVERY_STEPS
from kdelay.engine.metrics import Metrics
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Settings
from kdelay.protocol.codec import (
    WATERMARK_MARKER,
    End,
    Fingerprint,
    IdState,
    IndexValue,
    Watermark,
    decode_id_state,
    decode_watermark,
    encode_due_key,
    fingerprint_of,
    id_record_key,
)
from kdelay.protocol.controls import Control, Pause, Scope, Subject
from kdelay.protocol.envelope import (
    DUE_MS,
    ERROR,
    ERROR_DETAIL,
    ORIGIN,
    SCHEDULE_ID,
    SCHEDULED_TARGET,
    TARGET,
    Headers,
    HeaderValue,
    schedule_headers,
    user_headers,
)
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import PartitionIndex
from kdelay.state.originals import Found, Missing

REQUESTS = "kdelay.requests"
CHANGELOG = "kdelay.changelog"
DLQ = "kdelay.dlq"
T0 = 1_700_000_000_000
SOME_FINGERPRINT = Fingerprint(T0 - 1, 12345)
CONFIG = DeliveryConfig(
    requests_topic=REQUESTS, changelog_topic=CHANGELOG, dlq_topic=DLQ, lookahead_ms=2_000,
    batch_size=100, attempts=3, backoff_ms=500, backoff_max_ms=4_000,
)
Callback = Callable[[KafkaError | None, Message], None]


@dataclass
class Sent:
    """One ``produce`` call as the fake producer saw it."""

    topic: str
    key: bytes | None
    value: bytes | None
    partition: int
    headers: Headers
    timestamp: int
    on_delivery: Callback | None

    def header(self, name: str) -> list[HeaderValue]:
        return [v for n, v in self.headers if n == name]

    @property
    def origin(self) -> HeaderValue:
        [origin] = self.header(ORIGIN)
        return origin


class FakeProducer:
    """Records produce calls; delivery reports fire only from :meth:`report`.

    With ``only_errors`` it reports as librdkafka does with
    ``delivery.report.only.error``: a record that succeeds leaves the queue
    without a callback.
    """

    def __init__(self, *, only_errors: bool = False) -> None:
        self.only_errors = only_errors
        self.sent: list[Sent] = []
        self.unreported: list[Sent] = []
        self.raises: list[BaseException] = []
        self.queue_limit: int | None = None  # BufferError beyond this many unreported
        self.polls = 0
        self.missing_topics: set[str] = set()
        self.metadata_requests: list[str] = []
        self.metadata_error: KafkaError | None = None
        self._offsets: Counter[tuple[str, int]] = Counter()

    def list_topics(self, topic: str, timeout: float = -1) -> SimpleNamespace:
        """Metadata in which every topic exists except ``missing_topics``."""
        self.metadata_requests.append(topic)
        if self.metadata_error is not None:
            raise KafkaException(self.metadata_error)
        error = (KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "unknown topic")
                 if topic in self.missing_topics else None)
        return SimpleNamespace(topics={topic: SimpleNamespace(error=error)})

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                partition: int = -1, callback: Callback | None = None,
                on_delivery: Callback | None = None, timestamp: int = 0,
                headers: Headers | None = None) -> None:
        on_delivery = on_delivery or callback
        if self.raises:
            raise self.raises.pop(0)
        if self.queue_limit is not None and len(self.unreported) >= self.queue_limit:
            raise BufferError("Local: Queue full")
        # As on the wire: a str header value goes out as its UTF-8 bytes.
        wire: Headers = [(name, item.encode() if isinstance(item, str) else item)
                         for name, item in headers or []]
        sent = Sent(topic, key, value, partition, wire, timestamp, on_delivery)
        self.sent.append(sent)
        self.unreported.append(sent)

    def poll(self, timeout: float = -1) -> int:
        self.polls += 1
        return 0

    def flush(self, timeout: float = -1) -> int:
        return len(self.unreported)

    def __len__(self) -> int:
        return len(self.unreported)

    def report(self, error: KafkaError | None = None, *, topic: str | None = None,
               these: list[Sent] | None = None) -> list[Sent]:
        """Fire the callbacks of unreported records (of ``topic`` only, or ``these``)."""
        chosen = [s for s in self.unreported if (topic is None or s.topic == topic)
                  and (these is None or any(s is t for t in these))]
        self.unreported = [s for s in self.unreported if not any(s is c for c in chosen)]
        for sent in chosen:
            partition = max(sent.partition, 0)
            offset = self._offsets[(sent.topic, partition)]
            self._offsets[(sent.topic, partition)] += 1
            # As librdkafka reports: no headers, whatever the record carried.
            message = Message(topic=sent.topic, partition=partition, offset=offset, key=sent.key,
                              value=sent.value, error=error)
            assert sent.on_delivery is not None, "every produce needs a delivery callback"
            if error is not None or not self.only_errors:
                sent.on_delivery(error, message)
        return chosen


class FakeReader:
    """Answers ``read`` from ``log``; offsets missing from ``log`` stay unresolved."""

    def __init__(self) -> None:
        self.log: dict[tuple[int, int], Found] = {}
        self.calls: list[dict[int, list[int]]] = []

    def read(self, wanted: Mapping[int, Iterable[int]]) -> dict[int, dict[int, Found]]:
        asked = {p: list(offsets) for p, offsets in wanted.items()}
        self.calls.append(asked)
        return {p: {o: self.log[(p, o)] for o in offs if (p, o) in self.log}
                for p, offs in asked.items()}

    def close(self) -> None:
        pass


class World:
    """A Delivery wired to fakes, a manual clock and real indexes of three partitions."""

    def __init__(self, tmp_path: Path, config: DeliveryConfig = CONFIG, *,
                 transactional: bool = False, release: Release = by_service_clock,
                 failed: Callable[[], bool] = lambda: False) -> None:
        self.clock = ManualClock(T0)
        # At-least-once: the bulk lane reports failures only; the other producer
        # (for while the bulk lane is stalled) reports every record.
        self.targets = FakeProducer(only_errors=not transactional)
        self.each = FakeProducer()
        self.internal = FakeProducer()
        self.reader = FakeReader()
        self.metrics = Metrics()
        self.writer = ChangelogWriter(self.internal, CHANGELOG, self.metrics)
        self.indexes = {p: PartitionIndex(tmp_path / f"p{p}", p) for p in (0, 1, 2)}
        durability = (Transacted(self.writer, self.targets) if transactional
                      else Acknowledged(self.writer, self.targets, self.each, failed))
        self.outage = False
        self.delivery = Delivery(config, self.targets, self.internal, self.reader,
                                 self.clock, self.metrics, durability, release,
                                 outage=lambda: self.outage)

    def close(self) -> None:
        for index in self.indexes.values():
            index.close()

    def request(self, partition: int, offset: int, due: int, *, target: str = "orders",
                sid: str | None = None, target_partition: int | None = None,
                key: bytes | None = b"k", value: bytes | None = b"v",
                user: Headers | None = None) -> bytes:
        """Put a request record in the log and its entry in the index; return the due key."""
        headers = [*schedule_headers(target, due_ms=due, partition=target_partition,
                                     schedule_id=sid), *(user or [])]
        message = Message(topic=REQUESTS, partition=partition, offset=offset, key=key,
                          value=value, headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, T0 - 1))
        self.reader.log[(partition, offset)] = message
        return self.put(partition, offset, due, fingerprint_of(message), sid, target)

    def put(self, partition: int, offset: int, due: int,
            fingerprint: Fingerprint = SOME_FINGERPRINT,
            sid: str | None = None, target: str | None = None) -> bytes:
        due_key = encode_due_key(due, partition, offset)
        ids: dict[str, IdState | None] = {} if sid is None else {sid: IdState(due_key, None)}
        entry = Entry(due_key, IndexValue(fingerprint, sid, target))
        # Indexed by other means than intake (which hands delivery its entries):
        # delivery is told the lowest key put, as the service tells it.
        self.delivery.noted(partition, self.indexes[partition].apply(Changes(puts=[entry],
                                                                             ids=ids)))
        return due_key

    def at(self, now_ms: int) -> int:
        """Move the clock to ``now_ms`` and run one tick; return the wait it asks for."""
        self.clock.set(now_ms)
        return self.delivery.tick(self.indexes)

    def settle(self) -> None:
        self.delivery.settle(self.indexes, self.delivery.seal(self.indexes))

    def step(self, now_ms: int) -> None:
        """One step of the service as it goes when the broker acknowledges at once:
        tick, every record in the air (targets, dead letters, changelog) acknowledged,
        settle."""
        self.at(now_ms)
        self.targets.report()
        self.internal.report()
        self.settle()

    def finish(self, committed: bool) -> None:
        """End the transaction the way the service does: seal into it, then commit or abort."""
        sealed = self.delivery.seal(self.indexes)
        if committed:
            self.delivery.settle(self.indexes, sealed)
        else:
            self.delivery.abandon()

    def pending(self, partition: int = 0) -> list[bytes]:
        return [e.key for e in self.indexes[partition].entries()]

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.close()


@pytest.fixture
def txn(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path, transactional=True)
    yield w
    w.close()


def origin(partition: int, offset: int) -> bytes:
    return f"{REQUESTS}/{partition}/{offset}".encode()


def watermarks(world: World, partition: int | None = None) -> list[Watermark]:
    """The watermarks written to the changelog (of ``partition``), in order."""
    return [decode_watermark(s.value or b"") for s in world.internal.sent
            if s.topic == CHANGELOG and s.key == WATERMARK_MARKER
            and (partition is None or s.partition == partition)]


def timed_out() -> KafkaError:
    return KafkaError(KafkaError._MSG_TIMED_OUT, "Local: Message timed out")


# -- never early -------------------------------------------------------------------


def test_nothing_is_produced_before_its_due_time(world: World) -> None:
    world.request(0, 7, T0 + 5_000)
    world.at(T0)
    world.at(T0 + 4_000)
    assert world.at(T0 + 4_999) == 1, "the next tick is asked for at the due time"
    assert world.targets.sent == []
    world.at(T0 + 5_000)
    [sent] = world.targets.sent
    assert sent.timestamp == T0 + 5_000
    assert sent.origin == origin(0, 7)


def test_a_release_limit_holds_entries_the_service_clock_sees_due(tmp_path: Path) -> None:
    limit: list[int | None] = [None]
    w = World(tmp_path, release=lambda now: limit[0] if limit[0] is None else min(now,
                                                                                  limit[0]))
    try:
        w.request(0, 1, T0 + 1_000)
        w.request(0, 2, T0 + 3_000)
        assert w.at(T0 + 5_000) == MAX_WAIT_MS, "nothing to release yet: look again soon"
        assert w.targets.sent == []
        limit[0] = T0 + 2_000
        w.step(T0 + 5_000)
        assert [s.origin for s in w.targets.sent] == [origin(0, 1)]
        assert w.targets.sent[0].timestamp == T0 + 5_000, "stamped by the service clock"
        limit[0] = T0 + 3_000
        w.step(T0 + 5_001)
        assert [s.origin for s in w.targets.sent] == [origin(0, 1), origin(0, 2)]
    finally:
        w.close()


def test_a_far_entry_is_not_produced_early_after_a_clock_jump(world: World) -> None:
    world.request(0, 1, T0 + 60_000)
    world.at(T0 + 59_999)
    assert world.targets.sent == []
    world.at(T0 + 60_000)
    assert [s.timestamp for s in world.targets.sent] == [T0 + 60_000]


def test_a_late_tick_stamps_the_record_with_the_current_time(world: World) -> None:
    world.request(0, 1, T0 + 100)
    world.at(T0 + 700)
    [sent] = world.targets.sent
    assert sent.timestamp == T0 + 700
    assert sent.header(DUE_MS) == [str(T0 + 100).encode()]
    world.targets.report()
    world.settle()  # metrics are handed over once per settle, not per record
    assert world.sample("kdelay_lateness_seconds_sum", target="orders") == pytest.approx(0.6)


def test_lateness_is_observed_per_target(world: World) -> None:
    world.request(0, 1, T0 + 100, target="orders")
    world.request(0, 2, T0 + 300, target="mail")
    world.request(0, 3, T0 + 400, target="orders")
    world.at(T0 + 1_000)
    world.targets.report()
    world.settle()
    assert world.sample("kdelay_lateness_seconds_count", target="orders") == 2
    assert world.sample("kdelay_lateness_seconds_sum", target="orders") == pytest.approx(1.5)
    assert world.sample("kdelay_lateness_seconds_count", target="mail") == 1
    assert world.sample("kdelay_lateness_seconds_bucket", target="mail", le="1.0") == 1


def test_a_past_due_entry_goes_out_on_the_first_tick(world: World) -> None:
    world.request(1, 4, T0 - 86_400_000)
    world.at(T0)
    assert [(s.origin, s.timestamp) for s in world.targets.sent] == [(origin(1, 4), T0)]


def test_an_in_flight_entry_is_not_produced_again(world: World) -> None:
    key = world.request(0, 1, T0)
    world.at(T0)
    assert world.delivery.in_flight(key)
    assert not world.delivery.idle()
    world.at(T0 + 1_000)
    world.settle()
    world.at(T0 + 10_000)
    assert len(world.targets.sent) == 1


# -- order ----------------------------------------------------------------------------


def test_due_order_across_partitions_and_partition_offset_order_within_a_millisecond(
    world: World,
) -> None:
    world.request(1, 5, T0 + 10)
    world.request(0, 9, T0 + 10)
    world.request(2, 1, T0 + 5)
    world.request(0, 3, T0 + 10)
    world.request(1, 2, T0 + 20)
    world.request(2, 0, T0 + 10)
    world.at(T0 + 100)
    assert [s.origin for s in world.targets.sent] == [
        origin(2, 1), origin(0, 3), origin(0, 9), origin(1, 5), origin(2, 0), origin(1, 2),
    ]


def test_entries_becoming_due_over_several_ticks_go_out_in_due_order(world: World) -> None:
    world.request(0, 1, T0 + 300)
    world.request(1, 1, T0 + 100)
    world.request(2, 1, T0 + 200)
    for now in (T0 + 100, T0 + 250, T0 + 300):
        world.step(now)
    assert [(s.origin, s.timestamp) for s in world.targets.sent] == [
        (origin(1, 1), T0 + 100), (origin(2, 1), T0 + 250), (origin(0, 1), T0 + 300),
    ]


# -- the delivered record ----------------------------------------------------------------


def test_the_delivered_record_keeps_key_value_and_user_headers(world: World) -> None:
    user: Headers = [("trace", b"abc"), ("kdelay-custom", b"x"), ("trace", b"second"),
                     ("empty", None)]
    world.request(0, 7, T0 + 1, sid="order-7", key=b"the-key", value=b"\x00payload\xff",
                  user=user)
    world.at(T0 + 1)
    [sent] = world.targets.sent
    assert (sent.topic, sent.key, sent.value, sent.partition) == (
        "orders", b"the-key", b"\x00payload\xff", -1
    )
    assert sent.headers == [
        ("trace", b"abc"), ("trace", b"second"), ("empty", None),
        (ORIGIN, origin(0, 7)), (DUE_MS, str(T0 + 1).encode()),
    ]


def test_a_null_key_and_value_are_delivered_as_null(world: World) -> None:
    world.request(0, 7, T0, key=None, value=None)
    world.at(T0)
    [sent] = world.targets.sent
    assert (sent.key, sent.value) == (None, None)


def test_an_explicit_target_partition_is_honoured(world: World) -> None:
    world.request(0, 1, T0, target="audit", target_partition=4)
    world.request(0, 2, T0, target="audit", target_partition=0)
    world.at(T0)
    assert [(s.topic, s.partition) for s in world.targets.sent] == [("audit", 4), ("audit", 0)]


# -- settling ------------------------------------------------------------------------------


def test_an_entry_leaves_the_index_only_after_its_report(world: World) -> None:
    key = world.request(0, 7, T0, sid="order-7")
    world.at(T0)
    assert len(world.targets.sent) == 1
    world.settle()
    assert world.pending() == [key], "produced is not delivered"
    assert world.internal.sent == []
    assert world.indexes[0].id_state("order-7") == IdState(key, None)

    world.targets.report()
    assert world.pending() == [key], "reports take effect in settle"
    world.clock.set(T0 + 50)
    world.settle()
    assert world.pending() == []
    assert not world.delivery.in_flight(key)
    assert world.delivery.idle()
    [ended, mark] = world.internal.sent
    assert (mark.topic, mark.partition, mark.key) == (CHANGELOG, 0, WATERMARK_MARKER)
    assert decode_watermark(mark.value or b"").covers(key), "one watermark, no tombstone"
    assert (ended.topic, ended.partition, ended.key) == (CHANGELOG, 0, id_record_key("order-7"))
    state = world.indexes[0].id_state("order-7")
    assert state is not None
    assert decode_id_state(ended.value or b"") == state, "the changelog remembers the end too"
    assert (state.pending_key, state.end, state.first_key) == (None, End.DELIVERED, key)
    assert state.ended_ms is not None
    assert T0 <= state.ended_ms <= T0 + 50
    assert world.sample("kdelay_delivered_records_total") == 1


def settled_ranges(world: World, partition: int = 0) -> list[list[tuple[int, int, int]]]:
    """Watch what the partition's settles ask to delete as ranges (one list per apply)."""
    index = world.indexes[partition]
    seen: list[list[tuple[int, int, int]]] = []
    apply = index.apply

    def watched(changes: Changes) -> bytes | None:
        if changes.deletes:
            seen.append(list(changes.ranges))
        return apply(changes)

    index.apply = watched  # type: ignore[method-assign]
    return seen


def test_a_burst_read_in_one_scan_leaves_the_index_as_a_range(world: World) -> None:
    keys = [world.request(0, offset, T0) for offset in range(RANGE_DELETE_MIN)]
    ranges = settled_ranges(world)
    world.step(T0)
    world.clock.set(T0 + 50)
    world.settle()
    assert ranges == [[(0, len(keys), RANGE_DELETE_MIN)]]
    assert world.pending() == []
    assert world.indexes[0].tally.total == 0


def test_an_entry_put_inside_a_settling_range_stays_pending(world: World) -> None:
    """A request put between the keys of a run in the air (intake, a forward) is not
    deleted with them: the range goes key by key."""
    for offset in range(0, 2 * RANGE_DELETE_MIN, 2):
        world.request(0, offset, T0)
    world.at(T0)
    assert len(world.targets.sent) == RANGE_DELETE_MIN
    inside = world.request(0, 101, T0)
    world.targets.report()
    world.clock.set(T0 + 50)
    world.settle()
    assert world.pending() == [inside]
    assert world.indexes[0].tally.total == 1
    world.step(T0 + 60)
    world.clock.set(T0 + 110)
    world.settle()
    assert world.pending() == []
    assert [s.origin for s in world.targets.sent].count(origin(0, 101)) == 1


def test_the_watermark_goes_to_the_request_partition_and_covers_the_delivered(
        world: World) -> None:
    key = world.request(2, 11, T0)
    later = world.request(2, 12, T0 + 60_000)
    world.at(T0)
    world.targets.report()
    world.settle()
    assert [(s.topic, s.partition, s.key) for s in world.internal.sent] == [
        (CHANGELOG, 2, WATERMARK_MARKER)]
    assert tombstones(world) == []
    [mark] = watermarks(world)
    assert mark.covers(key)
    assert not mark.covers(later), "not what is pending"
    assert world.pending(2) == [later]
    assert world.indexes[2].watermark == mark
    assert [keys for _, keys in world.indexes[2].unswept(10)] == [[key]], (
        "its put awaits a tombstone, off the hot path")


def test_one_watermark_covers_a_whole_batch(world: World) -> None:
    keys = [world.request(0, offset, T0 + offset) for offset in range(50)]
    world.at(T0 + 100)
    assert len(world.targets.sent) == 50
    world.targets.report()
    world.settle()
    [mark] = watermarks(world)
    assert all(mark.covers(key) for key in keys)
    assert mark.pending == frozenset()
    assert tombstones(world) == []
    assert len(world.internal.sent) == 1
    assert world.pending() == []


def test_confirmed_watermarks_advance_the_changelog_position(world: World) -> None:
    world.request(0, 1, T0)
    world.at(T0)
    world.targets.report()
    world.settle()
    world.internal.report()
    assert world.writer.position(0) == 1

    world.request(0, 2, T0 + 10)
    world.at(T0 + 10)
    world.targets.report()
    world.settle()
    assert world.indexes[0].offset(b"changelog") == 1


def test_a_failed_watermark_is_counted_and_confirms_nothing(world: World) -> None:
    world.request(0, 1, T0)
    world.at(T0)
    world.targets.report()
    world.settle()
    world.internal.report(timed_out())
    assert world.writer.position(0) is None
    assert world.sample("kdelay_changelog_errors_total") == 1


# -- dead letters ------------------------------------------------------------------------------


def test_an_expired_original_is_dead_lettered_as_expired(world: World) -> None:
    key = world.put(0, 7, T0 + 10, sid="gone", target="orders")
    world.reader.log[(0, 7)] = Missing.EXPIRED
    world.at(T0 + 9)
    assert world.internal.sent == []
    world.at(T0 + 10)
    assert world.targets.sent == []
    [dead] = world.internal.sent
    assert (dead.topic, dead.key, dead.value) == (DLQ, None, None)
    assert dead.header(ERROR) == [b"expired"]
    assert dead.header(SCHEDULE_ID) == [b"gone"]
    assert dead.header(SCHEDULED_TARGET) == [b"orders"], "the target the index knows"
    assert dead.header(TARGET) == [], "not a request: produced again, it is refused"
    assert dead.header(ORIGIN) == [origin(0, 7)]
    assert dead.header(DUE_MS) == [str(T0 + 10).encode()]
    [detail] = dead.header(ERROR_DETAIL)
    assert isinstance(detail, bytes)
    assert b"kdelay.requests/0/7" in detail

    world.internal.report()
    world.settle()
    assert world.pending() == []
    [ended, mark] = world.internal.sent[1:]
    assert mark.key == WATERMARK_MARKER
    assert decode_watermark(mark.value or b"").covers(key)
    state = world.indexes[0].id_state("gone")
    assert state is not None
    assert (state.end, state.first_key) == (End.DEAD_LETTERED, key), "remembered"
    assert (ended.key, decode_id_state(ended.value or b"")) == (id_record_key("gone"), state)
    assert world.sample("kdelay_dead_lettered_records_total", reason="expired") == 1
    assert world.sample("kdelay_delivered_records_total") == 0


def changed_value(world: World) -> None:
    world.request(0, 7, T0)
    world.reader.log[(0, 7)] = Message(
        topic=REQUESTS, partition=0, offset=7, key=b"k", value=b"another record",
        headers=schedule_headers("orders", due_ms=T0), timestamp=(TIMESTAMP_CREATE_TIME, T0 - 1))


def changed_timestamp(world: World) -> None:
    world.request(0, 7, T0)
    world.reader.log[(0, 7)] = Message(
        topic=REQUESTS, partition=0, offset=7, key=b"k", value=b"v",
        headers=schedule_headers("orders", due_ms=T0), timestamp=(TIMESTAMP_CREATE_TIME, T0 - 2))


def no_schedule_any_more(world: World) -> None:
    world.request(0, 7, T0)
    world.reader.log[(0, 7)] = Message(
        topic=REQUESTS, partition=0, offset=7, key=b"k", value=b"v",
        headers=[("user", b"1")], timestamp=(TIMESTAMP_CREATE_TIME, T0 - 1))


def absent(world: World) -> None:
    world.put(0, 7, T0)
    world.reader.log[(0, 7)] = Missing.ABSENT


@pytest.mark.parametrize("arrange", [changed_value, changed_timestamp, no_schedule_any_more,
                                     absent])
def test_an_original_that_is_not_the_indexed_one_is_a_mismatch(
    world: World, arrange: Callable[[World], None]
) -> None:
    arrange(world)
    world.at(T0)
    assert world.targets.sent == []
    [dead] = world.internal.sent
    assert (dead.topic, dead.key, dead.value) == (DLQ, None, None)
    assert dead.header(ERROR) == [b"mismatch"]
    assert dead.header(ORIGIN) == [origin(0, 7)]
    world.internal.report(topic=DLQ)
    world.settle()
    assert world.pending() == []
    assert world.sample("kdelay_dead_lettered_records_total", reason="mismatch") == 1


# -- retries -------------------------------------------------------------------------------------


def test_a_failing_target_is_retried_with_backoff_then_dead_lettered(world: World) -> None:
    user: Headers = [("trace", b"t-1")]
    key = world.request(0, 7, T0, target="broken", sid="b-7", key=b"kk", value=b"vv", user=user)
    original = world.reader.log[(0, 7)]
    assert isinstance(original, Message)
    world.at(T0)
    for attempt, (fail_at, retry_at) in enumerate(
        [(T0, T0 + 500), (T0 + 500, T0 + 1_500)], start=1
    ):
        world.targets.report(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"boom {attempt}"))
        world.clock.set(fail_at)
        world.settle()
        assert world.pending() == [key]
        assert not world.delivery.in_flight(key)
        world.at(retry_at - 1)
        assert len(world.targets.sent) == attempt, "no retry before the backoff elapses"
        world.at(retry_at)
        assert len(world.targets.sent) == attempt + 1
    assert [s.timestamp for s in world.targets.sent] == [T0, T0 + 500, T0 + 1_500]
    assert world.internal.sent == []

    world.targets.report(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "boom 3"))
    world.settle()
    world.at(T0 + 1_500)
    assert len(world.targets.sent) == 3
    [dead] = world.internal.sent
    assert (dead.topic, dead.key, dead.value) == (DLQ, b"kk", b"vv")
    user = user_headers(original.headers())
    assert dead.headers[: len(user)] == user, "user headers first, kdelay-* replaced"
    assert dead.header(TARGET) == [b"broken"]
    assert dead.header(DUE_MS) == [str(T0).encode()], "one due time: re-sendable as is"
    assert dead.header(ERROR) == [b"undeliverable"]
    [detail] = dead.header(ERROR_DETAIL)
    assert isinstance(detail, bytes)
    assert b"3 attempts" in detail
    assert b"boom 3" in detail
    assert dead.header(ORIGIN) == [origin(0, 7)]
    assert world.sample("kdelay_delivery_retries_total") == 3

    world.internal.report(topic=DLQ)
    world.settle()
    assert world.pending() == []
    state = world.indexes[0].id_state("b-7")
    assert state is not None
    assert (state.pending_key, state.end) == (None, End.DEAD_LETTERED)
    assert world.sample("kdelay_dead_lettered_records_total", reason="undeliverable") == 1
    assert world.sample("kdelay_delivered_records_total") == 0


def test_a_target_that_succeeds_on_retry_is_delivered(world: World) -> None:
    key = world.request(0, 7, T0)
    world.at(T0)
    world.targets.report(timed_out())
    world.settle()
    world.at(T0 + 500)
    world.targets.report()
    world.settle()
    assert world.pending() == []
    assert [s.origin for s in world.targets.sent] == [origin(0, 7), origin(0, 7)]
    assert [(s.topic, s.key) for s in world.internal.sent] == [(CHANGELOG, WATERMARK_MARKER)]
    assert watermarks(world)[0].covers(key)
    assert world.sample("kdelay_delivered_records_total") == 1


def test_a_produce_that_raises_kafka_exception_is_retried_after_backoff(world: World) -> None:
    key = world.request(0, 7, T0)
    world.targets.raises.append(
        KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large")))
    world.at(T0)
    assert world.targets.sent == []
    assert world.delivery.in_flight(key), "its failure is pending until settled"
    world.settle()
    assert not world.delivery.in_flight(key)
    assert world.pending() == [key]
    world.at(T0 + 499)
    assert world.targets.sent == []
    world.at(T0 + 500)
    assert [s.origin for s in world.targets.sent] == [origin(0, 7)]


def test_a_failing_target_does_not_block_other_targets(world: World) -> None:
    broken = world.request(0, 1, T0, target="broken")
    world.request(0, 2, T0 + 100, target="orders")
    world.request(1, 1, T0 + 200, target="orders")
    world.at(T0)
    world.targets.report(timed_out())
    world.settle()
    world.step(T0 + 100)
    world.step(T0 + 200)
    assert [(s.topic, s.timestamp) for s in world.targets.sent] == [
        ("broken", T0), ("orders", T0 + 100), ("orders", T0 + 200),
    ]
    world.targets.report()
    world.settle()
    assert world.pending(0) == [broken]
    assert world.pending(1) == []


def test_entries_waiting_for_retry_do_not_use_up_the_read_ahead_room(tmp_path: Path) -> None:
    config = DeliveryConfig(
        requests_topic=REQUESTS, changelog_topic=CHANGELOG, dlq_topic=DLQ, lookahead_ms=2_000,
        batch_size=2, attempts=10, backoff_ms=60_000, backoff_max_ms=60_000,
    )
    world = World(tmp_path, config)
    try:
        world.request(0, 1, T0, target="broken")
        world.request(0, 2, T0, target="broken")
        world.request(0, 3, T0 + 1_000, target="orders")
        world.at(T0)
        world.targets.report(timed_out())
        world.settle()
        world.at(T0 + 1_000)
        assert [(s.topic, s.timestamp) for s in world.targets.sent[2:]] == [
            ("orders", T0 + 1_000)
        ]
    finally:
        world.close()


def test_a_burst_is_read_ahead_several_batches_before_it_is_due(world: World) -> None:
    """Entries due at one instant are read ahead AHEAD_BATCHES batches a partition during
    the look-ahead, their originals in one read, so that the burst's first records wait
    for no fetch when due; they go out in key order in one dispatch, and the rest after
    they landed."""
    count = AHEAD_BATCHES * CONFIG.batch_size
    for offset in range(count + 10):
        world.request(0, offset, T0 + 1_000)
    world.at(T0)
    assert world.targets.sent == []
    assert world.reader.calls == [{0: list(range(count))}]
    world.at(T0 + 1_000)
    assert [s.origin for s in world.targets.sent] == [origin(0, o) for o in range(count)]
    world.targets.report()
    world.settle()
    world.at(T0 + 1_001)
    assert [s.origin for s in world.targets.sent] == [origin(0, o) for o in range(count + 10)]
    world.targets.report()
    world.settle()
    assert world.pending() == []


def test_a_buffer_error_leaves_the_entry_for_a_later_tick(world: World) -> None:
    first = world.request(0, 1, T0)
    world.request(0, 2, T0)
    world.targets.raises.append(BufferError("queue full"))
    world.at(T0)
    assert world.targets.sent == []
    assert world.targets.polls == 1
    assert not world.delivery.in_flight(first)
    assert world.pending() == [first, encode_due_key(T0, 0, 2)]
    world.at(T0 + 5)
    assert [(s.origin, s.timestamp) for s in world.targets.sent] == [
        (origin(0, 1), T0 + 5), (origin(0, 2), T0 + 5),
    ]


# -- cancel and read-ahead ------------------------------------------------------------------------


def test_forget_drops_a_read_ahead_entry(world: World) -> None:
    key = world.request(0, 1, T0 + 1_000)
    kept = world.request(0, 2, T0 + 1_000)
    world.at(T0)
    assert world.reader.calls == [{0: [1, 2]}]
    world.indexes[0].apply(Changes(deletes=[key]))
    world.delivery.forget([key])
    world.at(T0 + 1_000)
    world.at(T0 + 10_000)
    assert [s.origin for s in world.targets.sent] == [origin(0, 2)]
    assert world.pending() == [kept]


def test_a_withheld_entry_is_not_produced_when_due_until_released(world: World) -> None:
    key = world.request(0, 1, T0 + 1_000)
    world.at(T0)
    assert world.delivery.withhold(key)
    world.step(T0 + 1_000)
    world.step(T0 + 1_500)
    assert world.targets.sent == []
    world.delivery.release([key])
    world.at(T0 + 1_501)
    assert [s.origin for s in world.targets.sent] == [origin(0, 1)]


def test_an_entry_withheld_before_it_is_read_ahead_is_never_produced(txn: World) -> None:
    key = txn.request(0, 1, T0)
    assert txn.delivery.withhold(key)
    txn.at(T0)
    assert txn.targets.sent == []
    txn.indexes[0].apply(Changes(deletes=[key]))
    txn.delivery.forget([key])
    txn.at(T0 + 10_000)
    assert txn.targets.sent == []
    assert txn.pending() == []


def test_an_in_flight_entry_cannot_be_withheld(world: World) -> None:
    key = world.request(0, 1, T0)
    world.at(T0)
    assert not world.delivery.withhold(key)
    assert [s.origin for s in world.targets.sent] == [origin(0, 1)]


def test_forget_leaves_an_in_flight_entry_to_its_report(world: World) -> None:
    key = world.request(0, 1, T0)
    world.at(T0)
    world.delivery.forget([key])
    assert world.delivery.in_flight(key)
    world.targets.report()
    world.settle()
    assert world.pending() == []
    assert [(s.topic, s.key) for s in world.internal.sent] == [(CHANGELOG, WATERMARK_MARKER)]
    assert watermarks(world)[0].covers(key)


def test_entries_due_within_the_lookahead_are_read_before_they_are_due(world: World) -> None:
    world.request(0, 10, T0 + 1_500)
    world.request(0, 20, T0 + 2_500)
    world.at(T0)
    assert world.reader.calls == [{0: [10]}]
    assert world.targets.sent == []
    world.at(T0 + 1_000)
    assert world.reader.calls == [{0: [10]}, {0: [20]}]
    world.step(T0 + 1_500)
    world.step(T0 + 2_500)
    assert [(s.origin, s.timestamp) for s in world.targets.sent] == [
        (origin(0, 10), T0 + 1_500), (origin(0, 20), T0 + 2_500),
    ]
    assert len(world.reader.calls) == 2, "the due moment costs only a produce"


def test_one_read_fetches_every_partition(world: World) -> None:
    world.request(0, 9, T0 + 10)
    world.request(1, 4, T0 + 20)
    world.request(0, 3, T0 + 30)
    world.request(2, 8, T0 + 3_000)
    world.at(T0)
    [call] = world.reader.calls
    assert {p: sorted(o) for p, o in call.items()} == {0: [3, 9], 1: [4]}


def test_an_entry_put_inside_the_read_window_is_picked_up(world: World) -> None:
    world.request(0, 1, T0 + 1_800)
    world.at(T0)
    world.request(0, 2, T0 + 500)
    world.request(1, 3, T0 - 10)
    world.step(T0 + 1)
    assert [(s.origin, s.timestamp) for s in world.targets.sent] == [(origin(1, 3), T0 + 1)]
    world.step(T0 + 500)
    world.step(T0 + 1_800)
    assert [(s.origin, s.timestamp) for s in world.targets.sent] == [
        (origin(1, 3), T0 + 1), (origin(0, 2), T0 + 500), (origin(0, 1), T0 + 1_800),
    ]


def test_an_unresolved_original_is_asked_for_again(world: World) -> None:
    world.request(0, 3, T0)
    held = world.reader.log.pop((0, 3))
    world.at(T0)
    assert world.targets.sent == []
    assert world.internal.sent == []
    world.reader.log[(0, 3)] = held
    world.at(T0 + 1)
    assert world.reader.calls == [{0: [3]}, {0: [3]}]
    assert [s.origin for s in world.targets.sent] == [origin(0, 3)]


def test_a_run_stops_before_its_first_unresolved_original_and_the_rest_follows(
        world: World) -> None:
    for offset in (1, 2, 3):
        world.request(0, offset, T0, key=f"k{offset}".encode())
    held = world.reader.log.pop((0, 2))
    world.at(T0)
    assert [s.origin for s in world.targets.sent] == [origin(0, 1)], "never past a gap"
    world.targets.report()
    world.settle()
    world.reader.log[(0, 2)] = held
    world.at(T0 + 1)
    assert [s.origin for s in world.targets.sent] == [origin(0, o) for o in (1, 2, 3)]
    assert world.reader.calls == [{0: [1, 2, 3]}, {0: [2, 3]}]


def test_a_scan_over_originals_on_two_partitions_reads_each_where_it_lies(
        world: World) -> None:
    """An index partition holding a forwarded id's entry (its original on another
    partition) among its own: one read asks both, and a gap still cuts the run."""
    headers = schedule_headers("orders", due_ms=T0, schedule_id="order-7")
    message = Message(topic=REQUESTS, partition=1, offset=9, key=b"k", value=b"v",
                      headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, T0 - 1))
    world.reader.log[(1, 9)] = message
    due_key = encode_due_key(T0, 1, 9)
    entry = Entry(due_key, IndexValue(fingerprint_of(message), "order-7"))
    world.delivery.noted(2, world.indexes[2].apply(
        Changes(puts=[entry], ids={"order-7": IdState(due_key, None)})))
    for offset in (4, 5):
        world.request(2, offset, T0, key=f"k{offset}".encode())
    held = world.reader.log.pop((2, 4))
    world.at(T0)
    assert world.reader.calls == [{1: [9], 2: [4, 5]}]
    assert [s.origin for s in world.targets.sent] == [origin(1, 9)]
    world.targets.report()
    world.settle()
    world.reader.log[(2, 4)] = held
    world.at(T0 + 1)
    assert [s.origin for s in world.targets.sent] == [origin(1, 9), origin(2, 4),
                                                      origin(2, 5)]


def test_a_dropped_partition_is_not_delivered(world: World) -> None:
    world.request(0, 1, T0 + 100)
    world.request(1, 1, T0 + 100)
    world.at(T0)
    world.delivery.drop_partition(1)
    del world.indexes[1]
    world.at(T0 + 100)
    assert [s.origin for s in world.targets.sent] == [origin(0, 1)]


# -- backoff --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(0, 500), (1, 500), (2, 1_000), (3, 2_000), (4, 4_000), (6, 16_000), (7, 30_000),
     (8, 30_000), (200, 30_000)],
)
def test_backoff_doubles_from_the_base_up_to_the_cap(attempt: int, expected: int) -> None:
    assert backoff_ms(attempt, 500, 30_000) == expected


def test_backoff_is_an_int_and_never_exceeds_a_small_cap() -> None:
    values = [backoff_ms(a, 100, 250) for a in range(1, 6)]
    assert values == [100, 200, 250, 250, 250]
    assert all(type(v) is int for v in values)


# -- transactions ----------------------------------------------------------------------------------


def tombstones(world: World) -> list[tuple[str, int, bytes | None, bytes | None]]:
    return [(s.topic, s.partition, s.key, s.value) for s in world.internal.sent
            if s.topic == CHANGELOG and s.value is None]


def ends(world: World) -> list[tuple[int, bytes | None, IdState]]:
    """The changelog records of ended ids: partition, key, state."""
    return [(s.partition, s.key, decode_id_state(s.value)) for s in world.internal.sent
            if s.topic == CHANGELOG and s.value is not None and s.key != WATERMARK_MARKER]


def test_a_transaction_produces_the_target_and_its_seal_together(txn: World) -> None:
    key = txn.request(2, 5, T0, sid="s-5")
    txn.at(T0)
    assert [(s.topic, s.origin) for s in txn.targets.sent] == [("orders", origin(2, 5))]
    assert txn.internal.sent == [], "sealed when the transaction is about to commit"
    txn.delivery.seal(txn.indexes)
    assert tombstones(txn) == []
    [mark] = watermarks(txn, 2)
    assert mark.covers(key)
    [(partition, ended_key, state)] = ends(txn)
    assert (partition, ended_key, state.end, state.first_key) == (
        2, id_record_key("s-5"), End.DELIVERED, key), "the id's end is in the transaction too"
    assert txn.pending(2) == [key], "nothing leaves the index before the commit"
    assert txn.delivery.in_flight(key)
    assert not txn.delivery.has_failures()


def test_a_committed_transaction_deletes_the_entry_with_the_seal_inside_it(
    txn: World,
) -> None:
    key = txn.request(2, 5, T0, sid="s-5")
    txn.at(T0)
    txn.targets.report()
    txn.clock.set(T0 + 20)
    sealed = txn.delivery.seal(txn.indexes)
    txn.internal.report()
    assert not txn.delivery.has_failures()
    txn.delivery.settle(txn.indexes, sealed)
    assert txn.pending(2) == []
    state = txn.indexes[2].id_state("s-5")
    assert state is not None
    assert (state.pending_key, state.ended_ms, state.end) == (None, T0 + 20, End.DELIVERED)
    assert [mark.covers(key) for mark in watermarks(txn)] == [True], "inside the transaction"
    assert txn.indexes[2].offset(b"changelog") == 2, "past the id's end and the watermark"
    assert txn.sample("kdelay_delivered_records_total") == 1
    assert txn.delivery.idle()
    txn.at(T0 + 10_000)
    assert len(txn.targets.sent) == 1
    assert len(txn.internal.sent) == 2


def test_a_seal_behind_intake_puts_of_its_transaction_leaves_the_position_to_them(
    txn: World,
) -> None:
    """Intake's puts come before the seal in the transaction's changelog records and are
    applied to the index after it: a position recorded with the seal's deletes would, after
    a crash in between, restore past the puts and lose them (seen with tools/crash)."""
    delivered, other = txn.request(2, 5, T0), txn.request(1, 6, T0)
    txn.at(T0)
    txn.targets.report()
    sealed = txn.delivery.seal(txn.indexes)
    txn.internal.report()
    sealed.behind = frozenset({2})
    txn.delivery.settle(txn.indexes, sealed)
    assert (txn.pending(2), txn.pending(1)) == ([], [])
    assert txn.indexes[2].offset(b"changelog") is None, "left to the plan's apply"
    assert txn.indexes[1].offset(b"changelog") == 1, "no plan of partition 1: recorded"
    assert any(mark.covers(delivered) for mark in watermarks(txn))
    assert any(mark.covers(other) for mark in watermarks(txn))


def test_an_aborted_transaction_keeps_the_entry_and_produces_it_again(txn: World) -> None:
    key = txn.request(0, 7, T0, sid="s-7")
    txn.request(0, 8, T0 + 1_000)
    txn.at(T0)
    txn.targets.report()
    txn.internal.report()
    txn.clock.set(T0 + 5)
    txn.finish(committed=False)
    assert txn.pending() == [key, encode_due_key(T0 + 1_000, 0, 8)]
    assert txn.indexes[0].id_state("s-7") == IdState(key, None)
    assert len(txn.targets.sent) == 1, "finishing a transaction produces nothing"
    assert not txn.delivery.in_flight(key)
    assert txn.sample("kdelay_delivered_records_total") == 0

    txn.at(T0 + 5)
    assert [(s.origin, s.timestamp) for s in txn.targets.sent] == [
        (origin(0, 7), T0), (origin(0, 7), T0 + 5)
    ], "retried at once, and the later entry not before its due time"
    txn.delivery.seal(txn.indexes)
    assert [mark.covers(key) for mark in watermarks(txn)] == [True, True], "a seal each time"


def test_a_failed_report_aborts_and_only_that_entry_backs_off(txn: World) -> None:
    broken = txn.request(0, 1, T0, target="broken")
    fine = txn.request(1, 1, T0, target="orders")
    txn.at(T0)
    assert not txn.delivery.has_failures()
    txn.targets.report(timed_out(), topic="broken")
    txn.targets.report(topic="orders")
    txn.internal.report()
    assert txn.delivery.has_failures()

    txn.clock.set(T0 + 10)
    txn.finish(committed=False)
    assert not txn.delivery.has_failures()
    assert (txn.pending(0), txn.pending(1)) == ([broken], [fine])
    txn.at(T0 + 10)
    assert [(s.topic, s.timestamp) for s in txn.targets.sent[2:]] == [("orders", T0 + 10)]
    txn.at(T0 + 509)
    assert len(txn.targets.sent) == 3, "the failed entry waits out its backoff"
    txn.at(T0 + 510)
    assert [(s.topic, s.timestamp) for s in txn.targets.sent[3:]] == [("broken", T0 + 510)]
    assert txn.sample("kdelay_delivery_retries_total") == 1


def test_a_failed_watermark_report_is_a_transaction_failure(txn: World) -> None:
    key = txn.request(0, 1, T0)
    txn.at(T0)
    txn.targets.report()
    txn.delivery.seal(txn.indexes)
    assert not txn.delivery.has_failures()
    txn.internal.report(timed_out())
    assert txn.delivery.has_failures()
    assert txn.writer.position(0) is None
    assert txn.sample("kdelay_changelog_errors_total") == 1
    txn.delivery.abandon()
    assert txn.pending() == [key]
    txn.at(T0)
    assert len(txn.targets.sent) == 2
    txn.delivery.seal(txn.indexes)
    assert len(watermarks(txn)) == 2


def test_a_buffer_error_on_the_watermark_never_commits_a_delete_without_it(
    txn: World,
) -> None:
    key = txn.request(0, 1, T0)
    txn.internal.raises.append(BufferError("queue full"))
    txn.at(T0)
    txn.targets.report()
    sealed = txn.delivery.seal(txn.indexes)
    txn.internal.report()
    if txn.delivery.has_failures():
        txn.delivery.abandon()
    else:
        txn.delivery.settle(txn.indexes, sealed)
    deleted = key not in txn.pending()
    assert not deleted or any(mark.covers(key) for mark in watermarks(txn))


def test_a_missing_target_does_not_abort_the_transaction(txn: World) -> None:
    txn.targets.missing_topics.add("gone")
    gone = txn.request(0, 1, T0, target="gone")
    txn.request(0, 2, T0, target="orders")
    txn.at(T0)
    txn.targets.report()
    txn.internal.report()
    assert not txn.delivery.has_failures()
    txn.finish(committed=True)
    assert txn.pending() == [gone]
    txn.at(T0 + 499)
    txn.at(T0 + 500)
    assert txn.targets.metadata_requests.count("gone") >= 1


# -- missing target topics -------------------------------------------------------------------------


def test_a_missing_target_fails_at_once_and_ends_undeliverable(world: World) -> None:
    world.targets.missing_topics.add("gone")
    key = world.request(0, 1, T0, target="gone", key=b"kk", value=b"vv")
    for attempt, at in enumerate((T0, T0 + 500, T0 + 1_500), start=1):
        if attempt > 1:
            world.at(at - 1)
            assert not world.delivery.in_flight(key), "no attempt before the backoff is over"
        world.at(at)
        assert world.targets.sent == [], "nothing is produced to a missing topic"
        assert world.delivery.in_flight(key)
        world.settle()
        assert world.sample("kdelay_delivery_retries_total") == attempt
        assert world.internal.sent == []
    world.at(T0 + 1_500)
    [dead] = world.internal.sent
    assert (dead.topic, dead.key, dead.value) == (DLQ, b"kk", b"vv")
    assert dead.header(ERROR) == [b"undeliverable"]
    assert dead.header(TARGET) == [b"gone"]
    [detail] = dead.header(ERROR_DETAIL)
    assert isinstance(detail, bytes)
    assert b"3 attempts" in detail
    assert world.pending() == [key]


def test_a_missing_target_does_not_block_an_existing_one(world: World) -> None:
    world.targets.missing_topics.add("gone")
    gone = world.request(0, 1, T0, target="gone")
    world.request(0, 2, T0, target="orders")
    world.request(1, 1, T0, target="orders")
    world.at(T0)
    assert [(s.topic, s.origin) for s in world.targets.sent] == [
        ("orders", origin(0, 2)), ("orders", origin(1, 1)),
    ]
    world.targets.report()
    world.settle()
    assert world.pending(0) == [gone]
    assert world.pending(1) == []


def test_topic_check_remembers_an_existing_topic_for_its_ttl() -> None:
    producer = FakeProducer()
    clock = ManualClock(T0)
    check = TopicCheck(producer, clock, ttl_s=30.0)
    assert check.missing("orders") is None
    clock.advance(29_900)
    assert check.missing("orders") is None
    assert producer.metadata_requests == ["orders"]
    clock.advance(200)
    assert check.missing("orders") is None
    assert producer.metadata_requests == ["orders", "orders"]


def test_topic_check_asks_again_about_a_missing_topic_after_a_second() -> None:
    producer = FakeProducer()
    producer.missing_topics.add("late")
    clock = ManualClock(T0)
    check = TopicCheck(producer, clock)
    error = check.missing("late")
    assert error is not None
    assert error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
    producer.missing_topics.clear()
    clock.advance(900)
    assert check.missing("late") is not None, "the answer is remembered for a second"
    assert producer.metadata_requests == ["late"]
    clock.advance(200)
    assert check.missing("late") is None
    assert producer.metadata_requests == ["late", "late"]


def test_delivery_reuses_the_topic_answer_across_entries(world: World) -> None:
    world.request(0, 1, T0, target="orders")
    world.request(0, 2, T0 + 10, target="orders")
    world.step(T0)
    world.step(T0 + 10)
    assert len(world.targets.sent) == 2
    assert world.targets.metadata_requests == ["orders"]


def test_a_target_created_later_is_delivered_on_a_retry(world: World) -> None:
    world.targets.missing_topics.add("late")
    world.request(0, 1, T0, target="late")
    world.at(T0)
    world.settle()
    world.targets.missing_topics.clear()
    world.at(T0 + 500)  # the clock's monotonic time moves with it: 0.5 s
    world.settle()
    assert world.targets.sent == [], "still the remembered answer"
    world.at(T0 + 1_500)
    assert [(s.topic, s.origin) for s in world.targets.sent] == [("late", origin(0, 1))]
    assert world.targets.metadata_requests == ["late", "late"]


def test_a_silent_cluster_is_a_retryable_failure_remembered_for_a_second(world: World) -> None:
    world.targets.metadata_error = KafkaError(KafkaError._TRANSPORT, "broker down")
    key = world.request(0, 1, T0)
    world.at(T0)
    assert world.targets.sent == []
    world.settle()
    assert not world.delivery.in_flight(key)
    assert world.sample("kdelay_delivery_retries_total") == 1
    world.targets.metadata_error = None
    world.at(T0 + 500)  # every record to a target waits once per second, not once each
    assert world.targets.sent == []
    assert world.targets.metadata_requests == ["orders"]
    for now in range(T0 + 1_000, T0 + 30_000, 250):
        world.at(now)
        world.settle()
        if world.targets.sent:
            break
    assert [s.topic for s in world.targets.sent] == ["orders"]
    assert world.targets.metadata_requests == ["orders", "orders"]


# -- prepare, dispatch, wait -----------------------------------------------------------------------


def test_prepare_says_whether_something_is_due_and_produces_nothing(world: World) -> None:
    world.request(0, 1, T0 + 50)
    world.clock.set(T0)
    assert world.delivery.prepare(world.indexes) is False
    world.delivery.dispatch()
    world.clock.set(T0 + 49)
    assert world.delivery.prepare(world.indexes) is False
    world.clock.set(T0 + 50)
    assert world.delivery.prepare(world.indexes) is True
    assert world.targets.sent == []
    world.delivery.dispatch()
    assert [s.timestamp for s in world.targets.sent] == [T0 + 50]
    assert world.delivery.prepare(world.indexes) is False


def test_prepare_is_true_when_a_backoff_is_over(world: World) -> None:
    world.request(0, 1, T0)
    world.at(T0)
    world.targets.report(timed_out())
    world.settle()
    world.clock.set(T0 + 499)
    assert world.delivery.prepare(world.indexes) is False
    assert world.delivery.wait_ms() == 1
    world.clock.set(T0 + 500)
    assert world.delivery.prepare(world.indexes) is True
    assert world.delivery.wait_ms() == 0


def test_wait_ms_is_the_time_to_the_next_due_entry_capped(world: World) -> None:
    assert world.delivery.wait_ms() == MAX_WAIT_MS == 100
    world.request(0, 1, T0 + 30)
    world.request(1, 1, T0 + 1_000)
    world.clock.set(T0)
    world.delivery.prepare(world.indexes)
    assert world.delivery.wait_ms() == 30
    world.clock.set(T0 + 29)
    assert world.delivery.wait_ms() == 1
    world.clock.set(T0 + 45)
    assert world.delivery.wait_ms() == 0, "overdue is due"
    world.delivery.dispatch()
    assert world.delivery.wait_ms() == IN_FLIGHT_WAIT_MS == 1, "a report is awaited"
    world.targets.report()
    world.settle()
    assert world.delivery.wait_ms() == 100, "the next entry is 955 ms away"
    world.clock.set(T0 + 950)
    assert world.delivery.wait_ms() == 50


def test_a_forgotten_entry_is_not_work_due(world: World) -> None:
    key = world.request(0, 1, T0 + 1_000)
    world.at(T0)
    world.indexes[0].apply(Changes(deletes=[key]))
    world.delivery.forget([key])
    world.clock.set(T0 + 950)
    assert world.delivery.wait_ms() == MAX_WAIT_MS
    world.clock.set(T0 + 1_000)
    assert world.delivery.prepare(world.indexes) is False


# -- adoption: intake hands over entries due soon, with their records ---------------


def _new_request(world: World, partition: int, offset: int, due: int) -> tuple[Entry, Message]:
    """A request intake has just planned: its entry and its record (not in the reader's
    log, so only adoption can deliver it without a read). Not in the index yet."""
    headers = schedule_headers("orders", due_ms=due)
    message = Message(topic=REQUESTS, partition=partition, offset=offset, key=b"k", value=b"v",
                      headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, T0 - 1))
    entry = Entry(encode_due_key(due, partition, offset), IndexValue(fingerprint_of(message), None))
    return entry, message


def _adopt(world: World, partition: int, entries: list[Entry],
           originals: dict[bytes, Message]) -> None:
    """What the service does once intake's plan is written: delivery adopts what it may."""
    world.delivery.adopt(partition, *Changes(puts=entries).put_fields(), originals)


def _index(world: World, partition: int, entries: list[Entry]) -> None:
    """What the service does once intake's plan is acknowledged: index it, tell delivery."""
    world.indexes[partition].apply(Changes(puts=entries))
    world.delivery.indexed(partition, [entry.key for entry in entries])


def _adopt_and_index(world: World, partition: int,
                     requests: list[tuple[Entry, Message]]) -> None:
    entries = [entry for entry, _ in requests]
    _adopt(world, partition, entries, {e.key: m for e, m in requests})
    _index(world, partition, entries)


def test_an_adopted_entry_is_delivered_without_reading_it_back(world: World) -> None:
    world.at(T0)  # the first tick scans: the window now reaches T0 + lookahead
    reads_before = len(world.reader.calls)
    _adopt_and_index(world, 0, [_new_request(world, 0, 5, T0 + 500)])
    world.at(T0 + 499)
    assert world.targets.sent == []
    world.at(T0 + 500)
    assert [(s.key, s.timestamp) for s in world.targets.sent] == [(b"k", T0 + 500)]
    assert len(world.reader.calls) == reads_before, "no read back from Kafka"


def test_more_adopted_entries_than_a_batch_are_all_adopted_and_leave_room_to_read(
    world: World,
) -> None:
    """Under steady load with short delays, adopted entries alone can outnumber a batch
    (CONFIG.batch_size is 100): none of them may be read back, and they must not stop
    the read-ahead of entries intake did not adopt."""
    world.at(T0)
    _adopt_and_index(world, 0, [_new_request(world, 0, offset, T0 + 500)
                                for offset in range(250)])
    world.request(0, 1_000, T0 + 400)  # indexed by other means: found by a scan
    world.at(T0 + 1)
    assert [call.get(0) for call in world.reader.calls if call.get(0)] == [[1_000]]
    world.step(T0 + 400)
    assert [s.timestamp for s in world.targets.sent] == [T0 + 400]
    world.step(T0 + 500)
    assert len(world.targets.sent) == 251
    reads = [call.get(0) for call in world.reader.calls if call.get(0)]
    assert reads == [[1_000]], "no adopted entry was read back"


def test_an_entry_due_beyond_the_window_is_left_to_the_scan(world: World) -> None:
    world.at(T0)
    entry, message = _new_request(world, 0, 5, T0 + 60_000)
    _adopt_and_index(world, 0, [(entry, message)])
    world.at(T0 + 59_999)
    assert world.targets.sent == []
    world.reader.log[(0, 5)] = message  # found by the scan once inside the window
    world.at(T0 + 60_000)
    assert [s.timestamp for s in world.targets.sent] == [T0 + 60_000]


def test_nothing_is_adopted_before_the_partition_was_scanned(world: World) -> None:
    entry, message = _new_request(world, 0, 5, T0)
    _adopt_and_index(world, 0, [(entry, message)])
    world.reader.log[(0, 5)] = message
    world.at(T0)
    assert len(world.targets.sent) == 1, "delivered once, through the scan"


def test_an_adopted_entry_goes_out_before_it_is_indexed_and_leaves_only_after(
    world: World,
) -> None:
    """Intake's changelog records may be acknowledged late: the entry goes out when due
    anyway, but its delete and its seal wait until its put is in the index, or a later
    index write of the put would bring the delivered entry back."""
    world.at(T0)
    entry, message = _new_request(world, 0, 5, T0 + 100)
    _adopt(world, 0, [entry], {entry.key: message})
    world.at(T0 + 100)
    assert [s.timestamp for s in world.targets.sent] == [T0 + 100], "on time, not indexed"
    world.targets.report()
    world.settle()
    assert world.internal.sent == [], "no seal before the entry is indexed"
    assert world.delivery.in_flight(entry.key), "held: too late to cancel"

    _index(world, 0, [entry])
    world.settle()
    assert [(s.topic, s.key) for s in world.internal.sent] == [(CHANGELOG, WATERMARK_MARKER)]
    assert watermarks(world)[0].covers(entry.key)
    assert list(world.indexes[0].entries()) == []
    assert len(world.targets.sent) == 1, "delivered once"


def test_plans_adopted_one_after_another_share_a_run_and_leave_the_index_each_when_in_it(
    world: World,
) -> None:
    """A steady rate adopts a few entries a step, each due after the last: they follow
    each other in one run (so a step walks a few runs, not one per step), and each
    plan's entries still leave the index only once that plan is applied."""
    world.at(T0)
    first = [_new_request(world, 0, offset, T0 + 100 + offset) for offset in (1, 2)]
    second = [_new_request(world, 0, offset, T0 + 100 + offset) for offset in (3, 4)]
    _adopt(world, 0, [e for e, _ in first], {e.key: m for e, m in first})
    _adopt(world, 0, [e for e, _ in second], {e.key: m for e, m in second})
    [run] = world.delivery._ahead.runs[0]
    assert len(run) == 4
    _index(world, 0, [e for e, _ in second])  # acknowledged first: it waits for the first
    world.at(T0 + 104)
    world.targets.report()
    world.settle()
    assert len(world.targets.sent) == 4
    assert world.internal.sent == [], "nothing leaves the index before its plan is in it"
    _index(world, 0, [e for e, _ in first])
    world.settle()
    assert list(world.indexes[0].entries()) == []
    assert all(watermarks(world)[-1].covers(e.key) for e, _ in first + second)


def test_an_adopted_plan_due_before_the_last_one_is_a_run_of_its_own(world: World) -> None:
    world.at(T0)
    late = [_new_request(world, 0, 1, T0 + 300)]
    early = [_new_request(world, 0, 2, T0 + 200)]
    _adopt_and_index(world, 0, late)
    _adopt_and_index(world, 0, early)
    assert len(world.delivery._ahead.runs[0]) == 2
    world.step(T0 + 200)
    world.step(T0 + 300)
    assert [s.timestamp for s in world.targets.sent] == [T0 + 200, T0 + 300]


def test_a_given_back_plan_takes_its_adopted_entries_back(world: World) -> None:
    world.at(T0)
    entry, message = _new_request(world, 0, 5, T0 + 100)
    _adopt(world, 0, [entry], {entry.key: message})
    world.delivery.disown([entry.key])
    world.at(T0 + 100)
    assert world.targets.sent == []


def test_an_entry_not_adopted_is_found_by_a_scan_once_indexed(tmp_path: Path) -> None:
    """A scan between the write and the index apply does not see the entry; being told
    it is indexed makes the next scan start no later than it."""
    world = World(tmp_path, DeliveryConfig(REQUESTS, CHANGELOG, DLQ, batch_size=1))
    try:
        world.at(T0)
        held = [_new_request(world, 0, offset, T0 + 500) for offset in range(25)]
        # MAX_HELD_BATCHES batches of one: 20 are adopted, the rest are not.
        _adopt(world, 0, [e for e, _ in held], {e.key: m for e, m in held})
        world.at(T0 + 1)  # a scan before the index write finds nothing
        for entry, message in held:
            world.reader.log[(0, entry.due.offset)] = message
        _index(world, 0, [e for e, _ in held])
        for step in range(2, 60):
            world.at(T0 + 500 + step)
            world.targets.report()
            world.settle()
        assert sorted(s.timestamp >= T0 + 500 for s in world.targets.sent) == [True] * 25
        assert list(world.indexes[0].entries()) == []
    finally:
        world.close()


def test_with_default_settings_a_missing_target_is_retried_for_fifteen_minutes(
    tmp_path: Path,
) -> None:
    defaults = Settings()
    assert defaults.delivery_retry_ms == 900_000
    config = DeliveryConfig(REQUESTS, CHANGELOG, DLQ, defaults.lookahead_ms,
                            defaults.batch_size, defaults.delivery_attempts,
                            defaults.retry_backoff_ms, defaults.retry_backoff_max_ms,
                            retry_ms=defaults.delivery_retry_ms)
    world = World(tmp_path, config)
    try:
        world.targets.missing_topics.add("late")
        world.request(0, 1, T0, target="late")
        for now in range(T0, T0 + 900_000, 1_000):
            world.at(now)
            world.settle()
        assert world.internal.sent == [], "dead-lettered inside the retry window"
        assert world.sample("kdelay_delivery_retries_total") > 30
        world.targets.missing_topics.discard("late")
        world.at(T0 + 900_000)
        assert [s.topic for s in world.targets.sent] == ["late"]
    finally:
        world.close()


def test_a_target_missing_beyond_the_retry_window_ends_undeliverable(world: World) -> None:
    config = dataclasses.replace(CONFIG, attempts=0, retry_ms=10_000)
    world.delivery = Delivery(config, world.targets, world.internal, world.reader, world.clock,
                              world.metrics, Acknowledged(world.writer, world.targets, world.each))
    world.targets.missing_topics.add("gone")
    world.request(0, 1, T0, target="gone")
    for now in range(T0, T0 + 10_000, 100):
        world.at(now)
        world.settle()
    assert world.internal.sent == []
    world.at(T0 + 10_000)
    world.settle()
    world.at(T0 + 10_000)
    [dead] = world.internal.sent
    assert dead.header(ERROR) == [b"undeliverable"]
    [detail] = dead.header(ERROR_DETAIL)
    assert isinstance(detail, bytes)
    assert b"failed over 10 s" in detail


def test_records_waiting_for_a_retry_are_bounded_per_partition(tmp_path: Path) -> None:
    config = dataclasses.replace(CONFIG, batch_size=1, attempts=0, retry_ms=3_600_000)
    world = World(tmp_path, config)
    try:
        world.targets.missing_topics.add("gone")
        room = MAX_RETRYING_BATCHES
        for offset in range(room + 2):
            world.request(0, offset, T0, target="gone")
        world.request(0, room + 2, T0 + 1, target="orders")
        for _ in range(room + 3):
            world.step(T0 + 1)
        dead = [s for s in world.internal.sent if s.topic == DLQ]
        assert len(dead) == 2, "beyond the room, failures are dead-lettered at once"
        assert all(b"wait for a retry" in (d.header(ERROR_DETAIL)[0] or b"") for d in dead)
        assert [s.origin for s in world.targets.sent] == [origin(0, room + 2)]
    finally:
        world.close()


def test_a_long_missing_target_logs_one_line_per_interval_not_per_failure(
    world: World, caplog: pytest.LogCaptureFixture,
) -> None:
    config = dataclasses.replace(CONFIG, attempts=0, retry_ms=900_000)
    world.delivery = Delivery(config, world.targets, world.internal, world.reader, world.clock,
                              world.metrics, Acknowledged(world.writer, world.targets, world.each))
    world.targets.missing_topics.add("gone")
    for offset in range(20):
        world.request(0, offset, T0, target="gone")
    with caplog.at_level(logging.WARNING, logger="kdelay.engine.delivery._failures"):
        for now in range(T0, T0 + 120_000, 500):
            world.at(now)
            world.settle()
    failures = world.sample("kdelay_delivery_retries_total")
    lines = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failures > 100
    assert len(lines) == 4, "one line per 30 s of failures"
# -- a broker outage -----------------------------------------------------------------


def test_failures_while_kafka_is_unreachable_spend_no_attempt(world: World) -> None:
    key = world.request(0, 7, T0)
    world.at(T0)
    world.outage = True
    now = T0
    for _ in range(10):  # far more than the 3 attempts of CONFIG
        world.targets.report(timed_out())
        world.settle()
        now += 4_000  # past the longest backoff
        world.at(now)
    assert world.internal.sent == [], "an outage dead-letters nothing"
    assert len(world.targets.sent) == 1, "nothing is sent again while Kafka is away"
    world.outage = False
    world.at(now)
    assert len(world.targets.sent) == 2, "sent again once it answers"
    world.targets.report()
    world.settle()
    assert world.pending() == []
    assert key not in world.pending()
    assert world.sample("kdelay_delivered_records_total") == 1


def test_many_failures_at_once_are_logged_as_one_line(
    world: World, caplog: pytest.LogCaptureFixture,
) -> None:
    for offset in range(50):
        world.request(offset % 3, offset, T0)
    world.at(T0)
    caplog.set_level(logging.WARNING, logger="kdelay.engine.delivery._failures")
    assert len(world.targets.report(timed_out())) == 50
    world.settle()
    assert len(caplog.records) == 1
    assert "50 deliveries failed" in caplog.text
    world.at(T0 + 4_000)  # the retries fail too, within the same thirty seconds
    assert len(world.targets.report(timed_out())) == 50
    world.settle()
    assert len(caplog.records) == 1, "one line per period, whatever the failures"
    world.clock.set(T0 + 30_000)
    world.settle()
    assert len(caplog.records) == 2
    assert world.sample("kdelay_delivery_retries_total") == 100


# -- forwarded schedules ------------------------------------------------------------


def test_an_entry_forwarded_to_its_ids_partition_reads_the_original_where_it_lies(
    world: World,
) -> None:
    headers = schedule_headers("orders", due_ms=T0 + 100, schedule_id="order-7")
    message = Message(topic=REQUESTS, partition=1, offset=9, key=b"k", value=b"v",
                      headers=headers, timestamp=(TIMESTAMP_CREATE_TIME, T0 - 1))
    world.reader.log[(1, 9)] = message
    due_key = encode_due_key(T0 + 100, 1, 9)
    entry = Entry(due_key, IndexValue(fingerprint_of(message), "order-7"))
    world.delivery.noted(2, world.indexes[2].apply(
        Changes(puts=[entry], ids={"order-7": IdState(due_key, None)})))
    world.at(T0 + 100)
    assert world.reader.calls == [{1: [9]}], "read from the original's partition"
    [sent] = world.targets.sent
    assert (sent.value, sent.origin) == (b"v", origin(1, 9))
    world.targets.report()
    world.settle()
    assert world.pending(2) == []
    state = world.indexes[2].id_state("order-7")
    assert state == IdState(None, T0 + 100, End.DELIVERED, due_key, fingerprint_of(message))
    [_, mark] = world.internal.sent
    assert (mark.topic, mark.partition, mark.key) == (CHANGELOG, 2, WATERMARK_MARKER)
    assert watermarks(world, 2)[0].covers(due_key), "in the changelog of the id's partition"


# -- flights ---------------------------------------------------------------------------------


def test_a_flight_lands_when_every_record_reported_and_one_failure_backs_off_alone(
        world: World) -> None:
    keys = [world.request(0, offset, T0, key=f"k{offset}".encode()) for offset in range(5)]
    world.at(T0)
    assert len(world.targets.sent) == 5
    failing = world.targets.unreported[2]
    world.targets.report(these=[s for s in world.targets.sent if s is not failing])
    world.settle()
    assert world.pending() == keys, "one record has not reported: the flight is in the air"
    world.targets.report(timed_out())
    world.settle()
    assert world.pending() == [keys[2]], "the others are done, the failed one backs off"
    assert not world.delivery.in_flight(keys[2])
    [mark] = watermarks(world)
    assert mark.pending == frozenset({keys[2]}), "the watermark lists it as pending"
    assert all(mark.covers(k) for k in keys if k != keys[2])


def test_a_few_due_entries_go_out_at_once_beside_a_bulk_generation_in_the_air(
        world: World) -> None:
    """A steady rate must not wait for the bulk lane's generation to land: a dispatch
    of few entries goes out on the producer that reports each record, and lands
    by its reports, whatever the bulk lane does meanwhile."""
    first = world.request(0, 1, T0)
    second = world.request(1, 1, T0 + 1)
    world.at(T0)
    assert len(world.targets.sent) == 1, "on the bulk lane"
    world.at(T0 + 1)
    assert [s.origin for s in world.each.sent] == [origin(1, 1)], "at once, not after it"
    assert world.each.sent[0].timestamp == T0 + 1
    world.each.report()
    world.settle()
    assert world.pending() == [first], "the reported one is done, the bulk one in the air"
    world.targets.report()
    world.settle()
    assert world.pending() == []
    assert second not in world.pending()


def test_a_dispatch_the_full_queue_cut_short_goes_on_on_the_bulk_lane(
        world: World) -> None:
    """Entries due at one millisecond go out in key order: what a full queue left of a
    dispatch follows it on the same producer (after its generation landed), even when
    it is few."""
    keys = [world.request(0, offset, T0) for offset in range(3)]
    world.targets.queue_limit = 1
    world.at(T0)
    assert [s.origin for s in world.targets.sent] == [origin(0, 0)], "the queue filled up"
    world.at(T0 + 1)
    assert world.each.sent == [], "the rest waits for the generation, on its lane"
    world.targets.report()
    world.settle()
    world.targets.queue_limit = None
    world.at(T0 + 2)
    assert [s.origin for s in world.targets.sent] == [origin(0, o) for o in range(3)]
    world.targets.report()
    world.settle()
    assert world.pending() == []
    assert all(watermarks(world)[-1].covers(key) for key in keys)


def test_with_a_cadence_a_partition_is_sealed_once_per_period_not_once_per_step(
        world: World) -> None:
    """At-least-once seals a partition at most once per period (a seal per step of a
    steady rate costs more than its records): what lands meanwhile waits for the next."""
    first = world.request(0, 1, T0)
    second = world.request(0, 2, T0 + 10)
    world.at(T0)
    world.targets.report()
    world.delivery.settle(world.indexes, world.delivery.seal(world.indexes, every_s=0.05))
    assert len(watermarks(world)) == 1, "never sealed yet: sealed at once"
    world.clock.set(T0 + 10)
    world.delivery.tick(world.indexes)
    world.targets.report()
    world.delivery.settle(world.indexes, world.delivery.seal(world.indexes, every_s=0.05))
    assert len(watermarks(world)) == 1, "landed within the period: it waits"
    assert world.pending() == [second]
    world.clock.set(T0 + 60)
    world.delivery.settle(world.indexes, world.delivery.seal(world.indexes, every_s=0.05))
    assert len(watermarks(world)) == 2
    assert world.pending() == []
    assert all(watermarks(world)[-1].covers(key) for key in (first, second))
    third = world.request(0, 3, T0 + 60)
    world.delivery.tick(world.indexes)
    world.targets.report()
    for _ in range(SEAL_EVERY_STEPS - 1):
        world.delivery.settle(world.indexes, world.delivery.seal(world.indexes, every_s=0.05))
    assert world.pending() == [third], "a clock that stands still..."
    world.delivery.settle(world.indexes, world.delivery.seal(world.indexes, every_s=0.05))
    assert world.pending() == [], "...seals once so many seals were asked for"


def test_a_stalled_bulk_lane_hands_over_to_a_producer_that_reports_each_record(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target partition without a leader keeps its records unacknowledged until their
    timeout. The bulk lane lets one generation in the air at a time (but for a few
    entries), so after STALL_S the next deliveries go out on a producer that reports
    each record, the stalled flight is taken off its run (the entries behind it settle
    meanwhile), and the bulk lane serves again once everything in the air has landed."""
    monkeypatch.setattr(delivery_module, "FEW", 1)
    stuck = world.request(0, 1, T0, target="stuck")
    for offset in (2, 3):
        world.request(0, offset, T0 + 10)
    world.at(T0)
    assert [s.topic for s in world.targets.sent] == ["stuck"]
    world.at(T0 + 10)
    assert len(world.targets.sent) == 1, "one generation in the air on the bulk lane"
    assert world.reader.calls == [{0: [1, 2, 3]}], "one run, read at once"
    world.at(T0 + int(STALL_S * 1000) + 1)
    assert [s.topic for s in world.each.sent] == ["orders", "orders"], "the other producer"
    world.each.report()
    world.settle()
    assert world.pending() == [stuck], "the stuck one detached: the others are sealed"
    assert world.delivery.in_flight(stuck)
    world.targets.report(topic="stuck")
    world.settle()
    assert world.pending() == []
    world.request(0, 4, T0 + 6_000)
    world.at(T0 + 6_000)
    assert len(world.targets.sent) == 2, "back on the bulk lane"
    assert len(world.each.sent) == 2, "nothing was produced twice"


def test_a_stalled_flight_that_then_fails_goes_out_again(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled flight is taken off its run; when its records then fail (their timeout),
    the failure is still found by the target topic the report names: the entry stays
    pending and goes out again. Taking the failure for a landing would seal the entry as
    delivered: lost."""
    monkeypatch.setattr(delivery_module, "FEW", 1)
    stuck = world.request(0, 1, T0, target="stuck")
    world.at(T0)
    world.at(T0 + int(STALL_S * 1000) + 1)
    world.settle()  # the flight is detached from its run
    assert world.delivery.in_flight(stuck)
    world.targets.report(timed_out(), topic="stuck")
    world.internal.report()
    world.settle()
    assert world.pending() == [stuck], "a record that timed out is not delivered"
    world.step(T0 + 60_000)
    assert [s.origin for s in world.targets.sent] == [origin(0, 1), origin(0, 1)]
    world.internal.report()
    world.settle()
    assert world.pending() == []


def test_entries_in_the_air_when_their_partition_is_lost_go_out_once_it_is_back(
        world: World, tmp_path: Path) -> None:
    """A partition lost (and given back) while its deliveries await their reports: what
    those flights do after the loss (stall, fail, land) must not leave its entries held by
    delivery, or they are never read ahead again once the partition is back."""
    first = world.request(0, 1, T0)
    second = world.request(0, 2, T0)
    world.at(T0)
    assert len(world.targets.sent) == 2
    world.delivery.drop_partition(0)
    index = world.indexes.pop(0)
    world.at(T0 + int(STALL_S * 1000) + 1)
    world.settle()  # the flight stalls while the partition is away
    world.targets.report(timed_out())  # then times out, the broker still away
    world.internal.report()
    world.settle()
    world.indexes[0] = index  # the partition is back, its index as it was
    world.delivery.noted(0, first)
    world.step(T0 + 10_000)
    world.step(T0 + 11_000)
    assert [s.origin for s in world.targets.sent[2:]] == [origin(0, 1), origin(0, 2)]
    assert world.pending() == []
    assert second


def test_a_failure_is_told_apart_by_its_topic_key_and_value_the_report_carries(
        world: World) -> None:
    """A delivery report carries no headers: the failed entry is found by what it does
    carry. Records that look alike all go out again (at-least-once: nothing is lost)."""
    ok = world.request(0, 1, T0, key=b"a", value=b"1")
    bad = world.request(0, 2, T0, key=b"b", value=b"2")
    twin = world.request(0, 3, T0, key=b"b", value=b"2")
    world.at(T0)
    sent = list(world.targets.unreported)
    world.targets.unreported = [sent[1]]
    world.targets.report(timed_out())
    world.targets.unreported = [sent[0], sent[2]]
    world.targets.report()
    world.settle()
    assert world.pending() == [bad, twin], "the twin of the failed one goes out again too"
    assert watermarks(world)[0].covers(ok)
    world.at(T0 + 500)
    assert [s.origin for s in world.targets.sent[3:]] == [origin(0, 2), origin(0, 3)]


# -- target controls -----------------------------------------------------------------


def _paused(now: int) -> Control:
    return Control(paused=Pause(now, "alice", "db maintenance"), changed_ms=now,
                   changed_by="alice")


def test_a_paused_target_with_a_long_backlog_does_not_hold_back_another_target(
        world: World) -> None:
    """More records of a paused target fall due in one partition than it may hold in
    memory (MAX_HELD_BATCHES batches): past SHELF_AT they stay on the shelf, in the
    index, and the other target's records behind them go out as before. On resume
    every held one goes out once, oldest first."""
    orders = Subject(Scope.TARGET, "orders")
    world.delivery.controls.apply(orders, _paused(T0), T0)
    count = MAX_HELD_BATCHES * CONFIG.batch_size + SHELF_AT
    held = [world.request(0, offset, T0 + offset) for offset in range(count)]
    for n in range(50):
        world.request(0, count + n, T0 + count + n, target="billing")
    for n in range(40):
        world.step(T0 + 2 * count + n * 100)
    assert [s.origin for s in world.targets.sent] == [origin(0, count + n) for n in range(50)]
    assert world.pending() == held, "the paused target's records stay pending"
    # Past SHELF_AT, at most what one read ahead takes (AHEAD_BATCHES) and a batch more.
    bound = SHELF_AT + (AHEAD_BATCHES + 1) * CONFIG.batch_size
    assert world.delivery.controls.holding(orders) < bound
    assert world.delivery.held_back() == {orders: (count, T0)}, "in memory and shelved"
    resumed = T0 + 2 * count + 5_000
    world.delivery.controls.apply(orders, Control(), resumed)
    for n in range(200):
        world.step(resumed + n * 100)
    out = [s.origin for s in world.targets.sent if s.topic == "orders"]
    assert out == [origin(0, offset) for offset in range(count)], "each once, oldest first"
    assert world.pending() == []


def test_a_record_of_a_shelved_target_is_not_adopted_and_goes_out_after_the_pause(
        world: World) -> None:
    orders = Subject(Scope.TARGET, "orders")
    world.delivery.controls.apply(orders, _paused(T0), T0)
    for offset in range(SHELF_AT + 10):
        world.request(0, offset, T0 + offset)
    for n in range(20):
        world.step(T0 + SHELF_AT + 100 + n)
    assert world.delivery.controls.holding(orders) >= SHELF_AT
    entry, message = _new_request(world, 0, 9_999, T0 + SHELF_AT + 500)
    entry = Entry(entry.key, entry.value._replace(target="orders"))
    world.reader.log[(0, 9_999)] = message  # in Kafka: a scan reads it back
    holding = world.delivery.controls.holding(orders)
    _adopt(world, 0, [entry], {entry.key: message})
    _index(world, 0, [entry])
    world.step(T0 + SHELF_AT + 600)
    assert world.targets.sent == []
    assert world.delivery.controls.holding(orders) == holding, "left in the index"
    world.delivery.controls.apply(orders, Control(), T0 + SHELF_AT + 700)
    for n in range(30):
        world.step(T0 + SHELF_AT + 700 + n * 100)
    assert len([s for s in world.targets.sent if s.topic == "orders"]) == SHELF_AT + 11
    assert world.pending() == []


def test_a_cancelled_shelved_record_is_counted_out_of_the_held_back_backlog(
        world: World) -> None:
    orders = Subject(Scope.TARGET, "orders")
    world.delivery.controls.apply(orders, _paused(T0), T0)
    count = SHELF_AT + 3 * CONFIG.batch_size
    keys = [world.request(0, offset, T0 + offset) for offset in range(count)]
    for n in range(30):
        world.step(T0 + count + n)
    assert world.delivery.held_back() == {orders: (count, T0)}
    world.indexes[0].apply(Changes(deletes=[keys[-1]]))  # a cancel, as intake applies it
    world.delivery.forget([keys[-1]])
    assert world.delivery.held_back() == {orders: (count - 1, T0)}

# -- a target producer renewed after a fatal error -----------------------------------------


def test_flights_taken_back_go_out_again_whatever_their_producer_reported(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target producer failed for good and was replaced: every flight in the air is
    taken back, even a record whose success was reported, and goes out again on the new
    producer. Trusting the old one's reports (or its empty queue) could seal an entry it
    never wrote: lost. A duplicate is what at-least-once allows."""
    monkeypatch.setattr(delivery_module, "FEW", 1)
    first = world.request(0, 1, T0)
    second = world.request(0, 2, T0)
    world.at(T0)
    world.at(T0 + int(STALL_S * 1000) + 1)
    world.settle()  # stalled: the flight is detached, its entries are jobs in flight
    third = world.request(0, 3, T0 + 6_000)
    world.at(T0 + 6_000)  # on the reporting producer, while the bulk lane is stalled
    assert [s.origin for s in world.targets.sent] == [origin(0, 1), origin(0, 2)]
    assert [s.origin for s in world.each.sent] == [origin(0, 3)]
    world.targets.report(these=world.targets.sent[:1])  # the first one's success, silently
    world.targets.unreported.clear()  # the old producer is dropped, never polled again
    world.each.unreported.clear()

    assert world.delivery.take_back() == 3
    for key in (first, second, third):
        assert world.delivery.in_flight(key), "too late to cancel: it may have been written"
        assert not world.delivery.withhold(key)
    world.settle()
    assert world.pending() == [first, second, third], "nothing taken back counts as delivered"

    world.step(T0 + 6_001)
    again = [s.origin for s in (*world.targets.sent[2:], *world.each.sent[1:])]
    assert sorted(again, key=repr) == [origin(0, 1), origin(0, 2), origin(0, 3)]
    world.each.report()
    world.settle()
    assert world.pending() == []
    assert world.sample("kdelay_dead_lettered_total", code="undeliverable") == 0


def test_taking_back_spends_no_attempt_and_dead_letters_nothing(tmp_path: Path) -> None:
    """A record taken back was not refused: its attempts stay as they were, so even with
    ``--delivery-attempts 1`` it goes out again instead of to the DLQ."""
    world = World(tmp_path, DeliveryConfig(REQUESTS, CHANGELOG, DLQ, attempts=1))
    try:
        key = world.request(0, 1, T0)
        world.at(T0)
        world.targets.unreported.clear()
        assert world.delivery.take_back() == 1
        world.step(T0 + 1)
        assert [s.topic for s in world.targets.sent] == ["orders", "orders"]
        assert [s.topic for s in world.internal.sent if s.topic == DLQ] == []
        assert world.pending() == []
        assert key, "the request was put"
    finally:
        world.close()


def test_no_flight_lands_while_a_target_producer_awaits_its_renewal(tmp_path: Path) -> None:
    """Between a target producer's fatal error and its renewal, its empty queue (the
    records purged, their reports never served) must not read as landed."""
    failed = [False]
    world = World(tmp_path, failed=lambda: failed[0])
    try:
        key = world.request(0, 1, T0)
        world.at(T0)
        failed[0] = True
        world.targets.unreported.clear()  # purged: len 0, no report
        world.settle()
        assert world.pending() == [key], "not sealed as delivered"
        assert world.delivery.in_flight(key)
    finally:
        world.close()
