"""A schedule's trace: what the outcomes and audit topics say about one id, in time order.

Both topics key their records by schedule id and place them on the id's
partition (murmur2), so the trace of an id reads one partition of each, from
at most :data:`DEPTH` records before its end: a bounded read whatever the
topics' size. Older steps than that window are not shown (the page says how
far back it looked). The pending entry and its original (request and
scheduled steps) come from the operator's view, in :mod:`kdelay.web.reads`.

Deliveries are in neither topic: how an ended schedule ended (its target
record, its dead letter) is read by :class:`~kdelay.web.reads.Reads` from the
view's ended-id record and the target or DLQ (:mod:`kdelay.view.deliveries`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, Message

from kdelay.plumbing.clients import reader_config
from kdelay.plumbing.settings import Settings
from kdelay.protocol import codec, envelope
from kdelay.protocol.codec import End, IdState
from kdelay.protocol.forward import id_partition
from kdelay.protocol.idkeys import decode_answer, outcome_key
from kdelay.view import deadletters, deliveries, tails
from kdelay.view.display import span, utc
from kdelay.web.actions import decode_done

DEPTH = 5_000
TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a trace: when, what (``requested``, ``scheduled``, an outcome, an
    action of the console), and a sentence of detail."""

    at_ms: int
    what: str
    detail: str


def keyed(settings: Settings, topic: str, key: str, *, depth: int = DEPTH,
          timeout_s: float = TIMEOUT_S, record_key: bytes | None = None) -> list[bytes]:
    """The values of the last records keyed ``record_key`` (default: ``key`` as UTF-8)
    among the last ``depth`` of ``key``'s partition (murmur2 of the plain id, whatever
    its lane, as the service places outcomes).

    An absent topic gives no records. Raises KafkaException for other Kafka
    errors; stops at the partition's end as it was when the read began (or at
    its end-of-partition event: see :mod:`kdelay.view.tails`), or after ``timeout_s``.
    """
    config = settings.client_config()
    consumer = Consumer(reader_config(config, f"kdelay-web-{uuid.uuid4().hex}"))
    try:
        found = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            return []
        partition = id_partition(key, len(found.partitions))
    finally:
        consumer.close()
    wanted = key.encode() if record_key is None else record_key
    return [message.value() or b"" for message in tails.last_of(
        config, topic, partition, depth, timeout_s=timeout_s, purpose="web-trace")
            if message.key() == wanted and message.value() is not None]


def outcome_steps(settings: Settings, schedule_id: str, lane: str | None = None) -> list[Step]:
    """The service's outcome records for ``schedule_id`` in ``lane``, as steps: those
    keyed by the id's key in that lane (:func:`~kdelay.protocol.idkeys.outcome_key`),
    so another lane's schedule of the same id is not in the trace."""
    steps = []
    for raw in keyed(settings, settings.outcomes_topic, schedule_id,
                     record_key=outcome_key(schedule_id, lane)):
        try:
            answer = decode_answer(raw)
        except ValueError:
            continue
        detail = f"request {answer.request}"
        if answer.schedule:
            detail += f", schedule {answer.schedule}"
        if answer.first:
            detail += f" (then {answer.first})"
        steps.append(Step(answer.at_ms, answer.outcome, detail))
    return steps


def audit_steps(settings: Settings, audit_topic: str, schedule_id: str,
                lane: str | None = None) -> list[Step]:
    """The console's audit records for ``schedule_id`` in ``lane``, as steps (audit
    records are keyed by the plain id; their ``lane`` tells the lanes apart)."""
    steps = []
    for raw in keyed(settings, audit_topic, schedule_id):
        try:
            done = decode_done(raw)
        except ValueError:
            continue
        if done.lane != lane:
            continue
        outcome = done.outcome or f"no outcome ({done.outcome_error})"
        steps.append(Step(done.at_ms, f"console {done.action}",
                          f"by {done.who} ({done.role}): {done.reason!r} -> {outcome}"))
    return steps


@dataclass(frozen=True, slots=True)
class Ended:
    """How the schedule an id reference names ended, from the view's ended-id record:
    its lane, the state, and the request record (None: gone, or not read)."""

    lane: str | None
    state: IdState
    request: Message | None


def end_steps(settings: Settings, ended: Ended) -> list[Step]:
    """The steps of an ended schedule: its request, and how it ended: delivered (the
    target record: partition, offset, lateness), dead-lettered (the DLQ record's code),
    or cancelled. The target record is looked for from the due time on (a delivery is
    never earlier), the dead letter from the request's time on, each within the bounds
    of :func:`kdelay.view.tails.search`."""
    state = ended.state
    at_ms = state.ended_ms or 0
    if state.first_key is None:  # an old marker: it knows only a delivery time
        return [Step(at_ms, "delivered", "the service marked the id delivered")]
    due_ms, partition, offset = codec.decode_due_key(state.first_key)
    origin = envelope.origin_of(settings.requests_topic, partition, offset)
    record_ms = state.fingerprint.timestamp_ms if state.fingerprint else at_ms
    steps = [Step(record_ms, "requested", f"written at {origin}, due at {utc(due_ms)}")]
    if state.end is End.CANCELLED:
        return [*steps, Step(at_ms, "cancelled", "no longer pending: the cancel's request "
                             "and who sent it are in the outcome and audit steps")]
    if state.end is End.DEAD_LETTERED:
        return [*steps, _dead_letter_step(settings, origin, record_ms, at_ms)]
    target = None if ended.request is None else deliveries.header(ended.request,
                                                                  envelope.TARGET)
    if target is None:
        return [*steps, Step(at_ms, "delivered", "settled by the service; its request is "
                             "gone (retention), so its target is not known")]
    found = deliveries.find(settings.client_config(), settings.requests_topic, target,
                            origin, due_ms)
    if found is None:
        return [*steps, Step(at_ms, "delivered", f"settled by the service; its record was "
                             f"not found on {target} from its due time on")]
    return [*steps, Step(found.delivered_ms, "delivered",
                         f"to {found.target}/{found.partition}/{found.offset} "
                         f"(target offset {found.offset}), "
                         f"{span(found.lateness_ms)} after its due time")]


def _dead_letter_step(settings: Settings, origin: str, since_ms: int, at_ms: int) -> Step:
    """The dead-lettered step of the request at ``origin``: the DLQ record's code."""
    message = tails.search(settings.client_config(), settings.dlq_topic, since_ms,
                           lambda m: deliveries.header(m, envelope.ORIGIN) == origin,
                           purpose="dlq-search")
    if message is None:
        return Step(at_ms, "dead-lettered", "its DLQ record was not found")
    letter = deadletters.decode(message)
    return Step(letter.at_ms, "dead-lettered",
                f"{letter.code}: {letter.detail} (DLQ {letter.partition}/{letter.offset})")
