"""The console's background copy: loading, then a summary rebuilt aside, only when the view
changed, and reads that never wait for a rebuild.

No broker: the view is a stand-in that holds due keys and their cached routes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import cast

import pytest

from kdelay.plumbing.clock import ManualClock
from kdelay.protocol import codec
from kdelay.view.pending import Originals, PendingView, encode_route
from kdelay.web import snapshots as snapshots_module
from kdelay.web.problems import Problem
from kdelay.web.snapshots import Copy, Snapshots

Step = tuple[list[bytes], int] | Exception


class _Targets:
    def __init__(self, routes: dict[bytes, bytes]) -> None:
        self.routes = routes

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.routes.get(key) for key in keys]


class _View:
    """Partition 0: each sync takes the next step, the keys it then holds and the records
    it replayed (or the failure it raises)."""

    def __init__(self, steps: list[Step]) -> None:
        self.partitions = [0]
        self._steps = iter(steps)
        self._keys: list[bytes] = []
        self.targets = _Targets({})
        self.closed = False
        self.synced_at: list[int] = []
        self.streamed: list[int] = []  # the partitions whose keys a build read
        self.streaming = threading.Event()  # a build is reading the keys
        self.proceed = threading.Event()  # ...and may go on
        self.proceed.set()

    def sync(self, now_ms: int) -> dict[int, int]:
        self.synced_at.append(now_ms)
        step = next(self._steps)
        if isinstance(step, Exception):
            raise step
        self._keys, replayed = step
        self.targets.routes.update({key: encode_route("orders", None) for key in self._keys})
        return {0: replayed}

    def count(self, partition: int) -> int:
        return len(self._keys)

    def key_stream(self, partition: int) -> Iterator[bytes]:
        self.streamed.append(partition)
        keys = list(self._keys)
        self.streaming.set()
        assert self.proceed.wait(10), "the test never let the build go on"
        return iter(keys)

    def close(self) -> None:
        self.closed = True


class _Originals(AbstractContextManager["_Originals"]):
    def __exit__(self, *_: object) -> None:
        return None


def _snapshots(view: _View, clock: ManualClock) -> tuple[Snapshots, Copy]:
    copy = Copy(lambda _now: cast(PendingView, view))
    return Snapshots(copy, lambda: cast(Originals, _Originals()), clock), copy


def _keys(count: int) -> list[bytes]:
    return [codec.encode_due_key(1_000 + i, 0, i) for i in range(count)]


def test_before_the_first_summary_screens_are_told_it_is_loading() -> None:
    snapshots, _ = _snapshots(_View([]), ManualClock(5))
    with pytest.raises(Problem) as raised:
        snapshots.summary()
    assert (raised.value.status, raised.value.code) == (503, "view-loading")
    assert snapshots.freshness.as_of_ms is None


def test_a_refresh_builds_then_only_moves_the_as_of_when_nothing_changed() -> None:
    clock = ManualClock(5)
    view = _View([(_keys(3), 3), (_keys(3), 0), (_keys(4), 1)])
    snapshots, _ = _snapshots(view, clock)
    assert snapshots.refresh() is True
    assert snapshots.summary().total == 3
    assert snapshots.freshness.as_of_ms == 5
    clock.advance(10)
    assert snapshots.refresh() is False
    assert snapshots.summary().total == 3
    assert snapshots.freshness.as_of_ms == 15
    assert snapshots.refresh() is True
    assert snapshots.summary().total == 4
    assert view.synced_at == [5, 15, 15]  # one view, kept open and synced as of each time
    assert not view.closed
    snapshots.stop()
    assert view.closed
    assert snapshots.freshness.loading is None


def test_a_failed_sync_keeps_the_last_summary() -> None:
    clock = ManualClock(5)
    broken = RuntimeError("changelog unreadable")
    view = _View([(_keys(2), 2), broken, broken])
    snapshots, _ = _snapshots(view, clock)
    snapshots.refresh()
    for _ in range(2):
        with pytest.raises(RuntimeError):
            snapshots.refresh()
    assert snapshots.summary().total == 2
    assert not view.closed  # the copy stays open: the next sync goes on from it


def test_records_a_page_read_replayed_into_the_shared_view_are_counted_at_the_next_refresh(
) -> None:
    """A record or filtered-list page syncs the same copy itself: what it replayed is not
    new to the next refresh's own sync, yet is not in the summary. The page says so
    (``changed``), and the next refresh rebuilds."""
    clock = ManualClock(5)
    view = _View([(_keys(3), 3), (_keys(5), 0)])
    snapshots, _ = _snapshots(view, clock)
    assert snapshots.refresh() is True
    snapshots.changed()  # a page read replayed two more records into the copy
    clock.advance(10)
    assert snapshots.refresh() is True
    assert snapshots.summary().total == 5


def test_a_lookup_proceeds_while_a_rebuild_is_under_way_and_the_old_summary_is_shown() -> None:
    """The rebuild reads the copy without its lock: a read (which syncs the copy first, as
    every record page and lookup does) goes on while the build is held mid-way, and the
    screens count the last summary until the new one is swapped in."""
    clock = ManualClock(5)
    view = _View([(_keys(3), 3), (_keys(6), 3), (_keys(6), 0)])
    snapshots, copy = _snapshots(view, clock)
    assert snapshots.refresh() is True
    view.proceed.clear()
    view.streaming.clear()
    clock.advance(10)
    rebuild = threading.Thread(target=snapshots.refresh)
    rebuild.start()
    try:
        assert view.streaming.wait(10), "the rebuild never started reading"
        looked_up: list[PendingView] = []
        lookup = threading.Thread(target=lambda: looked_up.append(copy.synced(16)[0]))
        lookup.start()
        lookup.join(5)
        assert not lookup.is_alive(), "a lookup waited for the rebuild"
        assert [id(found) for found in looked_up] == [id(view)]
        assert snapshots.summary().total == 3  # the last summary, until the swap
        assert snapshots.freshness.loading == 0
    finally:
        view.proceed.set()
        rebuild.join(10)
    assert not rebuild.is_alive()
    assert snapshots.summary().total == 6
    assert snapshots.freshness.as_of_ms == 15


def test_a_build_gives_the_heap_back_after_each_partition(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    view = _View([(_keys(3), 3)])
    monkeypatch.setattr(snapshots_module, "_give_back",
                        lambda: built.append(len(view.streamed)))
    view.partitions = [0, 1, 2]
    snapshots, _ = _snapshots(view, ManualClock(5))
    assert snapshots.refresh() is True
    assert snapshots.summary().total == 9
    assert [0, 1, 2, 3] == sorted(set(built)), "before the build, after each partition"
