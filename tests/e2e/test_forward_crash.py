"""A SIGKILL between the two halves of a forwarded request loses and duplicates nothing.

Requests with ids are written to partition P of a two-partition requests
topic, as a producer keyed by a business key would, while their ids belong
to the other partition, Q. A plain consumer in kdelay's group holds Q, so
the ``kdelay run`` that owns P forwards the requests to Q and nobody indexes
the forwards. Half of the ids are then cancelled (on Q, where the client
library writes cancels), and kdelay is killed with SIGKILL. Once the
consumer leaves and kdelay restarts, it owns Q too (a rebalance moves Q to
it): every forward is indexed and every cancel applied. The ids not
cancelled arrive exactly once (exactly-once) or at least once
(at-least-once), none before its due time, and no cancelled id arrives.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Message, TopicPartition

from kdelay.client import id_partition
from kdelay.protocol import envelope
from kdelay.protocol.forward import FORWARD
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

COUNT = 40
DELAY_MS = 12_000
WAIT_S = 60.0


def holder(deployment: Deployment) -> Consumer:
    """A member of kdelay's group that holds the partitions it is given and does nothing."""
    consumer = Consumer({"bootstrap.servers": deployment.bootstrap,
                         "group.id": deployment.group_id, "enable.auto.commit": False,
                         "auto.offset.reset": "latest", "session.timeout.ms": 10_000})
    consumer.subscribe([deployment.requests])
    deadline = time.monotonic() + WAIT_S
    while not consumer.assignment():
        assert time.monotonic() < deadline, "the holder got no partition"
        consumer.poll(0.1)
    return consumer


def forwards_on(deployment: Deployment, partition: int) -> int:
    """How many committed forwards of schedules ``partition`` of the requests topic holds."""
    reader = Consumer({"bootstrap.servers": deployment.bootstrap,
                       "group.id": f"forwards-{uuid.uuid4().hex}", "enable.auto.commit": False,
                       "isolation.level": "read_committed", "enable.partition.eof": True})
    reader.assign([TopicPartition(deployment.requests, partition, 0)])
    found = 0
    try:
        while True:
            messages = reader.consume(1, timeout=5)
            assert messages, "no end of partition within 5 s"
            if messages[0].error() is not None:
                return found
            names = {name for name, _ in headers_of(messages[0])}
            found += FORWARD in names and envelope.CANCEL not in names
    finally:
        reader.close()


def committed_to_end(deployment: Deployment, partition: int) -> bool:
    """Whether kdelay's group has committed ``partition`` up to its end."""
    probe = Consumer({"bootstrap.servers": deployment.bootstrap,
                      "group.id": deployment.group_id, "enable.auto.commit": False})
    try:
        tp = TopicPartition(deployment.requests, partition)
        [committed] = probe.committed([tp], timeout=10)
        _, high = probe.get_watermark_offsets(tp, timeout=10)
        return bool(committed.offset == high)
    finally:
        probe.close()


def wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S}s"
        time.sleep(0.2)


def headers_of(message: Message) -> list[tuple[str, bytes | str | None]]:
    headers = message.headers() or []
    assert isinstance(headers, list)
    return headers


def due_of(message: Message) -> int:
    [due] = [v for name, v in headers_of(message) if name == envelope.DUE_MS]
    assert isinstance(due, bytes)
    return int(due)


@pytest.mark.kafka
@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_a_kill_between_forward_and_indexing_loses_nothing_and_keeps_cancels(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    guarantee: str,
) -> None:
    deployment = deploy(partitions=2)
    target = topic_factory("target", 1)
    first = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee)
    first.wait_ready()
    held = holder(deployment)
    [q] = [tp.partition for tp in held.assignment()]
    p = 1 - q
    wait(lambda: f"assigned [{p}]" in first.log(), "kdelay keeps only the other partition")
    sids = [sid for sid in (f"order-{n}" for n in range(1_000))
            if id_partition(sid, 2) == q][:COUNT]
    due = time.time_ns() // 1_000_000 + DELAY_MS
    produce_requests(deployment, [
        {"key": f"customer-{n}".encode(), "value": sid.encode(), "partition": p,
         "headers": [(envelope.TARGET, target.encode()), (envelope.DUE_MS, str(due).encode()),
                     (envelope.SCHEDULE_ID, sid.encode())]} for n, sid in enumerate(sids)])
    wait(lambda: forwards_on(deployment, q) == COUNT, "a forward per request on the id's partition")
    wait(lambda: committed_to_end(deployment, p), "the forwarded requests' offsets committed")
    cancelled = set(sids[::2])
    produce_requests(deployment, [
        {"partition": q, "value": sid.encode(), "headers": [(envelope.CANCEL, sid.encode())]}
        for sid in sorted(cancelled)])
    first.kill()  # the forwards are written, not one of them indexed
    held.close()

    out = receiver([target])
    second = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee)
    second.wait_ready()
    kept = set(sids) - cancelled
    out.until(lambda: {(r.message.value() or b"").decode() for r in out.on(target)} >= kept,
              "every id not cancelled delivered", 120)
    out.drain(3.0)
    delivered = Counter((r.message.value() or b"").decode() for r in out.on(target))
    assert set(delivered) == kept, sorted(set(delivered) & cancelled)
    assert all(r.message.timestamp()[1] >= due_of(r.message) == due for r in out.on(target)), \
        "a record came before its due time"
    assert all(r.received_ms >= due for r in out.on(target))
    if guarantee == "exactly-once":
        assert max(delivered.values()) == 1, delivered.most_common(3)
    assert "request cancelled" in second.log()
