"""A cancel's outcome is the truth, even when it arrives at the due instant.

Schedules are produced in small groups with due times a few milliseconds
ahead, and their cancels right after the group is acknowledged, so cancels
reach ``kdelay run`` before, at and after the moment their entry comes due,
hundreds of times. Whatever the timing, an
id the service reports ``cancelled`` must never arrive at the target, and an
id it reports ``already-delivered`` must arrive.
"""

from __future__ import annotations

import functools
import random
import re
import time
from collections import Counter
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from kdelay.client import id_partition
from kdelay.protocol import envelope
from tests.conftest import TopicFactory, produce_all
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

OUTCOME = re.compile(r"request (cancelled|already-delivered|unknown): (race-\d+)")
COUNT = 400
GROUP = 10


def arrived(out: Receiver, keys: set[bytes]) -> bool:
    """Whether any record with one of ``keys`` has been received."""
    return any(r.message.key() in keys for r in out.received)


@pytest.mark.kafka
@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_cancels_at_the_due_instant_report_what_really_happened(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    guarantee: str,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("target", 1)
    service = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee)
    service.wait_ready()
    rng = random.Random(11)
    produce_requests(deployment, [])  # the service is warm: its partitions are assigned
    producer = Producer({"bootstrap.servers": deployment.bootstrap, "enable.idempotence": True,
                         "linger.ms": 1})
    out = receiver([target])
    for group in range(0, COUNT, GROUP):
        sids = [f"race-{i}" for i in range(group, group + GROUP)]
        group_keys = {sid.encode() for sid in sids}
        now = time.time_ns() // 1_000_000
        produce_all(producer, deployment.requests, [
            {"key": sid.encode(), "value": b"v", "partition": id_partition(sid, 3),
             "headers": [(envelope.TARGET, target.encode()),
                         (envelope.DUE_MS, str(now + rng.randint(-30, 40)).encode()),
                         (envelope.SCHEDULE_ID, sid.encode())]} for sid in sids])
        if group % (2 * GROUP):
            # Every other group: cancel once the first of it has arrived, so some
            # cancels come after a committed delivery (under exactly-once a
            # delivery takes one transaction more than its request's intake).
            out.until(functools.partial(arrived, out, group_keys), "a delivery of the group", 30)
        produce_all(producer, deployment.requests, [
            {"partition": id_partition(sid, 3), "headers": [(envelope.CANCEL, sid.encode())]}
            for sid in sids])

    def outcomes() -> dict[str, str]:
        return {sid: outcome for outcome, sid in OUTCOME.findall(service.log())}

    out.until(lambda: len(outcomes()) >= COUNT, "an outcome for every cancel", 90)
    reported = outcomes()
    late = {sid for sid, outcome in reported.items() if outcome == "already-delivered"}
    out.until(lambda: {(r.message.key() or b"").decode() for r in out.received} >= late,
              "every already-delivered id at the target", 60)
    out.drain(2.0)
    delivered = Counter((r.message.key() or b"").decode() for r in out.received)
    cancelled = {sid for sid, outcome in reported.items() if outcome == "cancelled"}
    print(f"{guarantee}: {len(cancelled)} cancelled, {len(late)} already delivered")
    assert set(reported) == {f"race-{i}" for i in range(COUNT)}
    assert cancelled.isdisjoint(delivered), sorted(cancelled & set(delivered))[:10]
    assert set(delivered) == late
    assert cancelled, "no cancel won its race: the test did not exercise cancelling"
    assert late, "no delivery won its race: the test did not exercise the due instant"
    if guarantee == "exactly-once":
        assert max(delivered.values()) == 1
