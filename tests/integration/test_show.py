"""``kdelay show topic/partition/offset`` finds the entry from the record there.

The lookup reads the request record first and looks its entry up by its id or
by its own due key (:func:`kdelay.view.lookup.lookup`), instead of scanning
the index. Whatever became of a request (forwarded to its id's partition,
rescheduled, cancelled, a duplicate of a pending id, timed by a level), it
must answer as the scan of every key does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kdelay.client import DelayProducer, id_partition
from kdelay.engine.service import Service
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from kdelay.view.lookup import lookup
from kdelay.view.pending import Originals, PendingView
from tests.conftest import TopicFactory, produce_all
from tests.integration.conftest import Deployment, Running

Make = Callable[..., Deployment]
Run = Callable[[Deployment, ManualClock], Running]
PARTITIONS = 3
DELAY_MS = 600_000


def outcomes(service: Service) -> float:
    """Every request intake has taken, whatever its outcome."""
    return sum(sample.value for metric in service.metrics.registry.collect()
               if metric.name == "kdelay_intake_records"
               for sample in metric.samples if sample.name.endswith("_total"))


def request(partition: int, target: str, *headers: tuple[str, bytes]) -> dict[str, object]:
    return {"partition": partition, "key": b"k",
            "headers": [(envelope.TARGET, target.encode()), *headers]}


def off_home(sid: str) -> int:
    """A partition that is not ``sid``'s own: its schedule is forwarded."""
    return (id_partition(sid, PARTITIONS) + 1) % PARTITIONS


@pytest.mark.kafka
def test_show_by_coordinates_answers_as_the_scan_of_every_key(
    deployment_factory: Make, running: Run, topic_factory: TopicFactory, bootstrap: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    deployment = deployment_factory(partitions=PARTITIONS)
    target = topic_factory("target", 1)
    clock = ManualClock(int(time.time() * 1000))
    group = running(deployment, clock)
    service = group.add()
    due = str(clock.now_ms() + DELAY_MS).encode()
    home = {sid: id_partition(sid, PARTITIONS) for sid in ("fwd", "moved", "gone", "twin")}
    cases = {  # name: (request, pending at the end)
        "due-ms": (request(0, target, (envelope.DUE_MS, due)), True),
        "delay-ms": (request(1, target, (envelope.DELAY_MS, str(DELAY_MS).encode())), True),
        "level": (request(2, target, (envelope.LEVEL, b"2")), True),
        "forwarded": (request((home["fwd"] + 1) % PARTITIONS, target, (envelope.DUE_MS, due),
                              (envelope.SCHEDULE_ID, b"fwd")), True),
        "rescheduled": (request(home["moved"], target, (envelope.DUE_MS, due),
                                (envelope.SCHEDULE_ID, b"moved")), True),
        "cancelled": (request(home["gone"], target, (envelope.DUE_MS, due),
                              (envelope.SCHEDULE_ID, b"gone")), False),
        "twin": (request(home["twin"], target, (envelope.DUE_MS, due),
                         (envelope.SCHEDULE_ID, b"twin")), True),
        "duplicate": (request(home["twin"], target, (envelope.DUE_MS, due),
                              (envelope.SCHEDULE_ID, b"twin")), False),
        "rejected": (request(0, target, (envelope.DUE_MS, b"not a time")), False),
    }
    written = produce_all(Producer({"bootstrap.servers": bootstrap}), deployment.requests,
                          [{**made, "value": name.encode()} for name, (made, _) in cases.items()])
    group.until(lambda: outcomes(service) >= len(written))
    with DelayProducer(deployment.settings) as client:
        moved = client.reschedule("moved", due=clock.now_ms() + 2 * DELAY_MS).coordinates
        gone = client.cancel("gone").coordinates
    group.until(lambda: outcomes(service) >= len(written) + 3)  # the forward, the controls
    group.step(5)

    settings = deployment.settings
    places = {(r.value() or b"").decode(): (r.partition() or 0, r.offset() or 0)
              for r in written}
    places |= {"reschedule": (moved.partition, moved.offset),
               "cancel": (gone.partition, gone.offset)}
    found: dict[str, bool] = {}
    with PendingView(settings, tmp_path / "view", clock.now_ms()) as view, \
            Originals(settings) as originals:
        for name, (partition, offset) in places.items():
            reference = f"{deployment.requests}/{partition}/{offset}"
            scan = view.find(partition, offset)
            with monkeypatch.context() as patched:
                patched.setattr(view, "find", _no_scan)
                fast = lookup(view, originals, reference, settings.requests_topic,
                              clock.now_ms(), levels=settings.levels)
            assert fast.pending == scan, reference
            scanned = lookup(view, originals, reference, settings.requests_topic, clock.now_ms())
            assert scanned.pending == fast.pending, reference  # a level is found by scanning
            assert fast.original is not None, reference
            assert fast.original.record is not None, reference  # read, not scanned for
            found[name] = fast.pending is not None
    assert found == {
        **{name: pending for name, (_, pending) in cases.items()},
        "reschedule": False, "cancel": False}


def _no_scan(partition: int, offset: int) -> None:
    raise AssertionError(f"scanned the index for {partition}/{offset}")
