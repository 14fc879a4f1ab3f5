"""The pure parts of the console's listing: due windows over sorted keys, route filters,
timeline sums. Whole listings over a synced view are tested in the browser tests,
against ``kdelay backlog``'s counts."""

from __future__ import annotations

from collections import Counter

import pytest

from kdelay.protocol import codec
from kdelay.view.listing import Filter, Timeline, bursts, window

KEYS = [codec.encode_due_key(due, partition, offset)
        for due, partition, offset in [(5, 1, 0), (10, 0, 3), (10, 1, 1), (20, 0, 4), (30, 2, 9)]]


@pytest.mark.parametrize(("low", "high", "expected"), [
    (None, None, [5, 10, 10, 20, 30]),
    (10, None, [10, 10, 20, 30]),
    (None, 10, [5, 10, 10]),
    (11, 29, [20]),
    (31, None, []),
    (-5, 4, []),
])
def test_a_due_window_keeps_both_ends(low: int | None, high: int | None,
                                      expected: list[int]) -> None:
    kept = window(KEYS, Filter(due_from_ms=low, due_to_ms=high))
    assert [codec.decode_due_key(key)[0] for key in kept] == expected


def test_route_filters_compare_target_and_lane() -> None:
    assert Filter().passes("orders", None)
    assert not Filter().routed
    chosen = Filter(target="orders", lane="dev1")
    assert chosen.routed
    assert chosen.passes("orders", "dev1")
    assert not chosen.passes("orders", None)
    assert not chosen.passes("payments", "dev1")


def test_a_timeline_sums_its_targets_per_bucket() -> None:
    found = Timeline(60_000, 5, {"a": {0: 2, 60_000: 1}, "b": {60_000: 1, 180_000: 1}})
    assert found.starts == [0, 60_000, 180_000]
    assert [found.count(start) for start in found.starts] == [2, 2, 1]


def test_a_bucket_is_marked_with_its_busiest_second_when_that_is_a_burst() -> None:
    seconds = Counter({0: 99, 61_000: 150, 62_000: 400, 63_000: 400, 3_600_000: 100})
    assert bursts(seconds, 60_000) == {60_000: (62_000, 400), 3_600_000: (3_600_000, 100)}
    assert bursts(seconds, 3_600_000) == {0: (62_000, 400), 3_600_000: (3_600_000, 100)}
    assert bursts(seconds, 60_000, minimum=1_000) == {}
