"""Watermark bookkeeping: what a cover writes for a batch of done keys."""

from __future__ import annotations

from pathlib import Path

from kdelay.engine.delivery._sealing import MAX_PENDING, Marks, PartitionMarks
from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue, Watermark
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import PartitionIndex

SOME_FINGERPRINT = Fingerprint(1, 12345)


def key(due: int, offset: int = 0) -> bytes:
    return codec.encode_due_key(due, 0, offset)


def test_a_seal_covers_the_done_keys_below_the_frontier() -> None:
    marks = Marks.of(None, [])
    done = [key(1), key(2)]
    cover = marks.cover(key(5), [], done)
    assert cover.mark == Watermark(key(5))
    assert (cover.covered, cover.uncovered) == (done, [])
    marks.written(cover, done)
    assert marks.bound == key(5)


def test_the_bound_never_goes_down() -> None:
    marks = Marks.of(Watermark(key(10)), [])
    cover = marks.cover(key(3), [], [key(12)])
    assert cover.mark is not None
    assert cover.mark.bound == key(10), "a later record says all an earlier one did"
    assert cover.uncovered == [key(12)], "above the bound: a tombstone of its own"


def test_what_is_held_below_the_bound_and_not_done_is_pending() -> None:
    marks = Marks.of(Watermark(key(10)), [key(4)])
    marks.put(b"plan", [key(6), key(20)])
    cover = marks.cover(key(8), [key(7), key(9)], [key(5)])
    assert cover.mark == Watermark(key(10), frozenset({key(4), key(6), key(7), key(9)}))
    assert cover.covered == [key(5)]


def test_a_done_pending_key_leaves_the_pending_set() -> None:
    marks = Marks.of(Watermark(key(10)), [key(4)])
    cover = marks.cover(None, [], [key(4)])
    assert cover.mark == Watermark(key(10))
    assert cover.covered == [key(4)]


def test_an_unapplied_plan_bounds_the_frontier_until_applied_or_given_back() -> None:
    marks = Marks.of(None, [])
    marks.put(b"p1", [key(30), key(7)])
    assert marks.frontier() == key(7)
    marks.applied(b"p1")
    assert marks.frontier() is None
    marks = Marks.of(Watermark(key(10)), [])
    marks.put(b"p2", [key(3)])
    assert marks.below == {key(3)}, "put below the bound: pending there"
    marks.given_back(b"p2")
    assert marks.below == set(), "never written"


def test_too_many_pending_keys_write_no_watermark_but_tombstones() -> None:
    marks = Marks.of(Watermark(key(10_000)), [])
    held = [key(i) for i in range(MAX_PENDING + 1)]
    done = [key(20_000)]
    cover = marks.cover(key(30_000), held, done)
    assert (cover.mark, cover.covered, cover.uncovered) == (None, [], done)
    marks.written(cover, done)
    assert marks.bound == key(10_000)


def test_without_any_bound_every_done_key_gets_a_tombstone() -> None:
    cover = Marks.of(None, []).cover(None, [], [key(1)])
    assert (cover.mark, cover.uncovered) == (None, [key(1)])


def test_gone_keys_are_no_longer_pending() -> None:
    marks = Marks.of(Watermark(key(10)), [key(1), key(2)])
    marks.gone([key(1)])
    assert marks.below == {key(2)}


def test_a_restarted_partition_counts_every_entry_below_its_bound_as_pending(
        tmp_path: Path) -> None:
    """An entry put after the last watermark with a key below its bound (a request indexed
    after its due time, or replayed from the changelog after that watermark) is pending:
    a running instance adds it as it writes the plan; after a restart only the index
    knows it. Without it, the next watermark covered it and the next restore dropped it,
    undelivered (seen with tools/crash under exactly-once and a paused target)."""
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        listed, late, above = key(4), key(6), key(20)
        entries = [Entry(k, IndexValue(SOME_FINGERPRINT, None, "orders"))
                   for k in (listed, above)]
        index.apply(Changes(puts=entries))
        index.apply(Changes(watermark=Watermark(key(10), frozenset({listed}))))
        index.apply(Changes(puts=[Entry(late, IndexValue(SOME_FINGERPRINT, None, "orders"))]))
        assert index.keys_below(key(10)) == [listed, late]

        marks = PartitionMarks()
        marks.load(0, index)
        cover = marks.of(0).cover(key(8), [], [key(5)])
        assert cover.mark == Watermark(key(10), frozenset({listed, late}))
    finally:
        index.close()
