"""The book of delivery's jobs: counts by partition and state, and the send order."""

from __future__ import annotations

from kdelay.engine.delivery._book import Book, Job, State
from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.state.changes import Entry
from kdelay.state.originals import Missing


def job(due_ms: int, partition: int, offset: int, state: State = State.READY) -> Job:
    key = codec.encode_due_key(due_ms, partition, offset)
    return Job(Entry(key, IndexValue(Fingerprint(0, 0), None)), Missing.ABSENT, partition,
               state)


def test_jobs_are_sent_in_key_order_and_counted_in_flight() -> None:
    book = Book()
    late, early, adopted = job(20, 0, 1), job(10, 1, 5), job(15, 0, 2, State.ADOPTED)
    for held in (late, early, adopted):
        book.hold(held)
    sent = []
    while (ready := book.next_to_send()) is not None:
        book.sent(ready)
        sent.append(ready)
    assert sent == [early, adopted, late]
    assert all(j.state is State.IN_FLIGHT for j in sent)
    assert (book.count(0, State.IN_FLIGHT), book.count(1, State.IN_FLIGHT)) == (2, 1)
    assert (book.count(0, State.READY), book.count(0, State.ADOPTED)) == (0, 0)
    assert book.flying() == 3
    book.drop(late.key)
    assert (book.flying(), book.held(0)) == (2, 1)


def test_a_job_sent_from_another_state_is_moved_in_full() -> None:
    book = Book()
    failed = job(10, 0, 1)
    book.hold(failed)
    failed.not_before_ms = 50
    book.move(failed, State.BACKING_OFF)
    book.sent(failed)  # pops the stale ready key and moves the job all the same
    assert failed.state is State.IN_FLIGHT
    assert (book.count(0, State.BACKING_OFF), book.count(0, State.IN_FLIGHT)) == (0, 1)
    assert book.flying() == 1
    assert book.next_to_send() is None
