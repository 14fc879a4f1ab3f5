"""Bounded reads of the newest records of topics, for screens that show the latest of something.

:func:`newest` reads, from every partition of some topics, the records written
since a time (found with the broker's time index) but never more than the last
``per_partition`` of each: a bounded read, whatever the topics' size, that
says where its cap cut the time window short (:attr:`Tail.capped`).
:func:`search` reads one topic from a time on, a bounded number of records a
partition, for the first record a predicate accepts.

Both read by assignment with a group-less, read-committed reader (no group
joined, no offset stored), stop at each partition's end as it was when the
read began (or at its end-of-partition event: under transactions the last
offsets are commit markers no reader sees), and give up after ``timeout_s``.
An absent topic gives no records; other Kafka errors raise KafkaException.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kdelay.plumbing.clients import reader_config, take, watermarks

TIMEOUT_S = 5.0
MIN_PER_PARTITION = 20
"""The fewest records a partition is read for when a budget is shared by many."""
QUEUE_KIB = 16_384
"""What a reader prefetches at most (librdkafka's default is 64 MiB)."""
Config = Mapping[str, str | int | bool]
Place = tuple[str, int]
T = TypeVar("T")


@dataclass(frozen=True)
class Tail(Generic[T]):
    """What was kept of the records read (each converted as it arrived), and the
    partitions (topic, partition) where the bound cut the window: older records of
    the window were left unread there."""

    items: list[T]
    capped: set[Place] = field(default_factory=set)


def _reader(config: Config, purpose: str) -> Consumer:
    return Consumer(reader_config(config, f"kdelay-{purpose}-{uuid.uuid4().hex}",
                                  **{"queued.max.messages.kbytes": QUEUE_KIB}))


def _partitions(consumer: Consumer, topic: str, timeout_s: float) -> list[int]:
    """The partitions of ``topic``, none when it does not exist (or cannot be described)."""
    found = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        return []
    return sorted(found.partitions)


def _time_offsets(consumer: Consumer, places: Sequence[Place], since_ms: int,
                  timeout_s: float) -> dict[Place, int]:
    """The first offset of each place whose record time is ``since_ms`` or later (-1: none)."""
    if not places:
        return {}
    asked = [TopicPartition(topic, partition, since_ms) for topic, partition in places]
    answered = consumer.offsets_for_times(asked, timeout=timeout_s)
    return {(tp.topic, tp.partition): tp.offset for tp in answered}


def newest(config: Config, topics: Sequence[str], convert: Callable[[Message], T | None], *,
           per_partition: int, budget: int | None = None, since_ms: int | None = None,
           timeout_s: float = TIMEOUT_S, purpose: str = "tail") -> Tail[T]:
    """What ``convert`` makes of the records of ``topics`` written at ``since_ms`` or
    later (None: any time), at most the last ``per_partition`` of each partition, and
    at most about ``budget`` in all (shared evenly, never under
    :data:`MIN_PER_PARTITION` a partition); None from ``convert`` drops a record. Each
    record is converted as it arrives, so only what is kept stays in memory. In no
    particular order."""
    consumer = _reader(config, purpose)
    try:
        places = [(topic, partition) for topic in topics
                  for partition in _partitions(consumer, topic, timeout_s)]
        if budget is not None and places:
            per_partition = min(per_partition, max(MIN_PER_PARTITION, budget // len(places)))
        ends: dict[Place, int] = {}
        starts: dict[Place, int] = {}
        for place in places:
            low, high = watermarks(consumer, TopicPartition(*place), timeout_s)
            if high > low:
                ends[place] = high
                starts[place] = max(low, high - per_partition)
        capped: set[Place] = set()
        if since_ms is not None:
            for place, offset in _time_offsets(consumer, list(starts), since_ms,
                                               timeout_s).items():
                first = ends[place] if offset < 0 else offset
                if first < starts[place]:
                    capped.add(place)
                starts[place] = max(starts[place], first)
        wanted = {place: start for place, start in starts.items() if start < ends[place]}
        kept: list[T] = []

        def keep(message: Message) -> bool:
            item = convert(message)
            if item is not None:
                kept.append(item)
            return False

        _scan(consumer, wanted, ends, timeout_s, keep)
        return Tail(kept, capped)
    finally:
        consumer.close()


def search(config: Config, topic: str, since_ms: int, accept: Callable[[Message], bool], *,
           partitions: Sequence[int] | None = None, scan: int = 10_000,
           timeout_s: float = TIMEOUT_S, purpose: str = "search") -> Message | None:
    """The first record of ``topic`` (of ``partitions`` only, when given) written at
    ``since_ms`` or later that ``accept`` takes, reading at most ``scan`` records a
    partition from there; None when there is none among them."""
    consumer = _reader(config, purpose)
    try:
        existing = _partitions(consumer, topic, timeout_s)
        places = [(topic, p) for p in existing if partitions is None or p in partitions]
        starts: dict[Place, int] = {}
        ends: dict[Place, int] = {}
        for place, offset in _time_offsets(consumer, places, since_ms, timeout_s).items():
            _, high = watermarks(consumer, TopicPartition(*place), timeout_s)
            if 0 <= offset < high:
                starts[place], ends[place] = offset, min(high, offset + scan)
        found = read_ranges(consumer, starts, ends, timeout_s, accept)
        return found[0] if found else None
    finally:
        consumer.close()


def last_of(config: Config, topic: str, partition: int, depth: int, *,
            timeout_s: float = TIMEOUT_S, purpose: str = "tail") -> list[Message]:
    """The last ``depth`` records of one partition of ``topic``, in offset order; none
    when the topic or the partition does not exist."""
    consumer = _reader(config, purpose)
    try:
        if partition not in _partitions(consumer, topic, timeout_s):
            return []
        place = (topic, partition)
        low, high = watermarks(consumer, TopicPartition(topic, partition), timeout_s)
        if high <= low:
            return []
        return read_ranges(consumer, {place: max(low, high - depth)}, {place: high}, timeout_s)
    finally:
        consumer.close()


def one(config: Config, topic: str, partition: int, offset: int, *,
        timeout_s: float = TIMEOUT_S, purpose: str = "record") -> Message | None:
    """The record of ``topic`` at ``partition``/``offset``, None when there is none (out
    of range, deleted by retention, no such partition or topic)."""
    consumer = _reader(config, purpose)
    try:
        if partition not in _partitions(consumer, topic, timeout_s):
            return None
        low, high = watermarks(consumer, TopicPartition(topic, partition), timeout_s)
        if not low <= offset < high:
            return None
        found = read_ranges(consumer, {(topic, partition): offset},
                            {(topic, partition): offset + 1}, timeout_s)
    finally:
        consumer.close()
    return next((message for message in found if message.offset() == offset), None)


def read_ranges(consumer: Consumer, starts: Mapping[Place, int], ends: Mapping[Place, int],
                timeout_s: float,
                accept: Callable[[Message], bool] | None = None) -> list[Message]:
    """The records of each place from ``starts`` up to ``ends`` (exclusive); with
    ``accept``, only the first record it takes (the read stops there)."""
    got: list[Message] = []

    def visit(message: Message) -> bool:
        if accept is None:
            got.append(message)
            return False
        if accept(message):
            got.append(message)
            return True
        return False

    _scan(consumer, starts, ends, timeout_s, visit)
    return got


def _scan(consumer: Consumer, starts: Mapping[Place, int], ends: Mapping[Place, int],
          timeout_s: float, visit: Callable[[Message], bool]) -> None:
    """Hand ``visit`` each record of each place from ``starts`` up to ``ends``
    (exclusive), until it answers True, every place is read (or at its end-of-partition
    event), or ``timeout_s`` has passed. Raises KafkaException for a failed fetch."""
    if not starts:
        return
    consumer.assign([TopicPartition(topic, partition, offset)
                     for (topic, partition), offset in starts.items()])
    open_places = set(starts)
    deadline = time.monotonic() + timeout_s
    while open_places and (left := deadline - time.monotonic()) > 0:
        for message in take(consumer, 500, min(left, 0.5), 0.05):
            place = (message.topic() or "", message.partition() or 0)
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    raise KafkaException(error)
                open_places.discard(place)
                continue
            offset = message.offset() or 0
            if offset + 1 >= ends.get(place, 0):
                open_places.discard(place)
            if offset < ends.get(place, 0) and visit(message):
                return
