"""Where the service's Kafka clients come from, and what makes an instance a static member.

The service never constructs a client itself: a :class:`ClientFactory` hands
them out (:class:`KafkaClients` in production, fakes that share one wire in
unit tests), so the loop can be driven without a broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from confluent_kafka import Consumer, Producer

from kdelay.plumbing import identity
from kdelay.plumbing.callbacks import ClientErrors
from kdelay.plumbing.clients import Consuming, Transacting
from kdelay.plumbing.settings import ClientConfig, Settings
from kdelay.state.changelog import Restorer, Restoring
from kdelay.state.originals import OriginalReader, Reading


def membership(me: identity.Identity, session_timeout_ms: int,
               given: Mapping[str, str]) -> dict[str, str | int | bool]:
    """Return the consumer settings that make an instance a static group member.

    A restarted instance rejoins under the same ``group.instance.id`` and gets
    its partitions back without a rebalance; an instance that died for good
    holds its partitions until ``session_timeout_ms`` passes, then the group
    hands them to the survivors. Heartbeats go every second (a tenth of the
    session timeout when that is shorter): a survivor learns of the rebalance
    from its next heartbeat, so librdkafka's 3 s would add up to 3 s to every
    failover. A key the user set in ``--kafka-config`` (``given``) is left to
    that setting.
    """
    wanted: dict[str, str | int | bool] = {
        "group.instance.id": me.member_id, "session.timeout.ms": session_timeout_ms,
        "heartbeat.interval.ms": max(1, min(1_000, session_timeout_ms // 10))}
    return {key: value for key, value in wanted.items() if key not in given}


INTAKE_FETCH_BACKOFF_MS = 20
"""How long intake's consumer waits before fetching again a partition whose prefetch
queue was full (librdkafka's ``fetch.queue.backoff.ms``, 1000 by default)."""


def prefetch(given: Mapping[str, str]) -> dict[str, str | int | bool]:
    """Return the intake consumer's prefetch settings, unless ``--kafka-config`` (``given``)
    sets them.

    A backlog fills the consumer's queue (``queued.max.messages.kbytes``, 64 MB)
    faster than intake empties it; librdkafka then waits a whole second before it
    fetches again, and by then intake has drained the queue and waits for the next
    fetch: about half its time, a backlog of 1 M. Looking again after
    :data:`INTAKE_FETCH_BACKOFF_MS` keeps the queue topped up, for no measurable CPU.
    """
    wanted: dict[str, str | int | bool] = {"fetch.queue.backoff.ms": INTAKE_FETCH_BACKOFF_MS}
    return {key: value for key, value in wanted.items() if key not in given}


class ClientFactory(Protocol):
    """Builds the service's Kafka clients; the service never constructs one itself."""

    def producer(self, name: str, **overrides: str | int | bool) -> Transacting:
        """Return a producer named ``name`` (in logs) with librdkafka ``overrides``."""
        ...

    def consumer(self, name: str, **overrides: str | int | bool) -> Consuming:
        """Return a consumer named ``name`` with librdkafka ``overrides``."""
        ...

    def reader(self) -> Reading:
        """Return the reader of originals in the requests topic."""
        ...

    def restorer(self) -> Restoring:
        """Return the restorer that replays the changelog into indexes."""
        ...


class KafkaClients:
    """The real clients, configured from settings (``--kafka-config`` and all).

    Every client reports the errors librdkafka raises outside any call to
    ``errors`` (its ``error_cb``).
    """

    def __init__(self, settings: Settings, errors: ClientErrors | None = None) -> None:
        self._settings = settings
        self._errors = errors or ClientErrors()

    def producer(self, name: str, **overrides: str | int | bool) -> Transacting:
        """A confluent-kafka producer."""
        return Producer(self._config(name, overrides))

    def consumer(self, name: str, **overrides: str | int | bool) -> Consuming:
        """A confluent-kafka consumer."""
        return Consumer(self._config(name, overrides))

    def reader(self) -> Reading:
        """An :class:`OriginalReader` of the requests topic."""
        return OriginalReader(self._config("originals", {}, watch=False),
                              self._settings.requests_topic, away=self._errors.unreachable_now)

    def restorer(self) -> Restoring:
        """A :class:`Restorer` of the changelog topic."""
        return Restorer(self._config("restore", {}, watch=False), self._settings.changelog_topic)

    def _config(self, name: str, overrides: Mapping[str, str | int | bool], *,
                watch: bool = True) -> ClientConfig:
        """``name``'s configuration; ``watch``: its reports of every broker down count."""
        config = self._settings.client_config(name, **overrides)
        config["error_cb"] = self._errors.callback(
            name, watch=watch, renewable="transactional.id" in overrides)
        config["logger"] = self._errors.quiet(config["logger"], name)
        return config
