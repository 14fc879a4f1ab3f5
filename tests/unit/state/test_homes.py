"""Which ids of a partition's index move when the requests topic grows."""

from __future__ import annotations

from pathlib import Path

from kdelay.protocol import codec
from kdelay.protocol.codec import End, Fingerprint, IdState, IndexValue
from kdelay.protocol.forward import id_partition
from kdelay.state.changes import Changes, Entry
from kdelay.state.homes import Move, moves_of
from kdelay.state.index import PartitionIndex

BEFORE, AFTER = 2, 5
SOURCE = 1
FP = Fingerprint(1_700_000_000_000, 7)


def an_id(before: int, after: int) -> str:
    """An id whose home is ``before`` of BEFORE partitions and ``after`` of AFTER."""
    return next(f"id-{n}" for n in range(10_000)
                if id_partition(f"id-{n}", BEFORE) == before
                and id_partition(f"id-{n}", AFTER) == after)


def test_entries_and_ended_ids_whose_home_moved_are_moved_whole(tmp_path: Path) -> None:
    moving, staying = an_id(SOURCE, 3), an_id(SOURCE, SOURCE)
    ended, ended_here = an_id(SOURCE, 4), an_id(SOURCE, SOURCE)
    index = PartitionIndex(tmp_path / "p1", SOURCE)
    # Entries name their original where it lies: partition 0 here (a forwarded request).
    keys = {sid: codec.encode_due_key(1_000 + n, 0, n)
            for n, sid in enumerate([moving, staying, "plain"])}
    values = {moving: IndexValue(FP, moving, "orders"), staying: IndexValue(FP, staying, "t"),
              "plain": IndexValue(FP, None, "orders")}
    gone = codec.ended(End.CANCELLED, 5_000, codec.encode_due_key(900, 1, 3), FP)
    index.apply(Changes(
        puts=[Entry(keys[sid], values[sid]) for sid in keys],
        ids={moving: IdState(keys[moving], None), staying: IdState(keys[staying], None),
             ended: gone, ended_here: gone}))
    try:
        moves = moves_of(index, AFTER)
    finally:
        index.close()
    assert moves.pending == [Move(SOURCE, 3, keys[moving], codec.encode_index_value(
        values[moving]))], "only the entry whose id lives elsewhere now; never one without id"
    assert moves.ended == [Move(SOURCE, 4, codec.id_record_key(ended),
                                codec.encode_id_state(gone))]
    assert len(moves) == 2


def test_nothing_moves_when_the_count_is_the_one_the_ids_were_placed_by(tmp_path: Path) -> None:
    sid = an_id(SOURCE, 3)
    key = codec.encode_due_key(1_000, SOURCE, 9)
    index = PartitionIndex(tmp_path / "p1", SOURCE)
    index.apply(Changes(puts=[Entry(key, IndexValue(FP, sid, "orders"))],
                        ids={sid: IdState(key, None)}))
    try:
        assert len(moves_of(index, BEFORE)) == 0
    finally:
        index.close()
