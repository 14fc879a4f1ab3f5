"""The kdelay service: one loop that owns some request partitions.

Each :meth:`Service.step` does, in order: intake (consume up to a batch,
waiting no longer than until the next due entry, and plan it), delivery
(read ahead, produce what is due), intake's writes (changelog and DLQ
records), the checkpoint (make them durable: acknowledgements, or a
committed transaction), the index writes, and settling (apply delivery
reports to the indexes). The order is the same under both guarantees; what
each part means is decided in :mod:`kdelay.engine.commit`, the one module that
reads the guarantee. Partitions come and go through an ordinary consumer
group; on assignment a partition's index is opened and caught up from the
changelog before it serves, on revocation the work in flight is finished
(and, at-least-once, offsets committed), and the index is closed in
``finally``. The Kafka clients come from a
:class:`~kdelay.engine.factory.ClientFactory`; :mod:`kdelay.engine.runner` runs it
as ``kdelay run``.

Intake stores a request offset only after the changelog and DLQ records
derived from it are durable and the index batch is written, so a crash at
any point re-reads the request and re-derives the same index keys.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, cast

from confluent_kafka import (
    OFFSET_INVALID,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from kdelay import native
from kdelay.engine import commit as checkpoints
from kdelay.engine.availability import Availability, T
from kdelay.engine.commit import (
    MAX_UNACKED_RECORDS,
    Batch,
    Checkpoint,
    Receipts,
    Takeover,
    owner_metadata,
)
from kdelay.engine.controlfeed import CONTROLS_GROUP, ControlFeed, Following
from kdelay.engine.delivery import Controls, Delivery, DeliveryConfig, by_service_clock
from kdelay.engine.factory import ClientFactory, KafkaClients, membership, prefetch
from kdelay.engine.health import Health, Observation
from kdelay.engine.intake import (
    IdWindow,
    Plan,
    Planner,
    Record,
    Topics,
    count_conflicts,
    count_outcomes,
)
from kdelay.engine.metrics import Metrics, PhaseTimer
from kdelay.engine.outlook import Housekeeper, Outlook, PartitionWatch
from kdelay.engine.skew import BROKER_TOLERANCE_MS, BrokerGuard, ClockSkew, unmeasured
from kdelay.engine.status import PRODUCER_CONFIG, StatusBoard
from kdelay.engine.sweeper import Sweeper
from kdelay.errors import ServiceError
from kdelay.plumbing import identity
from kdelay.plumbing.callbacks import ClientErrors, fatal_code, guarded
from kdelay.plumbing.clients import (
    Consuming,
    Producing,
    Report,
    explicit_start,
    produce,
    take,
    watermarks,
)
from kdelay.plumbing.clock import Clock
from kdelay.plumbing.settings import Guarantee, Settings
from kdelay.plumbing.topics import Layout, id_window_ms
from kdelay.protocol import durations
from kdelay.protocol.status import RESTORING, SERVING, PartitionStatus
from kdelay.protocol.targets import TargetPolicy
from kdelay.state.changelog import (
    Replay,
    Restoring,
    Staleness,
    logged_progress,
    open_checked,
    restored,
)
from kdelay.state.index import CONSUMED, PartitionIndex
from kdelay.state.memory import MB, StoreMemory
from kdelay.state.originals import Reading
from kdelay.state.statedir import IndexLocked, StateDirLock, store_path

log = logging.getLogger(__name__)
_ERROR: Final = Message.error  # called through the method: mypyc makes a C call of it
_PARTITION: Final = Message.partition
_OFFSET: Final = Message.offset

# How far past its start offset a partition's intake may read requests an instance
# before it indexed without recording their offset (see Planner, rereads_below):
# at-least-once records it only once their changelog records are acknowledged, and
# at most MAX_UNACKED_RECORDS records (plus a batch) await that.
REREAD_RECORDS = 2 * MAX_UNACKED_RECORDS
# The longest a step waits for requests while written batches await their
# acknowledgements (which the step after the wait applies).
ACK_WAIT_MS = 1
# Steps start at most once per this many ms (unless a full batch of requests comes): a
# step per millisecond of a steady rate costs more than its few records; none is early.
STEP_MS = 5
# Intake keeps the records of requests due within the read-ahead window plus this
# margin, for delivery to adopt (see Planner): the window moves on while a step runs.
ADOPT_MARGIN_MS = 10_000
# How long a clean stop writes the sweeper's tombstones before it leaves the rest.
SWEEP_CLOSE_S = 5.0
# How long a step replays the changelog of a partition in restore (see
# Service._restore_slice): the served partitions' deliveries wait at most about this.
RESTORE_SLICE_S = 0.2
# How long one read of a partition's earliest offset may take (then it is an outage).
EARLIEST_S: Final = 10.0


def _produce(producer: Producing, record: Record, report: Report, acks: Receipts) -> None:
    """Produce one of a step's intake records (a dead letter, a forward, an answer), or
    keep its refusal as a failure of the step (see :meth:`Receipts.refused`)."""
    try:
        produce(producer, record.topic, key=record.key, value=record.value,
                partition=record.partition, headers=record.headers, on_delivery=report)
    except KafkaException as exc:
        acks.refused(exc, record.topic, record.key)


@dataclass(frozen=True, slots=True)
class Terms:
    """What the topics' layout and the settings fix for the service's whole life."""

    partitions: int
    """The request partitions the changelog has, and so those served."""
    outcomes: int | None
    """The outcomes topic's partitions (None: the topic does not exist)."""
    limits: durations.Limits
    """The longest delays the requests topic's retention allows."""
    policy: TargetPolicy
    """Which targets a request may name."""
    id_window_ms: int
    """How long a schedule id's end is remembered (see :class:`IdWindow`)."""
    tombstones_kept_ms: int
    """How long the changelog keeps tombstones (a store older than this is stale)."""
    broker_tolerance_ms: int | None
    """How far the broker's clock may lag (None: no broker-clock guard)."""
    status: bool = False
    """Whether the status topic exists (else the instance publishes no status)."""

    @classmethod
    def of(cls, settings: Settings, layout: Layout, broker_tolerance_ms: int | None) -> Terms:
        """The terms of ``layout`` and ``settings``."""
        return cls(layout.partitions, layout.outcomes, durations.limits_for_retention(
            layout.retention_ms, settings.retention_margin_ms, settings.levels),
            settings.target_policy(), id_window_ms(layout.retention_ms),
            layout.tombstones_kept_ms, broker_tolerance_ms, layout.status)


@dataclass(slots=True)
class Owned:
    """The request partitions this instance serves now, each with its index, its planner
    and the offset intake has applied it up to (once it has one); the RocksDB memory
    budget their stores share."""

    memory: StoreMemory = field(default_factory=StoreMemory)
    indexes: dict[int, PartitionIndex] = field(default_factory=dict)
    planners: dict[int, Planner] = field(default_factory=dict)
    consumed: dict[int, int] = field(default_factory=dict)
    # Assigned partitions whose stores are behind the changelog, in the order they are
    # replayed (see Service._restore_slice); their requests are paused meanwhile.
    restoring: dict[int, Restore] = field(default_factory=dict)
    # Restored partitions whose paused requests resume once the consumer takes a seek to
    # their offset (not while it still looks their position up): see Service._resume.
    resuming: dict[int, TopicPartition] = field(default_factory=dict)


@dataclass(slots=True)
class Restore:
    """An assigned partition whose store is being caught up from the changelog."""

    partition: TopicPartition  # as assigned: its offset is the group's committed one
    index: PartitionIndex
    staleness: Staleness
    health: contextlib.ExitStack  # holds Health.restoring() while it lasts
    replay: Replay | None = None  # None until its turn comes
    done: int = 0  # changelog offsets replayed so far (for the status topic)
    total: int | None = None  # of those to replay; None until the replay begins


@dataclass(slots=True)
class _Clients:
    """What :meth:`Service.start` built: the group consumer, the checkpoint, the readers,
    the delivery and the sweeper; they live and close together."""

    consumer: Consuming
    group: dict[str, str | int | bool]  # the consumer's config: a rejoin builds it again
    checkpoint: Checkpoint
    reader: Reading
    restorer: Restoring
    guard: BrokerGuard | None
    takeover: Takeover
    delivery: Delivery
    sweeper: Sweeper
    feed: ControlFeed
    status: StatusBoard


class Service:
    """The delay service for the partitions its consumer group assigns it.

    Clients are created by :meth:`start` (from ``clients``, real Kafka clients
    by default), not in ``__init__``. Drive it with :meth:`run` (until
    :meth:`stop`) or, in tests, with :meth:`step`.

    When the changelog is stamped with ``LogAppendTime``, an entry goes out
    only once ``clock`` and the broker's clock (plus ``broker_tolerance_ms``)
    both say it is due (:class:`kdelay.engine.skew.BrokerGuard`). None turns that
    off: for tests that move a manual clock ahead of the broker's.

    ``phase_clock`` times the loop's phases (``kdelay_loop_phase_seconds``);
    by default ``clock.monotonic``. A benchmark passes ``time.thread_time``,
    so that the histogram splits the loop's CPU time by phase.
    """

    def __init__(self, settings: Settings, clock: Clock, layout: Layout,
                 metrics: Metrics | None = None, clients: ClientFactory | None = None,
                 broker_tolerance_ms: int | None = BROKER_TOLERANCE_MS,
                 phase_clock: Callable[[], float] | None = None) -> None:
        self.settings = settings
        self._terms = Terms.of(settings, layout,
                               broker_tolerance_ms if layout.broker_time else None)
        self.metrics = metrics or Metrics()
        self._clock = clock
        self._availability = Availability(ClientErrors(), clock,
                                          self.metrics.cluster.kafka_available)
        self._factory = clients or KafkaClients(settings, self._availability.errors)
        self._lock: StateDirLock | None = None
        outlook = Outlook(self.metrics, settings, layout)
        self._housekeeper = Housekeeper(clock, self.metrics, outlook, settings.state_dir)
        self._watch = PartitionWatch(settings, self.metrics, layout.partitions)
        if layout.outcomes is None:
            log.warning("outcome records are not published: topic %s does not exist (run "
                        "`kdelay topics create`)", settings.outcomes_topic)
        if not layout.status:
            log.warning("this instance's status is not published: topic %s does not exist (run "
                        "`kdelay topics create`)", settings.status_topic)
        if not layout.broker_time:
            unmeasured(settings.changelog_topic)
        self._owned = Owned(StoreMemory(settings.rocksdb_cache_mb * MB,
                                        settings.rocksdb_write_buffer_mb * MB))
        self._stopping = False
        self._clients: _Clients | None = None
        self._started_at = 0.0  # when the last step started (monotonic)
        self.health = Health.of(self._factory, settings, clock, self.metrics,
                                lambda: self._availability.errors.unreachable() is not None)
        self._phases = PhaseTimer(self.metrics.loop.phases, phase_clock or clock.monotonic)

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Lock the state dir, create the Kafka clients and join the consumer group.

        The state dir is locked before any client exists: a second process
        started on it stops with ``state-dir-in-use`` before it joins the
        group under the same static member id, which would fence this one.
        """
        s = self.settings
        try:
            self._lock = self._lock or StateDirLock(s.state_dir)
        except IndexLocked as exc:
            raise ServiceError("state-dir-in-use",
                               f"{exc}; give every instance its own --state-dir") from exc
        me = identity.of(s)
        log.info("instance %s (group %s, transactional id %s; delivery hot path %s)",
                 me.member_id, s.group_id, me.transactional_id, native.mode)
        skew = ClockSkew(self._clock, self.metrics.cluster.clock_skew)
        checkpoint = checkpoints.for_settings(
            s, self._factory.producer, me.transactional_id, self._clock, self.metrics,
            lambda: self._stopping, skew.observe, self._availability.waiting,
            lambda: self._availability.errors.unreachable() is not None,
            owner_metadata(me.member_id, me.transactional_id))
        takeover = Takeover(s.group_id, me.transactional_id, lambda: AdminClient(s.client_config(
            "admin")), self._factory.producer, transactions=s.guarantee is Guarantee.EXACTLY_ONCE)
        reader = self._factory.reader()
        guard = self._guard(skew)
        sweeper = Sweeper(self._factory.producer("sweeper", **{
            "enable.idempotence": True, "linger.ms": 5, "message.timeout.ms": 0,
            "delivery.report.only.error": True}), s.changelog_topic, self.metrics)
        feed = self._follow_controls()
        delivery = Delivery(
            DeliveryConfig(s.requests_topic, s.changelog_topic, s.dlq_topic, s.lookahead_ms,
                           s.batch_size, s.delivery_attempts, s.retry_backoff_ms,
                           s.retry_backoff_max_ms, self._terms.policy, s.delivery_retry_ms),
            checkpoint.targets, checkpoint.internal, reader, self._clock, self.metrics,
            checkpoint.durability, by_service_clock if guard is None else guard.release_ms,
            outage=lambda: self._availability.errors.unreachable() is not None,
            away=self._availability.errors.unreachable_now, controls=feed.controls)
        group: dict[str, str | int | bool] = {
            "group.id": s.group_id, "enable.auto.commit": checkpoint.auto_commit,
            "auto.commit.interval.ms": 1000, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest", "isolation.level": "read_committed",
            **membership(me, s.session_timeout_ms, given=s.kafka_config),
            **prefetch(s.kafka_config)}
        status = StatusBoard(self._factory.producer("status", **PRODUCER_CONFIG)
                             if self._terms.status else None, s.status_topic, me.member_id)
        self._clients = _Clients(self._join(group), group, checkpoint, reader,
                                 self._factory.restorer(), guard, takeover, delivery, sweeper,
                                 feed, status)
        self.health.start()

    def _follow_controls(self) -> ControlFeed:
        """The controls topic, read to its end: no record goes out before the pauses
        in force are known. ServiceError ``controls-unreadable`` when it cannot be."""
        config: dict[str, str | int | bool] = {
            "group.id": CONTROLS_GROUP, "enable.auto.commit": False,
            "enable.auto.offset.store": False}
        consumer = self._factory.consumer("controls", **config)
        feed = ControlFeed(cast(Following, consumer), self.settings.controls_topic, Controls(),
                           self._clock)
        try:
            feed.catch_up()
        except KafkaException as exc:
            feed.close()
            raise ServiceError("controls-unreadable", str(exc.args[0])) from exc
        return feed

    def _join(self, group: dict[str, str | int | bool]) -> Consuming:
        """A new group consumer with the ``group`` config, subscribed to the requests topic."""
        consumer = self._factory.consumer("intake", **group)
        consumer.subscribe([self.settings.requests_topic], on_assign=guarded(self._on_assign),
                           on_revoke=guarded(self._on_revoke), on_lost=guarded(self._on_lost))
        return consumer

    def _guard(self, skew: ClockSkew) -> BrokerGuard | None:
        """The broker-clock guard, its first probe on its way; None when it is off."""
        tolerance_ms = self._terms.broker_tolerance_ms
        if tolerance_ms is None:
            return None
        plain: dict[str, str | int | bool] = {
            "enable.idempotence": False, "acks": "all", "linger.ms": 0}
        producer = self._factory.producer("clock", **plain)
        guard = BrokerGuard(skew, producer, self.settings.changelog_topic, self._clock,
                            tolerance_ms)
        guard.probe()
        return guard

    def run(self) -> None:
        """Step until :meth:`stop` is called, then finish the work in flight and close.

        Raises :class:`ServiceError` when the service cannot go on, among
        others when a Kafka client reports a fatal error (see :meth:`step`).
        """
        try:
            self.start()
            while not self._stopping:
                self.step()
        finally:
            self.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step (signal-safe)."""
        self._stopping = True

    def close(self) -> None:
        """Finish produces in flight, commit offsets, leave the group, close the stores,
        release the state dir."""
        clients = self._clients
        self._stopping = True
        self.health.close()
        try:
            if clients is not None:
                try:
                    clients.consumer.close()  # revokes: the checkpoint finishes the work
                finally:
                    self._clients = None
                    self._close_partitions(clients, list(self._owned.indexes))
                    clients.checkpoint.close()
                    clients.sweeper.close(SWEEP_CLOSE_S)
                    clients.reader.close()
                    clients.restorer.close()
                    if clients.guard is not None:
                        clients.guard.close()
                    clients.feed.close()
                    clients.status.close(self._clock.now_ms())
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def owned(self) -> list[int]:
        """Return the request partitions this instance serves now."""
        return sorted(self._owned.indexes)

    @property
    def indexes(self) -> Mapping[int, PartitionIndex]:
        """The open index of every owned partition (read-only view; for tools and tests)."""
        return MappingProxyType(self._owned.indexes)

    def step(self, max_wait_ms: int | None = None) -> None:
        """Take in one batch of requests, deliver what is due, settle the outcomes.

        The order is the same under both guarantees (the checkpoint decides
        what each part means, see :mod:`kdelay.engine.commit`): plan the batch,
        produce what is due, write the plans' records, make them durable,
        apply them to the indexes, settle delivery reports. Each phase's time
        goes to ``kdelay_loop_phase_seconds``; a step of a second or more is
        logged with its phases. The step waits
        for requests no longer than until the next due entry, and no longer
        than ``max_wait_ms`` (for tests that move a manual clock). Rebalance
        callbacks run inside the consume, before any produce of the step, so
        they never meet an open transaction.

        Raises :class:`ServiceError` (``fenced``, ``kafka-fatal``) when a
        client reported a fatal error: it can never work again, and the
        process must end rather than run on serving nothing. The end of each
        step sets ``kdelay_last_step_timestamp_seconds``, the loop's heartbeat.
        """
        self._check_fatal()
        clients, delivery = self._started()
        if self._owned.restoring:
            self._restore_slice(clients.consumer)
        if self._owned.resuming:
            self._resume(clients.consumer)
        checkpoint, indexes = clients.checkpoint, self._owned.indexes
        reachable = self._availability.reachable(checkpoint.internal, self.settings.requests_topic)
        phases = self._phases
        phases.start()
        if clients.guard is not None:
            clients.guard.poll()
        clients.feed.poll()
        wait_ms = delivery.wait_ms()
        if checkpoint.awaiting():
            wait_ms = min(wait_ms, ACK_WAIT_MS)
        if reachable and clients.sweeper.waiting(indexes):
            wait_ms = min(wait_ms, STEP_MS)
        started, self._started_at = self._started_at, self._clock.monotonic()
        gather_ms = STEP_MS - int((self._started_at - started) * 1000)
        wait_ms = max(wait_ms, gather_ms)
        if max_wait_ms is not None:
            wait_ms = min(wait_ms, max_wait_ms)
        if self._owned.restoring:  # the next restore slice waits for no request
            wait_ms = 0
        plans = self._plan(take(clients.consumer, self.settings.batch_size, wait_ms / 1000,
                                gather_ms / 1000))
        phases.lap("consume")
        due = reachable and delivery.prepare(indexes)
        phases.lap("read-ahead")
        if reachable and checkpoint.begin(bool(plans) or due):
            delivery.dispatch()
            phases.lap("dispatch")
            batch = self._write(plans, checkpoint, delivery)
            phases.lap("write")
            outcomes = checkpoint.commit(batch, self._offsets_after(plans), clients.consumer,
                                         delivery, indexes)
            phases.lap("commit")
            for done, durable in outcomes:
                if durable:
                    self._apply(done, checkpoint, clients.consumer, delivery)
                else:
                    self._give_back(done, clients.consumer, delivery)
            phases.lap("apply")
        elif plans:  # nothing may be produced (Kafka away): read the requests again later
            self._give_back(Batch(plans, {}, checkpoint.writer.acks()), clients.consumer,
                            delivery)
        checkpoint.settle(delivery, indexes)
        phases.lap("settle")
        if reachable:
            clients.sweeper.step(indexes, busy=not delivery.idle() or delivery.wait_ms() == 0)
            phases.lap("sweep")
        self._housekeeping(reachable)
        phases.lap("housekeeping")
        phases.finish()
        self.health.beat(self._clock.now_ms())

    def _check_fatal(self) -> None:
        """Raise :class:`ServiceError` if a client reported a fatal error.

        A fence during or right after an outage is the clients' own doing:
        the group consumer whose session timed out while the coordinator (or its
        broker alone) was away rejoins under the same static id and is fenced by
        that rejoin (librdkafka issue 3437), and the coordinator fences the
        transactional producer whose transaction it timed out. Then the
        consumer is replaced (the checkpoint replaces the producer) instead
        of ending the service.
        """
        reported = self._availability.errors.take_fatal()
        if reported is None:
            return
        client, error = reported
        if not self._own_fence(error, client):
            raise self._fatal(error, client)

    def _own_fence(self, error: KafkaError, client: str) -> bool:
        """Whether ``error`` is a fence an outage caused; if so, replace the consumer."""
        if fatal_code(error) != "fenced" or not self._availability.just_away():
            return False
        if client == "intake":
            self._rejoin(error)
        self._availability.errors.forgive()  # also what the old consumer reported while it closed
        return True

    def _rejoin(self, error: KafkaError) -> None:
        """Replace the group consumer its own rejoin fenced after an outage."""
        clients, _ = self._started()
        log.warning("intake: %s, right after Kafka or its group coordinator was away: the "
                    "consumer's own rejoin fenced it; a new consumer joins the group", error.str())
        try:
            clients.consumer.close()
        except Exception as exc:  # a fenced consumer's close may fail in any way: it is dropped
            log.debug("closing the fenced consumer: %s", exc)
        self._close_partitions(clients, list(self._owned.indexes))
        clients.consumer = self._join(clients.group)

    def _fatal(self, error: KafkaError, client: str) -> ServiceError:
        """The error that ends the service after ``client`` reported the fatal ``error``."""
        code = fatal_code(error)
        if code == "fenced":
            return ServiceError(code, (
                f"{client}: {error.str()}; another process runs with this instance's ids "
                f"(group {self.settings.group_id}, member {identity.of(self.settings).member_id}):"
                " give every instance its own --state-dir, or its own --instance-id"))
        return ServiceError(code, f"{client}: fatal Kafka client error: {error.str()}")

    def _housekeeping(self, reachable: bool) -> None:
        """Refresh the gauges and readiness, if it is time; check the requests' partitions
        only while Kafka answers (else the step would wait out the metadata call's timeout)."""
        clients, _ = self._started()
        if self._housekeeper.tick(self._owned.indexes, self._owned.consumed, self.health.marks):
            self.health.judge(Observation.of(reachable, self._owned.indexes, self._owned.consumed,
                                             clients.checkpoint.writer))
            if clients.guard is not None:
                clients.guard.tick()
            self.metrics.controls.show(clients.feed.rows(clients.delivery.held_back()))
        if reachable:
            self._watch.tick(self._clock.now_ms(), clients.checkpoint.internal)
        clients.status.tick(self._clock.now_ms(), self._statuses)

    def _statuses(self) -> dict[int, PartitionStatus]:
        """Each partition this instance serves or restores, as the status topic tells it."""
        found = dict.fromkeys(self._owned.indexes, PartitionStatus(SERVING))
        for partition, restore in self._owned.restoring.items():
            found[partition] = PartitionStatus(RESTORING, restore.done, restore.total)
        return found

    def _started(self) -> tuple[_Clients, Delivery]:
        if self._clients is None:
            raise RuntimeError("Service.step() before start()")
        return self._clients, self._clients.delivery

    # -- intake -----------------------------------------------------------------

    def _plan(self, messages: list[Message]) -> list[Plan]:
        if not messages:  # most steps at a steady rate: nothing to time or group
            return []
        by_partition: dict[int, list[Message]] = {}
        run: list[Message] = []  # the list of ``current``: a batch comes in runs of a partition
        current = -1
        for message in messages:
            error = _ERROR(message)
            if error is not None:
                if error.fatal() or error.code() == KafkaError._FATAL:
                    if self._own_fence(error, "intake"):
                        return []  # the old consumer's batch: the new one reads it again
                    raise self._fatal(error, "intake")
                log.warning("requests consumer: %s", error.str())
                continue
            partition = _PARTITION(message) or 0
            if partition != current:
                current, run = partition, by_partition.setdefault(partition, [])
            run.append(message)
        consumed = self._owned.consumed
        stale = [p for p, run in by_partition.items()
                 if (_OFFSET(run[0]) or 0) < consumed.get(p, 0)]
        for partition in stale:
            run = self._from_start(partition, by_partition.pop(partition), consumed[partition])
            if run:
                by_partition[partition] = run
        now = self._clock.now_ms()
        delays: list[int] = []  # each planner reads a timestamp once and notes its age
        plans = [self._owned.planners[p].plan(p, ms, now, delays) for p, ms in by_partition.items()
                 if p in self._owned.planners]
        self.metrics.intake.delay.observe_ms(delays)
        return plans

    def _from_start(self, partition: int, run: list[Message], start: int) -> list[Message]:
        """``run``'s records from ``start`` on, the offset ``partition`` was sought to.

        Records below it were consumed before: taken in again, they would be
        scheduled twice. librdkafka hands them out when a seek loses to an
        offset lookup still under way (the seek of a restored partition right
        after an assignment at a logical offset); the partition is sought again.
        """
        clients, _ = self._started()
        try:
            clients.consumer.seek(TopicPartition(self.settings.requests_topic, partition, start))
        except KafkaException as exc:  # still looking up: dropped again next batch
            log.debug("partition %d: seeking %d again: %s", partition, start, exc)
        else:
            log.warning("partition %d: the consumer read from offset %d, before the offset %d "
                        "it was sought to; those records are dropped and it is sought again",
                        partition, _OFFSET(run[0]), start)
        return [message for message in run if (_OFFSET(message) or 0) >= start]

    def _write(self, plans: list[Plan], checkpoint: Checkpoint, delivery: Delivery) -> Batch:
        """Produce the plans' changelog records, dead letters, forwards and consumed markers.

        A plan's marker follows its own records on the same partition, so its
        acknowledgement confirms them all. Delivery adopts the new entries due
        soon, so they go out when due whenever the batch is acknowledged.
        """
        writer = checkpoint.writer
        acks = writer.acks()
        floors: dict[int, int | None] = {}
        for plan in plans:
            # Before its records: an index never records a position past them unapplied.
            floors.setdefault(plan.partition, writer.position(plan.partition))
            writer.puts(plan.partition, plan.log_keys, plan.log_values, acks)
            for record in plan.dead_letters:
                _produce(checkpoint.internal, record, acks.dead_letter(), acks)
            for record in plan.forwards:
                _produce(checkpoint.internal, record, acks.forward(), acks)
            for record in plan.answers:  # lost, they lose no schedule: as dead letters
                _produce(checkpoint.internal, record, acks.dead_letter(), acks)
            if plan.changes.consumed is not None:
                checkpoint.mark(plan, acks)
            delivery.adopt(plan.partition, *plan.changes.put_fields(), plan.originals)
        return Batch(plans, {plan.partition: self._owned.indexes[plan.partition] for plan in plans},
                     acks, floors)

    def _apply(self, batch: Batch, checkpoint: Checkpoint, consumer: Consuming,
               delivery: Delivery) -> None:
        """Write a durable batch's plans to their indexes and count them.

        A plan of a partition this instance lost (or lost and got back) since
        it was written is skipped: its offset is not stored, so it is read again.
        """
        for plan in batch.plans:
            partition = plan.partition
            index = self._owned.indexes.get(partition)
            if index is None or index is not batch.indexes[partition]:
                continue
            plan.changes.changelog = checkpoint.position(partition)
            index.apply(plan.changes)
            self._owned.planners[partition].done(plan)
            delivery.forget(plan.changes.deletes)
            delivery.indexed(partition, plan.changes.put_fields()[0])
            consumed = plan.changes.consumed
            if consumed is not None:
                self._owned.consumed[partition] = consumed
                checkpoint.consumed(consumer, partition, consumed)
                delivery.rereads.passed(partition, consumed)
            count_outcomes(self.metrics, plan.outcomes)
            count_conflicts(self.metrics, plan.conflicts)
            if plan.changes.expired:
                self.metrics.intake.ids_expired.inc(len(plan.changes.expired))
            if plan.dead_letters and self.settings.lanes:
                self.metrics.intake.count_lane_refusals((r.headers for r in plan.dead_letters),
                                                 self.settings.lanes)

    def _give_back(self, batch: Batch, consumer: Consuming, delivery: Delivery) -> None:
        """Undo plans that were not made durable: release their cancels, read them again.

        The entries the plans' cancels withheld go out again, the entries they
        adopted are dropped, and the consumer seeks back to each plan's first record.
        """
        for plan in batch.plans:
            planner = self._owned.planners.get(plan.partition)
            if planner is not None:
                planner.done(plan)
            delivery.release(plan.changes.deletes)
            delivery.disown(plan.changes.put_fields()[0])
            if plan.first is not None:
                consumer.seek(TopicPartition(self.settings.requests_topic, plan.partition,
                                             plan.first))

    def _offsets_after(self, plans: list[Plan]) -> list[TopicPartition]:
        """Return the consumed positions of every owned partition once ``plans`` are applied."""
        positions = dict(self._owned.consumed)
        positions.update({p.partition: p.changes.consumed for p in plans
                          if p.changes.consumed is not None})
        return [TopicPartition(self.settings.requests_topic, p, offset)
                for p, offset in sorted(positions.items()) if p in self._owned.indexes]

    # -- partitions -------------------------------------------------------------

    def _on_assign(self, consumer: Consuming, partitions: list[TopicPartition]) -> None:
        clients, _ = self._started()
        terms = self._terms
        beyond = [tp.partition for tp in partitions if tp.partition >= terms.partitions]
        if beyond:
            # Added underneath the running service: no changelog partition backs them.
            self._watch.added(max(beyond) + 1)
            partitions = [tp for tp in partitions if tp.partition < terms.partitions]
        committed = {tp.partition: tp.offset for tp in self._waited(
            lambda: clients.takeover.committed(consumer, partitions, lambda: self._stopping),
            "reading the group's committed offsets")}
        topics = self._topics()
        behind: list[TopicPartition] = []
        for tp in partitions:
            index, restore = self._open(tp)
            if restore is not None:
                # Served once restored from the later of this and the store's own offset;
                # assigned (paused) at it meanwhile, an explicit offset (see _earliest).
                start = committed.get(tp.partition, -1)
                restore.partition.offset = tp.offset = (
                    start if start >= 0 else self._earliest(consumer, tp.partition))
                self._owned.restoring[tp.partition] = restore
                behind.append(tp)
                continue
            self._serve(tp, index, committed.get(tp.partition, -1), topics)
        self.metrics.cluster.rebalances.labels(kind="assign").inc()
        self.metrics.cluster.owned.set(len(self._owned.indexes))
        clients.checkpoint.claim(consumer, partitions)
        self.health.assigned(self._owned.indexes)
        log.info("assigned %s", [tp.partition for tp in partitions])
        consumer.assign([explicit_start(tp) for tp in partitions])
        if behind:  # their requests wait for their stores: see _restore_slice
            consumer.pause(behind)
            log.info("partitions %s: restoring from the changelog, each served once its own "
                     "restore is done", [tp.partition for tp in behind])

    def _earliest(self, consumer: Consuming, partition: int) -> int:
        """The low watermark of a requests partition nothing was committed for yet.

        A partition in restore is assigned paused: assigned at the logical
        earliest offset, librdkafka's lookup of where that is can be lost to
        the pause (an operation it finds outdated), and the partition is then
        never fetched after its resume. Read here, the start is an offset.
        """
        tp = TopicPartition(self.settings.requests_topic, partition)
        return self._waited(lambda: watermarks(consumer, tp, EARLIEST_S)[0],
                            f"reading partition {partition}'s earliest offset")

    def _topics(self) -> Topics:
        """The topics a planner writes to."""
        outcomes = self._terms.outcomes
        return Topics(self.settings.requests_topic, self.settings.changelog_topic,
                      self.settings.dlq_topic,
                      None if outcomes is None else self.settings.outcomes_topic, outcomes or 1)

    def _serve(self, tp: TopicPartition, index: PartitionIndex, committed: int,
               topics: Topics) -> None:
        """Serve ``tp`` from ``index``: intake from the later of the group's ``committed``
        offset and the store's own, a planner, delivery from the store."""
        _, delivery = self._started()
        terms = self._terms
        local = index.offset(CONSUMED)
        start = max(committed, -1 if local is None else local)
        if start >= 0:  # else the consumer starts at the earliest offset
            tp.offset = self._owned.consumed[tp.partition] = start
        self._owned.indexes[tp.partition] = index
        # An empty index holds nothing a request read again could find pending.
        start = max(self._owned.consumed.get(tp.partition, 0), 0)
        rereads = None if index.first_key() is None else start + REREAD_RECORDS
        self._owned.planners[tp.partition] = Planner(
            topics, terms.limits, index.id_state, delivery.withhold, terms.policy,
            terms.partitions, IdWindow(terms.id_window_ms, self._clock, index),
            rereads, delivery.rereads.watch(tp.partition, start, rereads),
            originals_ms=self.settings.lookahead_ms + ADOPT_MARGIN_MS)

    def _open(self, tp: TopicPartition) -> tuple[PartitionIndex, Restore | None]:
        """Open a partition's index; with the Restore that catches it up from the changelog
        when it is behind (Kafka waited for), else None (the store is in step)."""
        clients, _ = self._started()
        partition = tp.partition
        path = store_path(self.settings.state_dir, self.settings.requests_topic, partition)
        staleness = Staleness(self._clock.now_ms(), self._terms.tombstones_kept_ms)
        try:
            index, behind = self._waited(
                lambda: open_checked(path, partition, clients.restorer, staleness,
                                     self._owned.memory), f"restoring partition {partition}")
        except IndexLocked as exc:
            raise ServiceError("state-dir-in-use",
                               f"{exc}; give every instance its own --state-dir") from exc
        if not behind:
            return restored(index, staleness), None
        health = contextlib.ExitStack()
        health.enter_context(self.health.restoring())
        return index, Restore(TopicPartition(tp.topic, partition, tp.offset), index, staleness,
                              health)

    def _restore_slice(self, consumer: Consuming) -> None:
        """Replay the first partition in restore for about :data:`RESTORE_SLICE_S`; serve it
        once it is done (its paused requests resumed at their offset).

        One partition at a time, a slice per step: the partitions already
        served go on delivering between slices, whatever the others still replay.
        """
        clients, _ = self._started()
        partition, restore = next(iter(self._owned.restoring.items()))
        if restore.replay is None:
            state = self.metrics.state
            logged = logged_progress(partition, state.restored, state.restore_remaining,
                                     state.restore_total)

            def progress(done: int, all_: int) -> None:
                restore.done, restore.total = done, all_
                logged(done, all_)

            restore.replay = self._waited(
                lambda: clients.restorer.begin(restore.index, progress),
                f"restoring partition {partition}")
        replay = restore.replay
        if replay is not None and not replay.advance(RESTORE_SLICE_S):
            return
        applied = 0 if replay is None else replay.applied
        self._end_restore(partition)
        tp = restore.partition
        committed = tp.offset
        self._serve(tp, restored(restore.index, restore.staleness), committed, self._topics())
        # Intake starts at the later of the group's committed offset and the store's own
        # (_serve sets it), sought explicitly: the consumer's own start is the group's.
        self._owned.resuming[partition] = TopicPartition(
            tp.topic, partition, tp.offset if tp.offset >= 0 else OFFSET_INVALID)
        self._resume(consumer)
        self.metrics.cluster.owned.set(len(self._owned.indexes))
        self.health.assigned([partition])
        log.info("partition %d: %d changelog records replayed; serving it", partition, applied)

    def _resume(self, consumer: Consuming) -> None:
        """Resume the requests of restored partitions, each after a seek to its offset.

        A seek fails while the consumer still looks up the partition's position
        (``_STATE``): that partition stays paused and is tried again next step.
        """
        for partition, tp in list(self._owned.resuming.items()):
            if tp.offset != OFFSET_INVALID:
                try:
                    consumer.seek(tp)
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError._STATE:
                        raise
                    continue
            del self._owned.resuming[partition]
            consumer.resume([TopicPartition(tp.topic, partition)])

    def _end_restore(self, partition: int, close: bool = False) -> None:
        """Forget ``partition``'s restore (closing its store too with ``close``)."""
        restore = self._owned.restoring.pop(partition, None)
        if restore is None:
            return
        state = self.metrics.state
        for gauge in (state.restore_remaining, state.restore_total):
            with contextlib.suppress(KeyError):
                gauge.remove(str(partition))
        try:
            if restore.replay is not None:
                restore.replay.close()
            if close:
                restore.index.close()
        finally:
            restore.health.close()

    def _waited(self, call: Callable[[], T], what: str) -> T:
        """``call()``, waiting while Kafka does not answer it (:meth:`Availability.waited`)."""
        return self._availability.waited(call, what, lambda: self._stopping)

    def _on_revoke(self, consumer: Consuming, partitions: list[TopicPartition]) -> None:
        clients, delivery = self._started()
        self.metrics.cluster.rebalances.labels(kind="revoke").inc()
        try:
            for batch in clients.checkpoint.drain():
                self._apply(batch, clients.checkpoint, consumer, delivery)
            clients.checkpoint.revoke(consumer, delivery, self._owned.indexes)
            if self._stopping:
                # A clean stop writes the tombstones it still owes (for a while).
                clients.sweeper.drain({tp.partition: self._owned.indexes[tp.partition]
                                     for tp in partitions if tp.partition in self._owned.indexes},
                                    SWEEP_CLOSE_S)
        finally:
            self._close_partitions(clients, [tp.partition for tp in partitions])

    def _on_lost(self, _: Consuming, partitions: list[TopicPartition]) -> None:
        clients = self._started()[0]
        log.warning("partitions lost: %s", [tp.partition for tp in partitions])
        self.metrics.cluster.rebalances.labels(kind="lost").inc()
        self._close_partitions(clients, [tp.partition for tp in partitions])

    def _close_partitions(self, clients: _Clients, partitions: list[int]) -> None:
        """Forget ``partitions``: their delivery, their tombstones owed, their planners.
        ``clients`` is passed, not read from the service: :meth:`close` calls this
        after it has let go of its clients."""
        for partition in partitions:
            self._end_restore(partition, close=True)
            self._owned.resuming.pop(partition, None)
            clients.delivery.drop_partition(partition)
            clients.sweeper.drop_partition(partition)
            self._owned.planners.pop(partition, None)
            self._owned.consumed.pop(partition, None)
            index = self._owned.indexes.pop(partition, None)
            if index is not None:
                index.close()
        self.metrics.cluster.owned.set(len(self._owned.indexes))
