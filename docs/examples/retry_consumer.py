"""A consumer whose failures are retried through kdelay, then dead-lettered.

Run ``kdelay run`` first. Settings come from KDELAY_BOOTSTRAP_SERVERS and
KDELAY_REQUESTS_TOPIC. The backoff is 1 s then 2 s here; the default is
RocketMQ's 16 steps, 10 s to 2 h.
"""

from __future__ import annotations

import os
import time
import uuid

from confluent_kafka import Consumer, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from kdelay.plumbing.settings import Settings
from kdelay.retry import RetryingConsumer, RetryPolicy, attempts_of

settings = Settings(
    bootstrap_servers=os.environ.get("KDELAY_BOOTSTRAP_SERVERS", "localhost:9092"),
    requests_topic=os.environ.get("KDELAY_REQUESTS_TOPIC", "kdelay.requests"))
run = uuid.uuid4().hex[:6]
orders, dead_letters = f"orders-{run}", f"orders-{run}.dlq"
admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
for future in admin.create_topics([NewTopic(orders, 1), NewTopic(dead_letters, 1)]).values():
    future.result()
started = time.monotonic()
done: set[bytes] = set()


class OutOfStock(Exception):
    """Never worth retrying."""


def handle(message: Message) -> None:
    """Order 1 fails twice then succeeds; order 2 always fails; order 3 is out of stock."""
    key, attempt = message.key() or b"", attempts_of(message.headers())
    print(f"{time.monotonic() - started:5.1f}s  {key.decode()} attempt {attempt}")
    if key == b"order-3":
        raise OutOfStock("sku 17")
    if key == b"order-2" or attempt < 2:
        raise RuntimeError("payment service unavailable")
    done.add(key)


policy = RetryPolicy(dead_letters, backoff=(1_000, 2_000), non_retryable=(OutOfStock,))
consumer = RetryingConsumer(settings, [orders], handle, policy, group_id=f"shop-{run}")
producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
for n in (1, 2, 3):
    producer.produce(orders, f'{{"order": {n}}}'.encode(), f"order-{n}".encode())
if producer.flush(10):
    raise SystemExit("the orders were not written")

dlq = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"dlq-{run}",
                "auto.offset.reset": "earliest"})
dlq.subscribe([dead_letters])
dead: list[Message] = []
while len(dead) < 2 or not done:
    consumer.step(0.2)
    dead += [m for m in dlq.consume(10, timeout=0.05) if m.error() is None]
for message in dead:
    reasons = {k: v.decode() for k, v in list(message.headers() or [])
               if isinstance(v, bytes)}
    print(f"dead letter {(message.key() or b'').decode()}: {reasons['kdelay.error-type']} "
          f"{reasons['kdelay.error-message']!r} after {reasons['kdelay.attempts']} attempts")
consumer.close()
dlq.close()
admin.delete_topics([orders, dead_letters])
