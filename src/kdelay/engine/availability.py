"""Whether Kafka answers, as the service sees it: one line and a gauge per outage.

Clients report every broker down (``_ALL_BROKERS_DOWN``) through their error
callbacks, and some calls find Kafka silent (a transaction call, a metadata
request that times out). :class:`Availability` confirms such a report with a
probe before it declares an outage, says so once (and once again when Kafka
answers), sets ``kdelay_kafka_available``, and remembers when the last outage
ended: a fence right after one is the clients' own doing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaException
from prometheus_client import Gauge

from kdelay.errors import ServiceError
from kdelay.plumbing.callbacks import ClientErrors
from kdelay.plumbing.clients import AWAY, Producing
from kdelay.plumbing.clock import Clock

log = logging.getLogger(__name__)

# While Kafka is unreachable: how often the service asks whether a broker answers
# again, and how long it waits for the answer.
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 1.0
# A fence reported this soon after an outage is the client's own doing, not a
# second process with this instance's ids (see Service._check_fatal).
FENCE_AFTER_OUTAGE_S = 60.0

T = TypeVar("T")


class Availability:
    """Kafka's availability: reports confirmed by probes, the outage line, the gauge."""

    def __init__(self, errors: ClientErrors, clock: Clock, gauge: Gauge) -> None:
        self.errors = errors
        """What the clients reported: the errors that tell Kafka is away, and fatal ones."""
        self._clock = clock
        self._gauge = gauge
        self._down_since: float | None = None
        self._back_at: float | None = None
        self._next_probe = 0.0

    def reachable(self, probe: Producing, topic: str) -> bool:
        """Return whether Kafka answers; while it does not, say so once and probe it.

        Kafka counts as unreachable from a client's ``_ALL_BROKERS_DOWN``
        report on. Then the step neither reads ahead nor produces (records
        already queued wait in the clients, and failures meanwhile cost no
        delivery attempt), and every :data:`PROBE_EVERY_S` a metadata request
        (bounded by :data:`PROBE_TIMEOUT_S`) asks whether a broker is back.
        The loop keeps stepping, so the process neither exits nor hangs.
        """
        why = self.errors.unreachable()
        if why is None:
            return True
        now = self._clock.monotonic()
        if self._down_since is not None and now < self._next_probe:
            return False
        # A report is confirmed by a probe before an outage is declared: a client
        # that reconnects after an outage may still report the brokers it saw down.
        self._next_probe = now + PROBE_EVERY_S
        try:
            probe.list_topics(topic, timeout=PROBE_TIMEOUT_S)
        except KafkaException:
            self._note_down(why)
            return False
        self.errors.reachable()
        if self._down_since is not None:
            log.warning("Kafka answers again after %.1f s unreachable: serving",
                        now - self._down_since)
            self._down_since = None
            self._back_at = now
            self._gauge.set(1)
        return True

    def waiting(self, why: str) -> None:
        """A call waits for Kafka (a transaction commit that timed out): say so, once."""
        self.errors.unreachable_now(why)
        self._note_down(why)

    def waited(self, call: Callable[[], T], what: str, stopping: Callable[[], bool],
               pause: Callable[[float], None] = time.sleep) -> T:
        """Return ``call()``, called again for as long as it fails because Kafka is silent.

        A failure with an :data:`AWAY` code (a request timed out, every broker
        down) is an outage: said once (:meth:`waiting`), then ``call`` is tried
        again every :data:`PROBE_EVERY_S`; the next :meth:`reachable` says when
        Kafka answers. Any other failure is raised. Asked to stop meanwhile
        (``stopping``), it raises :class:`ServiceError` ``kafka-unreachable``.
        """
        while True:
            try:
                return call()
            except KafkaException as exc:
                error = exc.args[0]
                if error.code() not in AWAY:
                    raise
                if stopping():
                    raise ServiceError("kafka-unreachable", (
                        f"stopped while {what} waited for Kafka: {error.str()}")) from exc
                self.waiting(f"{what}: {error.str()}")
            pause(PROBE_EVERY_S)

    def _note_down(self, why: str) -> None:
        """Set the gauge and log the one line of an outage, at its start."""
        if self._down_since is not None:
            return
        self._down_since = self._clock.monotonic()
        self._gauge.set(0)
        log.warning("Kafka is unreachable (%s): waiting for it, nothing is lost meanwhile; "
                    "kdelay_kafka_available is 0 until a broker answers", why)

    def just_away(self) -> bool:
        """Whether Kafka is unreachable, or answered again less than a minute ago, or a
        group consumer's session timed out less than a minute ago (on a cluster, the
        group's coordinator can be away while the other brokers answer)."""
        if self._down_since is not None or self.errors.unreachable() is not None:
            return True
        if self.errors.session_lost_lately():
            return True
        return (self._back_at is not None
                and self._clock.monotonic() - self._back_at < FENCE_AFTER_OUTAGE_S)
