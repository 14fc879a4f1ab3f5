"""The kdelay service: one loop that owns some request partitions.

Each :meth:`Service.step` does, in order: delivery (read ahead, produce what is
due), intake (consume up to a batch, waiting no longer than until the next due
entry), and settling (apply delivery reports to the indexes). Partitions come
and go through an ordinary consumer group; on assignment a partition's index is
opened and caught up from the changelog before it serves, on revocation the
work in flight is finished and offsets committed, and the index is closed in
``finally``.

Intake stores a request offset only after the changelog and DLQ records
derived from it are acknowledged and the index batch is written, so a crash at
any point re-reads the request and re-derives the same index keys.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from types import FrameType, MappingProxyType

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kdelay import envelope, identity
from kdelay.callbacks import guarded
from kdelay.changelog import Positions, Progress, Restorer, open_restored
from kdelay.clock import Clock, SystemClock
from kdelay.delivery import Delivery, DeliveryConfig
from kdelay.index import CONSUMED, IndexLocked, PartitionIndex, store_path
from kdelay.intake import Outcome, Plan, Planner, Record, Topics, consumed_marker
from kdelay.metrics import Metrics
from kdelay.originals import OriginalReader
from kdelay.outlook import Outlook
from kdelay.polling import take
from kdelay.settings import Guarantee, Settings
from kdelay.skew import ClockSkew
from kdelay.topics import Layout, check_layout

log = logging.getLogger(__name__)

HOUSEKEEPING_EVERY_MS = 5_000
# Most delivered-id markers one partition drops per housekeeping round, so a
# backlog of them never stalls a step.
PRUNE_LIMIT = 10_000
TXN_MARGIN_MS = 10_000
# Collect the youngest generation every 50 000 container allocations instead of
# 700, and the older ones far more rarely. See :func:`tune_gc`.
GC_THRESHOLDS = (50_000, 50, 100)
ACK_POLL_S = 0.001


def tune_gc() -> None:
    """Keep the cyclic garbage collector from pausing delivery.

    Every request and delivery allocates a few containers that live for the
    length of a delay, so with CPython's default thresholds full collections
    walk tens of thousands of live objects: 19 full collections of up to
    170 ms in 20 s at 5 k/s (docs/benchmarks.md). The hot path creates no
    reference cycles; objects alive at start-up are frozen out of every
    collection, and the thresholds make collections rare.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def membership(me: identity.Identity, session_timeout_ms: int,
               given: Mapping[str, str]) -> dict[str, str | int | bool]:
    """Return the consumer settings that make an instance a static group member.

    A restarted instance rejoins under the same ``group.instance.id`` and gets
    its partitions back without a rebalance; an instance that died for good
    holds its partitions until ``session_timeout_ms`` passes, then the group
    hands them to the survivors. Heartbeats go every second (a tenth of the
    session timeout when that is shorter): a survivor learns of the rebalance
    from its next heartbeat, so librdkafka's 3 s would add up to 3 s to every
    failover. A key the user set in ``--kafka-config`` (``given``) is left to
    that setting.
    """
    wanted: dict[str, str | int | bool] = {
        "group.instance.id": me.member_id, "session.timeout.ms": session_timeout_ms,
        "heartbeat.interval.ms": max(1, min(1_000, session_timeout_ms // 10))}
    return {key: value for key, value in wanted.items() if key not in given}


class ServiceError(Exception):
    """The service cannot go on (its own topics refuse writes); ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Service:
    """The delay service for the partitions its consumer group assigns it.

    Clients are created by :meth:`start`, not in ``__init__``. Drive it with
    :meth:`run` (until :meth:`stop`) or, in tests, with :meth:`step`.
    """

    def __init__(self, settings: Settings, clock: Clock, layout: Layout,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._clock = clock
        # Delivered-id markers live as long as a request they answer can be read.
        self._id_ttl_ms = layout.retention_ms
        self._limits = envelope.limits_for_retention(
            layout.retention_ms, settings.retention_margin_ms, settings.levels)
        self._topics = Topics(settings.requests_topic, settings.changelog_topic,
                              settings.dlq_topic)
        self._skew = ClockSkew(clock, self.metrics.clock_skew)
        self._outlook = Outlook(self.metrics, settings, layout)
        if not layout.broker_time:
            log.warning("clock skew against the broker is not measured: changelog topic %s "
                        "does not use LogAppendTime (kafka-configs.sh --alter --entity-type "
                        "topics --entity-name %s --add-config "
                        "message.timestamp.type=LogAppendTime)",
                        settings.changelog_topic, settings.changelog_topic)
        self._indexes: dict[int, PartitionIndex] = {}
        self._planners: dict[int, Planner] = {}
        self._positions = Positions()
        self._stopping = False
        self._next_housekeeping_ms = 0
        self._consumed: dict[int, int] = {}
        self._consumer: Consumer | None = None

    # -- lifecycle --------------------------------------------------------------

    @property
    def exactly_once(self) -> bool:
        """Whether this service runs with Kafka transactions."""
        return self.settings.guarantee is Guarantee.EXACTLY_ONCE

    def start(self) -> None:
        """Create the Kafka clients and join the consumer group."""
        s = self.settings
        me = identity.of(s)
        log.info("instance %s (group %s, transactional id %s)", me.member_id, s.group_id,
                 me.transactional_id)
        if self.exactly_once:
            txn: dict[str, str | int | bool] = {
                "transactional.id": me.transactional_id, "linger.ms": 2,
                "partitioner": s.partitioner,
                "message.timeout.ms": s.delivery_timeout_ms,
                "transaction.timeout.ms": s.delivery_timeout_ms + TXN_MARGIN_MS}
            producer = Producer(s.client_config("transactions", **txn))
            producer.init_transactions(30)
            self._targets = self._internal = producer
        else:
            targets: dict[str, str | int | bool] = {
                "enable.idempotence": True, "linger.ms": 2, "partitioner": s.partitioner,
                "message.timeout.ms": s.delivery_timeout_ms}
            self._targets = Producer(s.client_config("targets", **targets))
            self._internal = Producer(s.client_config("internal", **{
                "enable.idempotence": True, "linger.ms": 2, "message.timeout.ms": 0}))
        self._reader = OriginalReader(s.client_config("originals"), s.requests_topic)
        self._restorer = Restorer(s.client_config("restore"), s.changelog_topic)
        self._delivery = Delivery(
            DeliveryConfig(s.requests_topic, s.changelog_topic, s.dlq_topic, s.lookahead_ms,
                           s.batch_size, s.delivery_attempts, s.retry_backoff_ms,
                           s.retry_backoff_max_ms),
            self._targets, self._internal, self._reader, self._clock, self.metrics,
            self._positions, transactional=self.exactly_once)
        group: dict[str, str | int | bool] = {
            "group.id": s.group_id, "enable.auto.commit": not self.exactly_once,
            "auto.commit.interval.ms": 1000, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest", "isolation.level": "read_committed",
            **membership(me, s.session_timeout_ms, given=s.kafka_config)}
        self._consumer = Consumer(s.client_config("intake", **group))
        self._consumer.subscribe([s.requests_topic], on_assign=guarded(self._on_assign),
                                 on_revoke=guarded(self._on_revoke),
                                 on_lost=guarded(self._on_lost))

    def run(self) -> None:
        """Step until :meth:`stop` is called, then finish the work in flight and close."""
        self.start()
        try:
            while not self._stopping:
                self.step()
        finally:
            self.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step (signal-safe)."""
        self._stopping = True

    def close(self) -> None:
        """Finish produces in flight, commit offsets, leave the group, close the stores."""
        if self._consumer is None:
            return
        consumer, self._consumer = self._consumer, None
        try:
            consumer.close()
        finally:
            self._close_partitions(list(self._indexes))
            self._targets.flush(10)
            self._internal.flush(10)
            self._reader.close()
            self._restorer.close()

    def owned(self) -> list[int]:
        """Return the request partitions this instance serves now."""
        return sorted(self._indexes)

    @property
    def indexes(self) -> Mapping[int, PartitionIndex]:
        """The open index of every owned partition (read-only view; for tools and tests)."""
        return MappingProxyType(self._indexes)

    def step(self, max_wait_ms: int | None = None) -> None:
        """Take in one batch of requests, deliver what is due, settle the outcomes.

        The step waits for requests no longer than until the next due entry, and
        no longer than ``max_wait_ms`` (for tests that move a manual clock).
        Rebalance callbacks run inside the consume, before any produce of the
        step, so they never meet an open transaction.
        """
        if self._consumer is None:
            raise RuntimeError("Service.step() before start()")
        wait_ms = self._delivery.wait_ms()
        if max_wait_ms is not None:
            wait_ms = min(wait_ms, max_wait_ms)
        messages = take(self._consumer, self.settings.batch_size, wait_ms / 1000)
        plans = self._plan(messages)
        if self.exactly_once:
            self._transact(plans)
        else:
            self._step_at_least_once(plans)
        self._housekeeping()

    # -- at-least-once ------------------------------------------------------------

    def _step_at_least_once(self, plans: list[Plan]) -> None:
        # What is due goes out before the intake batch waits for its
        # acknowledgements, and what intake adopted goes out right after.
        self._delivery.tick(self._indexes)
        if plans:
            if self._write_durably(plans):
                self._apply(plans)
            else:
                self._release(plans)
        self._delivery.tick(self._indexes)
        self._targets.poll(0)
        self._internal.poll(0)
        self._delivery.settle(self._indexes)

    def _write_durably(self, plans: list[Plan]) -> bool:
        """Produce the plans' changelog and DLQ records and wait for every acknowledgement.

        Returns False when the service is asked to stop before they are all
        acknowledged (the batch is then re-read by whoever owns it next).
        Raises :class:`ServiceError` when a changelog write fails for good.
        """
        failures = self._produce_plans(plans)
        while len(self._internal) > 0:
            if self._stopping:
                return False
            # Entries come due while the acknowledgements are awaited.
            self._internal.poll(ACK_POLL_S)
            self._delivery.dispatch()
        for topic, error in failures:
            if topic == self.settings.changelog_topic:
                raise ServiceError("changelog-write-failed",
                                   f"cannot write to {topic}: {error.str()}")
            log.error("dead-letter write to %s failed for good (%s); the request stays "
                      "readable at its origin in the requests topic", topic, error.str())
            self.metrics.changelog_errors.inc()
        return True

    # -- exactly-once -------------------------------------------------------------

    def _transact(self, plans: list[Plan]) -> None:
        """Run one transaction: intake writes, due deliveries, tombstones and offsets."""
        due = self._delivery.prepare(self._indexes)
        if not plans and not due:
            return
        self._internal.begin_transaction()
        failures = self._produce_plans(plans)
        self._delivery.dispatch()
        committed = self._commit(plans, failures)
        self._delivery.finish_transaction(committed, self._indexes)
        if committed:
            self._apply(plans)
        else:
            self._release(plans)
            self._rewind(plans)

    def _commit(self, plans: list[Plan], failures: list[tuple[str, KafkaError]]) -> bool:
        """Commit the open transaction; abort it when any of its records failed.

        Returns whether it committed. Raises :class:`ServiceError` on a fatal
        transaction error, such as being fenced by a newer instance.
        """
        producer = self._internal
        try:
            deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000
            while producer.flush(1.0) > 0 and time.monotonic() < deadline:
                pass
            if failures or self._delivery.has_failures() or len(producer) or self._stopping:
                producer.abort_transaction(30)
                return False
            offsets = self._offsets_after(plans)
            if offsets:
                assert self._consumer is not None  # noqa: S101 - step() checked it
                producer.send_offsets_to_transaction(
                    offsets, self._consumer.consumer_group_metadata(), 30)
            with self.metrics.commit_duration.time():
                producer.commit_transaction(30)
            return True
        except KafkaException as exc:
            error = exc.args[0]
            if error.txn_requires_abort():
                log.warning("transaction aborted: %s", error.str())
                producer.abort_transaction(30)
                return False
            raise ServiceError("transaction-failed", f"transaction failed: {error.str()}") from exc

    def _offsets_after(self, plans: list[Plan]) -> list[TopicPartition]:
        """Return the consumed positions of every owned partition once ``plans`` are applied."""
        positions = dict(self._consumed)
        positions.update({p.partition: p.changes.consumed for p in plans
                          if p.changes.consumed is not None})
        return [TopicPartition(self.settings.requests_topic, p, offset)
                for p, offset in sorted(positions.items()) if p in self._indexes]

    def _release(self, plans: list[Plan]) -> None:
        """Give back to delivery the entries the plans' cancels held back: they were not applied."""
        for plan in plans:
            self._delivery.release(plan.changes.deletes)

    def _rewind(self, plans: list[Plan]) -> None:
        """Seek back to the first record of each aborted plan, so it is read again."""
        assert self._consumer is not None  # noqa: S101 - step() checked it
        for plan in plans:
            if plan.first is not None:
                self._consumer.seek(
                    TopicPartition(self.settings.requests_topic, plan.partition, plan.first))

    # -- intake -----------------------------------------------------------------

    def _plan(self, messages: list[Message]) -> list[Plan]:
        by_partition: dict[int, list[Message]] = defaultdict(list)
        for message in messages:
            error = message.error()
            if error is not None:
                log.warning("requests consumer: %s", error.str())
                continue
            by_partition[int(message.partition() or 0)].append(message)
        return [self._planners[p].plan(p, ms) for p, ms in by_partition.items()
                if p in self._planners]

    def _apply(self, plans: list[Plan]) -> None:
        """Write the plans to their indexes (after their records are durable) and count them."""
        assert self._consumer is not None  # noqa: S101 - step() checked it
        for plan in plans:
            plan.changes.changelog = self._positions.get(plan.partition)
            index = self._indexes[plan.partition]
            index.apply(plan.changes)
            self._delivery.forget(plan.changes.deletes)
            self._delivery.adopt(plan.partition, plan.changes.puts, plan.originals, index)
            consumed = plan.changes.consumed
            if consumed is not None:
                self._consumed[plan.partition] = consumed
                if not self.exactly_once:
                    self._consumer.store_offsets(offsets=[TopicPartition(
                        self.settings.requests_topic, plan.partition, consumed)])
            self._count(plan.outcomes)

    def _count(self, outcomes: list[tuple[Outcome, str]]) -> None:
        """Count a batch's outcomes (one metric update per kind) and log the notable ones."""
        kinds: Counter[Outcome] = Counter()
        reasons: Counter[str] = Counter()
        for outcome, detail in outcomes:
            kinds[outcome] += 1
            if outcome is Outcome.REJECTED:
                reasons[detail.split(":", 1)[0]] += 1
            elif outcome is not Outcome.SCHEDULED:
                log.info("request %s: %s", outcome, detail)
        for outcome, count in kinds.items():
            self.metrics.intake.labels(outcome=str(outcome)).inc(count)
        for reason, count in reasons.items():
            self.metrics.dead_lettered.labels(reason=reason).inc(count)

    def _produce_plans(self, plans: list[Plan]) -> list[tuple[str, KafkaError]]:
        """Produce the plans' changelog and DLQ records; return a list failures land in.

        Every callback collects ``(topic, error)`` for a record that failed. Only
        the consumed-offset marker, a plan's last changelog record on its
        partition, confirms the changelog position: the producer is idempotent,
        so its offset is the highest of the plan's, and the other records' reports
        stay as cheap as possible.
        """
        failures: list[tuple[str, KafkaError]] = []

        def failed(error: KafkaError | None, message: Message) -> None:
            if error is not None:
                failures.append((str(message.topic()), error))

        def marker(error: KafkaError | None, message: Message) -> None:
            failed(error, message)
            if error is None:
                self._positions.confirm(message)
                self._skew.observe(message)

        on_record, on_marker = guarded(failed), guarded(marker)
        for plan in plans:
            for record in (*plan.changelog, *plan.dead_letters):
                self._produce_internal(record, on_record)
            for record in consumed_marker(self._topics, plan):
                self._produce_internal(record, on_marker)
        return failures

    def _produce_internal(self, record: Record,
                          callback: Callable[[KafkaError | None, Message], None]) -> None:
        partition = -1 if record.partition is None else record.partition
        while True:
            try:
                self._internal.produce(record.topic, value=record.value, key=record.key,
                                       partition=partition, headers=record.headers,
                                       on_delivery=callback)
                return
            except BufferError:
                self._internal.poll(0.1)

    # -- partitions -------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        committed = {tp.partition: tp.offset for tp in consumer.committed(partitions, timeout=30)}
        for tp in partitions:
            index = self._open(tp.partition)
            local = index.offset(CONSUMED)
            if local is not None and local > committed.get(tp.partition, -1):
                tp.offset = local
            if tp.offset >= 0:
                self._consumed[tp.partition] = tp.offset
            elif committed.get(tp.partition, -1) >= 0:
                self._consumed[tp.partition] = committed[tp.partition]
            self._indexes[tp.partition] = index
            self._planners[tp.partition] = Planner(self._topics, self._limits, index.id_state,
                                                   self._delivery.withhold)
        self.metrics.rebalances.labels(kind="assign").inc()
        self.metrics.owned.set(len(self._indexes))
        log.info("assigned %s", [tp.partition for tp in partitions])
        consumer.assign(partitions)

    def _open(self, partition: int) -> PartitionIndex:
        """Open a partition's index and catch it up from the changelog before it serves."""
        path = store_path(self.settings.state_dir, self.settings.requests_topic, partition)
        self.metrics.restoring.inc()
        try:
            index, restored = open_restored(path, partition, self._restorer,
                                            self._restore_progress(partition))
        except IndexLocked as exc:
            raise ServiceError("state-dir-in-use",
                               f"{exc}; give every instance its own --state-dir") from exc
        finally:
            self.metrics.restoring.dec()
        log.info("partition %d: %d changelog records replayed", partition, restored)
        return index

    def _restore_progress(self, partition: int) -> Progress:
        last = [0]

        def progress(done: int, total: int) -> None:
            self.metrics.restored.inc(done - last[0])
            last[0] = done
            log.info("partition %d: restored %d/%d changelog offsets", partition, done, total)

        return progress

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.metrics.rebalances.labels(kind="revoke").inc()
        try:
            if not self.exactly_once:
                self._drain()
                self._commit_offsets(consumer)
        finally:
            self._close_partitions([tp.partition for tp in partitions])

    def _on_lost(self, _: Consumer, partitions: list[TopicPartition]) -> None:
        log.warning("partitions lost: %s", [tp.partition for tp in partitions])
        self.metrics.rebalances.labels(kind="lost").inc()
        self._close_partitions([tp.partition for tp in partitions])

    def _drain(self) -> None:
        """Wait for produces in flight and apply their reports, so revoked work is settled."""
        deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000 + 5
        while self._targets.flush(1.0) > 0 and time.monotonic() < deadline:
            pass
        while self._internal.flush(1.0) > 0 and time.monotonic() < deadline:
            pass
        self._delivery.settle(self._indexes)

    def _commit_offsets(self, consumer: Consumer) -> None:
        try:
            consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                log.warning("offset commit failed: %s", exc)

    def _close_partitions(self, partitions: list[int]) -> None:
        for partition in partitions:
            self._delivery.drop_partition(partition)
            self._planners.pop(partition, None)
            self._consumed.pop(partition, None)
            index = self._indexes.pop(partition, None)
            if index is not None:
                index.close()
        self.metrics.owned.set(len(self._indexes))

    def _housekeeping(self) -> None:
        """Every few seconds (service clock): refresh the gauges, drop expired id markers."""
        now = self._clock.now_ms()
        if now < self._next_housekeeping_ms:
            return
        self._next_housekeeping_ms = now + HOUSEKEEPING_EVERY_MS
        expired_before = None if self._id_ttl_ms is None else now - self._id_ttl_ms
        for index in self._indexes.values():
            if expired_before is not None:
                self.metrics.ids_expired.inc(index.prune_ids(expired_before, PRUNE_LIMIT))
        self._outlook.refresh(now, self._indexes, self._consumed, self._consumer)


def run_service(settings: Settings, *, check: bool) -> int:
    """Run the service until SIGTERM or SIGINT; with ``check``, only verify and exit.

    Raises :class:`kdelay.topics.LayoutError` when the topics are missing or
    not co-partitioned, with a message that says how to fix it.
    """
    admin = AdminClient(settings.client_config("admin"))
    layout = check_layout(admin, settings)
    if check:
        print(f"ok: {settings.bootstrap_servers} reachable; {settings.requests_topic}, "
              f"{settings.changelog_topic} ({layout.partitions} partitions, co-partitioned) "
              f"and {settings.dlq_topic} are in place")
        return 0
    service = Service(settings, SystemClock(), layout)
    if settings.metrics_port is not None:
        service.metrics.serve(settings.metrics_port)

    def on_signal(signum: int, _: FrameType | None) -> None:
        log.info("signal %d: finishing the batch in flight", signum)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tune_gc()
    try:
        service.run()
    except ServiceError as exc:
        log.error("error[%s]: %s", exc.code, exc)
        return 1
    return 0
