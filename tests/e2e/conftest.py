"""Fixtures for end-to-end tests: the real ``kdelay`` command as a subprocess.

A test gets a :class:`Deployment` (three topics with random names, made by
``kdelay topics create``, deleted when the test ends) and starts ``kdelay run``
with :func:`start_kdelay` configured only through ``KDELAY_*`` environment
variables. Each process writes its stdout and stderr to a log file under the
test's tmp dir; when a test fails, the tail of every log is attached to its
report. Processes still running when the test ends are killed.

The service runs on the system clock here, so a test waits for real due
times: it polls a :class:`Receiver` on the target topics until the records it
expects have arrived, within a bounded deadline, and never sleeps for a due
time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kafka_broker
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from tests.conftest import _unavailable, produce_all

READY = re.compile(r"assigned \[\d")
STOP_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 60.0
# A dead instance's partitions are served again after one session timeout (6 s by
# default; 10 s until session 47) plus the rebalance and the restore: 6.1-6.8 s measured
# alone on a three-broker cluster (10-12.5 s with 10 s, 15.3 s once in a loaded CI
# run). The bound catches a failover that waits for anything longer
# (librdkafka's default session timeout, 45 s; a dead transaction's timeout, 300 s;
# the poll interval) without failing on a slow minute of the machine; the measured
# figure is printed, and its timing belongs to tools/bench.
FAILOVER_S = 30.0
TAIL_LINES = 60


def kdelay_command() -> list[str]:
    """The ``kdelay`` console script of the running interpreter's environment."""
    script = Path(sys.executable).parent / "kdelay"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from kdelay.cli import main; main()"]


def clean_environment(**variables: str) -> dict[str, str]:
    """This process's environment without any ``KDELAY_*`` variable, plus ``variables``.

    ``COLUMNS`` is fixed so that typer's help output does not wrap by terminal.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDELAY_")}
    return {**env, "COLUMNS": "200", **variables}


def run_cli(env: dict[str, str], *args: str,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one ``kdelay`` command to completion; stdout and stderr are captured."""
    return subprocess.run([*kdelay_command(), *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)

class OwnBroker(kafka_broker.PrivateBroker):
    """A broker of ``tools/kafka`` that only one test uses, in ``cache``.

    For a test that kills or stops its broker: never the broker the other
    tests share (``tools/test`` runs two parts of the suite side by side on
    it). Of the version the session runs (``KDELAY_KAFKA_VERSION``, set by
    the compatibility runs), else the default one.
    """

    def __init__(self, cache: Path) -> None:
        version = os.environ.get("KDELAY_KAFKA_VERSION")
        super().__init__(cache, KDELAY_BROKER_HEAP="512m",
                         **({"KDELAY_KAFKA_VERSION": version} if version else {}))


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[OwnBroker]:
    """A fresh jar broker in the test's tmp dir, sharing only the downloaded jars."""
    libs = kafka_broker.LIBS
    if not (libs / ".complete").exists():
        _unavailable(f"the broker jars are not fetched into {libs} (tools/kafka start does)")
    broker = OwnBroker(tmp_path / "broker-cache")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()



@dataclass(frozen=True)
class Deployment:
    """kdelay's three topics (random names), its group and its state dir, for one test."""

    bootstrap: str
    requests: str
    changelog: str
    dlq: str
    group_id: str
    state_dir: Path
    partitions: int
    outcomes: str = "kdelay.outcomes"
    controls: str = "kdelay.controls"
    status: str = "kdelay.status"

    def env(self, **overrides: str) -> dict[str, str]:
        """The environment ``kdelay`` runs with: every setting as a ``KDELAY_*`` variable."""
        return clean_environment(**{
            "KDELAY_BOOTSTRAP_SERVERS": self.bootstrap,
            "KDELAY_REQUESTS_TOPIC": self.requests,
            "KDELAY_CHANGELOG_TOPIC": self.changelog,
            "KDELAY_DLQ_TOPIC": self.dlq,
            "KDELAY_OUTCOMES_TOPIC": self.outcomes,
            "KDELAY_CONTROLS_TOPIC": self.controls,
            "KDELAY_STATUS_TOPIC": self.status,
            "KDELAY_GROUP_ID": self.group_id,
            "KDELAY_STATE_DIR": str(self.state_dir),
            "KDELAY_LOG_LEVEL": "INFO",
            **overrides,
        })


@pytest.fixture
def deploy(
    bootstrap: str, admin: AdminClient, tmp_path: Path
) -> Iterator[Callable[..., Deployment]]:
    """Create deployments with ``kdelay topics create``; delete their topics at the end."""
    made: list[Deployment] = []

    def create(partitions: int = 3) -> Deployment:
        suffix = uuid.uuid4().hex[:12]
        deployment = Deployment(
            bootstrap=bootstrap, requests=f"e2e-req-{suffix}", changelog=f"e2e-chg-{suffix}",
            dlq=f"e2e-dlq-{suffix}", group_id=f"e2e-g-{suffix}",
            state_dir=tmp_path / f"state-{suffix}", partitions=partitions,
            outcomes=f"e2e-out-{suffix}", controls=f"e2e-ctl-{suffix}",
            status=f"e2e-sts-{suffix}",
        )
        made.append(deployment)
        result = run_cli(deployment.env(), "topics", "create", "--partitions", str(partitions))
        assert result.returncode == 0, result.stderr
        return deployment

    yield create
    names = [t for d in made
             for t in (d.requests, d.changelog, d.dlq, d.outcomes, d.controls, d.status)]
    existing = set(admin.list_topics(timeout=30).topics)
    doomed = [name for name in names if name in existing]
    if doomed:
        for future in admin.delete_topics(doomed).values():
            future.result(timeout=30)


def produce_requests(deployment: Deployment, records: list[dict[str, Any]]) -> list[Message]:
    """Produce ``records`` (``Producer.produce`` kwargs) to the requests topic; return reports.

    The idempotent producer is warmed up first: a fresh one can hold its first
    records for up to a second (producer id, metadata) while their timestamps,
    from which ``kdelay-delay-ms`` counts, are already set; that wait would
    show up as lateness. The warm-up records are cancels of an id that is never
    scheduled, one per partition: kdelay counts them as ``unknown`` and
    delivers or dead-letters nothing for them.
    """
    producer = Producer({"bootstrap.servers": deployment.bootstrap, "enable.idempotence": True,
                         "linger.ms": 5})
    warm_up = [{"partition": p, "headers": [("kdelay-cancel", b"e2e-warm-up")]}
               for p in range(deployment.partitions)]
    produce_all(producer, deployment.requests, warm_up)
    return produce_all(producer, deployment.requests, records)


class KdelayProcess:
    """One ``kdelay run`` subprocess, its combined output in ``log_path``."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path,
                 args: tuple[str, ...] = (), prefix: tuple[str, ...] = ()) -> None:
        self.name = name
        self.log_path = log_path
        self.started = time.monotonic()
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen([*prefix, *kdelay_command(), "run", *args], env=env,
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)

    def log(self) -> str:
        """Everything the process has written so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, times: int = 1) -> float:
        """Wait until the service logs its ``times``-th partition assignment.

        Returns the seconds since the process started. Fails if the process
        exits first or is not ready within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while len(READY.findall(self.log())) < times:
            code = self.popen.poll()
            assert code is None, f"{self.name} exited with {code} before it was ready"
            assert time.monotonic() < deadline, f"{self.name} not ready within {timeout_s}s"
            time.sleep(0.05)
        return time.monotonic() - self.started

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send SIGTERM and return the exit code; fail if it does not exit in time."""
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} did not exit within {timeout_s}s of SIGTERM")

    def kill(self) -> None:
        """SIGKILL the process if it still runs, and reap it."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)


_PROCESSES = pytest.StashKey[list[KdelayProcess]]()


@pytest.fixture
def start_kdelay(request: pytest.FixtureRequest,
           tmp_path: Path) -> Iterator[Callable[..., KdelayProcess]]:
    """Start ``kdelay run`` for a deployment; kill whatever still runs when the test ends."""
    processes: list[KdelayProcess] = []
    request.node.stash[_PROCESSES] = processes

    def start(deployment: Deployment, *args: str, prefix: tuple[str, ...] = (),
              **env: str) -> KdelayProcess:
        name = f"kdelay-run-{len(processes) + 1}"
        process = KdelayProcess(name, deployment.env(**env), tmp_path / f"{name}.log", args,
                                prefix)
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.kill()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach the tail of every ``kdelay run`` log to the report of a failed test."""
    report = yield
    if report.failed:
        for process in item.stash.get(_PROCESSES, []):
            report.sections.append(
                (f"{process.name} output (last {TAIL_LINES} lines of {process.log_path})",
                 process.tail()))
    return report


@dataclass(frozen=True)
class Received:
    """A record read by the test, and the wall time (ms) its consumer returned it."""

    message: Message
    received_ms: int


def partitions_of(admin: AdminClient, topics: list[str], timeout_s: float = 30.0) -> dict[str, int]:
    """Each topic's partition count, waiting until the metadata shows every one of them.

    A topic just created can be missing from the metadata of a broker for a moment.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        metadata = admin.list_topics(timeout=timeout_s).topics
        found = {t: len(metadata[t].partitions) for t in topics
                 if t in metadata and metadata[t].error is None and metadata[t].partitions}
        if len(found) == len(topics):
            return found
        assert time.monotonic() < deadline, f"topics {sorted(set(topics) - set(found))} unknown"
        time.sleep(0.1)


class Receiver:
    """Reads topics from their beginning by assignment (no group join delay).

    ``read_committed``, like any consumer of kdelay's targets. Each record is
    stamped with the wall time at which ``consume`` returned it.
    """

    def __init__(self, bootstrap: str, admin: AdminClient, topics: list[str]) -> None:
        self.consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"e2e-receiver-{uuid.uuid4().hex}",
            "enable.auto.commit": False, "isolation.level": "read_committed",
            "fetch.wait.max.ms": 50,
        })
        partitions = partitions_of(admin, topics)
        self.consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)
                              for topic in topics for partition in range(partitions[topic])])
        self.received: list[Received] = []

    def poll(self, timeout_s: float = 0.1) -> int:
        """Read what has arrived; return how many records were received in all."""
        messages = self.consumer.consume(10_000, timeout=timeout_s)
        now_ms = time.time_ns() // 1_000_000
        for message in messages:
            error = message.error()
            assert error is None, error
            self.received.append(Received(message, now_ms))
        return len(self.received)

    def until(self, condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
        """Poll until ``condition()`` holds; fail after ``timeout_s`` naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, (
                f"{what}: not within {timeout_s}s ({len(self.received)} records received)")
            self.poll()

    def drain(self, quiet_s: float) -> None:
        """Keep reading for ``quiet_s`` more seconds, to catch late duplicates."""
        deadline = time.monotonic() + quiet_s
        while time.monotonic() < deadline:
            self.poll()

    def on(self, topic: str) -> list[Received]:
        """The records received from ``topic``."""
        return [r for r in self.received if r.message.topic() == topic]

    def close(self) -> None:
        self.consumer.close()


@pytest.fixture
def receiver(bootstrap: str, admin: AdminClient) -> Iterator[Callable[[list[str]], Receiver]]:
    """Receivers of topics; closed when the test ends."""
    made: list[Receiver] = []

    def make(topics: list[str]) -> Receiver:
        made.append(Receiver(bootstrap, admin, topics))
        return made[-1]

    yield make
    for r in made:
        r.close()
