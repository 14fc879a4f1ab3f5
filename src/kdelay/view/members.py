"""Which instances serve which request partitions, and how far intake is behind.

The service's instances are members of one consumer group (``--group-id``);
the group coordinator knows each member's assigned partitions, and the
group's committed offsets say how far intake has read. :func:`membership`
asks both, and the requests topic's high watermarks, so an operator sees
from anywhere who serves what and each partition's intake lag (records
written but not yet read and committed). Whether an instance is still
restoring its index is not visible from Kafka: it is in its metrics.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from kdelay.plumbing.clients import reader_config, watermarks
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import admin_client
from kdelay.view.pending import QUIET


@dataclass(frozen=True, slots=True)
class Member:
    """One instance: its static instance id (else its member id), client id, host, and
    the request partitions it is assigned."""

    name: str
    client_id: str
    host: str
    partitions: list[int]


@dataclass(frozen=True, slots=True)
class Membership:
    """The group's state, its members, and each request partition's intake lag (None
    when the group has committed no offset for it)."""

    state: str
    members: list[Member] = field(default_factory=list)
    lag: dict[int, int | None] = field(default_factory=dict)


def membership(settings: Settings, timeout_s: float = 10.0) -> Membership:
    """Describe the service's group (``settings.group_id``) on the requests topic.

    An unknown group is state ``unknown`` with no members. Raises
    KafkaException for other Kafka errors.
    """
    admin = admin_client(settings, log_level=QUIET)
    group, topic = settings.group_id, settings.requests_topic
    try:
        described = admin.describe_consumer_groups([group], request_timeout=timeout_s)[group] \
            .result(timeout=timeout_s)
    except KafkaException as exc:
        if exc.args and exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
            return Membership("unknown")
        raise
    members = sorted((_member(m, topic) for m in described.members or []),
                     key=lambda m: m.partitions)
    metadata = admin.list_topics(topic, timeout=timeout_s).topics.get(topic)
    count = 0 if metadata is None or metadata.error is not None else len(metadata.partitions)
    return Membership(str(described.state.name).lower(), members,
                      _lag(settings, admin, list(range(count)), timeout_s))


def _member(described: object, topic: str) -> Member:
    """A :class:`Member` from the client's ``MemberDescription``."""
    assigned = getattr(getattr(described, "assignment", None), "topic_partitions", None) or []
    name = getattr(described, "group_instance_id", None) or getattr(described, "member_id", "")
    return Member(str(name), str(getattr(described, "client_id", "")),
                  str(getattr(described, "host", "")),
                  sorted(tp.partition for tp in assigned if tp.topic == topic))


def _lag(settings: Settings, admin: AdminClient, partitions: list[int],
         timeout_s: float) -> dict[int, int | None]:
    """High watermark minus the group's committed offset, per request partition."""
    if not partitions:
        return {}
    group, topic = settings.group_id, settings.requests_topic
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in partitions])
    found = admin.list_consumer_group_offsets(
        [request], require_stable=False, request_timeout=timeout_s)[group].result(timeout_s)
    committed = {tp.partition: tp.offset for tp in found.topic_partitions or []}
    consumer = Consumer(reader_config(settings.client_config(),
                                      f"kdelay-members-{uuid.uuid4().hex}"))
    try:
        highs = {p: watermarks(consumer, TopicPartition(topic, p), timeout_s)[1]
                 for p in partitions}
    finally:
        consumer.close()
    return {p: (highs[p] - committed[p] if committed.get(p, -1) >= 0 else None)
            for p in partitions}
