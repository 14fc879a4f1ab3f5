"""Chaos harness: a cluster's ordinary events under a steady load, and nothing lost.

A cluster of several brokers (``tools/kafka cluster``) serves one ``kdelay run``
per guarantee, side by side, each on topics of its own made by ``kdelay topics
create`` (so with the replication it picks: factor 3 and ``min.insync.replicas=2``
on three brokers). Each gets a steady load of requests with mixed delays
(already due, sub-second, a few seconds), a share with a ``kdelay-id`` placed by
key (so off the id's partition: forwards), some of those followed by a cancel
or a reschedule. While the load runs, a scenario acts on the cluster:

- ``baseline``: nothing (the lateness the others are compared with);
- ``roll``: a rolling restart, each node in turn stopped cleanly (leadership
  moves first), kept down ``--down`` seconds, started, and the next one only
  once every partition is in sync again;
- ``roll-kill``: the same with SIGKILL;
- ``roll-mixed``: the same, the first node killed, the others stopped (the CI
  test's scenario);
- ``outage``: one node killed for longer than every client timeout, then back;
- ``controller``: the active controller (the metadata quorum's leader) killed;
- ``reassign``: the requests, changelog and target partitions reassigned
  (``kafka-reassign-partitions``: every replica list reversed, then preferred
  leaders elected, so each partition's leader moves while kdelay serves);
- ``isr``: the target topic's ``min.insync.replicas`` raised to 3 and a node
  stopped, so the target refuses writes with ``NOT_ENOUGH_REPLICAS`` for
  longer than the produce timeout, then the node back and the setting restored;
- ``coordinators``: the brokers that coordinate kdelay's consumer group and its
  transactions killed one after the other;
- ``scale``: two more instances join each deployment, serve a while and are
  stopped again (1 -> 3 -> 1), best with ``--backlog`` requests pending (due in
  two hours, written and indexed before the load starts) for their partitions'
  restores to move.

When the scenario is done, the load stops, the instances drain, and every
target is read back (``read_committed``) with the outcomes topic:

- lost: a request that had to be delivered (not cancelled) and was not;
- early: a delivery before its due time (a rescheduled one's new due time);
- cancelled-delivered: a request whose cancel was answered ``cancelled`` yet
  arrived;
- duplicates: under exactly-once none; under at-least-once each must have its
  first copy delivered between shortly before an event of the scenario and
  the moment the instance next lost its partitions (``partitions lost``: the
  group's coordinator was away longer than the session; what was delivered
  since the last offset commit is delivered again), or shortly after the event
  when it lost none;
- dead-lettered: anything on the DLQ (none is expected);
- restarts: the instance must never exit;
- log lines: WARNING and above, which must stay a few per event whatever the
  number of records;
- lateness (delivery time - due time, or - the time of writing for a request
  written already due) p50, p99 and max;
- the longest stall of any request partition: the longest time between two
  deliveries of requests written to one partition.

Run ``tools/chaos --help``. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness
import kafka_cluster
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)
from harness import Arrivals, Instance, Load, Mix

from kdelay.plumbing.clients import produce
from kdelay.protocol import envelope
from kdelay.protocol.idkeys import decode_answer

KAFKA = harness.ROOT / "tools" / "kafka"
KDELAY = harness.KDELAY
# A duplicate under at-least-once is explained by an event within this long after
# its first copy (the batch in flight when a broker went away).
IN_FLIGHT_WINDOW_MS = 10_000
LOST_AT = re.compile(r"^(\S+ \S+) (?:\[\S+\] )?WARNING kdelay\.engine\.service: partitions lost",
                     re.MULTILINE)
IN_SYNC_TIMEOUT_S = 180.0
LOG_LINE = re.compile(r"^\S+ \S+ (?:\[\S+\] )?(WARNING|ERROR|CRITICAL) ", re.MULTILINE)
TRANSACTIONAL_ID = re.compile(r"transactional id (\S+?);")
SCENARIOS = ("baseline", "roll", "roll-kill", "roll-mixed", "outage", "controller", "reassign",
             "isr", "coordinators", "scale")
BACKLOG_DUE_MS = 2 * 3_600_000  # the backlog's delay: pending through the whole run
INDEX_TIMEOUT_S = 1_800.0
# Kafka's partition of a group's or a transactional id's coordinator: Java's
# String.hashCode, its absolute value, modulo the internal topic's partitions.
JAVA_INT = 1 << 32


def log(message: str) -> None:
    """Progress goes to stderr."""
    print(f"chaos: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


@dataclass
class Options:
    """What one harness run does."""

    bootstrap: str
    scenario: str = "roll-kill"
    guarantees: tuple[str, ...] = ("at-least-once", "exactly-once")
    rate: int = 200
    partitions: int = 3
    ids: float = 0.3
    cancels: float = 0.05
    reschedules: float = 0.05
    down_s: float = 10.0
    outage_s: float = 45.0
    lead_s: float = 10.0
    tail_s: float = 10.0
    drain_timeout_s: float = 240.0
    backlog: int = 0
    seed: int = 1
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kdelay-chaos-")))
    # The environment tools/kafka cluster runs with (KDELAY_CACHE_DIR: which cluster).
    cluster_env: Mapping[str, str] | None = None


@dataclass
class Report:
    """The outcome of one guarantee's run through a scenario."""

    scenario: str
    guarantee: str
    events: int
    requests: int
    cancels: int
    reschedules: int
    delivered: int
    lost: int
    early: int
    cancelled_delivered: int
    duplicates: int
    unexplained_duplicates: int
    dead_lettered: int
    restarts: int
    log_lines: int
    lateness_p50_ms: int
    lateness_p99_ms: int
    lateness_max_ms: int
    stall_max_ms: int
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether every check of the guarantee holds."""
        dupes_ok = self.duplicates == 0 if self.guarantee == "exactly-once" else (
            self.unexplained_duplicates == 0)
        return (self.lost == 0 and self.early == 0 and self.cancelled_delivered == 0
                and dupes_ok and self.dead_lettered == 0 and self.restarts == 0)


def table(reports: list[Report]) -> str:
    """The reports as one markdown table, a row each."""
    keys = [*asdict(reports[0]), "ok"]
    rows = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    rows += ["| " + " | ".join(str(v) for v in [*asdict(r).values(), r.ok]) + " |"
             for r in reports]
    return "\n".join(rows) + "\n"


# -- the cluster -------------------------------------------------------------------------


class Cluster:
    """``tools/kafka cluster`` for one cluster (its environment) and an admin client."""

    def __init__(self, bootstrap: str, env: Mapping[str, str] | None) -> None:
        self.bootstrap = bootstrap
        base = dict(os.environ if env is None else env)
        self._env = {k: v for k, v in base.items() if k != "KDELAY_BOOTSTRAP_SERVERS"}
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.events_ms: list[int] = []

    def node(self, action: str, node_id: int) -> None:
        """``stop``, ``kill`` or ``start`` node ``node_id``; events are timed."""
        log(f"{action} node {node_id}")
        self.events_ms.append(time.time_ns() // 1_000_000)
        subprocess.run([str(KAFKA), "cluster", action, str(node_id)], env=self._env,
                       check=True, stdout=subprocess.DEVNULL)

    def node_ids(self) -> list[int]:
        return sorted(self.admin.list_topics(timeout=30).brokers)

    def wait_in_sync(self, timeout_s: float = IN_SYNC_TIMEOUT_S) -> float:
        """Block until every partition of every topic has all its replicas in sync;
        return how long that took."""
        started = time.monotonic()
        while True:
            metadata = self.admin.list_topics(timeout=30)
            lagging = [f"{t}/{p}" for t, topic in metadata.topics.items()
                       for p, part in topic.partitions.items()
                       if set(part.isrs) != set(part.replicas)]
            if not lagging:
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{len(lagging)} partitions out of sync after "
                                   f"{timeout_s:.0f}s: {lagging[:5]}")
            time.sleep(1.0)

    def leader(self, topic: str, partition: int) -> int:
        """The broker that leads ``topic``'s ``partition`` now."""
        return int(self.admin.list_topics(topic, timeout=30).topics[topic]
                   .partitions[partition].leader)

    def coordinator(self, internal: str, key: str) -> int:
        """The broker coordinating ``key`` (a group id or a transactional id) through the
        internal topic ``internal``: the leader of the key's partition of it."""
        partitions = len(self.admin.list_topics(internal, timeout=30).topics[internal].partitions)
        return self.leader(internal, coordinator_partition(key, partitions))

    def active_controller(self) -> int:
        """The metadata quorum's leader, as the running nodes' quorum state says."""
        deadline = time.monotonic() + IN_SYNC_TIMEOUT_S
        while (found := kafka_cluster.active_controller()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("no running node knows the quorum's leader")
            time.sleep(1.0)
        return found

    def reassign_reversed(self, topics: list[str]) -> None:
        """Reassign every partition of ``topics`` to its replicas in reverse order, wait
        until done, then elect the preferred leaders: each partition's leader moves."""
        metadata = self.admin.list_topics(timeout=30)
        moves = [{"topic": t, "partition": p, "replicas": list(reversed(part.replicas))}
                 for t in topics for p, part in metadata.topics[t].partitions.items()]
        path = Path(tempfile.mkstemp(prefix="kdelay-reassign-", suffix=".json")[1])
        path.write_text(json.dumps({"version": 1, "partitions": moves}))
        self.events_ms.append(time.time_ns() // 1_000_000)
        log(f"reassigning {len(moves)} partitions")
        tool = "org.apache.kafka.tools.reassign.ReassignPartitionsCommand"
        self._tool(tool, "--bootstrap-server", self.bootstrap, "--execute",
                   "--reassignment-json-file", str(path))
        deadline = time.monotonic() + IN_SYNC_TIMEOUT_S
        while "is still in progress" in self._tool(
                tool, "--bootstrap-server", self.bootstrap, "--verify",
                "--reassignment-json-file", str(path)):
            if time.monotonic() > deadline:
                raise RuntimeError("the reassignment did not finish")
            time.sleep(2.0)
        self.events_ms.append(time.time_ns() // 1_000_000)
        log("electing the preferred leaders")
        self._tool("org.apache.kafka.tools.LeaderElectionCommand", "--bootstrap-server",
                   self.bootstrap, "--election-type", "PREFERRED", "--all-topic-partitions")
        path.unlink()

    def set_min_insync(self, topic: str, value: int) -> None:
        """Set ``topic``'s ``min.insync.replicas`` (incrementally: nothing else changes)."""
        self.events_ms.append(time.time_ns() // 1_000_000)
        log(f"{topic}: min.insync.replicas={value}")
        resource = ConfigResource("topic", topic, incremental_configs=[ConfigEntry(
            "min.insync.replicas", str(value),
            incremental_operation=AlterConfigOpType.SET)])
        for future in self.admin.incremental_alter_configs([resource]).values():
            future.result(timeout=30)

    def _tool(self, main_class: str, *args: str) -> str:
        """Run one of Kafka's command-line tools from the broker's jars; its stdout."""
        kafka_cluster.fetch_tools()
        done = subprocess.run(kafka_cluster.tool_command(main_class, *args), env=self._env,
                              capture_output=True, text=True, check=False, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{main_class} exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout


def coordinator_partition(key: str, partitions: int) -> int:
    """The partition of ``__consumer_offsets`` or ``__transaction_state`` that holds
    ``key``: Kafka's ``Utils.abs(key.hashCode()) % partitions``."""
    value = 0
    for unit in key.encode("utf-16-be").hex(" ", 2).split():  # Java hashes UTF-16 units
        value = (value * 31 + int(unit, 16)) % JAVA_INT
    signed = value - JAVA_INT if value >= JAVA_INT // 2 else value
    return (0 if signed == -JAVA_INT // 2 else abs(signed)) % partitions  # Utils.abs


# -- the load and its deployment ---------------------------------------------------------


@dataclass
class Deployment:
    """One guarantee's topics, group, state dir and log directory."""

    guarantee: str
    bootstrap: str
    suffix: str
    workdir: Path
    partitions: int

    @property
    def requests(self) -> str:
        return f"chaos.req.{self.suffix}"

    @property
    def target(self) -> str:
        return f"chaos.target.{self.suffix}"

    def env(self) -> dict[str, str]:
        """The environment of ``kdelay`` for this deployment (its defaults otherwise)."""
        return {**{k: v for k, v in os.environ.items() if not k.startswith("KDELAY_")},
                "KDELAY_BOOTSTRAP_SERVERS": self.bootstrap,
                "KDELAY_REQUESTS_TOPIC": self.requests,
                "KDELAY_CHANGELOG_TOPIC": f"chaos.chg.{self.suffix}",
                "KDELAY_DLQ_TOPIC": f"chaos.dlq.{self.suffix}",
                "KDELAY_OUTCOMES_TOPIC": f"chaos.out.{self.suffix}",
                "KDELAY_GROUP_ID": f"chaos-{self.suffix}",
                "KDELAY_STATE_DIR": str(self.workdir / "state"),
                "KDELAY_GUARANTEE": self.guarantee}

    def create(self) -> str:
        """``kdelay topics create`` the deployment's topics and its target; its output."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([str(KDELAY), "topics", "create", "--partitions",
                               str(self.partitions), "--target", self.target],
                              env=self.env(), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"kdelay topics create failed: {done.stderr}")
        return done.stdout


class Run:
    """One guarantee's deployment, load and ``kdelay run`` through a scenario."""

    def __init__(self, options: Options, guarantee: str, index: int) -> None:
        suffix = f"{guarantee[:3]}-{uuid.uuid4().hex[:8]}"
        self.deployment = Deployment(guarantee, options.bootstrap, suffix,
                                     options.workdir / guarantee, options.partitions)
        self.created = self.deployment.create()
        self.load = Load(options.bootstrap, self.deployment.requests, self.deployment.target,
                         Mix(options.rate, options.ids, options.cancels, options.reschedules),
                         options.seed + index)
        self.instance = Instance(self.deployment.workdir, self.deployment.env())
        self.log_path = self.instance.log_path(1)
        self.extra: list[Instance] = []
        self.extra_exits: list[int] = []

    def add_instance(self) -> None:
        """Start one more ``kdelay run`` in the deployment's group (a state dir of its own)."""
        workdir = self.deployment.workdir / f"extra-{len(self.extra) + 1}"
        workdir.mkdir(parents=True, exist_ok=True)
        instance = Instance(workdir, {**self.deployment.env(),
                                      "KDELAY_STATE_DIR": str(workdir / "state")})
        instance.start()
        self.extra.append(instance)

    def stop_extra(self) -> None:
        """SIGTERM the added instances; their exit statuses are kept."""
        self.extra_exits += [instance.terminate() for instance in self.extra]
        self.extra.clear()

    def write_backlog(self, count: int) -> None:
        """Write ``count`` requests due in two hours, as fast as the cluster takes them."""
        producer = Producer({"bootstrap.servers": self.deployment.bootstrap,
                             "enable.idempotence": True, "linger.ms": 50,
                             "batch.size": 1_000_000, "message.timeout.ms": 0})
        due = str(time.time_ns() // 1_000_000 + BACKLOG_DUE_MS).encode()
        headers: list[tuple[str, str | bytes | None]] = [
            (envelope.TARGET, self.deployment.target.encode()), (envelope.DUE_MS, due)]
        for n in range(count):
            produce(producer, self.deployment.requests, key=f"b{n}".encode(), value=b"backlog",
                    headers=headers, on_delivery=self._backlog_report)
            if n % 10_000 == 0:
                producer.poll(0)
        while producer.flush(5) > 0:
            log("waiting for the cluster to acknowledge the backlog")

    def _backlog_report(self, error: KafkaError | None, _: Message) -> None:
        if error is not None:
            raise RuntimeError(f"a backlog request was not written: {error.str()}")

    def wait_indexed(self, count: int) -> float:
        """Block until the changelog holds at least ``count`` records (every request the
        service indexed writes one); return how long that took."""
        started = time.monotonic()
        changelog = self.deployment.env()["KDELAY_CHANGELOG_TOPIC"]
        consumer = Consumer({"bootstrap.servers": self.deployment.bootstrap,
                             "group.id": f"chaos-watch-{uuid.uuid4()}"})
        try:
            partitions = consumer.list_topics(changelog, timeout=30).topics[changelog].partitions
            while True:
                total = sum(consumer.get_watermark_offsets(
                    TopicPartition(changelog, p), timeout=30)[1] for p in partitions)
                if total >= count:
                    return time.monotonic() - started
                if time.monotonic() - started > INDEX_TIMEOUT_S or not self.instance.alive():
                    raise RuntimeError(f"{total} of {count} requests indexed; see "
                                       f"{self.log_path}")
                time.sleep(2.0)
        finally:
            consumer.close()

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        """Block until the instance has its partitions (so the load's lateness is
        not its start-up)."""
        deadline = time.monotonic() + timeout_s
        while not harness.ASSIGNED_AT.search(self.log_path.read_text(errors="replace")):
            if time.monotonic() > deadline or not self.instance.alive():
                raise RuntimeError(f"kdelay run was not assigned its partitions; see "
                                   f"{self.log_path}")
            time.sleep(0.2)

    def transactional_id(self) -> str | None:
        """The instance's transactional id, from its first log line (exactly-once)."""
        found = TRANSACTIONAL_ID.search(self.log_path.read_text(errors="replace"))
        return found.group(1) if found else None


# -- scenarios ---------------------------------------------------------------------------


def roll(cluster: Cluster, options: Options, action: str, first: str | None = None) -> None:
    """Each node in turn: ``action`` (stop or kill; the first node ``first`` when
    given), down ``down_s``, start, in sync."""
    for index, node_id in enumerate(cluster.node_ids()):
        cluster.node(first if first and index == 0 else action, node_id)
        time.sleep(options.down_s)
        cluster.node("start", node_id)
        log(f"node {node_id} back; in sync after {cluster.wait_in_sync():.1f}s")


def outage(cluster: Cluster, options: Options, _: list[Run]) -> None:
    """One node killed for longer than every client timeout, then started again."""
    node_id = cluster.node_ids()[-1]
    cluster.node("kill", node_id)
    time.sleep(options.outage_s)
    cluster.node("start", node_id)
    log(f"in sync after {cluster.wait_in_sync():.1f}s")


def controller(cluster: Cluster, options: Options, _: list[Run]) -> None:
    """The active controller killed, and started again after ``down_s``."""
    node_id = cluster.active_controller()
    log(f"the active controller is node {node_id}")
    cluster.node("kill", node_id)
    time.sleep(options.down_s)
    log(f"the active controller is now node {cluster.active_controller()}")
    cluster.node("start", node_id)
    log(f"in sync after {cluster.wait_in_sync():.1f}s")


def reassign(cluster: Cluster, _: Options, runs: list[Run]) -> None:
    """The requests, changelog and target partitions reassigned and their leaders moved."""
    topics = [t for run in runs for t in (run.deployment.requests, run.deployment.target,
                                          run.deployment.env()["KDELAY_CHANGELOG_TOPIC"])]
    before = {t: cluster.leader(t, 0) for t in topics}
    cluster.reassign_reversed(topics)
    moved = sum(cluster.leader(t, 0) != leader for t, leader in before.items())
    log(f"partition 0's leader moved on {moved} of {len(topics)} topics")


def isr(cluster: Cluster, options: Options, runs: list[Run]) -> None:
    """The targets refuse writes (NOT_ENOUGH_REPLICAS) for ``outage_s``: their
    min.insync.replicas raised to 3 while a node is down, then both undone."""
    node_id = cluster.node_ids()[-1]
    targets = [run.deployment.target for run in runs]
    for target in targets:
        cluster.set_min_insync(target, 3)
    cluster.node("stop", node_id)
    time.sleep(options.outage_s)
    cluster.node("start", node_id)
    cluster.wait_in_sync()
    for target in targets:
        cluster.set_min_insync(target, 2)


def coordinators(cluster: Cluster, options: Options, runs: list[Run]) -> None:
    """The brokers coordinating the groups and the transactions killed in turn."""
    victims: list[int] = []
    for run in runs:
        victims.append(cluster.coordinator("__consumer_offsets",
                                           run.deployment.env()["KDELAY_GROUP_ID"]))
        txn = run.transactional_id() if run.deployment.guarantee == "exactly-once" else None
        if txn:
            victims.append(cluster.coordinator("__transaction_state", txn))
    log(f"coordinators on nodes {victims}")
    for node_id in dict.fromkeys(victims):
        cluster.node("kill", node_id)
        time.sleep(options.down_s)
        cluster.node("start", node_id)
        log(f"in sync after {cluster.wait_in_sync():.1f}s")


def scale(_: Cluster, options: Options, runs: list[Run]) -> None:
    """1 -> 3 -> 1 instances per deployment: two more join, serve ``4 * down_s``, and
    are stopped (SIGTERM), then the first serves alone for ``2 * down_s``."""
    for each in runs:
        each.add_instance()
        each.add_instance()
    log("two more instances per deployment started")
    time.sleep(4 * options.down_s)
    for each in runs:
        each.stop_extra()
    log(f"the added instances stopped (exit statuses {[r.extra_exits for r in runs]})")
    time.sleep(2 * options.down_s)


Scenario = Callable[[Cluster, Options, list[Run]], None]
ACTIONS: dict[str, Scenario] = {
    "baseline": lambda cluster, options, runs: None,
    "roll": lambda cluster, options, runs: roll(cluster, options, "stop"),
    "roll-kill": lambda cluster, options, runs: roll(cluster, options, "kill"),
    "roll-mixed": lambda cluster, options, runs: roll(cluster, options, "stop", "kill"),
    "outage": outage,
    "controller": controller,
    "reassign": reassign,
    "isr": isr,
    "coordinators": coordinators,
    "scale": scale,
}


# -- the run and its judgement -----------------------------------------------------------


def run(options: Options) -> list[Report]:
    """Run ``options.scenario`` with one deployment per guarantee; a report each."""
    cluster = Cluster(options.bootstrap, options.cluster_env)
    cluster.wait_in_sync()
    runs = [Run(options, g, i) for i, g in enumerate(options.guarantees)]
    log(runs[0].created.strip().splitlines()[-1])
    if options.backlog:
        for each in runs:
            each.write_backlog(options.backlog)
        log(f"a backlog of {options.backlog} requests written per deployment")
    started = time.monotonic()
    try:
        return scenario(cluster, options, runs, started)
    finally:  # a harness that failed leaves no kdelay running (judge stopped the others)
        for each in runs:
            each.instance.kill()
            each.stop_extra()


def scenario(cluster: Cluster, options: Options, runs: list[Run], started: float
             ) -> list[Report]:
    """Start the instances, the load and the scenario's events; judge each run."""
    for each in runs:
        each.instance.start()
    for each in runs:
        each.wait_serving()
    for each in runs:
        if options.backlog:
            log(f"{each.deployment.guarantee}: the backlog indexed in "
                f"{each.wait_indexed(options.backlog):.0f}s")
    for each in runs:
        each.load.start()
    time.sleep(options.lead_s)
    log(f"scenario {options.scenario}")
    ACTIONS[options.scenario](cluster, options, runs)
    time.sleep(options.tail_s)
    for each in runs:
        each.load.stop()
    log("load stopped; draining")
    return [judge(each, cluster, options, time.monotonic() - started) for each in runs]


def percentile(values: list[int], share: float) -> int:
    """The ``share`` percentile of ``values`` (0 when empty)."""
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def outcomes_of(bootstrap: str, topic: str) -> dict[str, set[str]]:
    """Every outcome the outcomes topic holds, by schedule id."""
    found: dict[str, set[str]] = defaultdict(set)
    reader = harness.TopicReader(bootstrap, topic)
    try:
        for message in reader.drain():
            if message.value():
                answer = decode_answer(message.value() or b"")
                found[answer.schedule_id].add(answer.outcome)
    finally:
        reader.close()
    return found


def judge(each: Run, cluster: Cluster, options: Options, seconds: float) -> Report:
    """Read the target, the DLQ and the outcomes back and compare with the load."""
    load, deployment = each.load, each.deployment
    env = deployment.env()
    # Every request whose id was not cancelled must arrive; wait for those first.
    must = {rid for rid in load.due if rid not in load.cancelled}
    delivered = harness.read_all(options.bootstrap, deployment.target, must,
                                 options.drain_timeout_s)
    time.sleep(2.0)  # the outcomes of the last cancels
    answers = outcomes_of(options.bootstrap, env["KDELAY_OUTCOMES_TOPIC"])
    exits = (0 if each.instance.alive() else 1) + sum(code != 0 for code in each.extra_exits)
    code = each.instance.terminate()
    if code != 0:
        log(f"{deployment.guarantee}: the instance exited {code}; see {each.log_path}")
    dead = harness.read_all(options.bootstrap, env["KDELAY_DLQ_TOPIC"], set(), 0.0)
    due = dict(load.due)
    cancelled_for_good = set()
    for rid in load.cancelled:
        said = answers.get(f"id-{rid}", set())
        if "cancelled" in said and not said & {"already-delivered", "unknown"}:
            cancelled_for_good.add(rid)
    for rid, new_due in load.rescheduled.items():
        if "rescheduled" in answers.get(f"id-{rid}", set()):
            due[rid] = new_due
    arrivals = Arrivals.of(delivered)
    counts, first = arrivals.counts, arrivals.first
    early = arrivals.early(due)
    lost = arrivals.lost(due, cancelled_for_good)
    cancelled_delivered = [rid for rid in cancelled_for_good if rid in counts]
    duplicated = arrivals.duplicated()
    unexplained = arrivals.unexplained(
        replay_windows(cluster.events_ms, stamps_ms(LOST_AT, each.log_path)))
    for name, rids in (("lost", lost), ("early", early), ("cancelled yet delivered",
                                                         cancelled_delivered),
                       ("unexplained duplicates", unexplained)):
        if rids:
            log(f"{deployment.guarantee}: {name}: {sorted(rids)[:10]}")
    # From the due time, or from the request's writing when it was already due.
    lateness = [stamp - max(due[rid], load.sent[rid]) for rid, stamp in first.items()
                if rid in due]
    text = each.log_path.read_text(errors="replace")
    return Report(
        options.scenario, deployment.guarantee, len(cluster.events_ms), len(load.due),
        len(load.cancelled), len(load.rescheduled), len(counts), len(lost), len(early),
        len(cancelled_delivered), len(duplicated), len(unexplained), len(dead), exits,
        len(LOG_LINE.findall(text)), percentile(lateness, 0.5), percentile(lateness, 0.99),
        max(lateness, default=0), longest_stall(arrivals.by_partition), round(seconds, 1))


def stamps_ms(pattern: re.Pattern[str], path: Path) -> list[int]:
    """The times (ms) of the log lines of ``path`` that ``pattern`` finds (its group 1 is
    logging's local ``asctime``)."""
    return [harness.logged_ms(stamp)
            for stamp in pattern.findall(path.read_text(errors="replace"))]


def replay_windows(events_ms: list[int], lost_ms: list[int]) -> list[tuple[int, int]]:
    """When a first copy may have been delivered for an at-least-once duplicate to be
    explained: from ``IN_FLIGHT_WINDOW_MS`` before each event to the next loss of the
    partitions after it (records delivered since the last offset commit are
    delivered again), or to ``IN_FLIGHT_WINDOW_MS`` after it when none followed
    within a minute."""
    windows = []
    for event in events_ms:
        later = [lost for lost in lost_ms if event <= lost <= event + 60_000]
        end = max(later) if later else event + IN_FLIGHT_WINDOW_MS
        windows.append((event - IN_FLIGHT_WINDOW_MS, end))
    return windows


def longest_stall(stamps: Mapping[str, list[int]]) -> int:
    """The longest time between two consecutive deliveries from one request partition."""
    gaps = [b - a for found in stamps.values() for a, b in itertools.pairwise(sorted(found))]
    return max(gaps, default=0)


def main() -> int:
    """Parse the command line, run each scenario, print the table (JSON with --json)."""
    parser = argparse.ArgumentParser(prog="tools/chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS),
                        help=f"any of {', '.join(SCENARIOS)} (default: all, in that order)")
    parser.add_argument("--guarantee", choices=["at-least-once", "exactly-once", "both"],
                        default="both")
    parser.add_argument("--rate", type=int, default=200, help="requests per second, each")
    parser.add_argument("--down", type=float, default=10.0,
                        help="seconds a node stays down in a roll (s)")
    parser.add_argument("--outage", type=float, default=45.0,
                        help="seconds of the outage and of the refused writes (s)")
    parser.add_argument("--backlog", type=int, default=0,
                        help="requests pending (due in 2 h) before the load starts, each")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the reports as JSON here")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    guarantees = ("at-least-once", "exactly-once") if args.guarantee == "both" else (
        args.guarantee,)
    bootstrap = kafka_cluster.address()
    reports: list[Report] = []
    for scenario in args.scenarios:
        reports += run(Options(bootstrap, scenario, guarantees, args.rate, down_s=args.down,
                               outage_s=args.outage, seed=args.seed, backlog=args.backlog))
        print(table(reports[-len(guarantees):]), flush=True)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in reports],
                                            indent=2))
    print(table(reports))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
