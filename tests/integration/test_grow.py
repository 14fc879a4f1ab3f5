"""More request partitions: ``kdelay topics grow`` moves every id to its new home.

An id lives on ``murmur2(id) mod partitions``. After the requests topic grows,
the client library writes an id's cancel, duplicate or reschedule to its home
under the new count. The instances are stopped, ``kdelay topics grow`` runs,
and they start again: every pending id and every ended id must be found at
its new home, nothing delivered twice or lost. Both guarantees, a manual clock.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from kdelay.client import DelayProducer, id_partition
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.plumbing.settings import Guarantee, Settings
from tests.conftest import TopicFactory
from tests.e2e.conftest import clean_environment, run_cli
from tests.integration.conftest import Collector, Deployment, Running

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
Collect = Callable[[list[str]], Collector]
BEFORE, AFTER = 2, 5
ANSWERS = ("scheduled", "cancelled", "rescheduled", "duplicate", "unknown", "already-delivered")


def answered(service: Service) -> float:
    """Requests with an id the service answered (forwards are not answers)."""
    registry = service.metrics.registry
    return sum(registry.get_sample_value("kdelay_intake_records_total", {"outcome": o}) or 0.0
               for o in ANSWERS)


def cli_env(settings: Settings) -> dict[str, str]:
    return clean_environment(
        KDELAY_BOOTSTRAP_SERVERS=settings.bootstrap_servers,
        KDELAY_REQUESTS_TOPIC=settings.requests_topic,
        KDELAY_CHANGELOG_TOPIC=settings.changelog_topic, KDELAY_DLQ_TOPIC=settings.dlq_topic,
        KDELAY_OUTCOMES_TOPIC=settings.outcomes_topic, KDELAY_GROUP_ID=settings.group_id,
        KDELAY_STATE_DIR=str(settings.state_dir))


@pytest.mark.kafka
def test_every_id_finds_its_schedule_after_the_requests_topic_grows(
    deployment_factory: Make, running: Run, collector: Collect, topic_factory: TopicFactory,
) -> None:
    # A short session: a stopped (static) member leaves the group sooner.
    deployment = deployment_factory(partitions=BEFORE, session_timeout_ms=3_000)
    settings = deployment.settings
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    due = clock.now_ms() + 60_000
    ids = [f"order-{n}" for n in range(12)]
    assert any(id_partition(sid, BEFORE) != id_partition(sid, AFTER) for sid in ids)
    out = collector([target])

    before = running(deployment, clock)
    service = before.add()
    with DelayProducer(settings) as client:
        for sid in ids:
            client.schedule(target, sid, id=sid, key=sid, due=due)
        for n in range(4):
            client.send(target, "plain", key=f"plain-{n}", due=due)
        client.schedule(target, "done", id="done-0", key="done-0", due=clock.now_ms())
        client.schedule(target, "cancel me", id="cancel-0", key="cancel-0", due=due)
    before.until(lambda: answered(service) >= len(ids) + 2 and out.poll() >= 1)
    with DelayProducer(settings) as client:
        client.cancel("cancel-0")
    before.until(lambda: answered(service) >= len(ids) + 3)
    shrink = run_cli(cli_env(settings), "topics", "grow", "--partitions", "1")
    assert (shrink.returncode, shrink.stderr.split(":")[0]) == (2, "error[cannot-shrink]")
    if settings.guarantee is Guarantee.AT_LEAST_ONCE:  # once is enough: it waits a session
        busy = run_cli(cli_env(settings), "topics", "grow", "--partitions", str(AFTER))
        assert busy.returncode == 2, busy.stderr
        assert "error[instances-running]" in busy.stderr
    before.close()

    grown = run_cli(cli_env(settings), "topics", "grow", "--partitions", str(AFTER),
                    timeout_s=120)
    assert grown.returncode == 0, grown.stderr
    assert f"requests {settings.requests_topic}: {BEFORE} -> {AFTER} partitions" in grown.stdout
    assert f"changelog {settings.changelog_topic}: {BEFORE} -> {AFTER} partitions" in (
        grown.stdout)

    after = running(deployment, clock)
    service = after.add()
    with DelayProducer(settings) as client:  # places each id by the new count
        cancels = [client.cancel(sid) for sid in ids[:6]]
        moves = [client.reschedule(sid, due=due - 30_000) for sid in ids[6:9]]
        again = [client.schedule(target, "again", id=sid, key=sid, due=due) for sid in ids[9:]]
        again.append(client.schedule(target, "done", id="done-0", key="done-0",
                                     due=clock.now_ms()))
        cancel_again = client.cancel("cancel-0")
        assert {ticket.coordinates.partition for ticket in cancels} - set(range(BEFORE)), (
            "some cancels went to the new partitions")
    after.until(lambda: answered(service) >= 14)
    assert [t.outcome(30).outcome for t in cancels] == ["cancelled"] * 6
    assert [t.outcome(30).outcome for t in moves] == ["rescheduled"] * 3
    assert [(t.outcome(30).outcome, t.outcome(30).first) for t in again] == [
        ("duplicate", "pending")] * 3 + [("duplicate", "delivered")]
    assert cancel_again.outcome(30).outcome == "cancelled"

    clock.advance(61_000)
    expected = Counter([b"done-0", *(sid.encode() for sid in ids[6:]),
                        *(f"plain-{n}".encode() for n in range(4))])
    after.until(lambda: out.poll() >= sum(expected.values()))
    after.step(20)
    out.poll(1.0)
    assert Counter(m.key() for m in out.on(target)) == expected, "each once, none cancelled"
