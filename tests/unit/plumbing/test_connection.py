"""How a failed connection probe names its cause, from the errors librdkafka reported."""

from __future__ import annotations

import time

from confluent_kafka import KafkaError

from kdelay.plumbing import connection

CONFIG = {"bootstrap.servers": "127.0.0.1:9093", "security.protocol": "SASL_SSL",
          "sasl.password": "s3cret"}
HANDSHAKE = ("sasl_ssl://127.0.0.1:9093/bootstrap: error:0A000086:SSL routines::"
             "certificate verify failed (after 3ms in state SSL_HANDSHAKE)")


def failure_of(*errors: KafkaError) -> connection.ConnectionFailure | None:
    return connection._failure(list(errors), CONFIG, time.monotonic() + 60)


def test_a_handshake_reported_only_as_a_transport_error_is_a_tls_failure() -> None:
    failure = failure_of(KafkaError(KafkaError._TRANSPORT, HANDSHAKE),
                         KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert failure is not None
    assert failure.code == connection.TLS_FAILED


def test_an_ssl_error_after_all_brokers_down_is_a_tls_failure() -> None:
    failure = failure_of(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"),
                         KafkaError(KafkaError._SSL, "SSL handshake failed"))
    assert failure is not None
    assert failure.code == connection.TLS_FAILED


def test_a_refused_connection_is_unreachable_and_an_early_transport_error_waits() -> None:
    refused = KafkaError(KafkaError._TRANSPORT, "127.0.0.1:9093/bootstrap: Connect to "
                         "ipv4#127.0.0.1:9093 failed: Connection refused (after 0ms in state "
                         "CONNECT)")
    assert failure_of(refused) is None
    failure = failure_of(refused, KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 down"))
    assert failure is not None
    assert failure.code == connection.BROKER_UNREACHABLE
    assert "s3cret" not in str(failure)
