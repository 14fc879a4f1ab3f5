"""Runs (due entries held as columns) and merging their due slices in key order."""

from __future__ import annotations

import itertools
import random

import pytest

from kdelay.engine.delivery._runs import Run, merged
from kdelay.protocol import codec


def run_of(partition: int, keys: list[bytes]) -> Run:
    return Run(partition, sorted(keys), [b""] * len(keys), [None] * len(keys))  # type: ignore[list-item]


def key(due: int, partition: int, offset: int) -> bytes:
    return codec.encode_due_key(due, partition, offset)


def flatten(slices: list[tuple[Run, int, int]]) -> list[bytes]:
    return [run.keys[at] for run, start, end in slices for at in range(start, end)]


def test_slices_that_follow_each_other_come_out_whole() -> None:
    """A burst: one due time over three partitions, each a run of its own."""
    runs = [run_of(p, [key(1_000, p, o) for o in range(100)]) for p in (2, 0, 1)]
    out = list(merged([(run, 0, 100) for run in runs]))
    assert [(run.partition, start, end) for run, start, end in out] == [
        (0, 0, 100), (1, 0, 100), (2, 0, 100)]


@pytest.mark.parametrize("seed", range(20))
def test_interleaved_slices_come_out_in_key_order_each_entry_once(seed: int) -> None:
    rng = random.Random(seed)
    runs = [run_of(p, [key(rng.randrange(50), p, o) for o in range(rng.randrange(1, 30))])
            for p in range(4)]
    slices = []
    for run in runs:
        start = rng.randrange(len(run.keys))
        slices.append((run, start, rng.randrange(start, len(run.keys) + 1)))
    out = list(merged(slices))
    keys = flatten(out)
    expected = sorted(itertools.chain.from_iterable(
        run.keys[start:end] for run, start, end in slices))
    assert keys == expected
    assert all(start < end for _, start, end in out)


def test_the_cursors_step_over_entries_taken_out() -> None:
    run = run_of(0, [key(10, 0, o) for o in range(5)])
    run.take(0)
    run.take(2)
    assert run.unsent_key() == key(10, 0, 1)
    assert list(run.live(0, 5)) == [1, 3, 4]
    assert run.position(key(10, 0, 2)) is None, "taken out"
    assert run.position(key(10, 0, 3)) == 3
    run.sent = run.landed = 2
    assert run.first_pending() == key(10, 0, 3), "landed, and 2 is the book's"
    run.indexed_to = 0
    assert run.first_pending() == key(10, 0, 1), "not indexed: not done until settled"
    assert run.due_end(key(11, 0, 0)) == 5
    assert run.below(key(10, 0, 3)) == 3


def test_the_indexed_prefix_grows_only_over_entries_in_the_index() -> None:
    run = run_of(0, [key(10, 0, o) for o in range(6)])
    run.indexed_to = 0
    run.indexed([3, 4])
    assert run.indexed_to == 0, "the entries before them are not in the index yet"
    assert not run.in_index(3)
    run.take(2)  # the book's now
    run.indexed([0, 1])
    assert run.indexed_to == 5, "over the one taken out, and the two indexed ahead"
    run.sent = run.landed = 6
    assert run.settles_to() == 5
    assert run.first_pending() == key(10, 0, 5), "landed, not indexed"
    run.extend([key(11, 0, 9)], [b"v"], [run.originals[0]])
    assert run.keys[-1] == key(11, 0, 9)
    assert len(run) == 7
