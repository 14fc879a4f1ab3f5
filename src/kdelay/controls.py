"""Target controls for operators: pause, resume and cap deliveries to a target or a lane.

The functions here write the control records of :mod:`kdelay.protocol.controls`
to the controls topic and read them back; every running instance follows the
topic and applies a record within a step (``kdelay target pause orders``).
A change is read, modified and written: the record written keeps the other
controls of its subject (a pause keeps the cap). Two operators changing one
subject at the same moment may overwrite each other's change; the last
record written is in force, and ``kdelay target list`` shows it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from kdelay.errors import KdelayError
from kdelay.plumbing.settings import Settings
from kdelay.protocol.controls import (
    Control,
    ControlError,
    Pause,
    Scope,
    Subject,
    decode_control,
    decode_subject,
    encode_control,
)

TIMEOUT_S = 10.0
POLL_S = 0.1
"""How long one poll of the controls topic waits for records."""


class ControlsUnavailable(KdelayError):
    """The controls topic cannot be read or written (code ``controls-unavailable``)."""

    code = "controls-unavailable"


def subject_of(name: str, lane: bool, settings: Settings) -> Subject:
    """The subject named on the command line; ControlError for kdelay's own topics."""
    if not name:
        raise ControlError("name a target topic (or a lane with --lane)")
    if not lane and name in settings.reserved_topics:
        raise ControlError(f"{name} is one of kdelay's own topics, never a target")
    return Subject(Scope.LANE if lane else Scope.TARGET, name)


def holding(found: Mapping[Subject, Control], target: str | None,
            lane: str | None) -> str | None:
    """Say how the controls in ``found`` hold back a record to ``target`` (of ``lane``):
    ``paused since <time> by <who>: <why>``, ``capped at <n>/s``; None when none does."""
    said = []
    for subject in (None if target is None else Subject(Scope.TARGET, target),
                    None if lane is None else Subject(Scope.LANE, lane)):
        control = None if subject is None else found.get(subject)
        if subject is None or control is None:
            continue
        if control.paused is not None:
            since = datetime.fromtimestamp(control.paused.since_ms / 1000, tz=UTC)
            said.append(f"{subject} paused since {since:%Y-%m-%d %H:%M:%S} UTC by "
                        f"{control.paused.by or '?'}: {control.paused.reason or '-'}")
        elif control.rate_per_s is not None:
            said.append(f"{subject} capped at {control.rate_per_s:g}/s")
    return "; ".join(said) or None


def read_controls_or_none(settings: Settings) -> dict[Subject, Control]:
    """:func:`read_controls`, or no controls when the topic cannot be read (for views that
    only mention them)."""
    try:
        return read_controls(settings)
    except ControlsUnavailable:
        return {}


def read_controls(settings: Settings, timeout_s: float = TIMEOUT_S) -> dict[Subject, Control]:
    """Return every control in force: the controls topic read from the beginning to its end.

    Raises ControlsUnavailable when the topic is missing or not read in time;
    records that cannot be decoded are left out.
    """
    config: dict[str, str | int | bool] = {"group.id": "kdelay-controls",
                                           "enable.auto.commit": False}
    consumer = Consumer(settings.client_config("controls-reader", **config))
    try:
        topic = consumer.list_topics(settings.controls_topic, timeout=timeout_s).topics.get(
            settings.controls_topic)
        if topic is None or topic.error is not None:
            raise ControlsUnavailable(
                f"the controls topic {settings.controls_topic} does not exist; run "
                "`kdelay topics create`")
        return _read(consumer, settings.controls_topic, sorted(topic.partitions), timeout_s)
    except KafkaException as exc:
        raise ControlsUnavailable(str(exc.args[0])) from exc
    finally:
        consumer.close()


def _read(consumer: Consumer, topic: str, partitions: list[int],
          timeout_s: float) -> dict[Subject, Control]:
    """Read ``partitions`` of ``topic`` from the beginning to the end they had when asked.

    The end is reached when the consumer's position passes it, so offsets that
    compaction removed at the end do not keep it waiting. Reads in short polls:
    a topic of a few records is read in one broker round trip, not in
    ``timeout_s`` (``consume`` waits for its whole batch or its timeout).
    """
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)[1]
            for p in partitions}
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    found: dict[Subject, Control] = {}
    left = {p for p, end in ends.items() if end > 0}
    deadline = time.monotonic() + timeout_s
    while left:
        if time.monotonic() > deadline:
            raise ControlsUnavailable(f"the controls topic {topic} was not read in time")
        for message in consumer.consume(500, POLL_S):
            if message.error() is not None:
                continue
            try:
                found[decode_subject(message.key())] = decode_control(message.value())
            except ControlError:
                continue
        positions = consumer.position([TopicPartition(topic, p) for p in left])
        left -= {tp.partition for tp in positions if tp.offset >= ends[tp.partition]}
    return {subject: control for subject, control in found.items() if not control.empty}


def write_control(settings: Settings, subject: Subject, control: Control,
                  timeout_s: float = TIMEOUT_S) -> None:
    """Write ``subject``'s control record (a tombstone when it controls nothing) and wait
    for the broker's acknowledgement; ControlsUnavailable when it does not come."""
    producer = Producer(settings.client_config("controls-writer", **{"acks": "all"}))
    failures: list[str] = []

    def report(error: object, _message: object) -> None:
        if error is not None:
            failures.append(str(error))

    producer.produce(settings.controls_topic, key=subject.encode(),
                     value=encode_control(control), on_delivery=report)
    left = producer.flush(timeout_s)
    if left or failures:
        raise ControlsUnavailable(
            f"the control of {subject} was not written to {settings.controls_topic}: "
            f"{failures[0] if failures else 'no acknowledgement in time'}")


def pause(settings: Settings, subject: Subject, by: str, reason: str, now_ms: int) -> Control:
    """Pause ``subject`` (its other controls kept); return the control written."""
    current = read_controls(settings).get(subject, Control())
    since = current.paused.since_ms if current.paused is not None else now_ms
    control = dataclasses.replace(current, paused=Pause(since, by, reason),
                                  changed_ms=now_ms, changed_by=by)
    write_control(settings, subject, control)
    return control


def resume(settings: Settings, subject: Subject, by: str, now_ms: int,
           catch_up_per_s: float | None) -> Control:
    """Lift ``subject``'s pause; what it held goes out at ``catch_up_per_s`` (None: at its
    cap, or unbounded), then normally. Return the control written."""
    current = read_controls(settings).get(subject, Control())
    control = dataclasses.replace(current, paused=None, catch_up_per_s=catch_up_per_s,
                                  changed_ms=now_ms, changed_by=by)
    write_control(settings, subject, control)
    return control


def limit(settings: Settings, subject: Subject, by: str, now_ms: int,
          rate_per_s: float | None) -> Control:
    """Cap ``subject``'s deliveries at ``rate_per_s`` a second (None: lift the cap)."""
    current = read_controls(settings).get(subject, Control())
    control = dataclasses.replace(current, rate_per_s=rate_per_s, changed_ms=now_ms,
                                  changed_by=by)
    write_control(settings, subject, control)
    return control
