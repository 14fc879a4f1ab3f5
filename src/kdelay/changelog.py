"""The index changelog: a compacted topic that can rebuild any partition's index.

Record key = due key, value = encoded index value; a tombstone (value None)
when the entry is delivered, dead-lettered or cancelled. Partition ``p`` of the
changelog mirrors partition ``p`` of the requests topic. Payloads never go in.

Restore replays a changelog partition into a local index from the offset the
index says it has replayed up to (``CHANGELOG`` in its metadata; the whole
partition when the store is new). Replay is idempotent: re-applying a put or a
tombstone yields the same store. It reads with ``read_committed``, so effects of
transactions that never committed are skipped.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from kdelay import codec
from kdelay.codec import IdState
from kdelay.index import CHANGELOG, Changes, IndexCorrupt, PartitionIndex, store_path
from kdelay.polling import take
from kdelay.settings import Settings

log = logging.getLogger(__name__)

APPLY_EVERY = 50_000
Progress = Callable[[int, int], None]
PartitionProgress = Callable[[int, int, int], None]


class StaleIndex(Exception):
    """The index claims changelog offsets the changelog does not have (topic recreated)."""


class RestoreError(Exception):
    """The changelog could not be read to its end before the deadline."""


def reader_config(config: Mapping[str, str | int | bool]) -> dict[str, str | int | bool]:
    """Return a consumer configuration for replaying changelog partitions."""
    return {
        **config,
        "group.id": "kdelay-restore",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": True,
        "isolation.level": "read_committed",
        # Changelog records are ~70 bytes: fetch in large chunks, not the 1 MiB default.
        "max.partition.fetch.bytes": 16 * 1024 * 1024,
        "fetch.max.bytes": 64 * 1024 * 1024,
    }


class Restorer:
    """Replays changelog partitions into indexes with one group-less consumer."""

    def __init__(self, config: Mapping[str, str | int | bool], topic: str, *,
                 timeout_s: float = 600.0) -> None:
        self._consumer = Consumer(reader_config(config))
        self._topic = topic
        self._timeout_s = timeout_s

    def close(self) -> None:
        """Close the consumer."""
        self._consumer.close()

    def partitions(self) -> list[int]:
        """Return the changelog topic's partitions; :class:`RestoreError` if it is missing."""
        metadata = self._consumer.list_topics(self._topic, timeout=30)
        topic = metadata.topics.get(self._topic)
        if topic is None or topic.error is not None or not topic.partitions:
            raise RestoreError(f"changelog topic {self._topic} does not exist: run "
                               "`kdelay topics create`")
        return sorted(topic.partitions)

    def restore(self, index: PartitionIndex, progress: Progress | None = None) -> int:
        """Replay the changelog into ``index`` up to its current end; return records applied.

        Raises :class:`RestoreError` when the end is not reached within the
        timeout, and :class:`StaleIndex` when the index is past the changelog's
        end (the changelog was recreated): such an index must be rebuilt whole.
        """
        low, high = self._watermarks(index.partition)
        start = index.offset(CHANGELOG)
        if start is not None and start > high:
            raise StaleIndex(f"index at changelog offset {start}, changelog ends at {high}")
        begin = low if start is None or start < low else start
        if begin >= high:
            return 0
        tp = TopicPartition(self._topic, index.partition,
                            begin if start is not None else OFFSET_BEGINNING)
        self._consumer.assign([tp])
        try:
            return self._replay(index, begin, high, progress)
        finally:
            self._consumer.unassign()

    def _watermarks(self, partition: int) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(
            TopicPartition(self._topic, partition), timeout=30, cached=False)
        return int(low), int(high)

    def _replay(self, index: PartitionIndex, begin: int, high: int,
                progress: Progress | None) -> int:
        staged: dict[bytes, bytes | None] = {}
        applied = 0
        position = begin
        deadline = time.monotonic() + self._timeout_s
        while position < high:
            if time.monotonic() > deadline:
                raise RestoreError(f"{self._topic}[{index.partition}] stuck at {position}/{high}")
            for message in take(self._consumer, 10_000, 0.5):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        position = high
                        break
                    log.warning("restoring %s: %s", self._topic, error)
                    continue
                staged[message.key() or b""] = message.value()
                position = int(message.offset() or 0) + 1
            if len(staged) >= APPLY_EVERY or position >= high:
                applied += len(staged)
                _apply(index, staged, position)
                staged = {}
                if progress is not None:
                    progress(position - begin, high - begin)
        return applied


def _apply(index: PartitionIndex, staged: dict[bytes, bytes | None], position: int) -> None:
    """Write replayed records and the changelog position they reach in one batch."""
    changes = Changes(changelog=position)
    for key, raw in staged.items():
        if key == codec.CONSUMED_MARKER and raw is not None:
            changes.consumed = codec.decode_offset(raw)
            continue
        if len(key) != codec.DUE_KEY_SIZE:
            log.warning("changelog key of %d bytes ignored", len(key))
            continue
        if raw is None:
            old = index.get(key)
            if old is not None and old.schedule_id is not None:
                changes.ids[old.schedule_id] = None
            changes.deletes.append(key)
            continue
        try:
            schedule_id = codec.schedule_id_of(raw)
        except ValueError as exc:
            log.warning("changelog value for %r ignored: %s", key, exc)
            continue
        changes.raw_puts[key] = raw
        if schedule_id is not None:
            changes.ids[schedule_id] = IdState(key, None)
    index.apply(changes)


def open_restored(path: Path, partition: int, restorer: Restorer,
                  progress: Progress | None = None) -> tuple[PartitionIndex, int]:
    """Open the index at ``path`` and catch it up from the changelog; return it and the count.

    A corrupt store, or one past the changelog's end (the topic was
    recreated), is destroyed and rebuilt whole. :class:`IndexLocked` (another
    process holds the store) propagates: such a store is never touched.
    """
    for attempt in range(2):
        try:
            index = PartitionIndex(path, partition)
        except IndexCorrupt as exc:
            log.warning("%s; rebuilding it from the changelog", exc)
            PartitionIndex.destroy(path)
            index = PartitionIndex(path, partition)
        try:
            return index, restorer.restore(index, progress)
        except StaleIndex as exc:
            log.warning("partition %d: %s; rebuilding it whole", partition, exc)
            index.close()
            PartitionIndex.destroy(path)
            if attempt:
                raise
        except BaseException:
            index.close()
            raise
    raise AssertionError("unreachable")


def rebuild(settings: Settings, *, partitions: Sequence[int] | None = None,
            fresh: bool = False, progress: PartitionProgress | None = None) -> dict[int, int]:
    """Rebuild or catch up the local indexes of ``partitions`` (all when None) from the changelog.

    With ``fresh`` the local stores are deleted first and rebuilt whole.
    Returns the records replayed per partition. Raises :class:`IndexLocked`
    when a running service holds a store, and :class:`RestoreError` when the
    changelog topic does not exist.
    """
    restorer = Restorer(settings.client_config(), settings.changelog_topic)
    try:
        chosen = list(partitions) if partitions is not None else restorer.partitions()
        replayed: dict[int, int] = {}
        for partition in chosen:
            path = store_path(settings.state_dir, settings.requests_topic, partition)
            if fresh:
                PartitionIndex(path, partition).close()  # raises IndexLocked if in use
                PartitionIndex.destroy(path)
            step = None if progress is None else functools.partial(progress, partition)
            index, replayed[partition] = open_restored(path, partition, restorer, step)
            index.close()
        return replayed
    finally:
        restorer.close()


def confirmed_offset(message: Message) -> int:
    """Return the changelog position a successfully produced changelog record confirms."""
    return int(message.offset() or 0) + 1


class Positions:
    """Changelog positions confirmed by this instance's own writes, by partition.

    Every changelog record this instance writes reflects a change already made
    (or, for intake, made right after the flush that confirms it) to the local
    index, so the position after the latest confirmed record is a safe place
    for the next restore to start from.
    """

    def __init__(self) -> None:
        self._next: dict[int, int] = {}

    def confirm(self, message: Message) -> None:
        """Record a successfully produced changelog record."""
        partition = int(message.partition() or 0)
        self._next[partition] = max(self._next.get(partition, 0), confirmed_offset(message))

    def get(self, partition: int) -> int | None:
        """Return the confirmed position of ``partition``, or None if nothing was written."""
        return self._next.get(partition)
