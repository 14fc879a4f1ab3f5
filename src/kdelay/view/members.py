"""Which instances serve which request partitions, and how far intake is behind.

The service's instances are members of one consumer group (``--group-id``);
the group coordinator knows each member's assigned partitions, and the
group's committed offsets say how far intake has read. :func:`membership`
asks both, and the requests topic's high watermarks, so an operator sees
from anywhere who serves what and each partition's intake lag (records
written but not yet read and committed). Whether a partition's index is
still being restored from the changelog, and how far, each instance says in
its records on the status topic (:mod:`kdelay.protocol.status`):
:func:`partition_states` joins them to the group's assignment.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from kdelay.plumbing.clients import reader_config, watermarks
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import admin_client
from kdelay.protocol.status import SERVING, InstanceStatus, StatusError, decode
from kdelay.view import tails
from kdelay.view.pending import QUIET

STATUS_READ = 2_000
"""The most status records read: the newest ones (each instance writes one at least every
30 s, so this holds the latest of every instance of any plausible deployment)."""
STALE_MS = 90_000
"""A status older than this is shown as stale: its instance may have stopped."""
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Member:
    """One instance: its static instance id (else its member id), client id, host, and
    the request partitions it is assigned."""

    name: str
    client_id: str
    host: str
    partitions: list[int]


@dataclass(frozen=True, slots=True)
class PartitionState:
    """What is known of one request partition's index: ``serving``, ``restoring`` (``done``
    of ``total`` changelog offsets replayed; ``total`` None before the replay begins) or
    ``unknown`` (``why``); the instance that said so, and when (its clock)."""

    state: str
    done: int = 0
    total: int | None = None
    instance: str | None = None
    as_of_ms: int | None = None
    why: str | None = None

    @property
    def percent(self) -> float | None:
        """How far a restore has got, 0-100 (None: not restoring, or the total unknown)."""
        if not self.total:
            return None
        return min(100.0, 100.0 * self.done / self.total)


@dataclass(frozen=True, slots=True)
class Membership:
    """The group's state, its members, and each request partition's intake lag (None
    when the group has committed no offset for it)."""

    state: str
    members: list[Member] = field(default_factory=list)
    lag: dict[int, int | None] = field(default_factory=dict)
    partitions: dict[int, PartitionState] = field(default_factory=dict)


def membership(settings: Settings, timeout_s: float = 10.0) -> Membership:
    """Describe the service's group (``settings.group_id``) on the requests topic.

    Each partition's state comes from the status topic (:func:`statuses`): a
    missing or unreadable status topic leaves every partition ``unknown``, never an
    error. An unknown group is state ``unknown`` with no members. Raises
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
    said, why = statuses(settings, admin, timeout_s)
    return Membership(str(described.state.name).lower(), members,
                      _lag(settings, admin, list(range(count)), timeout_s),
                      partition_states(members, said, count, why))


def statuses(settings: Settings, admin: AdminClient,
             timeout_s: float) -> tuple[dict[str, InstanceStatus], str | None]:
    """The latest status of each instance on the status topic (the newest
    :data:`STATUS_READ` records read), and None; or no status and why not (the topic
    is missing or cannot be read). Records that are no status are skipped."""
    topic = settings.status_topic
    try:
        metadata = admin.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return {}, f"the status topic {topic} does not exist (run `kdelay topics create`)"
        read = tails.newest(settings.client_config(), [topic], _status,
                            per_partition=STATUS_READ, timeout_s=timeout_s, purpose="status")
    except KafkaException as exc:
        return {}, f"the status topic {topic} cannot be read: {exc.args[0]}"
    latest: dict[str, InstanceStatus] = {}
    for found in read.items:
        known = latest.get(found.instance)
        if known is None or found.at_ms >= known.at_ms:
            latest[found.instance] = found
    return latest, None


def _status(message: Message) -> InstanceStatus | None:
    try:
        return decode(message.value())
    except StatusError:
        return None


def partition_states(members: list[Member], said: dict[str, InstanceStatus], count: int,
                     why: str | None = None) -> dict[int, PartitionState]:
    """Each of ``count`` request partitions' state: as the member the group assigns it
    says in its latest status (``said``, by instance), else ``unknown`` and why
    (``why`` when there is no status at all)."""
    owners = {partition: member.name for member in members for partition in member.partitions}
    found: dict[int, PartitionState] = {}
    for partition in range(count):
        owner = owners.get(partition)
        status = None if owner is None else said.get(owner)
        entry = None if status is None else status.partitions.get(partition)
        if owner is None:
            found[partition] = PartitionState(UNKNOWN, why="no instance is assigned it")
        elif status is None or entry is None:
            found[partition] = PartitionState(UNKNOWN, instance=owner, why=why or (
                f"{owner} has not said yet" if status is None
                else f"{owner}'s status does not name it yet"))
        else:
            found[partition] = PartitionState(entry.state, entry.done if entry.state != SERVING
                                              else 0, entry.total, owner, status.at_ms)
    return found


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
