"""The bench's reader of the broker's own figures, attached to the real broker.

``tools/bench`` places a late request with the broker's ``RequestMetrics``
(read over JMX) and the JVM's pause counters; this proves the reader attaches
to the broker ``tools/kafka`` runs and that a run's produce requests show.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import Producer
from kdelay_bench import broker_metrics
from kdelay_bench.broker import broker_pid

from tests.conftest import produce_all

pytestmark = pytest.mark.kafka


def test_a_run_of_produce_requests_shows_in_the_brokers_own_figures(
    bootstrap: str, topic_factory: Callable[..., str],
) -> None:
    pid = broker_pid(bootstrap)
    if pid is None:
        pytest.skip(f"{bootstrap} is not a broker tools/kafka runs here: no pid to attach to")
    topic = topic_factory("jmx", 1)
    reader = broker_metrics.Reader(pid)
    try:
        before = reader.read()
        assert isinstance(before, broker_metrics.Snapshot), before
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        for batch in range(5):
            produce_all(producer, topic, [{"value": f"{batch}-{n}".encode()} for n in range(10)])
        after = reader.read()
        assert isinstance(after, broker_metrics.Snapshot), after
    finally:
        reader.close()
    got = broker_metrics.figures(after, before)
    assert isinstance(got["Produce_count"], int)
    assert got["Produce_count"] >= 5
    assert isinstance(got["Produce_mean_ms"], float)
    assert isinstance(got["Produce_queue_mean_ms"], float)
    assert got["safepoints"] is not None
    assert isinstance(got["gc_young_count"], int)
    handlers, java = got["cpu_handlers_s"], got["cpu_java_s"]
    assert isinstance(handlers, float)
    assert isinstance(java, float)
    assert 0 <= handlers <= java
    assert java > 0, "the broker's threads ran in the meantime"
    assert reader.read() == "broker metrics reader closed"
