"""Outcome records: what the service made of a request with an id, read by its sender.

For every request that carries a schedule id (a schedule or a cancel) the
service writes an outcome record to the outcomes topic (``kdelay.outcomes``,
made by ``kdelay topics create``): key = the id (a request of a lane: the lane
and the id, :func:`~kdelay.protocol.idkeys.outcome_key`), value = a JSON object
(:class:`~kdelay.protocol.idkeys.Answer`), on the partition the id hashes to
(murmur2 of the id alone, as a Java producer places it as a key). Any producer
can read it.

A sender learns its own request's outcome with a :class:`Tracker`: it notes
the end of the id's outcome partition (:meth:`Tracker.mark`) *before* the
request is written, then reads from there for the record that names the
request's coordinates (:meth:`Tracker.wait`). Reading from the mark, not from
the beginning, makes waiting cost one partition's newest records, and the
mark taken first means the answer cannot be missed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import NamedTuple

from confluent_kafka import Consumer, KafkaError, TopicPartition

from kdelay.errors import KdelayError
from kdelay.plumbing.clients import reader_config, take, watermarks
from kdelay.protocol.forward import id_partition
from kdelay.protocol.idkeys import Answer, decode_answer, outcome_key

# Exit status of ``kdelay cancel --wait`` and ``kdelay send --wait`` per outcome.
EXIT_CODES: Mapping[str, int] = {
    "scheduled": 0, "cancelled": 0, "rescheduled": 0, "duplicate": 3, "unknown": 4,
    "already-delivered": 5, "dead-lettered": 6,
}
NO_OUTCOME_EXIT = 7
"""Exit status when no outcome arrived in time, or the outcomes topic is missing."""


class NoOutcome(KdelayError):
    """No outcome can be read: ``outcomes-missing`` (no outcomes topic),
    ``outcomes-unreadable`` (not allowed to read it) or ``no-outcome`` (none arrived in
    time: the service is not running, or is behind)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Mark(NamedTuple):
    """Where a request's outcome will be: the id's outcome partition, from this offset."""

    partition: int
    offset: int


class Tracker:
    """Reads outcome records of the outcomes ``topic`` (a group-less, read-committed reader).

    ``config`` is a librdkafka configuration (the deployment's client
    settings). Close it, or use it as a context manager.
    """

    def __init__(self, config: Mapping[str, str | int | bool], topic: str, *,
                 metadata_timeout: float = 10.0) -> None:
        self._consumer = Consumer(reader_config(config, f"kdelay-outcomes-{uuid.uuid4().hex}",
                                                **{"enable.partition.eof": False}))
        self._topic = topic
        self._timeout = metadata_timeout
        self._partitions: int | None = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the reader."""
        self._consumer.close()

    def mark(self, schedule_id: str) -> Mark:
        """Note where the next outcome of ``schedule_id`` will be; call before writing.

        Raises :class:`NoOutcome` ``outcomes-missing`` when the topic does not exist.
        """
        partition = id_partition(schedule_id, self._partition_count())
        _, high = watermarks(self._consumer, TopicPartition(self._topic, partition),
                             self._timeout)
        return Mark(partition, high)

    def wait(self, schedule_id: str, request: str, mark: Mark, timeout_s: float,
             lane: str | None = None) -> Answer:
        """Return the outcome of the request at ``request`` (``topic/partition/offset``),
        which named ``lane`` (None: no lane).

        Reads the id's outcome partition from ``mark`` until the record for
        this request arrives; raises :class:`NoOutcome` ``no-outcome`` after
        ``timeout_s`` seconds without it.
        """
        key = outcome_key(schedule_id, lane)
        self._consumer.assign([TopicPartition(self._topic, mark.partition, mark.offset)])
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                for message in take(self._consumer, 500, min(left, 0.5)):
                    if message.error() is not None or message.key() != key:
                        continue
                    try:
                        answer = decode_answer(message.value() or b"")
                    except ValueError:
                        continue
                    if answer.request == request:
                        return answer
        finally:
            self._consumer.unassign()
        raise NoOutcome("no-outcome", f"no outcome for {schedule_id} ({request}) within "
                        f"{timeout_s:g} s: is the kdelay service running and caught up?")

    def _partition_count(self) -> int:
        if self._partitions is None:
            metadata = self._consumer.list_topics(self._topic, timeout=self._timeout)
            found = metadata.topics.get(self._topic)
            error = None if found is None else found.error
            if error is not None and error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise NoOutcome("outcomes-unreadable", f"the outcomes topic {self._topic} "
                                f"cannot be read: {error.str()}")
            if found is None or not found.partitions or error is not None:
                raise NoOutcome("outcomes-missing", f"outcomes topic {self._topic} does not "
                                "exist: run `kdelay topics create` (it creates only the "
                                "missing topics)")
            self._partitions = len(found.partitions)
        return self._partitions
