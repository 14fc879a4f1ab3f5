"""Scenario ``floor``: the I/O floor of one Python process, produce and consume.

One process produces N records (the burst's records: same size, same
headers) with the bench's producer, then consumes them back, nothing in
between. Each half is timed on its own, with the process's CPU (user +
system, all threads) over the same window. A delivery costs one read and two
writes (the target record and the changelog tombstone), so
``delivery_cpu_us`` = consume + 2 x produce is the least CPU a record of a
burst can take in one process, and ``delivery_per_s`` the rate one core
gives at that cost. The burst is reported against it (:func:`relate`).
"""

from __future__ import annotations

import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from kdelay.plumbing.clients import take
from kdelay_bench.cputime import own_cpu_s
from kdelay_bench.load import Loader, request_headers, values
from kdelay_bench.progress import Progress, say
from kdelay_bench.report import Figure, Result, per_record_us, ratio_to
from kdelay_bench.throughput import HOUR_MS, Setup

CONSUME_BATCH = 10_000


def produce(setup: Setup, topic: str, total: int) -> tuple[float, float]:
    """Produce ``total`` records to ``topic``; return (seconds, CPU seconds) from the
    first produce to the flush that acknowledged the last."""
    loader = Loader(setup.topics.bootstrap)
    pool = values(setup.value_size)
    headers = request_headers(topic, int(time.time() * 1000) + HOUR_MS)
    progress = Progress(f"floor: producing to {topic}", total)
    start, cpu = time.monotonic(), own_cpu_s()
    for i in range(total):
        loader.produce(topic, f"k{i}".encode(), pool[i % len(pool)], headers,
                       partition=i % setup.partitions)
        if i % 1_000 == 0:
            loader.poll()
            progress.update(i)
    loader.finish()
    return time.monotonic() - start, own_cpu_s() - cpu


def consume(setup: Setup, topic: str, total: int) -> tuple[float, float]:
    """Consume ``total`` records of ``topic`` from the start; return (seconds, CPU
    seconds) from the first batch received to the last (the group-free assignment and
    the first fetch are left out, as the pipe leaves them out)."""
    consumer = Consumer({"bootstrap.servers": setup.topics.bootstrap,
                         "group.id": f"bench-floor-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                     for p in range(setup.partitions)])
    seen, first, start, cpu = 0, 0, 0.0, 0.0
    deadline = time.monotonic() + max(120.0, total / 5_000)
    try:
        while seen < total and time.monotonic() < deadline:
            batch = take(consumer, CONSUME_BATCH, 1.0)
            seen += sum(1 for m in batch if m.error() is None)
            if batch and not start:
                first, start, cpu = seen, time.monotonic(), own_cpu_s()
        elapsed, used = time.monotonic() - start, own_cpu_s() - cpu
    finally:
        consumer.close()
    if seen < total:
        raise RuntimeError(f"floor: consumed {seen:,} of {total:,}")
    scale = total / max(total - first, 1)  # to the whole, from the records timed
    return elapsed * scale, used * scale


def run_floor(setup: Setup, total: int) -> Result:
    """Produce ``total`` records and consume them back; return the ``floor`` row."""
    topic = setup.topics.create("floor", setup.partitions)
    say(f"floor: {total:,} records produced, then consumed, by one process")
    produce_s, produce_cpu = produce(setup, topic, total)
    consume_s, consume_cpu = consume(setup, topic, total)
    return floor_result(total, produce_s, produce_cpu, consume_s, consume_cpu)


def floor_result(total: int, produce_s: float, produce_cpu_s: float, consume_s: float,
                 consume_cpu_s: float) -> Result:
    """Return the ``floor`` row from the two halves' seconds and CPU seconds."""
    produce_us = per_record_us(produce_cpu_s, total)
    consume_us = per_record_us(consume_cpu_s, total)
    delivery_us = (None if produce_us is None or consume_us is None
                   else round(consume_us + 2 * produce_us, 2))
    result = Result("floor", {
        "records": total, "produce_per_s": round(total / max(produce_s, 1e-9)),
        "produce_cpu_us_per_record": produce_us,
        "consume_per_s": round(total / max(consume_s, 1e-9)),
        "consume_cpu_us_per_record": consume_us, "delivery_cpu_us": delivery_us,
        "delivery_per_s": round(1e6 / delivery_us) if delivery_us else None})
    result.headline("floor: produce (one process)", result.figures["produce_per_s"],
                    produce_us)
    result.headline("floor: consume (one process)", result.figures["consume_per_s"],
                    consume_us)
    result.headline("floor: a delivery, 1 read + 2 writes (one core)",
                    result.figures["delivery_per_s"], delivery_us)
    return result


def relate(results: list[Result]) -> None:
    """Give the ``burst`` row its ratios to the floor: ``cpu_ratio_to_floor`` (its
    service CPU per record over the floor's per delivery) and ``rate_ratio_to_floor``
    (its rate over the rate one core gives at the floor's cost)."""
    floor = next((r for r in results if r.scenario == "floor" and not r.skipped), None)
    if floor is None:
        return
    for result in results:
        if result.scenario != "burst" or result.skipped:
            continue
        figures: dict[str, Figure] = result.figures
        cpu = ratio_to(figures.get("service_cpu_us_per_record"),
                       floor.figures.get("delivery_cpu_us"))
        rate = ratio_to(figures.get("records_per_s"), floor.figures.get("delivery_per_s"))
        figures.update({"floor_delivery_cpu_us": floor.figures.get("delivery_cpu_us"),
                        "cpu_ratio_to_floor": cpu, "rate_ratio_to_floor": rate})
