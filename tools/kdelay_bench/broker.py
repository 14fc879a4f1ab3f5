"""The broker the bench runs on, and the randomly named topics it creates there.

Every topic is registered with :class:`Topics` and deleted when the run ends
(unless ``--keep-topics``), so the shared development broker does not fill up.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import kafka_broker
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import create_topics

ROOT = Path(__file__).resolve().parents[2]
WEEK_MS = 7 * 86_400_000


def bootstrap_servers(given: str | None) -> str:
    """Return the broker address: the flag, else ``KDELAY_BOOTSTRAP_SERVERS``, else
    whatever ``tools/kafka start`` finds or starts. Raises SystemExit if none answers."""
    found = given or os.environ.get("KDELAY_BOOTSTRAP_SERVERS")
    return found or _kafka_start()


def external_broker(given: str | None) -> bool:
    """Return whether the broker is somebody else's (the flag or the variable names it)."""
    return bool(given or os.environ.get("KDELAY_BOOTSTRAP_SERVERS"))


def _kafka_start() -> str:
    """The broker ``tools/kafka start`` finds or starts (called only when none is named)."""
    try:
        return kafka_broker.address()
    except kafka_broker.BrokerUnavailable as exc:
        raise SystemExit(f"tools/bench: no broker: {exc}") from exc


def left_running(given: str | None, bootstrap: str) -> str | None:
    """Return how to stop the ``tools/kafka`` broker the bench ran on, or None if it is
    somebody else's: the bench leaves it up (the next run skips its start-up)."""
    if external_broker(given):
        return None
    cache = os.environ.get("KDELAY_CACHE_DIR")
    prefix = f"KDELAY_CACHE_DIR={cache} " if cache else ""
    return f"the broker on {bootstrap} stays up for the next run; stop it: {prefix}tools/kafka stop"


def restart_broker(bootstrap: str) -> None:
    """Stop the broker ``tools/kafka`` runs and start it again (same data, same port).

    Only for a broker the bench manages (see :func:`external_broker`): every
    client of it loses it for the seconds the restart takes. Raises
    RuntimeError when it comes back on another address.
    """
    stop = subprocess.run([str(ROOT / "tools" / "kafka"), "stop"], capture_output=True,
                          text=True, check=False)
    if stop.returncode != 0:
        raise RuntimeError(f"tools/kafka stop failed: {stop.stderr.strip()[-400:]}")
    again = _kafka_start()
    if again != bootstrap:
        raise RuntimeError(f"the broker came back on {again}, not {bootstrap}")


def broker_pid(bootstrap: str) -> int | None:
    """Return the pid of the jar broker ``tools/kafka`` runs on ``bootstrap``; None for
    any other broker (external, in Docker, or not started by this checkout's tool)."""
    recorded = kafka_broker.RUN / "bootstrap"
    if not recorded.exists() or recorded.read_text().strip() != bootstrap:
        return None
    return kafka_broker.recorded_pid()


class Topics:
    """Creates bench topics with random names and deletes them all in :meth:`cleanup`."""

    def __init__(self, bootstrap: str, run_id: str) -> None:
        self.bootstrap = bootstrap
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self._run_id = run_id
        self._created: list[str] = []

    def name(self, role: str) -> str:
        """Return a fresh, unique topic name for ``role``."""
        return f"bench-{self._run_id}-{role}-{uuid.uuid4().hex[:6]}"

    def create(self, role: str, partitions: int, config: dict[str, str] | None = None) -> str:
        """Create a topic; return its name. Raises KafkaException if the broker refuses."""
        name = self.name(role)
        futures = self.admin.create_topics([NewTopic(
            name, num_partitions=partitions, replication_factor=1, config=config or {})])
        self._created.append(name)
        futures[name].result(timeout=30)
        return name

    def deployment(self, role: str, partitions: int, state_dir: Path,
                   batch_size: int) -> Settings:
        """Create requests, changelog and DLQ topics with ``kdelay.plumbing.topics``; return the
        settings of a service on them (one week retention, state under ``state_dir``)."""
        prefix = self.name(role)
        settings = Settings(
            bootstrap_servers=self.bootstrap, requests_topic=f"{prefix}-req",
            changelog_topic=f"{prefix}-chg", dlq_topic=f"{prefix}-dlq",
            group_id=f"{prefix}-group", state_dir=state_dir, batch_size=batch_size)
        self._created += [settings.requests_topic, settings.changelog_topic, settings.dlq_topic]
        create_topics(self.admin, settings, partitions=partitions, replication_factor=1,
                      retention_ms=WEEK_MS)
        return settings

    def cleanup(self) -> None:
        """Delete every topic this run created; failures are reported, not raised."""
        if not self._created:
            return
        futures = self.admin.delete_topics(self._created, operation_timeout=30)
        for name, future in futures.items():
            try:
                future.result(timeout=30)
            except KafkaException as exc:
                print(f"tools/bench: cannot delete {name}: {exc}", flush=True)
        self._created.clear()


def wait_for_topic(bootstrap: str, topic: str, timeout_s: float = 30.0) -> int:
    """Wait until ``topic``'s partitions have leaders; return the partition count."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic, timeout=10).topics.get(topic)
        if meta is not None and meta.error is None and meta.partitions and all(
                p.leader >= 0 for p in meta.partitions.values()):
            return len(meta.partitions)
        time.sleep(0.2)
    raise SystemExit(f"tools/bench: topic {topic} has no leaders after {timeout_s}s")


def wait_group_stable(admin: AdminClient, group: str, timeout_s: float,
                      alive: Callable[[], bool] | None = None) -> bool:
    """Wait until ``group`` is stable with an assignment; False after ``timeout_s``.

    ``alive`` may be a callable returning False to stop waiting early (its
    process died).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        try:
            description = admin.describe_consumer_groups([group])[group].result(timeout=10)
        except KafkaException as exc:
            if not _coordinator_not_ready(exc):
                raise
            time.sleep(0.25)
            continue
        assigned = any(m.assignment.topic_partitions for m in description.members)
        if str(description.state).endswith("STABLE") and assigned:
            return True
        time.sleep(0.25)
    return False


def _coordinator_not_ready(exc: KafkaException) -> bool:
    """Return whether ``exc`` says the group coordinator is still loading or moving,
    as it is in the first seconds after a broker start."""
    error = exc.args[0] if exc.args else None
    return isinstance(error, KafkaError) and (error.retriable() or error.code() in (
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR))
