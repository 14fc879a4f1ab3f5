"""Partitions whose exactly-once owner died inside a transaction are served within seconds.

The transaction such an owner leaves open holds the group's committed offsets
of its partitions: without kdelay's takeover the next owner would wait for the
transaction coordinator to abort it, the dead producer's
``transaction.timeout.ms`` (here five minutes) plus the broker's abort check
interval. The dead owner is played by a process that does what a kdelay
instance does (kdelay's offset metadata, a committed transaction, then one
left open with a request in it) and is killed with SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay.engine.commit._takeover import owner_of
from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.e2e.conftest import (
    FAILOVER_S,
    Deployment,
    KdelayProcess,
    Receiver,
    produce_requests,
)

kafka = pytest.mark.kafka
DEAD_TRANSACTION_TIMEOUT_MS = 300_000

DEAD_OWNER = """
import os, signal, sys
from confluent_kafka import Consumer, Producer, TopicPartition
from kdelay.engine.commit._takeover import owner_metadata
from kdelay.protocol import envelope

bootstrap, group, requests, target = sys.argv[1:5]
transactional_id = f"kdelay-{group}-dead-host"
metadata = owner_metadata("dead-host", transactional_id)
consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id,
                     "transaction.timeout.ms": int(sys.argv[5])})
producer.init_transactions(30)
offsets = [TopicPartition(requests, p, 0, metadata) for p in range(3)]
producer.begin_transaction()
producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
producer.commit_transaction(30)
producer.begin_transaction()
producer.produce(requests, key=b"aborted", value=b"v", partition=0,
                 headers=[(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"0")])
producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
producer.flush(30)
print("transaction left open", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@kafka
def test_partitions_whose_dead_owner_left_a_transaction_open_are_served_within_seconds(
    deploy: Callable[..., Deployment], start_kdelay: Callable[..., KdelayProcess],
    receiver: Callable[[list[str]], Receiver], topic_factory: TopicFactory, tmp_path: Path,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("target", 3)
    dead = subprocess.run(
        [sys.executable, "-c", DEAD_OWNER, deployment.bootstrap, deployment.group_id,
         deployment.requests, target, str(DEAD_TRANSACTION_TIMEOUT_MS)],
        capture_output=True, text=True, check=False, timeout=120)
    assert "transaction left open" in dead.stdout, dead.stderr
    produce_requests(deployment, [
        {"key": f"k{i}".encode(), "value": b"v", "partition": i % 3,
         "headers": [(envelope.TARGET, target.encode()), (envelope.DELAY_MS, b"0")]}
        for i in range(30)])
    service = start_kdelay(deployment, KDELAY_GUARANTEE="exactly-once",
                           KDELAY_STATE_DIR=str(tmp_path / "state"))
    serving_s = service.wait_ready(timeout_s=120)
    out = receiver([target])
    out.until(lambda: out.poll() >= 30, "every request delivered", 60)
    out.drain(2.0)
    print(f"serving {serving_s:.2f} s after start, past the dead owner's open transaction")
    assert serving_s < FAILOVER_S, service.tail()
    seen = Counter(r.message.key() for r in out.received)
    assert set(seen) == {f"k{i}".encode() for i in range(30)}, "the aborted request is not"
    assert max(seen.values()) == 1
    log = service.log()
    assert log.count("ended the transaction their last owner dead-host left open") == 1, log
    assert "Kafka is unreachable" not in log
    assert service.terminate() == 0


@kafka
def test_an_instance_names_itself_the_owner_of_its_partitions_before_any_work(
    deploy: Callable[..., Deployment], start_kdelay: Callable[..., KdelayProcess],
    admin: AdminClient, tmp_path: Path,
) -> None:
    """Were it to die inside its first transaction, the next owner could end it at once.

    Without the claim, a partition nothing was consumed from has no committed
    offset, and one whose last owner left names that owner: the next owner
    would wait out the dead instance's transaction timeout.
    """
    deployment = deploy(partitions=3)
    service = start_kdelay(deployment, KDELAY_GUARANTEE="exactly-once",
                           KDELAY_STATE_DIR=str(tmp_path / "state"))
    service.wait_ready()
    request = ConsumerGroupTopicPartitions(
        deployment.group_id, [TopicPartition(deployment.requests, p) for p in range(3)])
    found = admin.list_consumer_group_offsets([request], require_stable=True,
                                              request_timeout=30)
    offsets = found[deployment.group_id].result(timeout=30).topic_partitions or []
    owners = {tp.partition: (tp.offset, owner_of(tp.metadata)) for tp in offsets}
    assert set(owners) == {0, 1, 2}
    named = {owner for _, owner in owners.values()}
    assert None not in named, owners
    assert len(named) == 1, owners
    assert all(offset == 0 for offset, _ in owners.values()), "claimed where it starts"
    assert service.terminate() == 0
