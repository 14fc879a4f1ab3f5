"""``kdelay run`` end to end: the real command, configured by ``KDELAY_*`` variables.

These tests run on the system clock and wait for real (short) delays by
polling the target topics. They check the contract from outside: every request
delivered, never early, key, value and user headers intact; SIGTERM exits 0
and loses nothing; a lost state dir is rebuilt from the changelog; malformed
requests go to the DLQ. Timing is measured and reported, not asserted tightly:
timing goals belong to the benchmarks.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Message

from tests.conftest import TopicFactory
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    Received,
    Receiver,
    clean_environment,
    produce_requests,
    run_cli,
)
from tests.integration.conftest import header, produce

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]
Headers = list[tuple[str, bytes | None]]

kafka = pytest.mark.kafka
MAX_LATENESS_MS = 30_000


@dataclass(frozen=True)
class Sent:
    """A request as the test produced it, and what its delivery must look like."""

    key: bytes
    value: bytes
    user_headers: Headers
    target: str
    target_partition: int | None
    due_ms: int


def request(target: str, i: int, delay_ms: int, partition: int,
            target_partition: int | None = None) -> dict[str, Any]:
    """Producer kwargs of request ``i``: user headers around the ``kdelay-*`` ones."""
    headers: Headers = [("trace", f"t{i}".encode()), ("kdelay-target", target.encode()),
                        ("kdelay-delay-ms", str(delay_ms).encode()), ("trace", b"again"),
                        ("empty", None)]
    if target_partition is not None:
        headers.append(("kdelay-partition", str(target_partition).encode()))
    return {"key": f"k{i}".encode(), "value": f"value-{i}|".encode() * 4, "headers": headers,
            "partition": partition}


def sent_requests(deployment: Deployment, records: list[dict[str, Any]],
                  reports: list[Message]) -> dict[str, Sent]:
    """Map each request's ``kdelay-origin`` to what it must be delivered as.

    The due time is the record's own timestamp (from its delivery report)
    plus its ``kdelay-delay-ms``.
    """
    by_key = {record["key"]: record for record in records}
    sent = {}
    for report in reports:
        record = by_key[report.key()]
        headers: Headers = record["headers"]
        fields = dict(headers)
        delay = int(fields["kdelay-delay-ms"] or b"")
        partition = fields.get("kdelay-partition")
        origin = f"{deployment.requests}/{report.partition()}/{report.offset()}"
        sent[origin] = Sent(
            key=record["key"], value=record["value"],
            user_headers=[(k, v) for k, v in headers if not k.startswith("kdelay-")],
            target=(fields["kdelay-target"] or b"").decode(),
            target_partition=int(partition) if partition is not None else None,
            due_ms=report.timestamp()[1] + delay,
        )
    assert len(sent) == len(records)
    return sent


def origin(received: Received) -> str:
    """The ``kdelay-origin`` of a delivered record."""
    value = header(received.message, "kdelay-origin")
    assert value is not None, "delivered record without kdelay-origin"
    return value.decode()


def delivered(out: Receiver, targets: Iterable[str]) -> list[Received]:
    """Every record received from ``targets``, duplicates included."""
    names = set(targets)
    return [r for r in out.received if r.message.topic() in names]


def distinct(out: Receiver, targets: Iterable[str]) -> int:
    """How many different requests have been delivered to ``targets``."""
    return len({origin(r) for r in delivered(out, targets)})


def check_delivery(received: Received, sent: Sent) -> None:
    """One delivered record: intact, to the right place, not early by any clock."""
    message = received.message
    assert message.topic() == sent.target
    if sent.target_partition is not None:
        assert message.partition() == sent.target_partition
    assert message.key() == sent.key
    assert message.value() == sent.value
    headers = message.headers() or []
    assert isinstance(headers, list)
    assert [(k, v) for k, v in headers if not k.startswith("kdelay-")] == sent.user_headers
    assert header(message, "kdelay-due-ms") == str(sent.due_ms).encode()
    assert message.timestamp()[1] >= sent.due_ms, "record timestamp before its due time"
    assert received.received_ms >= sent.due_ms, "record received before its due time"


def check_all(received: list[Received], sent: dict[str, Sent]) -> Counter[str]:
    """Check every delivered record; return how often each origin was delivered."""
    counts: Counter[str] = Counter()
    for r in received:
        key = origin(r)
        assert key in sent, f"unexpected origin {key}"
        check_delivery(r, sent[key])
        counts[key] += 1
    missing = set(sent) - set(counts)
    assert not missing, f"{len(missing)} requests never delivered, e.g. {sorted(missing)[:5]}"
    return counts


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile ``q`` (0-100] of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def lateness_report(received: list[Received], sent: dict[str, Sent], path: Path) -> dict[str, Any]:
    """Lateness of each request's first delivery: receive wall time minus due time (ms)."""
    first: dict[str, int] = {}
    for r in received:
        first.setdefault(origin(r), r.received_ms - sent[origin(r)].due_ms)
    values = list(first.values())
    figures = {
        "measured": "wall time (ms) when the test's consumer received the record "
                    "minus its kdelay-due-ms; first delivery of each request",
        "count": len(values), "min_ms": min(values), "p50_ms": percentile(values, 50),
        "p99_ms": percentile(values, 99), "max_ms": max(values),
    }
    path.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return figures


@kafka
def test_thousand_requests_end_to_end(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    tmp_path: Path,
) -> None:
    deployment = deploy(partitions=3)
    targets = [topic_factory("e2e-target-a", 3), topic_factory("e2e-target-b", 2)]
    out = receiver([*targets, deployment.dlq])
    process = start_kdelay(deployment)
    process.wait_ready()
    rng = random.Random(1000)
    records = [request(targets[i % 2], i, rng.randint(0, 5_000), partition=i % 3,
                       target_partition=(i // 7) % 2 if i % 7 == 0 else None)
               for i in range(1000)]
    started = time.monotonic()
    sent = sent_requests(deployment, records, produce_requests(deployment, records))

    out.until(lambda: distinct(out, targets) >= len(sent), "all 1000 delivered")
    elapsed = time.monotonic() - started
    out.drain(2.0)
    assert process.terminate() == 0

    received = delivered(out, targets)
    counts = check_all(received, sent)
    assert [o for o, n in counts.items() if n > 1] == [], "duplicates without a crash"
    assert out.on(deployment.dlq) == []
    figures = lateness_report(received, sent, tmp_path / "lateness.json")
    print(f"\n1000 requests delivered in {elapsed:.1f}s; lateness ms: p50={figures['p50_ms']} "
          f"p99={figures['p99_ms']} max={figures['max_ms']} min={figures['min_ms']} "
          f"({figures['measured']}); written to {tmp_path / 'lateness.json'}")
    assert figures["max_ms"] < MAX_LATENESS_MS


def seconds(durations: list[float]) -> str:
    """Durations as ``1.23s, 0.45s``."""
    return ", ".join(f"{d:.2f}s" for d in durations)


def stop(process: KdelayProcess) -> float:
    """SIGTERM ``process``, assert it exits 0 (within 30 s); return how long it took."""
    started = time.monotonic()
    assert process.terminate() == 0
    return time.monotonic() - started


@pytest.mark.compat
@kafka
def test_sigterm_and_restart_mid_stream_lose_nothing(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
) -> None:
    # Half the requests are due over the first 10 s; the other half is written
    # once the second instance serves, due 10-20 s later, so that some are still
    # pending when the state dir is deleted however slowly the instances start.
    total, spread_ms, later_ms = 600, 10_000, 10_000
    half = total // 2
    deployment = deploy(partitions=3)
    target = topic_factory("e2e-target", 3)
    out = receiver([target, deployment.dlq])
    first = start_kdelay(deployment)
    ready = [first.wait_ready()]
    early = [request(target, i, i * spread_ms // half, partition=i % 3) for i in range(half)]
    sent = sent_requests(deployment, early, produce_requests(deployment, early))

    out.until(lambda: distinct(out, [target]) >= total // 6, "a third of the first half delivered")
    stops = [stop(first)]
    second = start_kdelay(deployment)
    ready.append(second.wait_ready())
    late = [request(target, i, later_ms + (i - half) * spread_ms // half, partition=i % 3)
            for i in range(half, total)]
    sent |= sent_requests(deployment, late, produce_requests(deployment, late))
    out.until(lambda: distinct(out, [target]) >= half, "the first half delivered")
    stops.append(stop(second))
    pending_at_wipe = total - distinct(out, [target])
    assert deployment.state_dir.is_dir()
    shutil.rmtree(deployment.state_dir)
    third = start_kdelay(deployment)
    ready.append(third.wait_ready())
    out.until(lambda: distinct(out, [target]) >= total, "all delivered")
    out.drain(2.0)
    stops.append(stop(third))

    received = delivered(out, [target])
    counts = check_all(received, sent)
    duplicates = len(received) - len(counts)
    replayed = sum(int(n) for n in re.findall(r"(\d+) changelog records replayed", third.log()))
    print(f"\nSIGTERM/restart: {len(counts)} requests, {len(received)} records delivered, "
          f"{duplicates} duplicates; {pending_at_wipe} pending when the state dir was deleted, "
          f"{replayed} changelog records replayed by the third run; start to assigned took "
          f"{seconds(ready)}, SIGTERM to exit 0 took {seconds(stops)}")
    assert pending_at_wipe > 0, "nothing left pending: the rebuild was not exercised"
    assert replayed > 0
    assert duplicates <= total // 20
    assert out.on(deployment.dlq) == []


@kafka
def test_run_check(deploy: Deploy, topic_factory: TopicFactory) -> None:
    deployment = deploy(partitions=3)

    good = run_cli(deployment.env(), "run", "--check")
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("ok")

    missing = run_cli(deployment.env(KDELAY_CHANGELOG_TOPIC=f"e2e-none-{uuid.uuid4().hex}"),
                      "run", "--check")
    assert missing.returncode == 2
    assert "error[changelog-missing]" in missing.stderr
    assert "kdelay topics create" in missing.stderr
    assert "Traceback" not in missing.stderr

    other = topic_factory("e2e-chg-one", 1, {"cleanup.policy": "compact"})
    skewed = run_cli(deployment.env(KDELAY_CHANGELOG_TOPIC=other), "run", "--check")
    assert skewed.returncode == 2
    assert "error[not-copartitioned]" in skewed.stderr
    assert "Traceback" not in skewed.stderr


@kafka
def test_malformed_request_goes_to_dlq_end_to_end(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    bootstrap: str,
) -> None:
    deployment = deploy(partitions=3)
    target = topic_factory("e2e-target", 1)
    out = receiver([target, deployment.dlq])
    bad: dict[str, Any] = {"key": b"bad", "value": b"bad value", "partition": 0,
                           "headers": [("kdelay-delay-ms", b"0"), ("user", b"u1")]}
    good: dict[str, Any] = {"key": b"good", "value": b"good value", "partition": 0,
                            "headers": [("kdelay-target", target.encode()),
                                        ("kdelay-delay-ms", b"0")]}
    reports = produce(bootstrap, deployment.requests, [bad, good])
    bad_offset = next(r.offset() for r in reports if r.key() == b"bad")
    process = start_kdelay(deployment)

    out.until(lambda: len(out.on(target)) >= 1 and len(out.on(deployment.dlq)) >= 1,
              "DLQ record and delivery")
    out.drain(1.0)
    assert process.terminate() == 0

    [dead] = [r.message for r in out.on(deployment.dlq)]
    assert header(dead, "kdelay-error") == b"missing-target"
    assert header(dead, "kdelay-error-detail")
    assert header(dead, "kdelay-origin") == f"{deployment.requests}/0/{bad_offset}".encode()
    assert header(dead, "user") == b"u1"
    assert (dead.key(), dead.value()) == (b"bad", b"bad value")
    [delivery] = [r.message for r in out.on(target)]
    assert (delivery.key(), delivery.value()) == (b"good", b"good value")


def test_help_smoke() -> None:
    env = clean_environment()
    top = run_cli(env, "--help")
    assert top.returncode == 0, top.stderr
    assert "run" in top.stdout
    run = run_cli(env, "run", "--help")
    assert run.returncode == 0, run.stderr
    assert "--check" in run.stdout
    assert "KDELAY_BOOTSTRAP_SERVERS" in run.stdout
