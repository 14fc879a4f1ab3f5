"""A single-node Kafka broker in a container, started through ``testcontainers``.

The test suite's broker comes from here when ``KDELAY_TEST_BROKER=testcontainers``
(else from ``tools/kafka``). It speaks Docker's API: ``DOCKER_HOST`` when set,
else Docker's own socket when it answers, else podman's Docker-compatible socket
(``podman system service``, started here when needed; it exits after 5 idle
minutes). The image is ``KDELAY_KAFKA_IMAGE`` (``apache/kafka:4.1.1`` works, as
does the image ``tools/images`` builds without a registry), else the one
``tools/images`` builds. Its broker settings are those of ``tools/kafka`` and
``compose.yml``. Ryuk, testcontainers' reaper, is off unless
``TESTCONTAINERS_RYUK_DISABLED`` says otherwise: its image cannot be pulled offline,
and :meth:`ContainerBroker.stop` removes the container.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PODMAN_SOCKET = Path("/run/podman/podman.sock")
DOCKER_SOCKET = Path("/var/run/docker.sock")
READY_TIMEOUT_S = 120.0
CLUSTER_ID = "cMS-bWRyTIODmPRUg-Aezg"
# podman's API service outlives the caller on purpose (it exits when idle); the
# handle is kept so that it is never collected, with a ResourceWarning, mid-test.
_SERVICES: list[subprocess.Popen[bytes]] = []


class Unavailable(Exception):
    """No container engine answers, or the broker container did not come up."""


def _answers(path: Path) -> bool:
    """Whether a Docker API answers ``GET /_ping`` on the unix socket ``path``."""
    if not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(path))
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return sock.recv(64).split(b" ")[1:2] == [b"200"]
    except (OSError, IndexError):
        return False


def docker_url() -> str:
    """The Docker API to use, starting podman's service when nothing else answers."""
    given = os.environ.get("DOCKER_HOST")
    if given:
        return given
    if _answers(DOCKER_SOCKET):
        return f"unix://{DOCKER_SOCKET}"
    if not _answers(PODMAN_SOCKET):
        if shutil.which("podman") is None:
            raise Unavailable("no Docker API answers (DOCKER_HOST unset, no Docker socket) "
                              "and podman is not installed")
        PODMAN_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        _SERVICES.append(subprocess.Popen(
            ["podman", "system", "service", "--time=300", f"unix://{PODMAN_SOCKET}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))
        deadline = time.monotonic() + 30
        while not _answers(PODMAN_SOCKET):
            if time.monotonic() > deadline:
                raise Unavailable(f"podman system service does not answer on {PODMAN_SOCKET}")
            time.sleep(0.2)
    return f"unix://{PODMAN_SOCKET}"


def kafka_image() -> str:
    """``KDELAY_KAFKA_IMAGE``, else the Kafka image ``tools/images`` builds (once)."""
    given = os.environ.get("KDELAY_KAFKA_IMAGE")
    if given:
        return given
    proc = subprocess.run([str(ROOT / "tools" / "images")], capture_output=True, text=True,
                          check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("KDELAY_KAFKA_IMAGE="):
            return line.split("=", 1)[1]
    raise Unavailable(f"tools/images built no Kafka image: {proc.stderr.strip()[-1500:]}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def broker_environment(port: int) -> dict[str, str]:
    """apache/kafka's settings (``KAFKA_FOO_BAR`` = ``foo.bar``) of a broker on host ``port``."""
    return {
        "CLUSTER_ID": CLUSTER_ID,
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        # Clients on the host use the published port; the broker talks to itself (the
        # transaction markers of exactly-once) on a listener it can reach inside.
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,BROKER://:19092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port},BROKER://localhost:19092",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": (
            "PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT"),
        "KAFKA_INTER_BROKER_LISTENER_NAME": "BROKER",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_NUM_PARTITIONS": "1",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_NUM_PARTITIONS": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS": "0",
        "KAFKA_LOG_CLEANER_DEDUPE_BUFFER_SIZE": "2097152",
        "KAFKA_LOG_RETENTION_CHECK_INTERVAL_MS": "1000",
        "KAFKA_LOG_CLEANER_BACKOFF_MS": "1000",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_DELETE_TOPIC_ENABLE": "true",
    }


@dataclass
class ContainerBroker:
    """A running broker container: its address, image and testcontainers handle."""

    bootstrap: str
    image: str
    container: Any

    def stop(self) -> None:
        """Remove the container (and its anonymous volume)."""
        self.container.stop()


def start() -> ContainerBroker:
    """Start a broker container and return it once an AdminClient lists its topics."""
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # read at import
    from confluent_kafka.admin import AdminClient
    from testcontainers.core.container import DockerContainer

    url = docker_url()
    image = kafka_image()
    port = free_port()
    # docker-py reads DOCKER_HOST when the container's client is made; set it only
    # for that, so that subprocesses (tools/kafka asks `docker info`) never see it.
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = url
    try:
        container = DockerContainer(image)
        container.with_bind_ports(9092, port)
        for name, value in broker_environment(port).items():
            container.with_env(name, value)
        container.start()
    finally:
        if saved is None:
            del os.environ["DOCKER_HOST"]
        else:
            os.environ["DOCKER_HOST"] = saved
    bootstrap = f"127.0.0.1:{port}"
    broker = ContainerBroker(bootstrap, image, container)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:  # the port first: no client logs a refusal
        with socket.socket() as sock:
            sock.settimeout(1)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    while True:
        try:
            admin.list_topics(timeout=5)
            return broker
        except Exception as exc:
            if time.monotonic() > deadline:
                logs = b"".join(container.get_logs()).decode(errors="replace")[-2000:]
                broker.stop()
                raise Unavailable(f"broker container from {image} does not answer at "
                                  f"{bootstrap}: {exc}\n{logs}") from exc
            time.sleep(0.5)
