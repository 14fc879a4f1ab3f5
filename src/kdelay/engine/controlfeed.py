"""The controls topic, followed: every instance reads every control record, from the start.

The controls topic is compacted and small (one record per controlled target
or lane), so each instance assigns itself all its partitions, with no group,
reads them from the beginning, and applies each record to delivery's
:class:`~kdelay.engine.delivery.Controls` as it arrives. :meth:`ControlFeed.catch_up`
reads up to the end the topic had at start before delivery sends anything, so
a pause holds across restarts and failovers; :meth:`ControlFeed.poll` then
follows it each step without waiting. A record that cannot be decoded is
skipped with one log line: a bad control never stops the service.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, Message, TopicPartition

from kdelay.engine.delivery import Controls
from kdelay.engine.metrics import ControlRow
from kdelay.plumbing.clients import take
from kdelay.plumbing.clock import Clock
from kdelay.protocol.controls import ControlError, Subject, decode_control, decode_subject

log = logging.getLogger(__name__)

CONTROLS_GROUP = "kdelay-controls"
"""The group id of the feed's consumer: it never joins nor commits, but a consumer names
one (the ACLs grant it Describe)."""
CATCH_UP_S = 30.0
"""How long :meth:`ControlFeed.catch_up` may take before the service gives up starting."""


class Following(Protocol):
    """What the feed asks of its (group-less) consumer."""

    def list_topics(self, topic: str, timeout: float = ...) -> Any:
        """Return the cluster's metadata for ``topic``."""
        ...

    def assign(self, partitions: list[TopicPartition]) -> None:
        """Fetch ``partitions`` from their given offsets."""
        ...

    def consume(self, num_messages: int = ..., timeout: float = ...) -> list[Message]:
        """Return up to ``num_messages`` messages, waiting up to ``timeout`` seconds."""
        ...

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = ...,
                              cached: bool = ...) -> tuple[int, int]:
        """Return the partition's low and high offsets."""
        ...

    def close(self) -> None:
        """Close the consumer."""
        ...


class ControlFeed:
    """Follows the controls topic into ``controls``."""

    def __init__(self, consumer: Following, topic: str, controls: Controls,
                 clock: Clock) -> None:
        self._consumer = consumer
        self._topic = topic
        self.controls = controls
        self._clock = clock
        self._partitions: list[int] = []

    def catch_up(self, timeout_s: float = CATCH_UP_S) -> bool:
        """Assign every partition from the beginning and read up to today's end.

        Returns False when the topic does not exist (no controls can be in
        force; logged once). Raises KafkaException when it exists but cannot
        be read (ACLs) or its end is not reached within ``timeout_s``:
        delivering before the pauses are known could send what a pause holds
        back.
        """
        metadata = self._consumer.list_topics(self._topic, timeout=timeout_s)
        topic = metadata.topics.get(self._topic)
        if topic is not None and topic.error is not None and (
                topic.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART):
            raise KafkaException(topic.error)  # not readable (ACLs): a pause could be missed
        if topic is None or topic.error is not None:
            log.warning("target controls are off: topic %s does not exist (run "
                        "`kdelay topics create`)", self._topic)
            return False
        self._partitions = sorted(topic.partitions)
        self._consumer.assign([TopicPartition(self._topic, p, OFFSET_BEGINNING)
                               for p in self._partitions])
        ends = {p: self._consumer.get_watermark_offsets(
            TopicPartition(self._topic, p), timeout=timeout_s)[1] for p in self._partitions}
        reached = dict.fromkeys(self._partitions, -1)
        deadline = self._clock.monotonic() + timeout_s
        while any(reached[p] + 1 < end for p, end in ends.items()):
            if self._clock.monotonic() > deadline:
                raise KafkaException(f"the controls topic {self._topic} was not read to its "
                                     f"end within {timeout_s:.0f} s")
            # The first record ends the wait (a consume of 500 would wait out its timeout
            # for fewer, on every start with a control in force).
            for message in take(self._consumer, 500, 0.2):
                if self._apply(message):
                    reached[message.partition() or 0] = message.offset() or 0
        return True

    def poll(self) -> int:
        """Apply the control records that arrived since the last call; never waits."""
        if not self._partitions:
            return 0
        applied = 0
        for message in self._consumer.consume(500, 0):
            applied += self._apply(message)
        return applied

    def _apply(self, message: Message) -> bool:
        """Apply one record; False for an error event (no record)."""
        if message.error() is not None:
            log.warning("controls topic %s: %s", self._topic, message.error())
            return False
        try:
            subject = decode_subject(message.key())
            control = decode_control(message.value())
        except ControlError as exc:
            log.warning("control record %s/%s/%s skipped (%s): %s", self._topic,
                        message.partition(), message.offset(), exc.code, exc)
            return True
        self.controls.apply(subject, control, self._clock.now_ms())
        if control.paused is not None:
            log.info("%s paused by %s since %d: %s", subject, control.paused.by,
                     control.paused.since_ms, control.paused.reason)
        return True

    def rows(self, held: dict[Subject, tuple[int, int | None]]) -> list[ControlRow]:
        """The gauges' rows: every controlled subject with what it holds back here
        (``held``: count and oldest due time, see ``Delivery.held_back``)."""
        rows = []
        for subject, control in self.controls.subjects.items():
            count, oldest = held.get(subject, (0, None))
            rows.append(ControlRow(subject.scope.value, subject.name, count, oldest,
                                   self.controls.rate_of(subject),
                                   None if control.paused is None else control.paused.since_ms))
        return rows

    def close(self) -> None:
        """Close the consumer."""
        self._consumer.close()
