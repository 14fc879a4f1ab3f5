"""Where schedule ids live when the requests topic grows: moving them to their new homes.

An id's home is ``murmur2(id)`` modulo the request partition count
(:func:`kdelay.protocol.forward.id_partition`). Its pending schedule (an index
entry) and, once that ended, its ended-id marker live in the index and the
changelog partition of that home, where cancels, duplicates and reschedules
look for them. When the count grows from N to M, most homes move.
``kdelay topics grow`` moves them, with every instance stopped, through the
changelog alone:

1. every changelog partition is read into a scratch index (the restore the
   service itself runs, :func:`kdelay.state.changelog.rebuild`);
2. each entry with an id whose home under M is another partition, and each
   such ended-id marker, is written as it is to the changelog partition of
   its new home, and acknowledged;
3. only then is it tombstoned where it was.

An entry moves whole: its due key still names the original where it lies, so
the payload is never copied. A restarted instance catches its indexes up from
the changelog before it reads a request, so every request written for the
new count already finds its id. Steps 2 and 3 are idempotent: a run stopped
half way is run again (an entry written to both partitions in between is
never served, since no instance runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from confluent_kafka import KafkaError, Message

from kdelay.plumbing.clients import Producing, produce
from kdelay.protocol import codec
from kdelay.protocol.forward import home_of
from kdelay.state.index import PartitionIndex

# How long the moves of one partition may wait for their acknowledgements.
FLUSH_S = 120.0


class MoveError(Exception):
    """A changelog write of a move failed; nothing was tombstoned for it, run again."""


@dataclass(frozen=True, slots=True)
class Move:
    """One changelog record to move from partition ``source`` to the id's new ``home``."""

    source: int
    home: int
    key: bytes
    value: bytes


@dataclass(slots=True)
class Moves:
    """What one partition's changelog holds of ids whose home is elsewhere now."""

    pending: list[Move]
    ended: list[Move]

    def __len__(self) -> int:
        return len(self.pending) + len(self.ended)

    def __iter__(self) -> Iterator[Move]:
        yield from self.pending
        yield from self.ended


def moves_of(index: PartitionIndex, partitions: int) -> Moves:
    """What ``index`` (one changelog partition, rebuilt) holds of ids that live elsewhere
    under ``partitions``: pending entries and ended-id markers, as changelog records."""
    source = index.partition
    pending = []
    for key, raw in index.raw_items():
        sid = codec.decode_index_value(raw).schedule_id
        if sid is not None and (home := home_of(sid, partitions)) != source:
            pending.append(Move(source, home, key, raw))
    ended = []
    for sid, state in index.id_states():
        if state.pending_key is None and (home := home_of(sid, partitions)) != source:
            ended.append(Move(source, home, codec.id_record_key(sid),
                              codec.encode_id_state(state)))
    return Moves(pending, ended)


def write_moves(producer: Producing, topic: str, moves: Moves) -> None:
    """Write every move to its new home's changelog partition and, once all are
    acknowledged, tombstone each where it was.

    Raises :class:`MoveError` when a write fails: what was acknowledged stays
    (at both places until a run tombstones it), and running again finishes it.
    """
    _write(producer, [(m.home, m.key, m.value) for m in moves], topic)
    _write(producer, [(m.source, m.key, None) for m in moves], topic)


def _write(producer: Producing, records: list[tuple[int, bytes, bytes | None]],
           topic: str) -> None:
    failed: list[str] = []

    def report(error: KafkaError | None, _: Message) -> None:
        if error is not None and len(failed) < 3:
            failed.append(error.str())

    for partition, key, value in records:
        produce(producer, topic, key=key, value=value, partition=partition, on_delivery=report)
    left = producer.flush(FLUSH_S)
    if failed or left:
        raise MoveError(f"writing to changelog {topic} failed ({left} unacknowledged): "
                        f"{'; '.join(failed) or 'timed out'}; nothing of it was tombstoned "
                        "where it was: run `kdelay topics grow` again")
