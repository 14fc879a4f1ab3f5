"""Stall probe: the CPU kdelay's Kafka producers burn while the broker stalls.

A broker that stops answering for a moment (a long garbage collection, a
stalled disk) but keeps its connections open is not an outage: librdkafka
still sees it up. This probe starts a private broker of ``tools/kafka`` (its
own cache directory and port; the shared broker is never touched), stops it
with SIGSTOP for ``--seconds`` and measures CPU (user + system) meanwhile:

- producers: one producer of each kind kdelay configures (plain, idempotent,
  idempotent and gapless), each with records queued behind a request in
  flight, one at a time, in this process;
- service: a ``kdelay run`` (``--guarantee``, default settings) delivering a
  steady load (``--rate`` requests a second, each due 200 ms after it is
  sent), before, during and after the stall.

Prints one table row per measurement: cores used (CPU seconds per second).
Run ``tools/stall --help``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from failover_probe import KDELAY, Instance, deployment
from kafka_broker import PrivateBroker
from kdelay_bench.cputime import own_cpu_s, stat_cpu_s
from kdelay_bench.load import request_headers

DELAY_MS = 200
# The slowed broker: stopped this long, then running this long, in turn.
SLOW_CYCLE_S = (0.04, 0.01)
KINDS: dict[str, dict[str, str | int | bool]] = {
    "plain (acks=all)": {"linger.ms": 2},
    "idempotent": {"enable.idempotence": True, "linger.ms": 2},
    "idempotent, gapless": {"enable.idempotence": True, "enable.gapless.guarantee": True,
                            "linger.ms": 2},
}


def log(message: str) -> None:
    """Progress goes to stderr."""
    print(f"stall: {message}", file=sys.stderr, flush=True)


@contextmanager
def stalled(broker: PrivateBroker) -> Iterator[None]:
    """The broker process stopped (SIGSTOP) for the block, continued after it."""
    pid = broker.pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextmanager
def slowed(broker: PrivateBroker) -> Iterator[None]:
    """The broker stopped and continued in turn (:data:`SLOW_CYCLE_S`) for the block: it
    answers, late, as a broker short of CPU does."""
    pid = broker.pid()
    done = threading.Event()

    def cycle() -> None:
        stopped_s, running_s = SLOW_CYCLE_S
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)

    cycler = threading.Thread(target=cycle, daemon=True)
    cycler.start()
    try:
        yield
    finally:
        done.set()
        cycler.join()
        os.kill(pid, signal.SIGCONT)


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``, every thread."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())


def producer_row(broker: PrivateBroker, name: str, seconds: float) -> str:
    """Cores one producer of kind ``name`` uses while the broker is stopped."""
    topic = f"stall-{time.monotonic_ns()}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "log_level": 3,
                         "message.timeout.ms": 0, **KINDS[name]})
    for _ in range(100):
        producer.produce(topic, b"x" * 100)
    producer.flush(30)
    with stalled(broker):
        before, started = own_cpu_s(), time.monotonic()
        while time.monotonic() - started < seconds:
            for _ in range(20):  # at least 5 in flight, the rest queued behind them
                producer.produce(topic, b"x" * 100)
            producer.poll(0.01)
        used = (own_cpu_s() - before) / (time.monotonic() - started)
    producer.flush(60)
    return f"| producer: {name} | {used:.2f} |"


def service_rows(broker: PrivateBroker, workdir: Path, guarantee: str, rate: int,
                 seconds: float) -> list[str]:
    """Cores ``kdelay run`` uses under a steady load: before, during and after a stall."""
    env = deployment(broker.bootstrap, workdir, 3, guarantee)
    service = Instance(env, workdir / "service.log")
    service.wait("its assignment", lambda seen: bool(seen))
    load = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 5, "log_level": 3})
    topic, target = env["KDELAY_REQUESTS_TOPIC"], env["KDELAY_DLQ_TOPIC"]
    rows = []
    try:
        for phase in PHASES:
            before, started = process_cpu_s(service.proc.pid), time.monotonic()
            sent = 0
            with _phase(broker, phase):
                while (elapsed := time.monotonic() - started) < seconds:
                    while sent < elapsed * rate:
                        due = time.time_ns() // 1_000_000 + DELAY_MS
                        load.produce(topic, b"x" * 100, headers=request_headers(target, due))
                        sent += 1
                    load.poll(0.005)
            used = (process_cpu_s(service.proc.pid) - before) / (time.monotonic() - started)
            if phase != "warm-up":
                rows.append(f"| kdelay run ({guarantee}, {rate:,}/s): {phase} | {used:.2f} |")
        load.flush(60)
    finally:
        service.kill()
    return rows


PHASES = ("warm-up", "before the stall", "broker stopped", "after the stall",
          "broker slowed", "after the slowdown")


@contextmanager
def _phase(broker: PrivateBroker, phase: str) -> Iterator[None]:
    """What the broker does in ``phase``: stopped, slowed, or nothing special."""
    if phase == "broker stopped":
        with stalled(broker):
            yield
    elif phase == "broker slowed":
        with slowed(broker):
            yield
    else:
        yield


def main() -> int:
    """Start the private broker, measure, print the table, stop the broker."""
    parser = argparse.ArgumentParser(prog="tools/stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each phase")
    parser.add_argument("--rate", type=int, default=2_000, help="requests a second")
    parser.add_argument("--guarantee", choices=["at-least-once", "exactly-once"],
                        default="at-least-once")
    args = parser.parse_args()
    if not KDELAY.exists():
        sys.exit(f"tools/stall: {KDELAY} is missing; run tools/test or pip install -e . first")
    workdir = Path(tempfile.mkdtemp(prefix="kdelay-stall-"))
    broker = PrivateBroker(workdir / "cache")
    log("starting a private broker")
    broker.start()
    try:
        rows = []
        for name in KINDS:
            log(f"producer: {name}")
            rows.append(producer_row(broker, name, args.seconds))
        log(f"kdelay run, {args.guarantee}")
        rows += service_rows(broker, workdir, args.guarantee, args.rate, args.seconds)
    finally:
        broker.stop()
    print(f"| broker stopped {args.seconds:g} s | cores used |\n|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
