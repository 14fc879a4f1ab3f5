"""The instance's status on the status topic: which partitions it serves, which it restores.

A :class:`StatusBoard` writes this instance's :class:`InstanceStatus` (see
:mod:`kdelay.protocol.status`) to the compacted status topic, keyed by its
group member id, when it changes and at least every :data:`REFRESH_MS`, but
never more often than every :data:`MIN_GAP_MS`: a restore reports its
progress about every two seconds, a steady instance a record every half a
minute. The console reads the topic to show, per request partition, serving
or restoring and how far.

It never slows the loop nor fails the service: :meth:`StatusBoard.tick` costs
a comparison between writes; a write is queued on a producer of its own
(never waited for); a write that fails (the topic is missing, not allowed,
Kafka away, the queue full) is logged once, and once more when writes
succeed again. The status is advice: the loop never depends on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Final

from confluent_kafka import KafkaError, KafkaException, Message

from kdelay.plumbing.clients import Producing
from kdelay.protocol.status import InstanceStatus, PartitionStatus, encode

log = logging.getLogger(__name__)

MIN_GAP_MS: Final = 2_000
"""The least time between two status records of one instance."""
REFRESH_MS: Final = 30_000
"""The most time between two status records of one running instance: the age of its
latest record tells a reader whether it still runs."""
PRODUCER_CONFIG: Final[dict[str, str | int | bool]] = {
    "enable.idempotence": False, "acks": 1, "linger.ms": 50, "message.timeout.ms": 10_000,
    "queue.buffering.max.messages": 100}
"""The status producer: few records, none waited for, none retried past the next one."""

Snapshot = Callable[[], Mapping[int, PartitionStatus]]


class StatusBoard:
    """Writes one instance's status to ``topic`` (see the module docstring).

    ``producer`` is None when the topic does not exist: then nothing is
    written and :meth:`tick` does nothing.
    """

    def __init__(self, producer: Producing | None, topic: str, instance: str) -> None:
        self._producer = producer
        self._topic = topic
        self._instance = instance
        self._last: dict[int, PartitionStatus] | None = None
        self._written_ms = 0
        self._next_ms = 0
        self._failing = False

    def tick(self, now_ms: int, snapshot: Snapshot) -> None:
        """Write the status ``snapshot`` gives if it changed since the last write (or
        :data:`REFRESH_MS` passed), at most every :data:`MIN_GAP_MS`; ``snapshot`` is
        called only when a write may be due."""
        producer = self._producer
        if producer is None or now_ms < self._next_ms:
            return
        self._next_ms = now_ms + MIN_GAP_MS
        producer.poll(0)
        found = dict(snapshot())
        if found == self._last and now_ms - self._written_ms < REFRESH_MS:
            return
        self._write(producer, InstanceStatus(self._instance, now_ms, found))

    def close(self, now_ms: int, timeout_s: float = 1.0) -> None:
        """Write that this instance serves nothing now (it stops), wait ``timeout_s`` at
        most for it and the writes before it, and let the producer go."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        self._write(producer, InstanceStatus(self._instance, now_ms, {}))
        left = producer.flush(timeout_s)
        if left:
            log.info("status: %d status record(s) not written at the stop", left)

    def _write(self, producer: Producing, status: InstanceStatus) -> None:
        """Queue ``status``; it counts as written (a failure is reported once, then the
        next change or refresh writes again)."""
        key, value = encode(status)
        try:
            producer.produce(self._topic, value, key, on_delivery=self._reported)
        except (BufferError, KafkaException) as exc:
            self._failed(str(exc))
            return
        self._last, self._written_ms = status.partitions, status.at_ms

    def _reported(self, error: KafkaError | None, _: Message) -> None:
        if error is not None:
            self._failed(error.str())
        elif self._failing:
            self._failing = False
            log.info("status: writing to %s again", self._topic)

    def _failed(self, why: str) -> None:
        if not self._failing:
            self._failing = True
            log.warning("status: not written to %s (%s); the console shows this instance's "
                        "partitions as unknown until a write succeeds (said once)",
                        self._topic, why)
