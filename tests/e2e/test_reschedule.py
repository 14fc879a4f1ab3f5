"""A reschedule racing the due instant moves the entry or reports it delivered, never both.

Like the cancel race (test_cancel.py), on the real broker through ``kdelay run``:
schedules go out in small groups due a few milliseconds ahead, and a reschedule
of each follows at once (every other group: once the first of the group
arrived), so reschedules reach the service before, at and after the moment
their entry comes due, hundreds of times. An id reported ``rescheduled`` must
arrive only at its new due time (its ``kdelay-due-ms`` is the new one, and it
arrives no earlier); an id reported ``already-delivered`` must arrive at its
old due time and never again at the new one.
"""

from __future__ import annotations

import functools
import random
import re
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from kdelay.client import id_partition
from kdelay.protocol import envelope
from tests.conftest import TopicFactory, produce_all
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests
from tests.e2e.test_cancel import arrived

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

OUTCOME = re.compile(r"request (rescheduled|already-delivered|unknown): (moved-\d+)\b")
COUNT = 300
GROUP = 10
MOVE_MS = 3_000


def due_of(headers: list[tuple[str, bytes]] | None) -> int:
    """The ``kdelay-due-ms`` a delivered record carries."""
    return int(dict(headers or [])[envelope.DUE_MS] or b"")


@pytest.mark.kafka
@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_reschedules_at_the_due_instant_move_the_entry_or_report_it_delivered(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    guarantee: str,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("target", 1)
    service = start_kdelay(deployment, KDELAY_GUARANTEE=guarantee)
    service.wait_ready()
    rng = random.Random(13)
    produce_requests(deployment, [])  # the service is warm: its partitions are assigned
    producer = Producer({"bootstrap.servers": deployment.bootstrap, "enable.idempotence": True,
                         "linger.ms": 1})
    out = receiver([target])
    new_due: dict[str, int] = {}
    for group in range(0, COUNT, GROUP):
        sids = [f"moved-{i}" for i in range(group, group + GROUP)]
        now = time.time_ns() // 1_000_000
        produce_all(producer, deployment.requests, [
            {"key": sid.encode(), "value": b"v", "partition": id_partition(sid, 3),
             "headers": [(envelope.TARGET, target.encode()),
                         (envelope.DUE_MS, str(now + rng.randint(-30, 40)).encode()),
                         (envelope.SCHEDULE_ID, sid.encode())]} for sid in sids])
        if group % (2 * GROUP):
            out.until(functools.partial(arrived, out, {sid.encode() for sid in sids}),
                      "a delivery of the group", 30)
        moved = time.time_ns() // 1_000_000 + MOVE_MS
        new_due.update(dict.fromkeys(sids, moved))
        produce_all(producer, deployment.requests, [
            {"partition": id_partition(sid, 3),
             "headers": envelope.reschedule_headers(sid, due_ms=moved)} for sid in sids])

    def outcomes() -> dict[str, str]:
        return {sid: outcome for outcome, sid in OUTCOME.findall(service.log())}

    out.until(lambda: len(outcomes()) >= COUNT, "an outcome for every reschedule", 90)
    reported = outcomes()
    out.until(lambda: {(r.message.key() or b"").decode() for r in out.received} >= set(reported),
              "every id at the target", 60)
    out.drain(MOVE_MS / 1000 + 2.0)
    deliveries: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in out.received:
        deliveries[(r.message.key() or b"").decode()].append(
            (due_of(r.message.headers()), r.message.timestamp()[1]))  # type: ignore[arg-type]
    rescheduled = {sid for sid, outcome in reported.items() if outcome == "rescheduled"}
    late = {sid for sid, outcome in reported.items() if outcome == "already-delivered"}
    print(f"{guarantee}: {len(rescheduled)} rescheduled, {len(late)} already delivered")
    assert set(reported) == {f"moved-{i}" for i in range(COUNT)}
    assert rescheduled | late == set(reported), "no reschedule found its id unknown"
    for sid in rescheduled:
        assert {due for due, _ in deliveries[sid]} == {new_due[sid]}, (sid, deliveries[sid])
        assert all(at >= new_due[sid] for _, at in deliveries[sid]), (sid, deliveries[sid])
    for sid in late:
        assert new_due[sid] not in {due for due, _ in deliveries[sid]}, (sid, deliveries[sid])
    assert rescheduled, "no reschedule won its race: the test did not exercise moving"
    assert late, "no delivery won its race: the test did not exercise the due instant"
    if guarantee == "exactly-once":
        assert max(len(found) for found in deliveries.values()) == 1
