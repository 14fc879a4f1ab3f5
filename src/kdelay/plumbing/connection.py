"""Whether the Kafka cluster answers: one quick question before a command's real work.

librdkafka never gives up on a broker it cannot reach: a client pointed at a
wrong address retries for as long as its timeouts allow and logs every
attempt. A command line tool should instead say, within seconds and in one
line, that nothing answers (or that the credentials were refused). kdelay asks
once, with :func:`check_connection`, before the first client that would wait.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from kdelay.errors import KdelayError
from kdelay.plumbing.clientconfig import REDACTED, secret_values

BROKER_UNREACHABLE = "broker-unreachable"
AUTHENTICATION_FAILED = "authentication-failed"
TLS_FAILED = "tls-failed"
DEFAULT_TIMEOUT_S = 5.0
_AUTHENTICATION_CODES = frozenset({KafkaError._AUTHENTICATION,
                                   KafkaError.SASL_AUTHENTICATION_FAILED})


class ConnectionFailure(KdelayError):
    """No broker answered, or the cluster refused the credentials.

    ``code`` is :data:`BROKER_UNREACHABLE`, :data:`AUTHENTICATION_FAILED` or
    :data:`TLS_FAILED` (the TLS handshake failed: the broker's certificate is not
    trusted, or its name does not match);
    the message names the bootstrap servers and librdkafka's reason, never a
    secret of the configuration.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Silent:
    """A confluent-kafka ``logger`` that drops every line: the probe reports its own failure."""

    def log(self, level: int, message: str, *args: object) -> None:
        """Drop the line."""


def check_connection(config: Mapping[str, Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Return once a broker of ``config`` (a client configuration) answers a metadata request.

    Raises :class:`ConnectionFailure` ``authentication-failed`` as soon as a
    broker refuses the SASL credentials, ``tls-failed`` as soon as a TLS
    handshake fails, and ``broker-unreachable`` as soon as
    librdkafka reports every bootstrap broker down (a closed port, an unknown
    host), else when ``timeout_s`` passes without an answer. The probe's own
    librdkafka log lines are dropped: the error carries the reason.
    """
    errors: list[KafkaError] = []
    probe: dict[str, Any] = {**config, "logger": _Silent(), "error_cb": errors.append}
    admin = AdminClient(probe)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=max(0.01, min(0.1, deadline - time.monotonic())))
            return
        except KafkaException as exc:
            errors.extend(e for e in exc.args[:1] if isinstance(e, KafkaError))
        admin.poll(0)
        failure = _failure(errors, config, deadline)
        if failure is not None:
            raise failure


def _failure(
    errors: list[KafkaError], config: Mapping[str, object], deadline: float
) -> ConnectionFailure | None:
    """The failure the errors so far prove, or ``None`` to keep asking until ``deadline``."""
    servers = config.get("bootstrap.servers")
    refused = next((e for e in errors if e.code() in _AUTHENTICATION_CODES), None)
    if refused is not None:
        return ConnectionFailure(AUTHENTICATION_FAILED, (
            f"the brokers at {servers} refused the credentials: "
            f"{_scrubbed(refused.str(), config)}; check sasl.username, sasl.password and "
            "sasl.mechanism (or sasl.jaas.config) in --kafka-config"))
    handshake = next((e for e in errors if _in_handshake(e)), None)
    if handshake is not None:
        return ConnectionFailure(TLS_FAILED, (
            f"the TLS handshake with the brokers at {servers} failed: "
            f"{_scrubbed(handshake.str(), config)}; trust the CA that signs the brokers' "
            "certificates with ssl.truststore.type=PEM and ssl.truststore.location (or "
            "ssl.ca.location) in --kafka-config"))
    down = any(e.code() == KafkaError._ALL_BROKERS_DOWN for e in errors)
    if not down and time.monotonic() < deadline:
        return None
    reason = next((e.str() for e in reversed(errors)
                   if e.code() != KafkaError._ALL_BROKERS_DOWN), None) or "no answer"
    return ConnectionFailure(BROKER_UNREACHABLE, (
        f"no Kafka broker answers at {servers} ({_scrubbed(reason, config)}); is a broker "
        "running there? Give its address with --bootstrap-servers or KDELAY_BOOTSTRAP_SERVERS"))


def _in_handshake(error: KafkaError) -> bool:
    """Whether ``error`` says the TLS handshake failed.

    librdkafka reports a failed handshake twice: as ``_SSL`` through the error
    callback, and as a ``_TRANSPORT`` error "... (after N ms in state
    SSL_HANDSHAKE)". Which comes first depends on scheduling, and
    ``_ALL_BROKERS_DOWN`` can come between them, so either one names the cause.
    """
    return error.code() == KafkaError._SSL or (
        error.code() == KafkaError._TRANSPORT and "in state SSL_HANDSHAKE" in error.str())


def _scrubbed(text: str, config: Mapping[str, object]) -> str:
    """``text`` with every secret value of ``config`` replaced by ``***``."""
    for secret in secret_values(config):
        text = text.replace(secret, REDACTED)
    return text
