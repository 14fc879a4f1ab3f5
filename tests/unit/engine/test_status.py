"""The status board: writes on change, at most every MIN_GAP_MS, at least every REFRESH_MS,
and a failed write is said once, never raised."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from kdelay.engine.runner import optional_topics
from kdelay.engine.status import MIN_GAP_MS, REFRESH_MS, StatusBoard
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import Layout
from kdelay.protocol.status import RESTORING, SERVING, PartitionStatus, decode

Report = Callable[[Any, Any], None]


class Producer:
    """Queues records; ``full`` makes produce raise BufferError; reports on poll."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes]] = []
        self.reports: list[Report] = []
        self.full = False
        self.error: Any = None
        self.snapshots = 0

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Report) -> None:
        if self.full:
            raise BufferError("queue full")
        self.records.append((topic, key, value))
        self.reports.append(on_delivery)

    def poll(self, _: float = 0) -> int:
        reports, self.reports = self.reports, []
        for report in reports:
            report(self.error, None)
        return len(reports)

    def flush(self, _: float = 0) -> int:
        self.poll()
        return 0


class Failed:
    def str(self) -> str:
        return "TOPIC_AUTHORIZATION_FAILED"


def _board() -> tuple[StatusBoard, Producer, dict[int, PartitionStatus]]:
    producer = Producer()
    return StatusBoard(producer, "kdelay.status", "host-1"), producer, {}  # type: ignore[arg-type]


def test_a_change_is_written_but_not_sooner_than_the_gap() -> None:
    board, producer, state = _board()
    state[0] = PartitionStatus(RESTORING, 0, 100)
    board.tick(1_000, lambda: state)
    state[0] = PartitionStatus(RESTORING, 50, 100)
    board.tick(1_000 + MIN_GAP_MS - 1, lambda: state)
    assert len(producer.records) == 1
    board.tick(1_000 + MIN_GAP_MS, lambda: state)
    state[0] = PartitionStatus(SERVING)
    board.tick(1_000 + 2 * MIN_GAP_MS, lambda: state)
    said = [decode(value) for _, _, value in producer.records]
    assert [s.partitions[0] for s in said] == [
        PartitionStatus(RESTORING, 0, 100), PartitionStatus(RESTORING, 50, 100),
        PartitionStatus(SERVING)]
    assert {(topic, key) for topic, key, _ in producer.records} == {("kdelay.status", b"host-1")}


def test_no_change_is_written_again_only_after_the_refresh() -> None:
    board, producer, state = _board()
    state[1] = PartitionStatus(SERVING)
    for now in range(0, REFRESH_MS, MIN_GAP_MS):
        board.tick(now, lambda: state)
    assert len(producer.records) == 1
    board.tick(REFRESH_MS, lambda: state)
    assert len(producer.records) == 2


def test_the_snapshot_is_not_taken_between_writes() -> None:
    board, _, state = _board()
    taken = []

    def snapshot() -> dict[int, PartitionStatus]:
        taken.append(1)
        return state

    for now in range(0, MIN_GAP_MS):
        board.tick(now, snapshot)
    assert len(taken) == 1


def test_failures_are_said_once_and_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    board, producer, state = _board()
    producer.full = True
    with caplog.at_level(logging.INFO, "kdelay.engine.status"):
        for step in range(5):
            state[0] = PartitionStatus(RESTORING, step, 10)
            board.tick(step * MIN_GAP_MS, lambda: state)
        producer.full, producer.error = False, Failed()
        for step in range(5, 10):
            state[0] = PartitionStatus(RESTORING, step, 10)
            board.tick(step * MIN_GAP_MS, lambda: state)
        producer.error = None
        state[0] = PartitionStatus(SERVING)
        board.tick(10 * MIN_GAP_MS, lambda: state)
        board.tick(11 * MIN_GAP_MS, lambda: state)
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "not written" in m]) == 1
    assert len([m for m in messages if "again" in m]) == 1


def test_a_stop_says_the_instance_serves_nothing() -> None:
    board, producer, state = _board()
    state[0] = PartitionStatus(SERVING)
    board.tick(0, lambda: state)
    board.close(5)
    assert decode(producer.records[-1][2]).partitions == {}
    board.tick(REFRESH_MS * 2, lambda: state)  # closed: nothing more
    assert len(producer.records) == 2


def test_without_the_topic_nothing_is_written() -> None:
    board = StatusBoard(None, "kdelay.status", "host-1")
    board.tick(0, lambda: {0: PartitionStatus(SERVING)})
    board.close(0)


def test_run_check_names_the_optional_topics_that_are_missing() -> None:
    settings = Settings()
    assert optional_topics(settings, Layout(3, None, outcomes=3, status=True)) == (
        "ok: kdelay.outcomes and kdelay.status are in place")
    missing = optional_topics(settings, Layout(3, None, outcomes=3))
    assert missing.startswith("warning: missing kdelay.status (no instance status")
    assert missing.endswith("run `kdelay topics create`")
    assert "kdelay.outcomes" in optional_topics(settings, Layout(3, None))
