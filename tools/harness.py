"""What the crash and chaos harnesses share: the load, the instance, the read-back, the count.

- :class:`Load`: a thread writing requests at a steady rate with mixed delays
  (already due, sub-second, a few seconds), a share with a ``kdelay-id`` (one
  per request), placed by key with the producer's default partitioner (so most
  land off their id's partition and are forwarded), some of those followed by
  a cancel or a reschedule; it remembers what each request must become.
- :class:`Instance`: ``kdelay run`` as a subprocess, a log file per run.
- :class:`TopicReader` and :func:`read_all`: a topic read back whole with
  ``read_committed``.
- :class:`Arrivals`: what arrived on the target, counted per request, and the
  verdicts both harnesses draw from it: lost, early, duplicated, and which
  duplicates no event of the run explains.

``tools/crash`` (kills of ``kdelay run`` on one broker) and ``tools/chaos``
(a cluster's events) each add their own events and their own report.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)

from kdelay.plumbing.clients import produce
from kdelay.protocol import envelope

ROOT = Path(__file__).resolve().parent.parent
KDELAY = ROOT / ".venv" / "bin" / "kdelay"
ASSIGNED_AT = re.compile(r"^(\S+ \S+) (?:\[\S+\] )?INFO kdelay\.engine\.service: assigned \[\d",
                         re.MULTILINE)
# A cancel or reschedule follows only a request due at least this far ahead, so that it
# can arrive in time.
AMEND_AHEAD_MS = 1_500
RESCHEDULE_BY_MS = 2_000


def log(message: str) -> None:
    """Progress goes to stderr."""
    print(f"harness: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def now_ms() -> int:
    """The wall clock in milliseconds (what record timestamps are)."""
    return time.time_ns() // 1_000_000


def logged_ms(stamp: str) -> int:
    """A log line's ``asctime`` (local time, ``%Y-%m-%d %H:%M:%S,%f``) in epoch ms."""
    return int(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp() * 1000)


# -- the load -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """What the load writes: ``rate`` requests a second, the share with an id, and the
    shares of those followed by a cancel or a reschedule."""

    rate: int = 200
    ids: float = 0.3
    cancels: float = 0.0
    reschedules: float = 0.0


class Load(threading.Thread):
    """Writes requests at a steady rate until stopped; remembers what each must become:
    its due time (:attr:`due`), when it was written (:attr:`sent`), the cancelled ones
    and the new due time of the rescheduled ones."""

    def __init__(self, bootstrap: str, topic: str, target: str, mix: Mix, seed: int) -> None:
        super().__init__(daemon=True)
        self._producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                   "linger.ms": 5, "message.timeout.ms": 0})
        self._topic = topic
        self._target = target
        self._mix = mix
        self._rng = random.Random(seed)
        self._halt = threading.Event()
        self.due: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        self.cancelled: set[str] = set()
        self.rescheduled: dict[str, int] = {}
        self.errors: list[str] = []

    def run(self) -> None:
        sent = 0
        started = time.monotonic()
        while not self._halt.is_set():
            self._send(f"r{sent}")
            sent += 1
            ahead = sent / self._mix.rate - (time.monotonic() - started)
            if ahead > 0:
                self._halt.wait(ahead)
            self._producer.poll(0)

    def _send(self, rid: str) -> None:
        now = now_ms()
        kind = self._rng.random()
        if kind < 0.2:
            due = now - self._rng.randint(0, 5_000)
        elif kind < 0.6:
            due = now + self._rng.randint(1, 999)
        else:
            due = now + self._rng.randint(1_000, 5_000)
        self.due[rid] = due
        self.sent[rid] = now
        headers: list[tuple[str, str | bytes | None]] = [
            (envelope.TARGET, self._target.encode()), (envelope.DUE_MS, str(due).encode())]
        pick = self._rng.random()
        sid = f"id-{rid}"
        with_id = pick < self._mix.ids
        if with_id:
            headers.append((envelope.SCHEDULE_ID, sid.encode()))
        self._produce(rid, rid.encode(), headers, now)
        if not with_id or due < now + AMEND_AHEAD_MS:
            return
        if pick < self._mix.cancels:
            self.cancelled.add(rid)
            self._produce(f"{rid}/cancel", b"", envelope.cancel_headers(sid), now)
        elif pick < self._mix.cancels + self._mix.reschedules:
            self.rescheduled[rid] = due + RESCHEDULE_BY_MS
            self._produce(f"{rid}/reschedule", b"",
                          envelope.reschedule_headers(sid, due_ms=due + RESCHEDULE_BY_MS), now)

    def _produce(self, key: str, value: bytes, headers: list[tuple[str, str | bytes | None]],
                 now: int) -> None:
        def report(error: KafkaError | None, _: Message) -> None:
            if error is not None:
                self.errors.append(error.str())

        produce(self._producer, self._topic, key=key.encode(), value=value,
                headers=headers, timestamp=now, on_delivery=report)

    def stop(self) -> None:
        """Stop writing and wait until every request written is acknowledged."""
        self._halt.set()
        self.join()
        while self._producer.flush(5) > 0:
            log("waiting for Kafka to acknowledge the load")


# -- the instance -------------------------------------------------------------------------


class Instance:
    """``kdelay run`` as a subprocess with ``env``; each start logs to ``run-N.log`` in
    ``workdir``."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self._workdir = workdir
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._runs = 0
        self.started_ms: list[int] = []

    def log_path(self, run: int) -> Path:
        """The log file of start number ``run`` (from 1)."""
        return self._workdir / f"run-{run}.log"

    def serving_times_s(self) -> list[float]:
        """Seconds from each restart to its first partition assignment, for restarts that got one.

        Read from the ``assigned [...]`` line each run logs (its timestamp is the
        wall clock, like the recorded start).
        """
        times = []
        for run, started in enumerate(self.started_ms[1:], start=2):
            found = ASSIGNED_AT.search(self.log_path(run).read_text(errors="replace"))
            if found:
                times.append((logged_ms(found.group(1)) - started) / 1000)
        return times

    def show_last_run(self, lines: int = 60) -> None:
        """Print the last run's log lines (the run that delivered after the last kill)."""
        path = self.log_path(self._runs)
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        log(f"the last {len(tail)} lines of {path}:\n" + "\n".join(tail))

    @property
    def state_dir(self) -> Path:
        return Path(self._env["KDELAY_STATE_DIR"])

    def start(self) -> None:
        self._runs += 1
        self.started_ms.append(now_ms())
        with self.log_path(self._runs).open("wb") as out:
            self._proc = subprocess.Popen(
                [str(KDELAY), "run", "--log-level", "INFO"],
                env=self._env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()

    def terminate(self) -> int:
        if self._proc is None:
            return 0
        self._proc.send_signal(signal.SIGTERM)
        return self._proc.wait(timeout=60)


# -- reading back -------------------------------------------------------------------------


class TopicReader:
    """Reads a whole topic with read_committed, from the beginning, up to its current end."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"harness-{uuid.uuid4()}",
            "enable.auto.commit": False, "isolation.level": "read_committed",
            "enable.partition.eof": True})
        metadata = self._consumer.list_topics(topic, timeout=30)
        self._partitions = sorted(metadata.topics[topic].partitions)
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                               for p in self._partitions])
        self.messages: list[Message] = []

    def drain(self, timeout_s: float = 60.0) -> list[Message]:
        """Read until every partition reports its end; return everything read so far."""
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(at_end) < len(self._partitions) and time.monotonic() < deadline:
            for message in self._consumer.consume(10_000, timeout=0.5):
                error = message.error()
                if error is None:
                    self.messages.append(message)
                    at_end.discard(int(message.partition() or 0))
                elif error.code() == KafkaError._PARTITION_EOF:
                    at_end.add(int(message.partition() or 0))
        return self.messages

    def close(self) -> None:
        self._consumer.close()


def read_all(bootstrap: str, topic: str, keys: set[str], timeout_s: float) -> list[Message]:
    """Read ``topic`` until every key in ``keys`` has arrived or ``timeout_s`` passes."""
    reader = TopicReader(bootstrap, topic)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            found = {(m.key() or b"").decode() for m in reader.drain()}
            missing = len(keys - found)
            if not missing or time.monotonic() > deadline:
                return reader.messages
            log(f"{missing} requests not delivered yet")
            time.sleep(1.0)
    finally:
        reader.close()


# -- counting -----------------------------------------------------------------------------


def origin_of(message: Message) -> str:
    """The request a delivered copy was made from (its ``kdelay-origin`` header)."""
    origin = dict(message.headers() or []).get(envelope.ORIGIN)
    return origin.decode(errors="replace") if isinstance(origin, bytes) else "?"


@dataclass
class Arrivals:
    """What arrived on a target, per request id (the record key): how many copies, the
    first copy's timestamp (its delivery time), and the delivery times of the requests
    of each request partition."""

    counts: Counter[str] = field(default_factory=Counter)
    first: dict[str, int] = field(default_factory=dict)
    by_partition: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def of(cls, delivered: Iterable[Message]) -> Arrivals:
        """Count ``delivered``."""
        found = cls()
        for message in delivered:
            rid = (message.key() or b"").decode()
            stamp = message.timestamp()[1]
            found.counts[rid] += 1
            found.first[rid] = min(found.first.get(rid, stamp), stamp)
            found.by_partition[origin_of(message).rsplit("/", 1)[0]].append(stamp)
        return found

    def lost(self, due: Mapping[str, int], excused: set[str] | frozenset[str] = frozenset()
             ) -> list[str]:
        """The requests of ``due`` that never arrived, but the ``excused`` (cancelled)."""
        return [rid for rid in due if rid not in self.counts and rid not in excused]

    def early(self, due: Mapping[str, int]) -> list[str]:
        """The requests whose first copy arrived before their due time."""
        return [rid for rid, stamp in self.first.items() if stamp < due.get(rid, 0)]

    def duplicated(self) -> list[str]:
        """The requests that arrived more than once."""
        return [rid for rid, n in self.counts.items() if n > 1]

    def unexplained(self, windows: list[tuple[int, int]]) -> list[str]:
        """The duplicated requests whose first copy arrived in none of ``windows`` (epoch
        ms, inclusive): the times in which an event of the run explains a second copy."""
        return [rid for rid in self.duplicated()
                if not any(start <= self.first[rid] <= end for start, end in windows)]
