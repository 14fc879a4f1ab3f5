"""Delivery's book of work: every entry read ahead, and where its delivery stands.

A :class:`Job` is an index entry with its original record, in one
:class:`State`: adopted from intake or read ahead (both wait for their due
time), in flight (produced, report pending), backing off (waiting for a
retry) or held back by a target control (pending, untouched, until let go).
The :class:`Book` holds the jobs, the per-partition count of each state
(changed only as jobs are held, moved, sent and dropped), the heap of keys that
wait to be sent in key order (due time, then request partition, then offset),
the heap of retries by the time they may go again, and the keys a planned
cancel withholds. :class:`Reports` gathers what the producers reported of the
jobs in flight (to the target or the DLQ: the :class:`Sink`).
"""

from __future__ import annotations

import heapq
from collections.abc import KeysView
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from kdelay.protocol import codec, envelope
from kdelay.protocol.controls import Subject
from kdelay.protocol.envelope import ErrorCode
from kdelay.state.changes import Entry
from kdelay.state.originals import Found


class State(IntEnum):
    """Where the delivery of a job stands.

    An ``IntEnum`` so that a state indexes its partition's list of counts
    directly: a count changes twice for every record delivered.
    """

    ADOPTED = 0
    """Taken from intake with its record, never produced: it cost no read."""
    READY = 1
    """Read ahead (or back from a retry or an aborted transaction): waits for its due time."""
    IN_FLIGHT = 2
    """Produced; its delivery report is awaited. Too late to cancel."""
    BACKING_OFF = 3
    """Failed; waits until ``not_before_ms`` to be sent again."""
    HELD = 4
    """Due, held back by a target control (``held_by``); pending until it is let go."""


WAITING = (State.ADOPTED, State.READY)
"""The states of a job that waits for its due time to be sent."""


class Sink(Enum):
    """Where a produce for an entry went."""

    TARGET = "target"
    DLQ = "dlq"


@dataclass(slots=True)
class Job:
    """An entry held by delivery: its original, and how its delivery is going."""

    entry: Entry
    original: Found
    partition: int
    state: State = State.READY
    attempts: int = 0
    not_before_ms: int = 0
    first_failed_ms: int | None = None
    failure: tuple[ErrorCode, str] | None = None
    detail: str = ""
    routing: envelope.Routing | None = None
    held_by: Subject | None = None
    """The control that holds the job back (state HELD), or held it last."""
    indexed: bool = True
    """False while intake's plan for the entry awaits its acknowledgements: the
    entry may go out, but leaves the index only after it is in it."""
    doubtful: bool = False
    """True once a produce of it may have been written without its report ever being
    served (its producer failed for good, see :meth:`Delivery.take_back`): it goes
    out again, and is too late to cancel, as if still in flight."""

    @property
    def key(self) -> bytes:
        """The job's due key."""
        return self.entry.key


@dataclass(slots=True)
class Reports:
    """Delivery reports collected by the producers' callbacks, until delivery settles them:
    each names a job's key and where its record went (with a reason when it failed)."""

    done: list[tuple[bytes, Sink]] = field(default_factory=list)
    failed: list[tuple[bytes, Sink, str]] = field(default_factory=list)
    refused: list[tuple[bytes, Sink, str]] = field(default_factory=list)


class Book:
    """The jobs delivery holds, counted by partition and state."""

    def __init__(self) -> None:
        self._jobs: dict[bytes, Job] = {}
        # Per partition, the number of jobs in each state (indexed by the state).
        self._counts: dict[int, list[int]] = {}
        self._flying = 0
        # Keys that wait to be sent, smallest first; a key whose job left or
        # changed state since it was pushed is skipped when it reaches the top.
        self._ready: list[bytes] = []
        self._retries: list[tuple[int, bytes]] = []
        self._withheld: set[bytes] = set()
        self.unindexed: list[tuple[Job, Sink]] = []
        """Jobs done whose entries are not in their index yet (adopted ones, see
        :meth:`~kdelay.engine.delivery.Delivery.adopt`): they leave it once they are."""

    @property
    def withheld(self) -> set[bytes]:
        """The keys a planned cancel withholds (a live set: read-only for callers)."""
        return self._withheld

    @property
    def keys(self) -> KeysView[bytes]:
        """The keys of every job held (a live view: ``in`` on it runs in C)."""
        return self._jobs.keys()

    def get(self, key: bytes) -> Job | None:
        """Return the job of ``key``, if held."""
        return self._jobs.get(key)

    def count(self, partition: int, state: State) -> int:
        """Return how many jobs of ``partition`` are in ``state``."""
        counts = self._counts.get(partition)
        return 0 if counts is None else counts[state]

    def held(self, partition: int) -> int:
        """Return how many jobs of ``partition`` are held, whatever their state."""
        counts = self._counts.get(partition)
        return 0 if counts is None else sum(counts)

    def held_total(self) -> int:
        """Return how many jobs are held, of every partition and state."""
        return len(self._jobs)

    def flying(self) -> int:
        """Return how many jobs of every partition await their report."""
        return self._flying

    def in_flight(self, key: bytes) -> bool:
        """Return whether a produce for ``key`` awaits its report (or may have been
        written, see :attr:`Job.doubtful`)."""
        job = self._jobs.get(key)
        return job is not None and (job.state is State.IN_FLIGHT or job.doubtful)

    def jobs_in(self, state: State) -> list[Job]:
        """Return every job in ``state`` (a walk over all jobs: for rare events)."""
        return [job for job in self._jobs.values() if job.state is state]

    def jobs_of(self, partition: int) -> list[Job]:
        """Return every job of ``partition``."""
        return [job for job in self._jobs.values() if job.partition == partition]

    def keys_of(self, partition: int) -> list[bytes]:
        """Return the keys of every job of ``partition``."""
        return [key for key, job in self._jobs.items() if job.partition == partition]

    # -- transitions --------------------------------------------------------------

    def hold(self, job: Job) -> None:
        """Start tracking ``job`` in its state (adopted or ready) and queue it to be sent."""
        self._jobs[job.key] = job
        self._count(job, 1)
        heapq.heappush(self._ready, job.key)

    def move(self, job: Job, state: State) -> None:
        """Move a held job to ``state``; the counts follow (as in :meth:`sent`, its fast case).

        A job moving to ready is queued to be sent; one moving to (or failing
        again while) backing off is queued for its retry at ``job.not_before_ms``.
        """
        if job.state is not state:
            self._count(job, -1)
            job.state = state
            self._count(job, 1)
        if state is State.READY:
            heapq.heappush(self._ready, job.key)
        elif state is State.BACKING_OFF:
            heapq.heappush(self._retries, (job.not_before_ms, job.key))

    def drop(self, key: bytes) -> Job:
        """Stop tracking ``key``'s job and return it."""
        job = self._jobs.pop(key)
        self._count(job, -1)
        return job

    def _count(self, job: Job, delta: int) -> None:
        """Count ``job`` in (+1) or out (-1) of its state (:meth:`sent` counts its own move)."""
        counts = self._counts.get(job.partition)
        if counts is None:
            counts = self._counts[job.partition] = [0] * len(State)
        counts[job.state] += delta
        if job.state is State.IN_FLIGHT:
            self._flying += delta

    def promote(self, now_ms: int) -> None:
        """Make every job whose backoff is over ready again."""
        retries = self._retries
        while retries and retries[0][0] <= now_ms:
            _, key = heapq.heappop(retries)
            job = self._jobs.get(key)
            if job is not None and job.state is State.BACKING_OFF:
                self.move(job, State.READY)

    # -- sending ------------------------------------------------------------------

    def next_to_send(self) -> Job | None:
        """Return the job with the smallest key that waits to be sent (not withheld)."""
        ready = self._ready
        while ready:
            job = self._jobs.get(ready[0])
            if job is not None and job.state in WAITING and job.key not in self._withheld:
                return job
            heapq.heappop(ready)
        return None

    def sent(self, job: Job) -> None:
        """Take the job :meth:`next_to_send` returned off the queue and mark it in flight.

        Once per record delivered, so the move from waiting to in flight is
        counted here directly rather than through :meth:`move`.
        """
        heapq.heappop(self._ready)
        if job.state not in WAITING:  # not from next_to_send: the general move
            self.move(job, State.IN_FLIGHT)
            return
        counts = self._counts[job.partition]
        counts[job.state] -= 1
        counts[State.IN_FLIGHT] += 1
        job.state = State.IN_FLIGHT
        self._flying += 1

    def next_wakeup_ms(self) -> int | None:
        """Return the earliest due time of a waiting job or retry time, or None."""
        job = self.next_to_send()
        candidates = [] if job is None else [codec.decode_due_key(job.key).due_ms]
        if self._retries:
            candidates.append(self._retries[0][0])
        return min(candidates, default=None)

    # -- cancels ------------------------------------------------------------------

    def withhold(self, key: bytes) -> bool:
        """Keep ``key`` from being sent; False when its produce is already in flight."""
        if self.in_flight(key):
            return False
        self._withheld.add(key)
        return True

    def release(self, keys: list[bytes]) -> None:
        """Let withheld keys be sent again."""
        for key in keys:
            self._withheld.discard(key)
            if key in self._jobs:
                heapq.heappush(self._ready, key)

    def forget(self, keys: list[bytes]) -> None:
        """Drop the jobs of keys that left the index by other means; in-flight ones stay."""
        for key in keys:
            self._withheld.discard(key)
            if key in self._jobs and not self.in_flight(key):
                self.drop(key)
