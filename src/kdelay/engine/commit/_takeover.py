"""Taking over partitions whose last owner died inside a transaction (exactly-once).

An instance that dies between sending its offsets to a transaction and
committing it leaves that transaction open. The group's committed offsets of
its partitions are then *unstable*: the new owner's read of them waits until
the transaction coordinator aborts the transaction, ``transaction.timeout.ms``
(40 s by default) plus up to the broker's abort check interval (10 s) later,
and the partitions are served that much later than one session timeout.

So under exactly-once every instance names itself in the metadata of the
offsets it commits (:func:`owner_metadata`). When the read of a new
assignment's committed offsets has no answer within :data:`PROBE_S`,
:meth:`Takeover.committed` looks up the last owner of each partition (the
stable offsets, which any read returns at once) and ends the open transaction
of every such owner that is no longer a member of the group: it takes the
owner's transactional id (``InitProducerId`` aborts the open transaction and
fences its producer). An owner still in the group is never fenced; nor is
an owner the metadata does not name (the read then waits, as before).

Until an instance commits a partition's offsets, their stable offsets name
the last owner, or nobody; were it to die inside its first transaction, the
next owner would wait out the timeout. So an instance takes up every
partition it is assigned by committing its offsets at once, on their own
(:meth:`~kdelay.engine.commit._checkpoint.ExactlyOnce.claim`, at :func:`positioned`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay.plumbing.clients import Consuming, Transacting, Watermarks, watermarks

log = logging.getLogger("kdelay.engine.commit")  # the wing, not its private module

OWNER_PREFIX = "kdelay-owner "
# How long a read of committed offsets may take before the takeover looks for a
# dead owner's transaction (such a read answers in milliseconds otherwise), and
# how often it looks again while the read waits.
PROBE_S = 3.0
# How long each admin request and the fencing of one transactional id may take.
CALL_S = 30.0


def owner_metadata(member_id: str, transactional_id: str) -> str:
    """The offset metadata naming the instance that commits it."""
    return f"{OWNER_PREFIX}{member_id} {transactional_id}"


def owner_of(metadata: str | None) -> tuple[str, str] | None:
    """``(member id, transactional id)`` named by offset metadata, or None."""
    if not metadata or not metadata.startswith(OWNER_PREFIX):
        return None
    member, _, transactional_id = metadata[len(OWNER_PREFIX):].partition(" ")
    return (member, transactional_id) if member and transactional_id else None


def owned(offsets: Iterable[TopicPartition], owner: str) -> list[TopicPartition]:
    """``offsets`` with ``owner`` (:func:`owner_metadata`) as their metadata."""
    return [TopicPartition(tp.topic, tp.partition, tp.offset, owner) for tp in offsets]


def positioned(consumer: Watermarks, partitions: list[TopicPartition]) -> list[TopicPartition]:
    """``partitions``, one without an offset yet (negative) at its low watermark, where the
    consumer starts; none when a low watermark is not known within :data:`CALL_S`."""
    try:
        return [tp if tp.offset >= 0 else TopicPartition(
            tp.topic, tp.partition, watermarks(consumer, tp, CALL_S)[0]) for tp in partitions]
    except KafkaException as exc:
        log.warning("partitions %s: their owner is not named before their first transaction: "
                    "%s", sorted(tp.partition for tp in partitions), exc.args[0].str())
        return []


class Takeover:
    """Reads a new assignment's committed offsets, ending a dead owner's transaction."""

    def __init__(self, group_id: str, transactional_id: str, admin: Callable[[], AdminClient],
                 producer: Callable[..., Transacting], *, transactions: bool = True) -> None:
        """``admin`` makes the admin client (on first need); ``producer`` makes a
        producer: ``(client_name, **librdkafka_overrides)``. Without ``transactions``
        (at-least-once: no instance commits offsets in a transaction) the offsets are
        read with one plain call of :data:`CALL_S`."""
        self._transactions = transactions
        self._group_id = group_id
        self._transactional_id = transactional_id
        self._make_admin = admin
        self._admin: AdminClient | None = None
        self._producer = producer

    def committed(self, consumer: Consuming, partitions: list[TopicPartition],
                  stopping: Callable[[], bool]) -> list[TopicPartition]:
        """The group's committed offsets of ``partitions``.

        Every read without an answer within :data:`PROBE_S` ends the open
        transactions of owners that left the group, then reads again; when
        there is none to end, it says once that the read waits for a
        transaction, and waits. Raises ``KafkaException`` when Kafka does not
        answer the lookups (an outage), or when asked to stop (``stopping``).
        """
        if not self._transactions:
            return consumer.committed(partitions, timeout=CALL_S)
        said = False
        while True:
            try:
                return consumer.committed(partitions, timeout=PROBE_S)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError._TIMED_OUT or stopping():
                    raise
            if self.end_dead_transactions(partitions) or said:
                continue
            said = True
            log.warning("partitions %s: their committed offsets are held by a transaction "
                        "left open by an owner that is not named or still in the group: "
                        "waiting until the transaction coordinator ends it (the owner's "
                        "transaction.timeout.ms)", sorted(tp.partition for tp in partitions))

    def end_dead_transactions(self, partitions: list[TopicPartition]) -> list[str]:
        """End the open transactions of the last owners of ``partitions`` that left the
        group; return their transactional ids."""
        admin = self._admin = self._admin or self._make_admin()
        request = ConsumerGroupTopicPartitions(
            self._group_id, [TopicPartition(tp.topic, tp.partition) for tp in partitions])
        found = admin.list_consumer_group_offsets([request], require_stable=False,
                                                  request_timeout=CALL_S)
        stable = found[self._group_id].result(timeout=CALL_S).topic_partitions or []
        owners: dict[tuple[str, str], list[int]] = {}
        for tp in stable:
            owner = owner_of(tp.metadata)
            if owner is not None and owner[1] != self._transactional_id:
                owners.setdefault(owner, []).append(tp.partition)
        if not owners:
            return []
        described = admin.describe_consumer_groups([self._group_id], request_timeout=CALL_S)
        members = described[self._group_id].result(timeout=CALL_S).members or []
        live = {member.group_instance_id for member in members}
        ended = []
        for (member, transactional_id), held in sorted(owners.items()):
            if member in live:
                continue
            self._producer("fence", **{"transactional.id": transactional_id}).init_transactions(
                CALL_S)
            log.warning("partitions %s: ended the transaction their last owner %s left open "
                        "(transactional id %s; it is no longer in the group): they are "
                        "served now, not after its transaction timeout", sorted(held),
                        member, transactional_id)
            ended.append(transactional_id)
        return ended
