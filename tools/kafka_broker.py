"""Start, stop and inspect a single-node KRaft Apache Kafka broker.

``start`` prints exactly one line, ``bootstrap=HOST:PORT``, on stdout and
everything else on stderr. It is idempotent: a second ``start`` finds the
broker it started before and prints the same line. The broker comes from, in
order of preference:

1. ``KDELAY_BOOTSTRAP_SERVERS``: a broker somebody else runs; nothing starts,
   unless nothing listens there and it is the address this tool's own broker
   has or would get (127.0.0.1:9092 by default): then that broker starts, so a
   shell that exports the variable for kdelay can still ``kill`` and ``start`` it.
2. A Docker engine that answers: the ``kafka`` service of ``compose.yml`` (only
   for the default version; another ``KDELAY_KAFKA_VERSION`` runs from jars).
3. Kafka's jars from Maven Central (fetched with Maven into ``.cache/``) run
   with ``java`` on 127.0.0.1, port 9092 when it is free (so kdelay's default
   ``--bootstrap-servers`` finds it; ``KDELAY_BROKER_PORT`` picks another, 0
   any free one), else a free port.

The jar broker's version is ``KDELAY_KAFKA_VERSION`` (default 4.1.1, the one
the README names; 3.9.0 or later). Its jars are cached per version in
``.cache/kafka-libs-<version>/`` and a broker of another version than the
default keeps its data in ``.cache/broker-<version>/``, so brokers of two
versions can run side by side; every command acts on the version set.

The jar broker also has a SASL_PLAINTEXT listener for tests of authenticated
clients, with the mechanisms SCRAM-SHA-256 and PLAIN and one user,
``kdelay`` / ``kdelay-dev-secret`` (development only). ``sasl`` prints its
address as ``sasl_bootstrap=HOST:PORT`` (exit 1 when there is none).

It also has a SASL_SSL listener for tests of TLS and ACLs: a development CA and
a certificate for 127.0.0.1 are made with ``openssl`` at the first start into
``.cache/broker/tls`` (never committed), and KRaft's ``StandardAuthorizer``
checks ACLs with ``allow.everyone.if.no.acl.found=false``. The super users are
``ANONYMOUS`` (the PLAINTEXT and controller listeners, so every test on them
runs as before) and ``kdelay`` (the SASL user, the tests' administrator); any
other SCRAM user a test creates gets exactly the ACLs it is granted. ``tls``
prints ``tls_bootstrap=HOST:PORT`` and ``tls_ca=PATH`` (exit 1 when there is none).

The jar broker's log directories (its topics and KRaft's metadata log) are kept
in memory, on ``/dev/shm``, when that is a writable tmpfs with at least
``MEMORY_DATA_MIN_FREE`` free: a metadata log fsync then cannot stall behind
other processes' disk writes (a stall of 20 s once made the controller fence its
own broker while container images were built). ``KDELAY_BROKER_DATA_DIR`` picks
another directory; otherwise the data stays in ``.cache/broker/data``. The choice
is recorded in ``.cache/broker/data_dir`` at the first start and kept until
``reset``, which removes the directory too. Data in memory does not survive a
reboot; a later ``start`` then formats a new cluster. A checkout deleted
without ``reset`` leaves its directory behind: the next ``start`` of any
checkout that chooses memory removes it.

The jar broker runs at a higher CPU priority than the processes around it
(niceness ``BROKER_NICE``, -10, for every thread and for its session's
scheduling autogroup; ``KDELAY_BROKER_NICE`` sets another, 0 none): on a
machine of two cores that it shares with the tests, ``tools/bench`` and kdelay,
it stands in for a broker with cores of its own. Without it a long garbage
collection stretches while the clients hold both cores, and librdkafka's
idempotent producers spin while they wait for it (``docs/benchmarks.md``). It
needs root or CAP_SYS_NICE; without them ``start`` says so once and the broker
runs at normal priority.

``stop`` ends only the broker this tool started (by its recorded pid, or the
compose service), and ``kill`` sends it SIGKILL, for crash tests; a later
``start`` reuses its log directory. The jar broker's output goes to
``broker.log``; when it exits during ``start``, ``start`` says how and prints
the log's last lines of that run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KDELAY_CACHE_DIR", ROOT / ".cache"))
DEFAULT_VERSION = "4.1.1"
OLDEST_VERSION = (3, 9)
VERSION = os.environ.get("KDELAY_KAFKA_VERSION") or DEFAULT_VERSION
LIBS = CACHE / f"kafka-libs-{VERSION}"
RUN = CACHE / ("broker" if VERSION == DEFAULT_VERSION else f"broker-{VERSION}")
POM = ROOT / "tools" / "maven" / "kafka-broker.pom.xml"
COMPOSE = ROOT / "compose.yml"
DOCKER_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_PORT = 9092
SASL_USER = "kdelay"
SASL_PASSWORD = "kdelay-dev-secret"  # noqa: S105 - the development broker's fixed user
SCRAM_MECHANISM = "SCRAM-SHA-256"
READY_TIMEOUT_S = 120.0
LOG4J2_PROPERTIES = (
    "status = warn\n"
    "appender.err.type = Console\n"
    "appender.err.name = STDERR\n"
    "appender.err.target = SYSTEM_ERR\n"
    "appender.err.layout.type = PatternLayout\n"
    "appender.err.layout.pattern = [%d] %p %m (%c)%n\n"
    "rootLogger.level = warn\n"
    "rootLogger.appenderRef.err.ref = STDERR\n"
    # When the broker is fenced and unfenced (rare lines): what the WARNs do not say.
    "logger.lifecycle.name = kafka.server.BrokerLifecycleManager\n"
    "logger.lifecycle.level = info\n"
)
"""The log4j2 settings of every broker these tools start: WARN to stderr, plus fencing."""
MEMORY = Path("/dev/shm")  # noqa: S108 - a private directory is made in it, see own_dir
MEMORY_DATA_MIN_FREE = 4 << 30
OWNER_SUFFIX = ".owner"  # beside a directory in MEMORY: the RUN directory that chose it
LOG_TAIL_LINES = 30
# The jar broker's niceness (KDELAY_BROKER_NICE overrides; 0 leaves it as started).
BROKER_NICE = -10
RUN_MARKER = "--- tools/kafka start: "
STACK_FRAME = re.compile(r"\s+(at |\.\.\. \d+ more)")


class BrokerUnavailable(Exception):
    """No broker answers and none could be started; the message says why."""


def address(given: str | None = None) -> str:
    """Return a broker's bootstrap address: ``given``, else ``KDELAY_BOOTSTRAP_SERVERS``,
    else the broker ``tools/kafka start`` finds or starts (in a subprocess, so it
    outlives the caller). The one way tools and tests find their broker; raises
    :class:`BrokerUnavailable` when none answers."""
    found = given or os.environ.get("KDELAY_BOOTSTRAP_SERVERS")
    if found:
        return found
    proc = subprocess.run([str(ROOT / "tools" / "kafka"), "start"], capture_output=True,
                          text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("bootstrap=")]
    if proc.returncode != 0 or not lines:
        raise BrokerUnavailable(proc.stderr.strip()[-2000:]
                                or "tools/kafka start printed no bootstrap line")
    return lines[0].removeprefix("bootstrap=")


class PrivateBroker:
    """A jar broker of this tool in ``cache``, a directory of its own, sharing only the
    downloaded jars: for a test or a probe that kills or stops its broker (never the
    shared one). Its port is any free one; ``env`` adds to the environment
    ``tools/kafka`` runs with (none of the caller's ``KDELAY_*`` variables but
    ``KDELAY_BROKER_JVM_OPTIONS``: how Java runs, not which broker)."""

    def __init__(self, cache: Path, **env: str) -> None:
        cache.mkdir(parents=True, exist_ok=True)
        jars = cache / LIBS.name
        if not jars.exists():
            jars.symlink_to(LIBS)
        self.env = {**{k: v for k, v in os.environ.items()
                       if not k.startswith("KDELAY_") or k == "KDELAY_BROKER_JVM_OPTIONS"},
                    "KDELAY_CACHE_DIR": str(cache), "KDELAY_BROKER_PORT": "0", **env}
        self.pid_file = cache / RUN.name / "pid"
        self.bootstrap = ""

    def start(self) -> None:
        done = self._kafka("start", check=True)
        self.bootstrap = done.stdout.strip().removeprefix("bootstrap=")

    def kill(self) -> None:
        self._kafka("kill", check=True)

    def stop(self) -> None:
        self._kafka("stop", check=False)

    def pid(self) -> int:
        """The broker's process id, as ``start`` recorded it."""
        return int(self.pid_file.read_text())

    def _kafka(self, command: str, *, check: bool) -> subprocess.CompletedProcess[str]:
        """Run ``tools/kafka command``; with ``check``, a failure raises with its stderr."""
        done = subprocess.run([str(ROOT / "tools" / "kafka"), command], env=self.env,
                              capture_output=True, text=True, check=False, timeout=180)
        if check and done.returncode != 0:
            raise RuntimeError(f"tools/kafka {command} exited {done.returncode} "
                               f"(KDELAY_CACHE_DIR={self.env['KDELAY_CACHE_DIR']}):\n"
                               f"{done.stderr.strip()}")
        return done


def running() -> bool:
    """Return whether a broker this tool started is running (``tools/kafka status``)."""
    return subprocess.run([str(ROOT / "tools" / "kafka"), "status"], capture_output=True,
                          check=False).returncode == 0


def log(message: str) -> None:
    """Write a progress line to stderr; stdout carries only the bootstrap line."""
    print(f"tools/kafka: {message}", file=sys.stderr, flush=True)


def port_open(host: str, port: int) -> bool:
    """Return whether a TCP connection to ``host:port`` succeeds."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    return free_ports(1)[0]


def free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 that nothing listens on now,
    none of them in ``avoid``.

    Their sockets stay bound until all are chosen: ports chosen one after the
    other, each socket closed at once, can repeat (the kernel may hand the
    same port out again), and a broker given one port twice does not start.
    """
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid and port not in ports:
                ports.append(port)
        return ports


def wait_ready(bootstrap: str, deadline: float, pid: int | None = None) -> None:
    """Block until an AdminClient lists topics on ``bootstrap``.

    Raises ``SystemExit`` when ``deadline`` passes or the broker process dies.
    """
    from confluent_kafka.admin import AdminClient

    host, port = bootstrap.rsplit(":", 1)
    while not port_open(host, int(port)):
        exit_if_dead(pid)
        if time.monotonic() > deadline:
            sys.exit(f"tools/kafka: nothing listens on {bootstrap}")
        time.sleep(0.2)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    while True:
        try:
            admin.list_topics(timeout=5)
            return
        except Exception as exc:
            exit_if_dead(pid)
            if time.monotonic() > deadline:
                sys.exit(f"tools/kafka: broker at {bootstrap} does not answer: {exc}")
            time.sleep(0.5)


def exit_reason(pid: int) -> str:
    """How process ``pid`` ended: its exit status when it is this process's child."""
    try:
        _, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return "exit status unknown: an earlier tools/kafka start started it"
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def log_tail(lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines that the latest run of the jar broker wrote to broker.log,
    without the frames of stack traces (their messages and causes stay)."""
    try:
        text = (RUN / "broker.log").read_text(errors="replace")
    except OSError:
        return "(no broker.log)"
    latest = text.rsplit(RUN_MARKER, 1)[-1].splitlines()[1:]
    kept = [ln for ln in latest if not STACK_FRAME.match(ln)]
    return "\n".join(kept[-lines:]) or "(it wrote nothing)"


def exit_if_dead(pid: int | None) -> None:
    """Exit, saying how and with its last log lines, when the broker ``pid`` has ended."""
    if pid is not None and not pid_alive(pid):
        sys.exit(f"tools/kafka: broker pid {pid} exited during start ({exit_reason(pid)}); "
                 f"the last lines of {RUN / 'broker.log'}:\n{log_tail()}")


def pid_alive(pid: int) -> bool:
    """Return whether ``pid`` is a live (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def recorded_pid() -> int | None:
    """Return the pid of the broker this tool started, if it still runs."""
    try:
        pid = int((RUN / "pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def docker_available() -> bool:
    """Return whether a Docker engine answers (not just a client installed)."""
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        check=False,
        timeout=20,
    )
    return probe.returncode == 0


def version_parts(version: str = VERSION) -> tuple[int, int]:
    """Return ``(major, minor)`` of a Kafka release number; exit on one kdelay cannot run."""
    found = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version)
    if found is None:
        sys.exit(f"tools/kafka: KDELAY_KAFKA_VERSION={version!r} is not a Kafka release "
                 f"number such as {DEFAULT_VERSION}")
    parts = int(found[1]), int(found[2])
    if parts < OLDEST_VERSION:
        sys.exit(f"tools/kafka: Kafka {version} is older than {OLDEST_VERSION[0]}."
                 f"{OLDEST_VERSION[1]}, the oldest kdelay supports")
    return parts


def maven_properties(version: str = VERSION) -> list[str]:
    """The pom's properties for Kafka ``version``: its log4j2 backend and bridges.

    Kafka keeps log4j2 compile-only, so the backend is named here at the
    version each line was built with: 2.24 up to 4.1, 2.25 from 4.2. Kafka 3.x
    still logs through log4j 1's API, which ``log4j-1.2-api`` (the ``log4j1``
    profile) bridges to the same log4j2 backend and configuration.
    """
    parts = version_parts(version)
    log4j = "2.24.3" if parts < (4, 2) else "2.25.3"
    found = [f"-Dkafka.version={version}", f"-Dlog4j.version={log4j}"]
    if parts < (4, 0):
        found.append("-Dkafka.log4j1=true")
    return found


def fetch_jars() -> None:
    """Download the broker's jars with Maven once; later calls find them cached."""
    marker = LIBS / ".complete"
    if marker.exists():
        return
    if shutil.which("mvn") is None:
        sys.exit("tools/kafka: Maven (mvn) is needed to fetch Kafka's jars; install it")
    properties = maven_properties()
    log(f"fetching Kafka {VERSION} jars with Maven into {LIBS}")
    started = time.monotonic()
    LIBS.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run(
        [
            "mvn", "-B", "-q", "-f", str(POM), "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={LIBS}", *properties,
        ],
        check=False,
        stdout=sys.stderr,
    )
    if fetched.returncode != 0:
        sys.exit(f"tools/kafka: Maven could not fetch Kafka {VERSION} "
                 "(is it a released version?); see its output above")
    size = sum(p.stat().st_size for p in LIBS.glob("*.jar"))
    log(f"fetched {size / 1e6:.1f} MB of jars in {time.monotonic() - started:.1f}s")
    marker.touch()


def preferred_port() -> int:
    """``KDELAY_BROKER_PORT`` (default 9092) when nothing listens there, else a free port."""
    wanted = int(os.environ.get("KDELAY_BROKER_PORT", DEFAULT_PORT))
    if wanted and not port_open("127.0.0.1", wanted):
        return wanted
    return free_port()


def broker_ports() -> tuple[int, int, int, int]:
    """The (plain, controller, SASL, SASL_SSL) ports, chosen once, all distinct, and
    kept in ``RUN/ports``.

    A ports file of an older layout gets the ports it lacks added: the SASL_SSL
    one from ``RUN/tls_port`` (where it was kept on its own) unless that
    repeats a port of the file.
    """
    ports_file = RUN / "ports"
    known = [int(p) for p in ports_file.read_text().split()] if ports_file.exists() else []
    legacy_tls = RUN / "tls_port"
    if len(known) == 3 and legacy_tls.exists() and int(legacy_tls.read_text()) not in known:
        known.append(int(legacy_tls.read_text()))
    if not known:
        known = [preferred_port()]
    known += free_ports(4 - len(known), avoid=known)
    RUN.mkdir(parents=True, exist_ok=True)
    ports_file.write_text(" ".join(map(str, known)) + "\n")
    return known[0], known[1], known[2], known[3]


def memory_has_room() -> bool:
    """Whether ``/dev/shm`` is a writable directory with room for a broker's data."""
    if not MEMORY.is_dir() or not os.access(MEMORY, os.W_OK):
        return False
    return shutil.disk_usage(MEMORY).free >= MEMORY_DATA_MIN_FREE


def own_dir(path: Path) -> bool:
    """Make ``path`` a directory only this user reaches; False when someone else owns it."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return False
    return not path.is_symlink() and path.stat().st_uid == os.getuid()


def data_dir() -> Path:
    """The broker's log directory: the recorded one, else ``KDELAY_BROKER_DATA_DIR``,
    else ``RUN/data`` when a broker was formatted there, else one on ``/dev/shm``
    when it has room, else ``RUN/data``; the choice is recorded at once."""
    recorded = RUN / "data_dir"
    if recorded.exists():
        return Path(recorded.read_text().strip())
    given = os.environ.get("KDELAY_BROKER_DATA_DIR")
    if given:
        chosen = Path(given)
    elif (RUN / "data" / "meta.properties").exists():  # formatted before the choice existed
        chosen = RUN / "data"
    else:
        sweep_orphans()
        chosen = MEMORY / f"kdelay-{os.getuid()}-{RUN.name}-{zlib.crc32(str(RUN).encode()):08x}"
        if memory_has_room() and own_dir(chosen):
            chosen.with_name(chosen.name + OWNER_SUFFIX).write_text(f"{RUN}\n")
        else:
            chosen = RUN / "data"
    RUN.mkdir(parents=True, exist_ok=True)
    recorded.write_text(f"{chosen}\n")
    return chosen


def sweep_orphans() -> None:
    """Remove this user's broker directories in memory whose checkout is gone.

    Each has an owner file beside it naming the ``RUN`` directory that chose
    it; when that no longer records the choice (the checkout was deleted, or
    reset while the file was kept), the data would hold memory until a reboot.
    """
    for owner in MEMORY.glob(f"kdelay-{os.getuid()}-*{OWNER_SUFFIX}"):
        data = owner.with_name(owner.name.removesuffix(OWNER_SUFFIX))
        try:
            recorded = Path(owner.read_text().strip()) / "data_dir"
            if recorded.exists() and Path(recorded.read_text().strip()) == data:
                continue
        except OSError:
            continue
        shutil.rmtree(data, ignore_errors=True)
        owner.unlink(missing_ok=True)
        log(f"removed {data}: the broker data of a checkout that is gone")


def write_config(port: int, controller_port: int, sasl_port: int, tls_port: int) -> Path:
    """Write server.properties and a WARN-level log4j2 config; return the former."""
    data = data_dir()
    config = RUN / "server.properties"
    listeners = (f"PLAINTEXT://127.0.0.1:{port},SASL_PLAINTEXT://127.0.0.1:{sasl_port},"
                 f"CONTROLLER://127.0.0.1:{controller_port}")
    plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}",
        "listeners": listeners,
        "advertised.listeners": listeners,
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": (
            "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"),
        "sasl.enabled.mechanisms": f"{SCRAM_MECHANISM},PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config": (
            f'{plain} required user_{SASL_USER}="{SASL_PASSWORD}";'),
        "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config": f"{scram} required;",
        "log.dirs": str(data),
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        # One partition each, where a default broker has 50 (offsets) and 50
        # (transactions): every group's commits and every transaction's state
        # fill one log, 50 times as fast. With the default 100 MB segments, the
        # log cleaner then compacts 100 MB at once, about a second of CPU at the
        # broker's raised priority, which on two cores stalls every client for
        # most of a second (an exactly-once run's p99, docs/benchmarks.md).
        # Segments of 2 MB keep each cleaning as small as a default broker's.
        "offsets.topic.segment.bytes": "2097152",
        "transaction.state.log.segment.bytes": "2097152",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "group.min.session.timeout.ms": "0",
        "log.cleaner.dedupe.buffer.size": "2097152",
        "log.retention.check.interval.ms": "1000",
        "log.cleaner.backoff.ms": "1000",
        "auto.create.topics.enable": "false",
        "delete.topic.enable": "true",
    }
    settings.update(secure_settings(settings, tls_port, plain, scram))
    config.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    (RUN / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
    return config


def broker_nice() -> int:
    """The niceness the jar broker runs at: ``KDELAY_BROKER_NICE``, else ``BROKER_NICE``."""
    given = os.environ.get("KDELAY_BROKER_NICE", "").strip()
    if not given:
        return BROKER_NICE
    nice = int(given) if re.fullmatch(r"[+-]?\d+", given) else None
    if nice is None or not -20 <= nice <= 19:
        sys.exit(f"tools/kafka: KDELAY_BROKER_NICE must be a niceness from -20 to 19, "
                 f"got {given!r}")
    return nice


def niceness(nice: int) -> None:
    """Set this process's niceness to ``nice``, if allowed (in the broker's child before
    ``exec``: every JVM thread inherits it). Refused, it stays; :func:`prioritise` tells."""
    if nice:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, nice)


def prioritise(pid: int, nice: int, proc: Path = Path("/proc")) -> str | None:
    """Give the autogroup of process ``pid`` (its session, where the kernel has
    autogroups) the niceness ``nice``; return why the broker runs at normal
    priority, or None. The process itself got ``nice`` from :func:`niceness`."""
    if not nice:
        return None
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None  # gone: start reports that
    if int(stat.rsplit(")", 1)[1].split()[16]) != nice:
        return f"setting niceness {nice} needs root or CAP_SYS_NICE"
    group = proc / str(pid) / "autogroup"
    if group.exists():
        try:
            group.write_text(f"{nice}\n")
        except OSError as exc:
            return f"its autogroup refused niceness {nice} ({exc.strerror})"
    return None


def java_command(*args: str) -> list[str]:
    """Return a ``java`` command line with the broker's classpath and JVM options.

    ``KDELAY_BROKER_JVM_OPTIONS`` adds options after Kafka's own (split on white
    space): tools/test gives its brokers ``-XX:TieredStopAtLevel=1``, the quick
    compiler alone, which cuts their CPU over a run of tests by a third to a
    half; benchmarks keep the JVM's defaults, as a long-running broker has them.
    """
    heap = os.environ.get("KDELAY_BROKER_HEAP", "1g")
    return [
        # Kafka's own defaults (kafka-server-start.sh, kafka-run-class.sh): a 1 GiB
        # heap and G1 aiming at 20 ms pauses. With 512 MiB and G1's default 200 ms
        # goal, young collections averaged 140 ms and showed in every p99.
        "java", f"-Xms{heap}", f"-Xmx{heap}", "-server", "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
        "-XX:+ExplicitGCInvokesConcurrent", "-XX:MaxInlineLevel=15",
        *os.environ.get("KDELAY_BROKER_JVM_OPTIONS", "").split(),
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={RUN / 'log4j2.properties'}",
        "-cp", f"{LIBS}/*", *args,
    ]


def start_jars() -> str:
    """Start (or find) the broker run from jars and return its bootstrap address."""
    pid = recorded_pid()
    if pid is not None:
        bootstrap = (RUN / "bootstrap").read_text().strip()
        wait_ready(bootstrap, time.monotonic() + READY_TIMEOUT_S, pid)
        return bootstrap
    fetch_jars()
    RUN.mkdir(parents=True, exist_ok=True)
    port, controller_port, sasl_port, tls_port = broker_ports()
    config = write_config(port, controller_port, sasl_port, tls_port)
    started = time.monotonic()
    if not (data_dir() / "meta.properties").exists():
        cluster_id = subprocess.run(
            java_command("kafka.tools.StorageTool", "random-uuid"),
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        subprocess.run(
            java_command(
                "kafka.tools.StorageTool", "format", "--standalone",
                "--cluster-id", cluster_id, "--config", str(config), "--ignore-formatted",
            ),
            check=True, stdout=sys.stderr,
        )
    with (RUN / "broker.log").open("ab") as out:
        out.write(f"{RUN_MARKER}{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        out.flush()
        nice = broker_nice()
        proc = subprocess.Popen(
            java_command("kafka.Kafka", str(config)),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=lambda: niceness(nice),
        )
    (RUN / "pid").write_text(f"{proc.pid}\n")
    refused = prioritise(proc.pid, nice)
    if refused:
        log(f"broker at normal CPU priority: {refused}")
    bootstrap = f"127.0.0.1:{port}"
    (RUN / "bootstrap").write_text(bootstrap + "\n")
    wait_ready(bootstrap, time.monotonic() + READY_TIMEOUT_S, proc.pid)
    add_scram_user(bootstrap)
    (RUN / "sasl_bootstrap").write_text(f"127.0.0.1:{sasl_port}\n")
    (RUN / "tls_bootstrap").write_text(f"127.0.0.1:{tls_port}\n")
    log(f"broker pid {proc.pid} ready on {bootstrap} in {time.monotonic() - started:.1f}s")
    return bootstrap


def add_scram_user(bootstrap: str) -> None:
    """Create (or reset) the SCRAM user of the SASL listener, through the plain listener."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AdminClient,
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    admin = AdminClient({"bootstrap.servers": bootstrap})
    upsert = UserScramCredentialUpsertion(
        SASL_USER, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 4096),
        SASL_PASSWORD.encode())
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result(timeout=30)


# -- the SASL_SSL listener and the authorizer (tests of TLS and ACLs) --------------------

TLS = RUN / "tls"
SUPER_USERS = ("ANONYMOUS", SASL_USER)


def make_certificates() -> tuple[Path, Path]:
    """Make (once) a development CA and the broker's key and certificate for 127.0.0.1.

    Returns the CA certificate and the broker's PEM keystore (PKCS#8 key, then
    its certificate and the CA's). Valid ten years; development only.
    """
    ca, keystore = TLS / "ca.pem", TLS / "broker-keystore.pem"
    if ca.exists() and keystore.exists():
        return ca, keystore
    TLS.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, cwd=TLS, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
            "-subj", "/CN=kdelay development CA", "-keyout", "ca-key.pem", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "broker-key.pem", "-out", "broker.csr")
    (TLS / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
            "-CAcreateserial", "-days", "3650", "-extfile", "san.ext", "-out", "broker.pem")
    openssl("pkcs8", "-topk8", "-nocrypt", "-in", "broker-key.pem", "-out", "broker-key8.pem")
    keystore.write_text((TLS / "broker-key8.pem").read_text() + (TLS / "broker.pem").read_text()
                        + ca.read_text())
    return ca, keystore


def secure_settings(settings: dict[str, str], port: int, plain: str, scram: str
                    ) -> dict[str, str]:
    """The broker settings that add the SASL_SSL listener and the authorizer."""
    _, keystore = make_certificates()
    listener = f"SASL_SSL://127.0.0.1:{port}"
    return {
        "listeners": f"{settings['listeners']},{listener}",
        "advertised.listeners": f"{settings['advertised.listeners']},{listener}",
        "listener.security.protocol.map": (
            f"{settings['listener.security.protocol.map']},SASL_SSL:SASL_SSL"),
        "listener.name.sasl_ssl.plain.sasl.jaas.config": (
            f'{plain} required user_{SASL_USER}="{SASL_PASSWORD}";'),
        "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config": f"{scram} required;",
        "listener.name.sasl_ssl.ssl.keystore.type": "PEM",
        "listener.name.sasl_ssl.ssl.keystore.location": str(keystore),
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": ";".join(f"User:{user}" for user in SUPER_USERS),
    }


def tls() -> int:
    """Print ``tls_bootstrap=HOST:PORT`` and ``tls_ca=PATH`` of the running jar broker."""
    address = RUN / "tls_bootstrap"
    if recorded_pid() is None or not address.exists():
        log("no broker of this tool with a SASL_SSL listener is running")
        return 1
    print(f"tls_bootstrap={address.read_text().strip()}")
    print(f"tls_ca={TLS / 'ca.pem'}")
    return 0


def start_docker() -> str:
    """Start (or find) the compose ``kafka`` service and return its address."""
    subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "up", "-d", "--wait", "kafka"],
        check=True, stdout=sys.stderr,
    )
    RUN.mkdir(parents=True, exist_ok=True)
    (RUN / "docker").write_text("compose\n")
    wait_ready(DOCKER_BOOTSTRAP, time.monotonic() + READY_TIMEOUT_S)
    return DOCKER_BOOTSTRAP


def own_addresses() -> set[str]:
    """The addresses this tool's broker has (recorded) or would get (compose's, the port
    ``KDELAY_BROKER_PORT`` names)."""
    found = {DOCKER_BOOTSTRAP, f"127.0.0.1:{os.environ.get('KDELAY_BROKER_PORT', DEFAULT_PORT)}"}
    with contextlib.suppress(OSError):
        found.add((RUN / "bootstrap").read_text().strip())
    return found


def external_broker() -> str | None:
    """``KDELAY_BOOTSTRAP_SERVERS`` when it names a broker that ``start`` only waits for.

    None when it is unset, or when it names this tool's own broker and nothing
    listens there (killed or stopped): then ``start`` starts that broker.
    """
    external = os.environ.get("KDELAY_BOOTSTRAP_SERVERS")
    if not external:
        return None
    first = external.split(",")[0]
    host, port = first.rsplit(":", 1)
    if first in own_addresses() and not port_open(host, int(port)):
        log(f"KDELAY_BOOTSTRAP_SERVERS={external} names this tool's broker and nothing "
            "listens there: starting it")
        return None
    log(f"KDELAY_BOOTSTRAP_SERVERS={external}: waiting for that broker, starting none")
    return external


def start() -> int:
    """Print the bootstrap line of a ready broker, starting one when needed."""
    external = external_broker()
    if external:
        wait_ready(external.split(",")[0], time.monotonic() + READY_TIMEOUT_S)
        bootstrap = external
    elif recorded_pid() is None and VERSION == DEFAULT_VERSION and docker_available():
        # compose.yml's broker image is the default version; others run from jars.
        bootstrap = start_docker()
    else:
        bootstrap = start_jars()
    print(f"bootstrap={bootstrap}", flush=True)
    return 0


def stop(sig: signal.Signals = signal.SIGTERM) -> int:
    """Stop the broker this tool started; with SIGKILL, leave its data for a restart."""
    if (RUN / "docker").exists():
        action = "kill" if sig == signal.SIGKILL else "stop"
        subprocess.run(["docker", "compose", "-f", str(COMPOSE), action, "kafka"], check=True)
        return 0
    pid = recorded_pid()
    if pid is None:
        log("no broker started by this tool is running")
        return 0
    os.kill(pid, sig)
    deadline = time.monotonic() + 60
    while pid_alive(pid):
        if time.monotonic() > deadline:
            log(f"broker pid {pid} ignored {sig.name} for 60s; sending SIGKILL")
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
        time.sleep(0.1)
    (RUN / "pid").unlink(missing_ok=True)
    log(f"broker pid {pid} stopped ({sig.name})")
    return 0


def status() -> int:
    """Print the bootstrap line and exit 0 if a broker of this tool runs, else exit 1."""
    pid = recorded_pid()
    if pid is None:
        log("not running")
        return 1
    print(f"bootstrap={(RUN / 'bootstrap').read_text().strip()}")
    log(f"running, pid {pid}")
    return 0


def sasl() -> int:
    """Print ``sasl_bootstrap=HOST:PORT`` of the running jar broker, or exit 1."""
    address = RUN / "sasl_bootstrap"
    if recorded_pid() is None or not address.exists():
        log("no broker of this tool with a SASL listener is running")
        return 1
    print(f"sasl_bootstrap={address.read_text().strip()}")
    return 0


def main() -> int:
    """Parse the command line and run one of start, stop, kill, status, reset, sasl, tls,
    fetch (only download the jars, if not yet), or ``cluster ...`` (a cluster of
    several nodes, :mod:`kafka_cluster`)."""
    if sys.argv[1:2] == ["cluster"]:  # several nodes: tools/kafka_cluster.py
        import kafka_cluster

        return kafka_cluster.main(sys.argv[2:])
    parser = argparse.ArgumentParser(prog="tools/kafka", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["start", "stop", "kill", "status", "reset", "sasl",
                                            "tls", "fetch"])
    command = parser.parse_args().command
    if command == "start":
        return start()
    if command == "fetch":
        fetch_jars()
        return 0
    if command == "stop":
        return stop()
    if command == "kill":
        return stop(signal.SIGKILL)
    if command == "reset":
        stop()
        data = data_dir() if RUN.exists() else RUN
        shutil.rmtree(data, ignore_errors=True)
        data.with_name(data.name + OWNER_SUFFIX).unlink(missing_ok=True)
        shutil.rmtree(RUN, ignore_errors=True)
        log(f"removed {RUN}" + ("" if data.is_relative_to(RUN) else f" and {data}"))
        return 0
    if command == "sasl":
        return sasl()
    if command == "tls":
        return tls()
    return status()


if __name__ == "__main__":
    sys.exit(main())
