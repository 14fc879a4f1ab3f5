"""Delivery: republish due originals to their targets, or dead-letter them.

Each tick reads ahead: entries due within ``lookahead_ms`` are taken from the
partition indexes (a bounded scan) and their originals fetched as sorted offset
ranges, so that when an entry comes due only a produce is left to do. What a
scan returns is held as a :class:`~kdelay.engine.delivery._runs.Run`: columns of keys,
index values and originals, walked by cursors. Due entries go out in key order
(due time, then request partition, then offset), a run slice at a time.

Produces are grouped in :class:`Flight` s, one per run and dispatch: every record of
a flight reports to one shared callback that counts it, and only a failed
record is looked at on its own. A flight is settled as a whole, once its
:class:`Durability` says it has landed (at-least-once: every record reported;
exactly-once: its transaction commits). Then delivery *seals* what is done,
per partition: one watermark record (:mod:`kdelay.engine.delivery._sealing`) instead
of a tombstone per entry, the index deletes in one batch, and an end record
for each schedule id. An entry leaves the index only after its produce is
acknowledged: at-least-once.

Entries that need care leave their run for the :class:`~kdelay.engine.delivery._book.Book`,
one job each: an entry a cancel withholds, an original that is gone or no
longer matches (dead-lettered), a target that fails. A failing target is
retried with exponential backoff for ``retry_ms`` after its first failure
(minutes by default: a target topic may be created late), then the original
goes to the DLQ as ``undeliverable``. Entries waiting for a retry sit apart,
so they never block entries to other targets. Nothing is produced before its
due time by the injected clock, and the republished record carries that
clock's time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from confluent_kafka import Message

from kdelay.engine.delivery._book import Book, Job, Sink, State
from kdelay.engine.delivery._controls import Controls
from kdelay.engine.delivery._failures import Retries, TopicCheck
from kdelay.engine.delivery._flights import (
    FEW,
    STALL_S,
    Channel,
    Durability,
    Flight,
    failed_entries,
)
from kdelay.engine.delivery._readahead import MAX_HELD_BATCHES, ReadAhead
from kdelay.engine.delivery._rereads import Rereads
from kdelay.engine.delivery._runs import merged
from kdelay.engine.delivery._sealing import (
    PartitionMarks,
    Seal,
    Seals,
    frontier,
    landed_runs,
    seal_of,
)
from kdelay.engine.delivery._sender import Routes, Sender
from kdelay.engine.metrics import DeliveryCounts, Metrics
from kdelay.plumbing.callbacks import unheard
from kdelay.plumbing.clients import Producing
from kdelay.plumbing.clock import Clock
from kdelay.protocol import codec
from kdelay.protocol.controls import Subject
from kdelay.protocol.envelope import ErrorCode
from kdelay.protocol.targets import TargetPolicy
from kdelay.state.index import PartitionIndex
from kdelay.state.originals import Reading

log = logging.getLogger("kdelay.engine.delivery")  # the wing, not its private module

MAX_WAIT_MS = 100

Release = Callable[[int], int | None]
"""The latest due time delivery may release when the service clock says ``now``
(None: release nothing yet); see :class:`kdelay.engine.skew.BrokerGuard`."""


def by_service_clock(now_ms: int) -> int | None:
    """Release what the service clock says is due."""
    return now_ms


IN_FLIGHT_WAIT_MS = 1
# Of the batches a partition may hold (MAX_HELD_BATCHES), at most this many wait
# for a retry: the rest stays free for the entries of targets that work. A
# failure beyond it is dead-lettered at once.
MAX_RETRYING_BATCHES = MAX_HELD_BATCHES // 2
# Detached flights are logged together, at most once per this many seconds.
STALL_LOG_EVERY_S = 30.0


class Stalls:
    """The entries of flights detached for stalling (see :meth:`Delivery.seal`), logged
    together at most once per :data:`STALL_LOG_EVERY_S`."""

    def __init__(self) -> None:
        self._count = 0
        self._logged = float("-inf")

    def detached(self, entries: int, now_s: float) -> None:
        """A stalled flight of ``entries`` was detached at monotonic ``now_s``."""
        self._count += entries
        if now_s >= self._logged + STALL_LOG_EVERY_S:
            log.warning("%d deliveries await their acknowledgements for over %.0f s (a target "
                        "partition without a leader?); the entries behind them go on",
                        self._count, STALL_S)
            self._logged, self._count = now_s, 0


@dataclass(frozen=True, slots=True)
class Gate:
    """Whether delivery may send now, and up to which due time."""

    release: Release
    """The latest due time that may go out at a service time (None: nothing yet)."""
    outage: Callable[[], bool]
    """Whether Kafka is unreachable now: then nothing is sent, and a failure costs no attempt."""


class Tally:
    """The per-record figures delivery gathers between two settles, handed to Prometheus
    at once."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.counts = DeliveryCounts()

    def flush(self, lateness_ms: dict[str, list[int]]) -> None:
        """Hand the counts gathered since the last call, and ``lateness_ms`` (by target), to
        Prometheus."""
        counts, self.counts = self.counts, DeliveryCounts()
        counts.flush(self._metrics, lateness_ms)


@dataclass(frozen=True, slots=True)
class DeliveryConfig:
    """What delivery needs from the settings."""

    requests_topic: str
    changelog_topic: str
    dlq_topic: str
    lookahead_ms: int = 2_000
    batch_size: int = 1_000
    attempts: int = 0
    """Attempts before a failing record is dead-lettered; 0: only ``retry_ms`` ends it."""
    backoff_ms: int = 500
    backoff_max_ms: int = 30_000
    targets: TargetPolicy | None = None
    """Which targets are allowed; None: any but kdelay's own three topics."""
    retry_ms: int = 900_000
    """How long after its first failure a record is retried before it is dead-lettered."""


class Delivery:
    """Reads due entries ahead, produces them when due, and settles the outcomes."""

    def __init__(self, config: DeliveryConfig, targets: Producing, internal: Producing,
                 reader: Reading, clock: Clock, metrics: Metrics,
                 durability: Durability, release: Release = by_service_clock,
                 outage: Callable[[], bool] = lambda: False,
                 away: Callable[[str], None] = unheard,
                 controls: Controls | None = None) -> None:
        """``outage`` tells whether Kafka is unreachable now: a failure then costs no attempt,
        and nothing more is sent until it answers; ``away`` is told when a metadata
        request finds the cluster silent; ``controls`` are the target controls in force
        (kept up to date by whoever follows the controls topic)."""
        self._gate = Gate(release, outage)
        policy = config.targets or TargetPolicy(
            (config.requests_topic, config.changelog_topic, config.dlq_topic), ())
        self._internal = internal
        self._clock = clock
        self._durability = durability
        self._book = Book()
        self.rereads = Rereads()
        self._retries = Retries(self._book, clock, metrics, outage, config.attempts,
                                config.backoff_ms, config.backoff_max_ms, config.retry_ms,
                                MAX_RETRYING_BATCHES * config.batch_size)
        self._ahead = ReadAhead(reader, self._book, config.lookahead_ms, config.batch_size,
                                Controls() if controls is None else controls,
                                policy.lanes.prefixes)
        self._marks = PartitionMarks()
        # The flights produced and not landed, in the order produced, and those
        # landed and sealed but not yet applied (exactly-once: until settle or abandon).
        self._flights: list[Flight] = []
        self._cut = False  # the last dispatch stopped at a full producer queue
        self._landed: list[Flight] = []
        self._tally = Tally(metrics)
        self._stalls = Stalls()
        self._sender = Sender(config.requests_topic, config.dlq_topic, targets, internal,
                              policy, TopicCheck(targets, clock, away=away),
                              self._book.withheld, self._ahead, outage, self._ahead.controls)

    # -- what intake and the service ask ------------------------------------------

    @property
    def controls(self) -> Controls:
        """The target controls in force (the read-ahead holds them, with what they hold)."""
        return self._ahead.controls

    def in_flight(self, key: bytes) -> bool:
        """Return whether a produce for ``key`` awaits its report (too late to cancel)."""
        run = self._ahead.held.get(key)
        if run is not None:
            at = run.position(key)
            return at is not None and run.flying(at)
        return self._book.in_flight(key)

    def withhold(self, key: bytes) -> bool:
        """Keep ``key`` from being produced, for a cancel being planned; False if too late.

        Returns False when a produce for ``key`` already awaits its report: the
        record is on its way and the cancel's truthful outcome is
        ``already-delivered``. Otherwise the key is not produced (even if it
        comes due, or is read ahead later) until :meth:`forget` or
        :meth:`release` is called for it, so a ``cancelled`` outcome is never
        followed by a delivery.
        """
        if self.in_flight(key):
            return False
        return self._book.withhold(key)

    def release(self, keys: list[bytes]) -> None:
        """Let withheld keys go out again: the cancels that withheld them were not applied."""
        self._book.release(keys)

    def idle(self) -> bool:
        """Return whether no produce awaits a report."""
        return not self._flights and not self._book.flying()

    def forget(self, keys: list[bytes]) -> None:
        """Drop read-ahead entries that left the index by other means (cancel)."""
        for key in keys:
            run = self._ahead.held.get(key)
            if run is None:
                continue
            at = run.position(key)
            if at is not None and at >= run.sent:
                run.take(at)
                del self._ahead.held[key]
        self._ahead.forgot(keys)
        self._book.forget(keys)
        self._marks.gone(keys)

    def noted(self, partition: int, lowest: bytes | None) -> None:
        """Learn that entries down to ``lowest`` were put in ``partition``'s index by others.

        An entry put inside the window already read ahead is found by the next
        scan, which starts no later than ``lowest``.
        """
        if lowest is None:
            return
        window = self._ahead.window(partition)
        if window.lowest_put is None or lowest < window.lowest_put:
            window.lowest_put = lowest

    def adopt(self, partition: int, keys: list[bytes], values: list[bytes],
              originals: Mapping[bytes, Message]) -> None:
        """Take entries intake has just written (``keys[i]`` with encoded value
        ``values[i]``), with their records, if due inside the window.

        They then need no read back from Kafka, and may go out as soon as they
        are due, before intake's plan is acknowledged and applied to the index;
        an adopted entry leaves the index only after :meth:`indexed` says it
        is in it. Entries not taken are found by a scan once they are indexed.
        Every plan's puts are noted, adopted or not: until the plan is applied,
        the partition's watermark stays below them. The plan is known by its
        first key: :meth:`indexed` and :meth:`disown` are given the same ``keys``.
        """
        if keys:
            self._marks.put(partition, keys)
        covered = self._ahead.window(partition).covered
        if covered is None:
            return
        # Adopted entries cost no read: only the cap on held entries bounds them. Keys
        # sort by due time, so the window's bound tells without decoding one.
        room, bound = self._ahead.cap(partition), codec.due_upper_bound(covered)
        held, book = self._ahead.held, self._book.keys
        taken = sorted(
            (at for at, key in enumerate(keys) if key < bound and key not in held
             and key not in book and key in originals), key=keys.__getitem__)
        shelf = self._ahead.shelf
        if shelf is not None:  # left in the index, found by a scan once not shelved
            taken = [at for at in taken if not shelf.holds(
                (codec.decode_index_value(values[at]).target or "").encode())]
        del taken[max(0, room):]
        if taken:
            self._ahead.adopt(partition, [keys[at] for at in taken],
                              [values[at] for at in taken],
                              [originals[keys[at]] for at in taken])

    def indexed(self, partition: int, keys: list[bytes]) -> None:
        """Learn that intake's puts ``keys`` (as given to :meth:`adopt`) are in
        ``partition``'s index now.

        Adopted ones may leave it from now on; an entry inside the window that
        was not adopted is found by the next scan, which starts no later than it.
        """
        if keys:
            self._marks.applied(partition, keys[0])
        window = self._ahead.window(partition)
        bound = None if window.covered is None else codec.due_upper_bound(window.covered)
        lowest: bytes | None = None
        rest = self._ahead.indexed(keys)
        if not self._book.keys:  # no job to tell: only the lowest key inside the window counts
            least = min(rest, default=None)  # in C; inside the window if any key is
            lowest = least if least is not None and (bound is None or least < bound) else None
            rest = []
        for key in rest:
            job = self._book.get(key)
            if job is not None:
                job.indexed = True
            elif (bound is None or key < bound) and (lowest is None or key < lowest):
                lowest = key
        if lowest is not None:
            # Scan again (from no later than ``lowest``) until a scan had room for it.
            window.covered = None
            self.noted(partition, lowest)

    def disown(self, keys: list[bytes]) -> None:
        """Drop the adopted entries of a plan that was given back (never indexed)."""
        if keys:
            self._marks.given_back(keys[0])
        for key in keys:
            run = self._ahead.held.get(key)
            at = None if run is None else run.position(key)
            if run is not None and (at is None or not run.in_index(at)):
                if at is not None and at >= run.sent:
                    run.take(at)
                    del self._ahead.held[key]
                continue
            job = self._book.get(key)
            if job is not None and not job.indexed and job.state is not State.IN_FLIGHT:
                self._book.drop(key)

    def drop_partition(self, partition: int) -> None:
        """Forget everything of a partition this instance no longer owns.

        Its flights in the air are forgotten too: whatever they do later (stall,
        fail, land) must not bring its entries back into the book, where they would
        keep the partition's next owner (this instance again, say) from reading them.
        Their reports still arrive, to flights nobody looks at any more; the entries
        stay in the index, and whoever serves the partition next delivers them
        (at-least-once: perhaps again).
        """
        for key in self._book.keys_of(partition):
            self._book.drop(key)
        self._flights = _without(self._flights, partition)
        self._landed = _without(self._landed, partition)
        self._ahead.drop(partition)
        self._marks.drop(partition)
        self._book.unindexed = [(job, sink) for job, sink in self._book.unindexed
                           if job.partition != partition]

    # -- the loop's phases ----------------------------------------------------------

    def tick(self, indexes: Mapping[int, PartitionIndex]) -> int:
        """Read ahead, produce what is due; return the milliseconds until there is more to do."""
        self.prepare(indexes)
        self.dispatch()
        return self.wait_ms()

    def prepare(self, indexes: Mapping[int, PartitionIndex]) -> bool:
        """Read ahead and take back retries whose backoff is over; return whether work is due."""
        now = self._clock.now_ms()
        for partition, index in indexes.items():
            self._marks.load(partition, index)
        self._ahead.read(indexes, now)
        self._book.promote(now)
        if self.controls:
            self._let_go(now)
        return self._next_wakeup_ms(now) == 0

    def dispatch(self) -> None:
        """Produce every read-ahead entry that is due by the clock, in key order.

        Due means due by ``release`` too (by default the service clock alone).
        The book's jobs go first (retries, dead letters), then the runs' due
        slices, merged in key order: one :class:`Flight` each.
        """
        now = self._clock.now_ms()
        limit = self._gate.release(now)
        if limit is None or self._gate.outage():
            return
        bound = codec.due_upper_bound(limit)
        due = [(run, run.sent, run.due_end(bound)) for runs in self._ahead.runs.values()
               for run in runs if run.sent < len(run.keys) and run.keys[run.sent] < bound]
        # A dispatch the full queue cut short goes on where it stopped, on its lane.
        few = not self._cut and sum(end - start for _, start, end in due) <= FEW
        since = self._clock.monotonic()
        channel = self._durability.channel(self._flights, since, few)
        if channel is None:  # the bulk lane's generation in the air lands first
            return
        self._cut = True
        if not self._dispatch_jobs(channel, limit, now, since):
            return
        routes: Routes = {}
        taken = self._book.held_total()
        latest: dict[int, Flight] = {}  # of each run: the run's next slice joins it
        try:
            for run, start, end in merged(due):
                flight = latest.get(id(run))
                if flight is None or flight.end != start:
                    flight = latest[id(run)] = Flight(run, start, start, channel,
                                                      since=since)
                    self._flights.append(flight)
                if not self._sender.slice(run, start, end, now, flight, routes):
                    return
        finally:
            self._flights = [f for f in self._flights if f.end > f.start or f.run is None]
            self._sender.gather(routes)
        if self._book.held_total() > taken:  # entries the slices handed the book
            self._cut = not self._dispatch_jobs(channel, limit, now, since)
        else:
            self._cut = False

    def _dispatch_jobs(self, channel: Channel, limit: int, now: int, since: float) -> bool:
        """Send the book's due jobs as one flight; False when the queue filled up."""
        jobs = Flight(None, channel=channel, since=since)
        sending = self._send_jobs(jobs, limit, now)
        if jobs.jobs or jobs.refusals:
            self._flights.append(jobs)
        return sending

    def wait_ms(self) -> int:
        """Return the milliseconds until there is work: the next due entry, or at most
        ``IN_FLIGHT_WAIT_MS`` while produces await their reports (at most ``MAX_WAIT_MS``)."""
        wait = self._next_wakeup_ms(self._clock.now_ms())
        return min(wait, IN_FLIGHT_WAIT_MS) if not self.idle() else wait

    def has_failures(self) -> bool:
        """Return whether a produce or a changelog write reported a failure since the
        flights were last settled."""
        return (any(flight.errors for flight in (*self._landed, *self._flights))
                or self._durability.has_failures())

    def seal(self, indexes: Mapping[int, PartitionIndex], every_s: float = 0.0) -> Seals:
        """Land the flights that have landed and write the seals of what is done: of each
        partition, or (``every_s``, see :class:`~kdelay.engine.delivery._sealing.Cadence`)
        of those not sealed for a while, with a batch landed, or jobs done; return them,
        for :meth:`settle` to apply.

        Flights of one run land in the order they were produced. A flight
        that has not landed after :data:`STALL_S` (a target partition without a
        leader, say) is detached from its run: its entries become jobs of the
        book, so the run, and every entry behind it, goes on.

        Exactly-once calls this inside the transaction, before it commits: the
        seals go into it, and :meth:`settle` applies them once it committed
        (:meth:`abandon` takes their flights back, and the seals are dropped).
        """
        now = self._clock.now_ms()
        stalled = self._clock.monotonic() - STALL_S
        done: dict[int, list[tuple[Job, Sink]]] = {}
        waiting: list[Flight] = []
        blocked: set[int] = set()  # runs with an earlier flight still in the air
        for flight in self._flights:
            run = flight.run
            if run is not None and id(run) in blocked:
                waiting.append(flight)
            elif self._durability.landed(flight):
                self._land(flight, now, done)
                self._landed.append(flight)
            else:
                if run is not None and flight.since < stalled:
                    self._detach(flight)
                elif run is not None:
                    blocked.add(id(run))
                waiting.append(flight)
        self._flights = waiting
        if self._book.unindexed:
            unindexed, self._book.unindexed = self._book.unindexed, []
            for job, sink in unindexed:
                if job.indexed:
                    done.setdefault(job.partition, []).append((job, sink))
                else:
                    self._book.unindexed.append((job, sink))
        self._retries.flush()
        now_s, cadence = self._clock.monotonic(), self._marks.cadence
        cadence.asked()
        sealed = Seals()
        for partition in sorted({*self._ahead.runs, *done}):
            if partition in indexes and (
                    partition in done or cadence.due(partition, now_s, every_s)
                    or self._ahead.landed(partition) >= self._ahead.batch_size):
                item = self._seal(partition, done.get(partition, []), now)
                if item is not None:
                    sealed.seals.append(item)
                    cadence.sealed(partition, now_s)
        return sealed

    def settle(self, indexes: Mapping[int, PartitionIndex], sealed: Seals) -> None:
        """Apply what :meth:`seal` returned, its records now durable: done entries leave
        the index; count and forget them. The indexes of ``sealed.behind`` keep their
        changelog position."""
        self._landed = []
        behind = sealed.behind
        for item in sealed.seals:
            self._marks.of(item.partition).written(item.cover, item.done)
            self.rereads.note(item.partition, item.done)
            index = indexes.get(item.partition)
            if index is not None:
                item.changes.changelog = (None if item.partition in behind
                                          else self._durability.position(item.partition))
                index.apply(item.changes)
            self._settled(item)
        self._flush_metrics()

    def abandon(self) -> None:
        """Take back every produce of an aborted transaction: the entries go out again.

        Failed and refused produces back off as after any failure; the others
        (whatever their report said) are ready to be sent at once. Seals
        written into the transaction are the caller's to drop.
        """
        now = self._clock.now_ms()
        flights, self._landed, self._flights = [*self._landed, *self._flights], [], []
        self._tally.counts.delivered = 0
        failed = [self._failures(flight) for flight in flights]
        for flight, failures in zip(flights, failed, strict=True):
            run = flight.run
            if run is not None:
                run.sent = min(run.sent, flight.start)
                run.landed = min(run.landed, flight.start)
            for job, _ in flight.jobs:
                if job.key not in failures and job.state is State.IN_FLIGHT:
                    self._book.move(job, State.READY)
        for failures in failed:
            for key, (sink, reason) in failures.items():
                self._failed(key, sink, reason, now)
        self._retries.flush()

    def take_back(self) -> int:
        """Take back every flight in the air, whatever its reports say: the producer they
        went out on failed for good and was replaced (at-least-once, see
        :class:`~kdelay.engine.commit._transactional.Renewing`). Return how many entries
        go out again.

        None of their entries counts as delivered, not even one whose success was
        reported: each becomes a job of the book, ready to be sent again at once on
        the new producer (at-least-once: perhaps twice, never lost). None counts as
        failed either (no attempt is spent, nothing is dead-lettered for it): whether
        it was written is unknown, not refused. Each stays too late to cancel
        (:attr:`~kdelay.engine.delivery._book.Job.doubtful`): the old producer may
        have written it. Flights landed and sealed are not in the air: they stay
        delivered.
        """
        flights, self._flights = self._flights, []
        again = 0
        for flight in flights:
            if flight.run is not None:
                self._unrun(flight)
            for job, _ in flight.jobs:
                if job.state is State.IN_FLIGHT:
                    job.doubtful = True
                    self._book.move(job, State.READY)
                    again += 1
        self._cut = False
        return again

    # -- controls ---------------------------------------------------------------

    def _let_go(self, now: int) -> None:
        """Send again the held-back jobs their controls let go now, oldest first."""
        book = self._book

        def holds(key: bytes, subject: Subject) -> bool:
            job = book.get(key)
            return job is not None and job.state is State.HELD and job.held_by == subject

        for key in self.controls.release(now, holds):
            job = book.get(key)
            if job is not None:
                book.move(job, State.READY)

    def held_back(self) -> dict[Subject, tuple[int, int | None]]:
        """Return, per controlled subject, how many due records it holds back in this
        instance and the oldest one's due time (None: none held): those in memory
        and those its shelf leaves in the index (see ``Shelf``)."""
        found: dict[Subject, tuple[int, int | None]] = dict.fromkeys(
            self.controls.subjects, (0, None))

        def add(subject: Subject, count: int, due: int) -> None:
            total, oldest = found.get(subject, (0, None))
            found[subject] = (total + count, due if oldest is None else min(oldest, due))

        for job in self._book.jobs_in(State.HELD):
            if job.held_by is not None:
                add(job.held_by, 1, job.entry.due.due_ms)
        shelf = self._ahead.shelf
        for target, (count, first) in self._ahead.shelved().items():
            subject = None if shelf is None else shelf.subject_of(target)
            if subject is not None and count:
                add(subject, count, codec.decode_due_key(first).due_ms)
        return found

    # -- sending ------------------------------------------------------------------

    def _send_jobs(self, flight: Flight, limit: int, now: int) -> bool:
        """Send the book's due jobs (retries, dead letters); False on a full queue."""
        book = self._book
        controls = self.controls
        while (job := book.next_to_send()) is not None and job.entry.due.due_ms <= limit:
            if self._gate.outage():  # learnt mid-way (a silent metadata request): wait for Kafka
                return False
            if controls and (held := self._sender.held_by(job, now)) is not None:
                self._ahead.hold_back(job, held)
                continue
            try:
                self._sender.job(job, now, flight)
                self._book.sent(job)
            except BufferError:
                if flight.producer is not None:
                    flight.producer.poll(0)
                self._internal.poll(0)
                return False
        return True

    # -- landing and sealing ---------------------------------------------------------

    def _land(self, flight: Flight, now: int, done: dict[int, list[tuple[Job, Sink]]]) -> None:
        """A flight landed: its records are written, but the failed ones.

        Failed entries leave their run (or stay in the book) to back off for a
        retry; the run range that landed waits to be sealed; the book's jobs
        that are done join ``done``, by partition.
        """
        failed = self._failures(flight)
        run = flight.run
        if run is not None:
            if failed:
                for at in [at for at in run.live(flight.start, flight.end)
                           if run.keys[at] in failed]:
                    self._book.move(self._ahead.take_out(run, at), State.IN_FLIGHT)
            run.landed = max(run.landed, flight.end)
        for job, sink in flight.jobs:
            if job.key in failed:
                continue
            if job.indexed:
                done.setdefault(job.partition, []).append((job, sink))
            else:
                self._book.unindexed.append((job, sink))
        for key, (sink, reason) in failed.items():
            self._failed(key, sink, reason, now)
        for lane, count in flight.lanes.items():
            self._tally.counts.by_lane[lane] = self._tally.counts.by_lane.get(lane, 0) + count

    def _failures(self, flight: Flight) -> dict[bytes, tuple[Sink, str]]:
        """The entries of ``flight`` whose produce was refused or reported failed."""
        failures = dict(flight.refusals)
        if flight.errors:
            failures.update(failed_entries(flight.errors, self._sender.produced(flight)))
        return failures

    def _detach(self, flight: Flight) -> None:
        """Turn a stalled flight's entries into jobs of the book, in flight with it, so
        that its run goes on; they are settled one by one once the flight lands."""
        self._unrun(flight)
        self._stalls.detached(len(flight.jobs), self._clock.monotonic())

    def _unrun(self, flight: Flight) -> None:
        """Move a run flight's entries out of its run into the book, as jobs in flight
        with it; the run goes on past them."""
        run = flight.run
        assert run is not None  # noqa: S101 - the callers check
        for at in list(run.live(flight.start, flight.end)):
            job = self._ahead.take_out(run, at)
            self._book.move(job, State.IN_FLIGHT)
            flight.jobs.append((job, Sink.TARGET))
        run.landed = max(run.landed, flight.end)
        flight.run = None

    def _seal(self, partition: int, jobs: list[tuple[Job, Sink]], now: int) -> Seal | None:
        """Write the seal of what is done in ``partition``; return it to apply (None:
        nothing was done)."""
        runs = self._ahead.runs.get(partition, [])
        marks = self._marks.of(partition)
        item = seal_of(partition, landed_runs(runs), jobs, marks,
                       frontier(self._ahead.windows.get(partition), marks, runs),
                       self._book.jobs_of(partition), now)
        if not item.done:
            self._settled(item)
            return None
        self._durability.seal(partition, item.cover.mark, item.cover.uncovered, item.ended)
        return item

    def _settled(self, item: Seal) -> None:
        """A seal is applied: its runs' ranges and its jobs are out of the index."""
        self._tally.counts.delivered += self._ahead.settled(item.partition, item.runs)
        for job, sink in item.jobs:
            if self._book.get(job.key) is job:
                self._book.drop(job.key)
            if sink is Sink.TARGET:
                self._tally.counts.delivered += 1
            else:
                code = str(job.failure[0] if job.failure else ErrorCode.UNDELIVERABLE)
                dead = self._tally.counts.dead_lettered
                dead[code] = dead.get(code, 0) + 1

    def _flush_metrics(self) -> None:
        """Hand the per-record counts gathered since the last call to Prometheus at once."""
        lateness, self._sender.lateness_ms = self._sender.lateness_ms, {}
        self._tally.flush(lateness)

    # -- failures -------------------------------------------------------------------

    def _failed(self, key: bytes, sink: Sink, reason: str, now: int) -> None:
        """A produce of ``key`` failed: its job backs off (taken out of its run if need be)."""
        job = self._book.get(key)
        if job is None:
            run = self._ahead.held.get(key)
            at = None if run is None else run.position(key)
            if run is None or at is None:
                return
            job = self._ahead.take_out(run, at)
        self._retries.failed(job, sink, reason, now)

    def _next_wakeup_ms(self, now: int) -> int:
        wakeup = self._book.next_wakeup_ms()
        first = self._ahead.first_unsent()
        if first is not None:
            due = codec.due_ms_of(first)
            wakeup = due if wakeup is None else min(wakeup, due)
        if self.controls:
            let_go = self.controls.next_release_ms(now)
            if let_go is not None:
                wakeup = let_go if wakeup is None else min(wakeup, let_go)
        if wakeup is None:
            return MAX_WAIT_MS
        limit = self._gate.release(now)
        if limit is None:
            return MAX_WAIT_MS
        if limit < now and wakeup <= now:
            # Due by the service clock, held by the release limit: look again soon.
            return max(0, min(MAX_WAIT_MS, wakeup - limit))
        return max(0, min(MAX_WAIT_MS, wakeup - now))


def _without(flights: list[Flight], partition: int) -> list[Flight]:
    """``flights`` without what they carry of ``partition``: its runs' flights, its jobs
    and their refusals."""
    kept: list[Flight] = []
    for flight in flights:
        if flight.run is not None and flight.run.partition == partition:
            continue
        gone = [job.key for job, _ in flight.jobs if job.partition == partition]
        if gone:
            flight.jobs = [(job, sink) for job, sink in flight.jobs if job.partition != partition]
            for key in gone:
                flight.refusals.pop(key, None)
        kept.append(flight)
    return kept
