"""The console's background copy: loading, then a summary, rebuilt only when the view changed.

No broker: the view is a stand-in that holds due keys and their cached routes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, cast

import pytest

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import codec
from kdelay.view.pending import Originals, PendingView, encode_route
from kdelay.web.problems import Problem
from kdelay.web.snapshots import Snapshots


class _Targets:
    def __init__(self, routes: dict[bytes, bytes]) -> None:
        self.routes = routes

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.routes.get(key) for key in keys]


class _View:
    """Partition 0 holds ``keys``; a sync replays ``replay`` records (then nothing)."""

    def __init__(self, keys: list[bytes], replay: int, fail: Exception | None = None) -> None:
        self.partitions = [0]
        self._keys = keys
        self._replay = replay
        self._fail = fail
        self.targets = _Targets({key: encode_route("orders", None) for key in keys})
        self.closed = False

    def sync(self) -> dict[int, int]:
        if self._fail is not None:
            raise self._fail
        return {0: self._replay}

    def key_stream(self, partition: int) -> Iterator[bytes]:
        return iter(self._keys)

    def close(self) -> None:
        self.closed = True


class _Originals(AbstractContextManager["_Originals"]):
    def __exit__(self, *_: object) -> None:
        return None


def _snapshots(views: list[_View], clock: ManualClock) -> Snapshots:
    opened = iter(views)
    return Snapshots(lambda _now: cast(PendingView, next(opened)),
                     lambda: cast(Originals, _Originals()), threading.Lock(), clock)


def _keys(count: int) -> list[bytes]:
    return [codec.encode_due_key(1_000 + i, 0, i) for i in range(count)]


def test_before_the_first_summary_screens_are_told_it_is_loading() -> None:
    snapshots = _snapshots([], ManualClock(5))
    with pytest.raises(Problem) as raised:
        snapshots.summary()
    assert (raised.value.status, raised.value.code) == (503, "view-loading")
    assert snapshots.freshness.as_of_ms is None


def test_a_refresh_builds_then_only_moves_the_as_of_when_nothing_changed() -> None:
    clock = ManualClock(5)
    views = [_View(_keys(3), replay=3), _View(_keys(3), replay=0), _View(_keys(4), replay=1)]
    snapshots = _snapshots(views, clock)
    assert snapshots.refresh() is True
    assert snapshots.summary().total == 3
    assert snapshots.freshness.as_of_ms == 5
    clock.advance(10)
    assert snapshots.refresh() is False
    assert snapshots.summary().total == 3
    assert snapshots.freshness.as_of_ms == 15
    assert snapshots.refresh() is True
    assert snapshots.summary().total == 4
    assert all(view.closed for view in views)
    assert snapshots.freshness.loading is None


def test_a_failed_sync_keeps_the_last_summary() -> None:
    clock = ManualClock(5)
    broken = RuntimeError("changelog unreadable")
    views: list[Any] = [_View(_keys(2), 2), _View([], 0, broken), _View([], 0, broken)]
    snapshots = _snapshots(views, clock)
    snapshots.refresh()
    for view in views[1:]:
        with pytest.raises(RuntimeError):
            snapshots.refresh()
        assert view.closed
    assert snapshots.summary().total == 2


def test_records_a_page_read_replayed_into_the_shared_view_are_counted_at_the_next_refresh(
) -> None:
    """A record or filtered-list page syncs the same copy itself: what it replayed is not
    new to the next refresh's own sync, yet is not in the summary. The page says so
    (``changed``), and the next refresh rebuilds."""
    clock = ManualClock(5)
    views = [_View(_keys(3), replay=3), _View(_keys(5), replay=0)]
    snapshots = _snapshots(views, clock)
    assert snapshots.refresh() is True
    snapshots.changed()  # a page read replayed two more records into the copy
    clock.advance(10)
    assert snapshots.refresh() is True
    assert snapshots.summary().total == 5
