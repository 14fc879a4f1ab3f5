"""compose.yml for real: broker, topics and two kdelay containers under exactly-once.

The stack runs from the images ``tools/images`` builds (the Dockerfile, the
Kafka jars), on a broker port of its own. Requests are sent from the host
through the containerised broker and read back ``read_committed``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from kdelay.client import DelayProducer
from tests.conftest import wait_visible
from tests.containers.conftest import Compose, podman
from tests.e2e.conftest import FAILOVER_S, Receiver

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

# The grace period podman and Docker give a container between SIGTERM and SIGKILL.
STOP_GRACE_S = 10.0
PARTITIONS = 3  # what `kdelay topics create` makes by default


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def until(condition: Callable[[], bool], what: str, timeout_s: float) -> float:
    """Poll ``condition`` until it holds; return the seconds it took, fail after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s}s"
        time.sleep(0.1)
    return time.monotonic() - started


def send(bootstrap: str, target: str, prefix: str, count: int, due_ms: int) -> set[bytes]:
    """``count`` requests with keys ``prefix0``..., due at ``due_ms``, through the client."""
    keys = {f"{prefix}{i}".encode() for i in range(count)}
    with DelayProducer({"bootstrap.servers": bootstrap}) as producer:
        for key in sorted(keys):
            producer.send_async(target, b"v", key=key, due=due_ms)
        producer.flush()
    return keys


def owned(compose: Compose, name: str) -> int:
    """The partitions a container owns by its metrics; 0 while its published port refuses
    the connection (seen once in CI right after the other container's SIGKILL, the
    survivor running; the test checks below that it did not restart meanwhile)."""
    try:
        value = compose.metric(name, "kdelay_owned_partitions")
    except OSError:
        return 0
    return int(value or 0)


def due_header(received: Receiver) -> dict[bytes, int]:
    """Each delivered key's ``kdelay-due-ms``."""
    found: dict[bytes, int] = {}
    for r in received.received:
        headers = dict(r.message.headers() or [])
        found[r.message.key() or b""] = int(headers["kdelay-due-ms"] or b"")
    return found


def test_compose_stack_delivers_on_time_scales_to_two_and_fails_over(compose: Compose) -> None:
    compose.up("kafka")
    kafka = compose.container("kafka")
    print(f"broker healthy after {compose.wait_healthy(kafka):.1f} s")
    compose.up("kdelay-topics")
    assert compose.wait_exit(compose.container("kdelay-topics")) == 0, \
        compose.logs(compose.container("kdelay-topics"))

    compose.up("kdelay", scale=2, KDELAY_GUARANTEE="exactly-once")
    first, second = compose.container("kdelay", 1), compose.container("kdelay", 2)
    for name in (first, second):
        compose.wait_healthy(name)
        state = compose.state(name)
        assert state["Running"], compose.logs(name)
    user = podman("exec", first, "id", "-u").strip()
    assert user == "10001", "the image must not run as root"
    until(lambda: owned(compose, first) >= 1 and owned(compose, second) >= 1
          and owned(compose, first) + owned(compose, second) == PARTITIONS,
          "both containers own partitions", 120)
    # The image's build stage compiles the delivery hot path; the service runs it.
    for name in (first, second):
        assert "delivery hot path compiled)" in compose.logs(name), compose.logs(name)[-3000:]
    assert podman("exec", first, "kdelay", "--version").endswith(
        "(delivery hot path compiled)\n")

    admin = AdminClient({"bootstrap.servers": compose.bootstrap})
    target = "compose-target"
    admin.create_topics([NewTopic(target, PARTITIONS, 1)])[target].result(timeout=30)
    wait_visible(admin, target, PARTITIONS)
    out = Receiver(compose.bootstrap, admin, [target])
    try:
        # 1. Both containers serve: records due 3 s after sending arrive, never early.
        due_first = now_ms() + 3_000
        sent = send(compose.bootstrap, target, "a", 300, due_first)
        out.until(lambda: out.poll() >= 300, "the first batch delivered", 120)
        early = [r for r in out.received if r.received_ms < due_first
                 or r.message.timestamp()[1] < due_first]
        assert not early, f"{len(early)} records delivered before their due time"
        lateness = sorted(r.received_ms - due_first for r in out.received)
        print(f"first batch lateness: median {lateness[len(lateness) // 2]} ms, "
              f"max {lateness[-1]} ms")
        print("memory: " + podman("stats", "--no-stream", "--format",
                                  "{{.Name}} {{.MemUsage}}", first, second).replace("\n", "; "))

        # 2. One container dies for good: the other takes its partitions.
        doomed, survivor = (first, second) if owned(compose, first) else (second, first)
        due_second = now_ms() + 1_000
        sent |= send(compose.bootstrap, target, "b", 300, due_second)
        survivor_started = compose.state(survivor)["StartedAt"]
        killed = time.monotonic()
        podman("kill", "--signal", "KILL", doomed)
        failover_s = until(lambda: owned(compose, survivor) == PARTITIONS,
                           "the survivor owns every partition", 120)
        assert compose.state(survivor)["StartedAt"] == survivor_started, (
            "the survivor restarted: " + compose.logs(survivor)[-3000:])
        out.until(lambda: out.poll() >= 600, "the second batch delivered", 120)
        delivered_s = time.monotonic() - killed
        out.drain(3.0)
        assert not compose.state(doomed)["Running"], "the killed container came back"
        print(f"failover: survivor owns all partitions {failover_s:.1f} s after SIGKILL, "
              f"last record of the second batch delivered after {delivered_s:.1f} s")

        # 3. Exactly once, on time, and no container fenced.
        seen = Counter(r.message.key() or b"" for r in out.received)
        lost = sent - set(seen)
        duplicates = {k: n for k, n in seen.items() if n > 1}
        print(f"compose: sent {len(sent)}, delivered {len(set(seen) & sent)}, "
              f"lost {len(lost)}, duplicated {len(duplicates)}")
        assert not lost, sorted(lost)[:10]
        assert not duplicates, sorted(duplicates)[:10]
        assert set(seen) == sent
        dues = due_header(out)
        assert all(r.received_ms >= dues[r.message.key() or b""] for r in out.received)
        for name in (first, second):
            assert "fenced" not in compose.logs(name).lower(), compose.logs(name)[-3000:]
        assert failover_s < FAILOVER_S

        # 4. SIGTERM: the survivor finishes its step and exits 0 within the grace period.
        started = time.monotonic()
        podman("stop", "-t", str(int(STOP_GRACE_S)), survivor)
        stopped_s = time.monotonic() - started
        print(f"SIGTERM to exit: {stopped_s:.2f} s")
        assert compose.state(survivor)["ExitCode"] == 0, compose.logs(survivor)[-3000:]
        assert stopped_s < STOP_GRACE_S
    finally:
        out.close()
