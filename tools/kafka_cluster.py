"""Start, stop and inspect a KRaft Apache Kafka cluster of several nodes on loopback.

``tools/kafka cluster start [--brokers N]`` (default 3) runs N combined
broker+controller nodes from the jars ``tools/kafka`` fetches, node ids 1..N,
each with a voter of a static controller quorum (``controller.quorum.voters``),
and prints one line, ``bootstrap=HOST:PORT,HOST:PORT,...``, on stdout. Combined
nodes, not a separate controller quorum: on two cores, three JVMs cost less than
six, and a combined node is what a small production cluster runs.

Its internal topics are set as a production cluster's are: replication factor
``min(3, N)`` and ``min.insync.replicas`` ``min(2, N)`` (the offsets and
transaction state topics, and the broker default), so a broker down costs no
coordinator and two down refuse transactional writes. The nodes' heaps are
``KDELAY_CLUSTER_HEAP`` (default 512m); their log directories are on
``/dev/shm`` when it has room, like the single broker's.

One node at a time: ``start N`` (starts node N and waits until it is an
unfenced broker), ``stop N`` (SIGTERM: a controlled shutdown, leadership moves
first), ``kill N`` (SIGKILL). ``stop`` without a node stops every node,
``status`` prints the bootstrap line and each node's state (exit 1 when none
runs), ``reset`` stops the cluster and removes its data.

Tools and tests find the cluster through ``KDELAY_CLUSTER_BOOTSTRAP_SERVERS``
(``tools/test`` sets it), else :func:`address` starts one. The cluster's files
are in ``.cache/cluster/`` (``KDELAY_CACHE_DIR`` moves it: a test or harness
that wants a cluster of its own gives it another cache directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import kafka_broker as broker

CLUSTER = broker.CACHE / ("cluster" if broker.VERSION == broker.DEFAULT_VERSION
                          else f"cluster-{broker.VERSION}")
DEFAULT_BROKERS = 3
DEFAULT_HEAP = "512m"
# Partitions of the offsets and transaction state topics: fewer than a default
# broker's 50 (three small JVMs on two cores load them at every leader move),
# enough that the group and transaction coordinators sit on different brokers.
INTERNAL_PARTITIONS = 6
STOP_TIMEOUT_S = 60.0
TOOLS = broker.CACHE / f"kafka-tools-{broker.VERSION}"
TOOLS_POM = broker.ROOT / "tools" / "maven" / "kafka-tools.pom.xml"


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the bootstrap line."""
    print(f"tools/kafka cluster: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Node:
    """One combined broker+controller node: its id and its two ports."""

    node_id: int
    port: int
    controller_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def replication(brokers: int) -> tuple[int, int]:
    """The replication factor and min.insync.replicas a cluster of ``brokers`` gives
    its internal topics: ``min(3, brokers)`` and ``min(2, brokers)``."""
    return min(3, brokers), min(2, brokers)


def plan_nodes(ports: list[int]) -> list[Node]:
    """Nodes 1..N from ``2N`` ports: the first N are their client ports, the rest their
    controller ports."""
    if len(ports) % 2 or not ports:
        raise ValueError(f"a cluster needs two ports per node, got {len(ports)}")
    count = len(ports) // 2
    return [Node(i + 1, ports[i], ports[count + i]) for i in range(count)]


def bootstrap(nodes: Iterable[Node]) -> str:
    """The cluster's bootstrap list, every node's client address."""
    return ",".join(node.address for node in nodes)


def node_settings(node: Node, nodes: list[Node], data: Path) -> dict[str, str]:
    """The server.properties of ``node`` in a cluster of ``nodes`` with its log dir ``data``."""
    factor, min_isr = replication(len(nodes))
    listeners = (f"PLAINTEXT://127.0.0.1:{node.port},"
                 f"CONTROLLER://127.0.0.1:{node.controller_port}")
    return {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": ",".join(
            f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in nodes),
        "listeners": listeners,
        "advertised.listeners": listeners,
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data),
        "num.partitions": "1",
        "default.replication.factor": str(factor),
        "min.insync.replicas": str(min_isr),
        "offsets.topic.replication.factor": str(factor),
        "offsets.topic.num.partitions": str(INTERNAL_PARTITIONS),
        "transaction.state.log.replication.factor": str(factor),
        "transaction.state.log.min.isr": str(min_isr),
        "transaction.state.log.num.partitions": str(INTERNAL_PARTITIONS),
        "offsets.topic.segment.bytes": "2097152",
        "transaction.state.log.segment.bytes": "2097152",
        "share.coordinator.state.topic.replication.factor": str(factor),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        "group.initial.rebalance.delay.ms": "0",
        "group.min.session.timeout.ms": "0",
        "log.cleaner.dedupe.buffer.size": "2097152",
        "log.retention.check.interval.ms": "1000",
        "log.cleaner.backoff.ms": "1000",
        "auto.create.topics.enable": "false",
        "delete.topic.enable": "true",
        # A stopped node's leaderships go back to it once it is in sync again, as
        # on a production cluster (the default, stated: rolling restarts rely on it).
        "auto.leader.rebalance.enable": "true",
        "leader.imbalance.check.interval.seconds": "30",
    }


def node_dir(node_id: int) -> Path:
    return CLUSTER / f"node-{node_id}"


def data_root() -> Path:
    """Where the nodes' log directories are: recorded at the first start, on
    ``/dev/shm`` when it has room (an owner file beside it, as the single broker's),
    else in the cluster's own directory."""
    recorded = CLUSTER / "data_dir"
    if recorded.exists():
        return Path(recorded.read_text().strip())
    broker.sweep_orphans()
    chosen = broker.MEMORY / (f"kdelay-{os.getuid()}-{CLUSTER.name}-"
                              f"{zlib.crc32(str(CLUSTER).encode()):08x}")
    if broker.memory_has_room() and broker.own_dir(chosen):
        chosen.with_name(chosen.name + broker.OWNER_SUFFIX).write_text(f"{CLUSTER}\n")
    else:
        chosen = CLUSTER / "data"
    CLUSTER.mkdir(parents=True, exist_ok=True)
    recorded.write_text(f"{chosen}\n")
    return chosen


def known_nodes() -> list[Node]:
    """The nodes of the cluster as planned at its first start (none before)."""
    ports_file = CLUSTER / "ports"
    if not ports_file.exists():
        return []
    return plan_nodes([int(p) for p in ports_file.read_text().split()])


def planned_nodes(brokers: int) -> list[Node]:
    """The cluster's nodes: the recorded ones, else ``brokers`` new ones on free ports."""
    nodes = known_nodes()
    if nodes:
        if len(nodes) != brokers:
            log(f"the cluster was made with {len(nodes)} nodes; keeping them "
                f"(tools/kafka cluster reset makes another)")
        return nodes
    if brokers < 1:
        sys.exit("tools/kafka cluster: --brokers must be at least 1")
    ports = broker.free_ports(2 * brokers)
    CLUSTER.mkdir(parents=True, exist_ok=True)
    (CLUSTER / "ports").write_text(" ".join(map(str, ports)) + "\n")
    return plan_nodes(ports)


def node_pid(node_id: int) -> int | None:
    """The pid of node ``node_id`` if it runs."""
    try:
        pid = int((node_dir(node_id) / "pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if broker.pid_alive(pid) else None


def java(heap: str, *args: str) -> list[str]:
    """A java command line with the broker's classpath, a heap of ``heap`` and the
    node's log4j2 settings."""
    command = broker.java_command(*args)
    return [f"-Xms{heap}" if a.startswith("-Xms") else f"-Xmx{heap}" if a.startswith("-Xmx")
            else a for a in command]


def write_node(node: Node, nodes: list[Node]) -> Path:
    """Write node ``node``'s server.properties and log4j2 settings; return the former."""
    home = node_dir(node.node_id)
    home.mkdir(parents=True, exist_ok=True)
    data = data_root() / f"node-{node.node_id}"
    config = home / "server.properties"
    settings = node_settings(node, nodes, data)
    config.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    (home / "log4j2.properties").write_text(broker.LOG4J2_PROPERTIES)
    return config


def node_java(node_id: int, *args: str) -> list[str]:
    """A java command for node ``node_id``: its heap and its log4j2 settings."""
    heap = os.environ.get("KDELAY_CLUSTER_HEAP", DEFAULT_HEAP)
    log4j = f"-Dlog4j2.configurationFile={node_dir(node_id) / 'log4j2.properties'}"
    return [log4j if a.startswith("-Dlog4j2.configurationFile=") else a
            for a in java(heap, *args)]


def format_nodes(nodes: list[Node]) -> None:
    """Format every node's log directory with one new cluster id (only those not yet
    formatted), side by side: each is a JVM start."""
    root = data_root()
    todo = [n for n in nodes if not (root / f"node-{n.node_id}" / "meta.properties").exists()]
    if not todo:
        return
    cluster_id_file = CLUSTER / "cluster_id"
    if not cluster_id_file.exists():
        cluster_id = subprocess.run(
            broker.java_command("kafka.tools.StorageTool", "random-uuid"),
            capture_output=True, text=True, check=True).stdout.strip()
        cluster_id_file.write_text(cluster_id + "\n")
    cluster_id = cluster_id_file.read_text().strip()
    formats = [subprocess.Popen(
        node_java(n.node_id, "kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
                  "--config", str(node_dir(n.node_id) / "server.properties"),
                  "--ignore-formatted"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for n in todo]
    for node, proc in zip(todo, formats, strict=True):
        _, err = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"tools/kafka cluster: formatting node {node.node_id} failed: "
                     f"{err.decode(errors='replace')[-2000:]}")


def launch(node: Node) -> int:
    """Start node ``node``'s JVM (unless it runs) and return its pid."""
    pid = node_pid(node.node_id)
    if pid is not None:
        return pid
    home = node_dir(node.node_id)
    nice = broker.broker_nice()
    with (home / "broker.log").open("ab") as out:
        out.write(f"{broker.RUN_MARKER}{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            node_java(node.node_id, "kafka.Kafka", str(home / "server.properties")),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=lambda: broker.niceness(nice))
    (home / "pid").write_text(f"{proc.pid}\n")
    refused = broker.prioritise(proc.pid, nice)
    if refused:
        log(f"node {node.node_id} at normal CPU priority: {refused}")
    return proc.pid


def log_tail(node_id: int, lines: int = broker.LOG_TAIL_LINES) -> str:
    """The last lines node ``node_id``'s latest run wrote, without stack frames."""
    try:
        text = (node_dir(node_id) / "broker.log").read_text(errors="replace")
    except OSError:
        return "(no broker.log)"
    latest = text.rsplit(broker.RUN_MARKER, 1)[-1].splitlines()[1:]
    kept = [ln for ln in latest if not broker.STACK_FRAME.match(ln)]
    return "\n".join(kept[-lines:]) or "(it wrote nothing)"


def wait_serving(node: Node, pid: int, deadline: float) -> None:
    """Block until node ``node`` is a broker in the cluster's metadata (registered and
    unfenced), as its own listener reports it. Exits when it dies or ``deadline`` passes."""
    from confluent_kafka.admin import AdminClient

    admin: AdminClient | None = None
    while True:
        if not broker.pid_alive(pid):
            sys.exit(f"tools/kafka cluster: node {node.node_id} (pid {pid}) exited during "
                     f"start; the last lines of its broker.log:\n{log_tail(node.node_id)}")
        if broker.port_open("127.0.0.1", node.port):
            admin = admin or AdminClient({"bootstrap.servers": node.address})
            with contextlib.suppress(Exception):
                if node.node_id in admin.list_topics(timeout=5).brokers:
                    return
        if time.monotonic() > deadline:
            sys.exit(f"tools/kafka cluster: node {node.node_id} is not a serving broker "
                     f"after {broker.READY_TIMEOUT_S:.0f}s; the last lines of its "
                     f"broker.log:\n{log_tail(node.node_id)}")
        time.sleep(0.5)


def start(brokers: int, only: int | None = None) -> int:
    """Start every node (or node ``only``), wait until they serve, print the bootstrap line."""
    broker.fetch_jars()
    nodes = planned_nodes(brokers)
    chosen = [n for n in nodes if only is None or n.node_id == only]
    if not chosen:
        sys.exit(f"tools/kafka cluster: no node {only} (nodes 1..{len(nodes)})")
    started = time.monotonic()
    for node in nodes:
        write_node(node, nodes)
    format_nodes(nodes)
    pids = {n.node_id: launch(n) for n in chosen}
    deadline = time.monotonic() + broker.READY_TIMEOUT_S
    for node in chosen:
        wait_serving(node, pids[node.node_id], deadline)
    (CLUSTER / "bootstrap").write_text(bootstrap(nodes) + "\n")
    log(f"node{'s' if only is None else ''} {', '.join(str(n.node_id) for n in chosen)} "
        f"serving in {time.monotonic() - started:.1f}s")
    print(f"bootstrap={bootstrap(nodes)}", flush=True)
    return 0


def stop(only: int | None = None, sig: signal.Signals = signal.SIGTERM) -> int:
    """Stop every node (or node ``only``) with ``sig``; SIGTERM is a controlled
    shutdown, SIGKILL a crash. Data stays for the next start."""
    nodes = [n for n in known_nodes() if only is None or n.node_id == only]
    if only is not None and not nodes:
        sys.exit(f"tools/kafka cluster: no node {only}")
    pids = {n.node_id: pid for n in nodes if (pid := node_pid(n.node_id)) is not None}
    for pid in pids.values():
        os.kill(pid, sig)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for node_id, pid in pids.items():
        while broker.pid_alive(pid):
            if time.monotonic() > deadline:
                log(f"node {node_id} (pid {pid}) ignored {sig.name} for "
                    f"{STOP_TIMEOUT_S:.0f}s; sending SIGKILL")
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
            time.sleep(0.1)
        (node_dir(node_id) / "pid").unlink(missing_ok=True)
        log(f"node {node_id} (pid {pid}) stopped ({sig.name})")
    if not pids:
        log("no node of the cluster is running" if only is None else f"node {only} is not running")
    return 0


def status() -> int:
    """Print the bootstrap line and each node's state; exit 1 when no node runs."""
    nodes = known_nodes()
    running = [n for n in nodes if node_pid(n.node_id) is not None]
    for node in nodes:
        pid = node_pid(node.node_id)
        log(f"node {node.node_id} on {node.address}: "
            + (f"running, pid {pid}" if pid else "not running"))
    if not running:
        log("not running")
        return 1
    print(f"bootstrap={bootstrap(nodes)}")
    return 0


def reset() -> int:
    """Stop every node and remove the cluster's data and files."""
    stop()
    data = data_root() if CLUSTER.exists() else CLUSTER
    shutil.rmtree(data, ignore_errors=True)
    data.with_name(data.name + broker.OWNER_SUFFIX).unlink(missing_ok=True)
    shutil.rmtree(CLUSTER, ignore_errors=True)
    log(f"removed {CLUSTER}" + ("" if data.is_relative_to(CLUSTER) else f" and {data}"))
    return 0


def active_controller(nodes: Iterable[Node] | None = None) -> int | None:
    """The node that leads the controller quorum now, as the running nodes' quorum
    state files say (the newest epoch wins: a stopped node's file is stale); None
    when no running node knows one."""
    best: tuple[int, int] | None = None
    for node in known_nodes() if nodes is None else nodes:
        if node_pid(node.node_id) is None:
            continue
        state = data_root() / f"node-{node.node_id}" / "__cluster_metadata-0" / "quorum-state"
        with contextlib.suppress(OSError, ValueError, KeyError):
            found = json.loads(state.read_text())
            if found.get("leaderId", -1) >= 0 and (best is None or found["leaderEpoch"] > best[0]):
                best = (int(found["leaderEpoch"]), int(found["leaderId"]))
    return None if best is None else best[1]


def fetch_tools() -> None:
    """Download Kafka's command-line tools (the kafka-tools module) with Maven once."""
    marker = TOOLS / ".complete"
    if marker.exists():
        return
    log(f"fetching Kafka {broker.VERSION}'s tools with Maven into {TOOLS}")
    TOOLS.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run(
        ["mvn", "-B", "-q", "-f", str(TOOLS_POM), "dependency:copy-dependencies",
         "-DincludeScope=runtime", f"-DoutputDirectory={TOOLS}",
         f"-Dkafka.version={broker.VERSION}"], check=False, stdout=sys.stderr)
    if fetched.returncode != 0:
        sys.exit(f"tools/kafka cluster: Maven could not fetch Kafka {broker.VERSION}'s tools")
    marker.touch()


def tool_command(main_class: str, *args: str, heap: str = "256m") -> list[str]:
    """A java command running one of Kafka's command-line tools (``main_class``, such as
    ``org.apache.kafka.tools.reassign.ReassignPartitionsCommand``), the broker's jars
    first on its classpath, then the tools'. :func:`fetch_tools` fetches them."""
    command = java(heap, main_class, *args)
    at = command.index("-cp") + 1
    command[at] = f"{command[at]}{os.pathsep}{TOOLS}/*"
    return command


def address() -> str:
    """The cluster's bootstrap list: ``KDELAY_CLUSTER_BOOTSTRAP_SERVERS``, else the one
    ``tools/kafka cluster start`` finds or starts (in a subprocess, so it outlives
    the caller). Raises :class:`kafka_broker.BrokerUnavailable` when none starts."""
    given = os.environ.get("KDELAY_CLUSTER_BOOTSTRAP_SERVERS")
    if given:
        return given
    proc = subprocess.run([str(broker.ROOT / "tools" / "kafka"), "cluster", "start"],
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("bootstrap=")]
    if proc.returncode != 0 or not lines:
        raise broker.BrokerUnavailable(proc.stderr.strip()[-2000:]
                                       or "tools/kafka cluster start printed no bootstrap line")
    return lines[0].removeprefix("bootstrap=")


def main(argv: list[str]) -> int:
    """``tools/kafka cluster start|stop|kill|status|reset [N] [--brokers N]``."""
    parser = argparse.ArgumentParser(prog="tools/kafka cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["start", "stop", "kill", "status", "reset"])
    parser.add_argument("node", nargs="?", type=int, help="one node's id (1..N)")
    parser.add_argument("--brokers", type=int, default=DEFAULT_BROKERS,
                        help="nodes of a new cluster (default 3)")
    args = parser.parse_args(argv)
    if args.command == "start":
        return start(args.brokers, args.node)
    if args.command == "stop":
        return stop(args.node)
    if args.command == "kill":
        if args.node is None:
            parser.error("kill needs a node id")
        return stop(args.node, signal.SIGKILL)
    if args.node is not None:
        parser.error(f"{args.command} acts on the whole cluster")
    return status() if args.command == "status" else reset()
