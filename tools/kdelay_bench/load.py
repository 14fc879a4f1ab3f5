"""Producing the bench's input: delay requests and changelog records.

Every produce has a delivery callback; failures are counted in
:class:`Loader.errors` and every flush's remaining count is checked, so a
figure is never taken on input that did not land.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from confluent_kafka import KafkaError, Message, Producer

from kdelay.plumbing.callbacks import guarded
from kdelay.plumbing.clients import produce
from kdelay.protocol import codec, envelope
from kdelay.protocol.envelope import Headers
from kdelay.protocol.forward import id_partition
from kdelay_bench.progress import Progress

WARMUP = "bench-warmup"
VALUE_POOL = 256


class LoadError(Exception):
    """Input could not be produced completely; the scenario's figures would be wrong."""


class Loader:
    """A fast producer for bench input that counts failed deliveries."""

    def __init__(self, bootstrap: str, **config: str | int | bool) -> None:
        self._producer = Producer({
            "bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000,
            "queue.buffering.max.messages": 1_000_000, "enable.idempotence": True,
            **config})
        self.errors = 0
        self.first_error: str | None = None
        self.acked = 0
        self._callback = guarded(self._report)

    def _report(self, error: KafkaError | None, _: Message) -> None:
        if error is None:
            self.acked += 1
            return
        self.errors += 1
        self.first_error = self.first_error or error.str()

    def produce(self, topic: str, key: bytes | None, value: bytes | None,
                headers: Headers | None = None, partition: int = -1,
                timestamp: int = 0) -> None:
        """Produce one record, waiting for queue room when librdkafka's queue is full.

        ``timestamp`` 0 lets the producer stamp the record with its own clock.
        """
        produce(self._producer, topic, value=value, key=key, headers=headers,
                partition=partition, timestamp=timestamp, on_delivery=self._callback)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Serve delivery callbacks, waiting up to ``timeout_s``."""
        self._producer.poll(timeout_s)

    def finish(self, timeout_s: float = 120.0) -> None:
        """Flush; raise :class:`LoadError` if anything is left over or failed."""
        remaining = self._producer.flush(timeout_s)
        if remaining:
            raise LoadError(f"{remaining} records still unacknowledged after {timeout_s}s")
        if self.errors:
            raise LoadError(f"{self.errors} records failed; first: {self.first_error}")


def values(size: int) -> list[bytes]:
    """Return a pool of random (incompressible) values of ``size`` bytes."""
    return [os.urandom(size) for _ in range(VALUE_POOL)]


def request_headers(target: str, due_ms: int, *, warmup: bool = False,
                    schedule_id: str | None = None) -> Headers:
    """Return the envelope of a request due at ``due_ms`` for ``target``."""
    headers: Headers = [(envelope.TARGET, target.encode()),
                        (envelope.DUE_MS, str(due_ms).encode())]
    if schedule_id is not None:
        headers.append((envelope.SCHEDULE_ID, schedule_id.encode()))
    if warmup:
        headers.append((WARMUP, b"1"))
    return headers


def produce_requests(bootstrap: str, topic: str, target: str, count: int, value_size: int,
                     due_of: Callable[[int], int], partitions: int, ids: bool = False) -> None:
    """Produce ``count`` requests round-robin over ``partitions``; record ``i`` is due
    at ``due_of(i)``. With ``ids`` each carries its own schedule id and goes to the id's
    partition, as the client library writes it. Raises :class:`LoadError` if any is not
    acknowledged."""
    loader = Loader(bootstrap)
    pool = values(value_size)
    progress = Progress(f"producing requests to {topic}", count)
    for i in range(count):
        sid = f"bench-{i}" if ids else None
        partition = i % partitions if sid is None else id_partition(sid, partitions)
        loader.produce(topic, f"k{i}".encode(), pool[i % VALUE_POOL],
                       request_headers(target, due_of(i), schedule_id=sid), partition=partition)
        if i % 1_000 == 0:
            loader.poll()
            progress.update(i)
    loader.finish()


def produce_changelog(bootstrap: str, topic: str, count: int, base_ms: int) -> None:
    """Produce ``count`` changelog puts (due key -> index value) to partition 0."""
    loader = Loader(bootstrap)
    progress = Progress(f"producing changelog to {topic}", count)
    for i in range(count):
        key = codec.encode_due_key(base_ms + i * 7 % 3_600_000, 0, i)
        value = codec.encode_index_value(codec.IndexValue(
            codec.Fingerprint(base_ms - 1_000, (i * 2_654_435_761) % 2**32), None, "orders"))
        loader.produce(topic, key, value, partition=0)
        if i % 1_000 == 0:
            loader.poll()
            progress.update(i)
    loader.finish()
