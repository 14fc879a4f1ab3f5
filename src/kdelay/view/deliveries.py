"""Deliveries as an operator reads them: from the delivered records themselves.

Every record kdelay delivers carries ``kdelay-origin`` (the request's
``topic/partition/offset``) and ``kdelay-due-ms``, and has the delivery time as
its timestamp (docs/protocol.md, "Delivered records"). A target's newest
records therefore say, with no record of kdelay's own, what was delivered,
where (target partition and offset), when, and how late: the delivery time
minus the due time. Records a target holds that kdelay did not deliver (no
``kdelay-origin`` naming the requests topic) are skipped.

:func:`latest` reads the newest deliveries of some targets (a bounded read:
see :mod:`kdelay.view.tails`), :func:`find` the delivery of one request,
:func:`lateness` sums deliveries up per target. The delivered record holds no
schedule id (kdelay's headers are removed on delivery); :func:`named` reads
the ids from the requests, while the requests topic still holds them.

Reading costs the service nothing (its hot path writes no extra record), but
it reads the targets' records, payloads included: the console needs ``Read``
on the targets it shows, and a target that receives many records besides
kdelay's shows fewer deliveries within the same bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from confluent_kafka import Message

from kdelay.protocol import envelope
from kdelay.view import tails
from kdelay.view.tails import Config

PER_PARTITION = 200
"""How many of each target partition's newest records the screens read at most."""
BUDGET = 50_000
"""How many target records a screen reads at most in all, whatever the targets'
partitions (each partition gets its share, see :func:`kdelay.view.tails.newest`): a
delivery kept costs a small object, its record's payload is dropped as it is read."""
SCAN = 10_000
"""How many records of each target partition :func:`find` reads at most from the due time."""
EDGES_MS = (0, 10, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000)
"""Lower bounds (ms) of the lateness histogram's bins; the last takes everything above,
and a bin below 0 (early: never, if all is well) is kept apart."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One record kdelay delivered: where it lies on its target, when it was delivered
    (its timestamp) and due, which request it came from (``origin``), and, once
    :func:`named`, the schedule id and lane of that request."""

    target: str
    partition: int
    offset: int
    delivered_ms: int
    due_ms: int
    origin: str
    schedule_id: str | None = None
    lane: str | None = None

    @property
    def lateness_ms(self) -> int:
        """Delivery time minus due time (negative: early, which must never happen)."""
        return self.delivered_ms - self.due_ms

    def request(self, requests_topic: str) -> tuple[int, int] | None:
        """The request's ``(partition, offset)`` on ``requests_topic``, None when the
        origin names another topic."""
        topic, _, rest = self.origin.rpartition("/")
        topic, _, partition = topic.rpartition("/")
        if topic != requests_topic or not (partition.isdigit() and rest.isdigit()):
            return None
        return int(partition), int(rest)


def decode(message: Message, requests_topic: str) -> Delivery | None:
    """The :class:`Delivery` a target record is, None for a record kdelay did not
    deliver from ``requests_topic`` (no origin naming it, or no due time)."""
    origin: str | None = None
    due: int | None = None
    headers = message.headers() or []
    for name, raw in headers.items() if isinstance(headers, dict) else headers:
        if name == envelope.ORIGIN and raw is not None:
            origin = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        elif name == envelope.DUE_MS and raw is not None:
            text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
            due = int(text) if text.isdigit() else None
    if origin is None or due is None or not origin.startswith(f"{requests_topic}/"):
        return None
    _, stamp = message.timestamp()
    return Delivery(message.topic() or "", message.partition() or 0, message.offset() or 0,
                    stamp, due, origin)


@dataclass(frozen=True, slots=True)
class Latest:
    """The newest deliveries read, newest first, and the targets whose window the read's
    bound cut short (older deliveries of the window were not read)."""

    deliveries: list[Delivery]
    capped: set[str] = field(default_factory=set)


def latest(config: Config, requests_topic: str, targets: Sequence[str], *,
           since_ms: int | None = None, per_partition: int = PER_PARTITION,
           budget: int = BUDGET, timeout_s: float = tails.TIMEOUT_S) -> Latest:
    """The deliveries among the newest records of ``targets`` (since ``since_ms`` when
    given; at most ``per_partition`` records of each partition and about ``budget`` in
    all: see :func:`kdelay.view.tails.newest`), newest first."""
    read = tails.newest(config, targets, lambda message: decode(message, requests_topic),
                        per_partition=per_partition, budget=budget, since_ms=since_ms,
                        timeout_s=timeout_s, purpose="deliveries")
    found = read.items
    found.sort(key=lambda d: (d.delivered_ms, d.target, d.partition, d.offset), reverse=True)
    return Latest(found, {topic for topic, _ in read.capped})


def find(config: Config, requests_topic: str, target: str, origin: str, due_ms: int, *,
         scan: int = SCAN, timeout_s: float = tails.TIMEOUT_S) -> Delivery | None:
    """The delivery to ``target`` of the request at ``origin`` (``topic/partition/offset``)
    due at ``due_ms``: read from the due time on (a delivery is never earlier), at most
    ``scan`` records of each partition. None when none of them is it."""
    wanted = origin.encode()

    def is_it(message: Message) -> bool:
        headers = message.headers() or []
        pairs = headers.items() if isinstance(headers, dict) else headers
        return any(name == envelope.ORIGIN and (raw == wanted or raw == origin)
                   for name, raw in pairs)

    message = tails.search(config, target, due_ms, is_it, scan=scan, timeout_s=timeout_s,
                           purpose="delivery")
    return None if message is None else decode(message, requests_topic)


def named(deliveries: Sequence[Delivery], requests_topic: str,
          requests: Mapping[tuple[int, int], Message]) -> list[Delivery]:
    """``deliveries`` with the schedule id and lane their requests (``requests``, by
    ``(partition, offset)``) carry; a delivery whose request is not there keeps none."""
    shown = []
    for delivery in deliveries:
        place = delivery.request(requests_topic)
        record = None if place is None else requests.get(place)
        if record is None:
            shown.append(delivery)
            continue
        schedule_id = header(record, envelope.SCHEDULE_ID)
        shown.append(replace(delivery, schedule_id=schedule_id,
                             lane=header(record, envelope.LANE)))
    return shown


def header(record: Message, name: str) -> str | None:
    """The first value of header ``name`` of ``record`` as text, None when absent."""
    headers = record.headers() or []
    for key, raw in headers.items() if isinstance(headers, dict) else headers:
        if key == name and raw is not None:
            return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return None


HOUR_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class Lateness:
    """The lateness of one target's deliveries (in one hour, from ``hour_ms``, when
    summed per hour): how many, how many early (must be 0), percentiles (nearest rank,
    ms), and the count in each bin of :data:`EDGES_MS`."""

    target: str
    count: int
    early: int
    p50_ms: int
    p95_ms: int
    p99_ms: int
    max_ms: int
    bins: list[int]
    hour_ms: int | None = None


def percentile(ordered: Sequence[int], q: float) -> int:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of non-empty ``ordered`` values."""
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def bin_of(lateness_ms: int) -> int:
    """The index of the :data:`EDGES_MS` bin that holds ``lateness_ms`` (-1: early)."""
    if lateness_ms < 0:
        return -1
    at = 0
    for index, edge in enumerate(EDGES_MS):
        if lateness_ms >= edge:
            at = index
    return at


def lateness(deliveries: Iterable[Delivery], *, by_hour: bool = False) -> list[Lateness]:
    """Each target's :class:`Lateness` over ``deliveries``, by target name; with
    ``by_hour``, one per target and hour of delivery (UTC), newest hour first."""
    groups: dict[tuple[str, int | None], list[int]] = {}
    for delivery in deliveries:
        hour = delivery.delivered_ms // HOUR_MS * HOUR_MS if by_hour else None
        groups.setdefault((delivery.target, hour), []).append(delivery.lateness_ms)
    ordered = sorted(groups.items(), key=lambda item: (-(item[0][1] or 0), item[0][0]))
    return [_summed(target, values, hour) for (target, hour), values in ordered]


def _summed(target: str, values: list[int], hour_ms: int | None) -> Lateness:
    """The :class:`Lateness` of ``values`` (not empty), sorted here."""
    values.sort()
    bins = [0] * len(EDGES_MS)
    early = 0
    for value in values:
        at = bin_of(value)
        if at < 0:
            early += 1
        else:
            bins[at] += 1
    return Lateness(target, len(values), early, percentile(values, 50), percentile(values, 95),
                    percentile(values, 99), values[-1], bins, hour_ms)
