"""Sealing: what a seal hands the index for the tally, and that it stays exact."""

from __future__ import annotations

from pathlib import Path

from kdelay.engine.delivery._book import Job, Sink
from kdelay.engine.delivery._runs import Run
from kdelay.engine.delivery._sealing import Marks, landed_runs, seal_of
from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.state.changes import Changes, Entry
from kdelay.state.index import PartitionIndex
from kdelay.state.originals import Missing
from kdelay.state.tally import MINUTE_MS, Tally

NOW = 1_700_000_000_000


def entry(slot: int) -> Entry:
    """Entries whose due and slack minutes differ by slot."""
    value = IndexValue(Fingerprint(NOW - (slot % 3) * 7 * MINUTE_MS, slot), None, "orders")
    return Entry(codec.encode_due_key(NOW + slot * MINUTE_MS, 0, slot), value,
                 codec.encode_index_value(value))


def landed(slots: range) -> Run:
    """A run read from the index over ``slots``, every entry landed."""
    entries = [entry(s) for s in slots]
    run = Run(0, [e.key for e in entries], [e.raw for e in entries],
              [Missing.ABSENT] * len(entries), gapless=True)
    run.sent = run.landed = len(entries)
    return run


def job(slot: int, raw: bool = True) -> tuple[Job, Sink]:
    found = entry(slot)
    return Job(Entry(found.key, found.value, found.raw if raw else b""), Missing.ABSENT,
               0), Sink.TARGET


def sealed(runs: list[Run], jobs: list[tuple[Job, Sink]]) -> Changes:
    item = seal_of(0, landed_runs(runs), jobs, Marks.of(None, []), None, [], NOW)
    return item.changes


def test_a_run_in_key_order_hands_its_values_in_order() -> None:
    changes = sealed([landed(range(0, 4)), landed(range(4, 8))], [job(9)])
    assert changes.deletes == [entry(s).key for s in (*range(8), 9)]
    assert changes.deleted_values == [entry(s).raw for s in (*range(8), 9)]
    assert changes.known == {}


def test_runs_out_of_key_order_hand_their_values_by_key() -> None:
    changes = sealed([landed(range(4, 8)), landed(range(0, 4))], [])
    assert changes.deleted_values is None
    assert changes.known == {entry(s).key: entry(s).raw for s in range(8)}


def test_a_job_without_its_value_leaves_the_known_values_by_key() -> None:
    changes = sealed([landed(range(0, 4))], [job(5, raw=False), job(6)])
    assert changes.deleted_values is None
    assert changes.known == {entry(s).key: entry(s).raw for s in (0, 1, 2, 3, 6)}
    assert changes.deletes == [entry(s).key for s in (0, 1, 2, 3, 5, 6)]


def test_either_way_the_tally_stays_exact(tmp_path: Path) -> None:
    index = PartitionIndex(tmp_path / "p0", 0)
    try:
        index.apply(Changes(puts=[entry(s) for s in range(20)]))
        for runs, jobs in (([landed(range(0, 5))], [job(6)]),
                           ([landed(range(10, 14)), landed(range(7, 10))], []),
                           ([landed(range(15, 17))], [job(18, raw=False)])):
            index.apply(sealed(runs, jobs))
            counted = Tally.of(index.raw_items())
            assert (index.tally.due, index.tally.slack) == (counted.due, counted.slack)
        assert index.tally.total == 4  # 5, 14, 17 and 19 are left
    finally:
        index.close()
