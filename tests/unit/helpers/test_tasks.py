"""Task registry, task calls and the worker's handling of one record; no broker."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
import pytest
from confluent_kafka import Message

from kdelay import client, tasks
from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import envelope
from kdelay.protocol.durations import Limits
from kdelay.protocol.envelope import Cancel, Schedule
from kdelay.recurring import Every, Series
from kdelay.retry import Failed
from kdelay.tasks import Registry, TaskRejected, Worker, WorkerTopics

REGISTRY = Registry()
RUNS: list[tuple[str, int]] = []


@REGISTRY.task("remind", schema={"user": str, "times": int})
def remind(user: str, times: int) -> None:
    """Record the call, and the occurrence it belongs to."""
    series = tasks.context().series
    RUNS.append((user, series.n if series else 0))


@REGISTRY.task("explode")
def explode() -> None:
    """Always fails."""
    raise RuntimeError("boom")


NOT_A_REGISTRY = object()
LIMITS = Limits((1,), None)


@dataclass
class Markers:
    """Cancel markers held in memory: ids whose series end."""

    ended: set[str] = field(default_factory=set)
    caught_up: int = 0

    def catch_up(self) -> None:
        self.caught_up += 1

    def ends(self, series: Series) -> bool:
        return series.schedule_id in self.ended


@pytest.fixture
def markers() -> Markers:
    return Markers()


@pytest.fixture
def worker(markers: Markers) -> Worker:
    RUNS.clear()
    return Worker(REGISTRY, WorkerTopics(), "kdelay.requests", 3, markers, ManualClock(10_000))


def delivered(topic: str, value: bytes, series: Series | None = None,
              due_ms: int = 10_000) -> Message:
    headers: list[tuple[str, str | bytes | None]] = [("trace", b"t")]
    if series is not None:
        headers.append(("kdelay.series", series.encode()))
    headers += [("kdelay-origin", b"kdelay.requests/0/4"),
                ("kdelay-due-ms", str(due_ms).encode())]
    return Message(topic=topic, partition=0, offset=4, key=b"k", value=value, headers=headers)


def call(name: str, **args: object) -> bytes:
    return tasks.encode_call(name, args)


def test_call_round_trip_and_strict_json() -> None:
    assert tasks.decode_call(call("remind", user="ann", times=2)) == (
        "remind", {"user": "ann", "times": 2})
    with pytest.raises(ValueError, match="JSON"):
        tasks.encode_call("remind", {"at": object()})
    with pytest.raises(ValueError, match="JSON"):
        tasks.encode_call("remind", {"at": __import__("datetime").date(2026, 1, 1)})


@pytest.mark.parametrize("value", [b"\x80\x04pickle", b"[1]", b'{"task": 3}', b"",
                                   b'{"task": "remind", "args": [1]}'])
def test_undecodable_call_is_rejected(value: bytes) -> None:
    with pytest.raises(TaskRejected) as caught:
        tasks.decode_call(value)
    assert caught.value.code == "bad-call"


def test_schema_checks_names_and_types() -> None:
    task = REGISTRY.get("remind")
    task.check({"user": "ann", "times": 1})
    for args in ({"user": "ann"}, {"user": "ann", "times": "1"},
                 {"user": "ann", "times": True}, {"user": "ann", "times": 1, "x": 0}):
        with pytest.raises(TaskRejected) as caught:
            task.check(args)
        assert caught.value.code == "bad-arguments"


def test_registry_refuses_a_name_twice_and_names_unknown_ones() -> None:
    with pytest.raises(ValueError, match="twice"):
        REGISTRY.task("remind")(lambda: None)
    with pytest.raises(TaskRejected, match="explode, remind"):
        REGISTRY.get("nope")


def test_load_registry_imports_only_the_named_object() -> None:
    assert tasks.load_registry("tests.unit.helpers.test_tasks:REGISTRY") is REGISTRY
    for reference, message in (("tests.unit.helpers.test_tasks", "module:object"),
                               ("no_such_module_xyz:r", "cannot import"),
                               ("tests.unit.helpers.test_tasks:MISSING", "has no"),
                               ("tests.unit.helpers.test_tasks:NOT_A_REGISTRY", "not a kdelay")):
        with pytest.raises(tasks.RegistryError, match=message):
            tasks.load_registry(reference)


def test_a_task_call_runs_once(worker: Worker) -> None:
    assert worker.handle(delivered("kdelay.tasks", call("remind", user="ann", times=1))) == []
    assert RUNS == [("ann", 0)]


def test_unknown_task_is_rejected(worker: Worker) -> None:
    with pytest.raises(TaskRejected) as caught:
        worker.handle(delivered("kdelay.tasks", call("nope")))
    assert caught.value.code == "unknown-task"


def test_an_occurrence_runs_and_schedules_the_next(worker: Worker) -> None:
    series = Series("s1", Every(1_000, 10_000), start_ms=9_000, count=3)
    [request] = worker.handle(delivered("kdelay.tasks", call("remind", user="ann", times=1),
                                        series))
    assert RUNS == [("ann", 1)]
    assert request.partition == client.id_partition("s1~", 3)
    assert envelope.parse(request.headers, 0, LIMITS) == Schedule("kdelay.tasks", 11_000,
                                                                  None, "s1~")
    following = [v for n, v in request.headers if n == "kdelay.series"]
    assert isinstance(following[0], bytes)
    assert orjson.loads(following[0])["n"] == 2
    assert request.value == call("remind", user="ann", times=1)


def test_a_failed_occurrence_still_schedules_the_next(worker: Worker) -> None:
    series = Series("s2", Every(1_000, 10_000), start_ms=9_000)
    with pytest.raises(Failed) as caught:
        worker.handle(delivered("kdelay.tasks", call("explode"), series))
    assert isinstance(caught.value.cause, RuntimeError)
    assert [r.topic for r in caught.value.outgoing] == ["kdelay.requests"]


def test_the_last_occurrence_schedules_nothing(worker: Worker) -> None:
    series = Series("s3", Every(1_000, 10_000), start_ms=9_000, n=3, count=3)
    assert worker.handle(delivered("kdelay.tasks", call("remind", user="a", times=1),
                                   series)) == []
    assert worker.settle() == []


def test_a_plain_occurrence_is_forwarded_to_its_target(worker: Worker) -> None:
    series = Series("p1", Every(1_000, 10_000), start_ms=9_000, target="orders", partition=1)
    request, forward = worker.handle(delivered("kdelay.series", b"payload", series))
    assert request.topic == "kdelay.requests"
    assert (forward.topic, forward.partition, forward.key, forward.value) == (
        "orders", 1, b"k", b"payload")
    assert [n for n, _ in forward.headers] == ["trace", "kdelay-origin", "kdelay-due-ms"]


def test_a_series_cancelled_before_its_occurrence_is_dropped(worker: Worker,
                                                             markers: Markers) -> None:
    markers.ended.add("s4")
    series = Series("s4", Every(1_000, 10_000), start_ms=9_000)
    assert worker.handle(delivered("kdelay.tasks", call("remind", user="a", times=1),
                                   series)) == []
    assert RUNS == []


def test_a_cancel_racing_the_occurrence_cancels_the_next_one(worker: Worker,
                                                             markers: Markers) -> None:
    """The marker shows up only after the next occurrence was written: settle cancels it."""
    series = Series("s5", Every(1_000, 10_000), start_ms=9_000)
    [request] = worker.handle(delivered("kdelay.tasks", call("remind", user="a", times=1),
                                        series))
    markers.ended.add("s5")
    [cancel] = worker.settle()
    assert markers.caught_up == 1
    assert envelope.parse(cancel.headers, 0, LIMITS) == Cancel("s5~")
    assert cancel.partition == request.partition
    assert worker.settle() == []
