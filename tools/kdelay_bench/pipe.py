"""The baseline: a plain confluent-kafka loop that consumes requests and produces each
to a target, with kdelay's batch size and target-producer settings.

Its rate is what a Python consume->produce service gets on this machine and
broker; kdelay's intake and burst delivery are reported as ratios to it.
"""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Callable
from typing import cast

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)

from kdelay.plumbing.callbacks import guarded
from kdelay.plumbing.clients import produce
from kdelay.protocol.envelope import Headers
from kdelay_bench.cputime import own_cpu_s
from kdelay_bench.progress import Progress
from kdelay_bench.report import Result, per_record_us

TOMBSTONE_KEY = struct.Struct(">QIQ")  # the layout of kdelay's due keys


class _Acks:
    """Delivery reports of the pipe's producer."""

    def __init__(self) -> None:
        self.ok = 0
        self.errors = 0
        self.first_error: str | None = None

    def report(self, error: KafkaError | None, _: Message) -> None:
        if error is None:
            self.ok += 1
        else:
            self.errors += 1
            self.first_error = self.first_error or error.str()


def _consumer(bootstrap: str, topic: str, partitions: int) -> Consumer:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-pipe-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    return consumer


def _forward(producer: Producer, target: str, messages: list[Message], acks: _Acks,
             tombstones: str | None) -> int:
    callback = guarded(acks.report)
    for message in messages:
        _produce(producer, callback, target, value=message.value(), key=message.key(),
                 headers=cast(Headers | None, message.headers()))
        if tombstones is not None:
            key = TOMBSTONE_KEY.pack(message.timestamp()[1], message.partition() or 0,
                                     message.offset() or 0)
            _produce(producer, callback, tombstones, value=None, key=key,
                     partition=message.partition() or 0)
    producer.poll(0)
    return len(messages)


def _produce(producer: Producer, callback: Callable[[KafkaError | None, Message], None],
             topic: str, *, value: bytes | None, key: bytes | None,
             headers: Headers | None = None, partition: int | None = None) -> None:
    produce(producer, topic, value=value, key=key, headers=headers, partition=partition,
            on_delivery=callback)


def run_pipe(bootstrap: str, requests: str, partitions: int, target: str, total: int,
             batch_size: int, tombstones: str | None = None) -> Result:
    """Pipe ``total`` records from ``requests`` to ``target``; report records/s.

    With ``tombstones`` (a compacted topic) each record also gets a tombstone
    keyed like a due key: the Kafka work of one kdelay delivery (read the
    original, produce it, produce its changelog tombstone) with no kdelay code
    around it. That run is reported as scenario ``pipe-tombstone``.

    The clock starts when the first batch has been forwarded and stops when the
    last produce is acknowledged, so group joins and connection set-up are not
    counted. Over the same window the process's CPU (user + system, all
    threads: the loop and librdkafka's) gives ``cpu_us_per_record``, and the
    loop thread's alone ``loop_cpu_us_per_record``; the bench process runs
    nothing else meanwhile.
    """
    consumer = _consumer(bootstrap, requests, partitions)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "linger.ms": 2})
    acks = _Acks()
    progress = Progress("pipe", total)
    seen, first, start = 0, 0, 0.0
    cpu_start = loop_start = 0.0
    try:
        while seen < total:
            batch = [m for m in consumer.consume(batch_size, timeout=1.0) if m.error() is None]
            seen += _forward(producer, target, batch, acks, tombstones)
            if batch and not start:
                first, start = seen, time.monotonic()
                cpu_start, loop_start = own_cpu_s(), time.thread_time()
            progress.update(seen)
        remaining = producer.flush(60)
        elapsed = time.monotonic() - start
        cpu_s, loop_s = own_cpu_s() - cpu_start, time.thread_time() - loop_start
    finally:
        consumer.close()
    scenario = "pipe" if tombstones is None else "pipe-tombstone"
    rate = round((total - first) / elapsed)
    cpu_us = per_record_us(cpu_s, total - first)
    result = Result(scenario, {"records": total, "seconds": round(elapsed, 3),
                               "records_per_s": rate, "cpu_us_per_record": cpu_us,
                               "loop_cpu_us_per_record": per_record_us(loop_s, total - first)})
    result.headline(scenario, rate, cpu_us)
    result.figures.update({"produce_errors": acks.errors, "unflushed": remaining})
    if acks.errors or remaining:
        result.skipped = f"{acks.errors} produce errors ({acks.first_error}), {remaining} left"
    return result
