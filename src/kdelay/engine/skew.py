"""How far the service clock is from the broker's clock, and the guard that uses it.

kdelay never delivers early by its own clock; whether that is also "never
early" for everybody else depends on how far its clock is from the rest of
the cluster. The changelog topic uses ``LogAppendTime``: the broker stamps
each record with its own time when it appends it, and the delivery report
carries that stamp back. The report arrives after the append, so
``broker stamp - service time at the report`` is the skew less the one-way
delay of the acknowledgement (a few milliseconds on a healthy cluster): the
estimate errs towards "the broker is behind".

The service clock slews, so a wall clock stepped under a running service
releases nothing early; but a restarted service starts from the wall clock.
:class:`BrokerGuard` makes the broker's clock a second witness: an entry goes
out only once the service clock and the broker's clock (plus a tolerance)
both say it is due. The broker's time is read at every start, before
anything is delivered, from a probe record (a tombstone under
:data:`kdelay.protocol.codec.CLOCK_PROBE`) written to the changelog, and kept fresh by
every consumed-offset marker intake writes; between two readings it is the
last stamp plus the monotonic time since, which never runs ahead of the
broker. Nothing needs to survive a restart.
"""

from __future__ import annotations

import logging

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaError, Message
from prometheus_client import Gauge

from kdelay.plumbing.callbacks import guarded
from kdelay.plumbing.clients import Producing, produce
from kdelay.plumbing.clock import Clock
from kdelay.protocol import codec

log = logging.getLogger(__name__)

WARN_ABOVE_MS = 1_000
WARN_EVERY_MS = 60_000
# A large reading is confirmed by one at least this long after it: reports served
# together after a stalled loop all read as behind by the stall.
CONFIRM_AFTER_S = 1.0
# How far past the broker's clock an entry may be released: the estimate of the
# broker's time lags it by the acknowledgement's one-way delay.
BROKER_TOLERANCE_MS = 1_000
# How often the broker's clock is read when intake writes nothing that reads it.
PROBE_EVERY_MS = 60_000


class ClockSkew:
    """Keeps the latest skew estimate in a gauge and warns, at most once a minute, when the
    readings stay large for :data:`CONFIRM_AFTER_S`."""

    def __init__(self, clock: Clock, gauge: Gauge, warn_above_ms: int = WARN_ABOVE_MS) -> None:
        self._clock = clock
        self._gauge = gauge
        self._warn_above_ms = warn_above_ms
        self._next_warning_ms = 0
        # The monotonic time (s) of the first of the latest readings in a row over
        # warn_above_ms; None after a small one.
        self._large_since: float | None = None
        self.last_ms: int | None = None
        # The latest broker stamp and the monotonic time (s) its report arrived.
        self._stamp: tuple[int, float] | None = None

    def broker_now_ms(self) -> int | None:
        """Return the broker's time as last read plus the monotonic time since (a lower
        bound of the broker's clock), or None before the first broker-stamped report."""
        if self._stamp is None:
            return None
        stamp, at = self._stamp
        return stamp + int((self._clock.monotonic() - at) * 1000)

    def read_age_ms(self) -> int | None:
        """Return the monotonic milliseconds since the broker's clock was last read."""
        if self._stamp is None:
            return None
        return int((self._clock.monotonic() - self._stamp[1]) * 1000)

    def observe(self, message: Message) -> None:
        """Take a delivery report of a broker-stamped record; others are ignored."""
        kind, stamp = message.timestamp()
        if kind != TIMESTAMP_LOG_APPEND_TIME:
            return
        now, at = self._clock.now_ms(), self._clock.monotonic()
        self._stamp = (stamp, at)
        skew = stamp - now
        self.last_ms = skew
        self._gauge.set(skew / 1000)
        # The broker stamped the record after it was sent, so it is at most its
        # acknowledgement's latency behind by this reading: an acknowledgement held
        # back (a follower gone, the ISR not yet shrunk) is no sign of skew. A report
        # served late (a loop held up by an assignment's restore) reads the broker as
        # behind too, and so do the reports served with it: a large skew is said only
        # once the readings stay large for CONFIRM_AFTER_S.
        latency_s = message.latency()
        least_behind = skew + (0 if latency_s is None else int(latency_s * 1000))
        large = skew > self._warn_above_ms or least_behind < -self._warn_above_ms
        if not large:
            self._large_since = None
            return
        if self._large_since is None:
            self._large_since = at
        if at - self._large_since < CONFIRM_AFTER_S or now < self._next_warning_ms:
            return
        self._next_warning_ms = now + WARN_EVERY_MS
        side = "ahead of" if skew > 0 else "behind"
        log.warning("the broker's clock is %.3f s %s this service's clock: records go "
                    "out when both clocks say they are due; synchronise the clocks (NTP)",
                    abs(skew) / 1000, side)


class BrokerGuard:
    """Holds back entries the broker's clock does not yet see due (see the module doc).

    ``producer`` is a plain (non-transactional) producer the guard owns, for
    its probes to ``topic`` (the changelog). :meth:`probe` at start, then
    :meth:`poll` every step and :meth:`tick` every few seconds.
    """

    def __init__(self, skew: ClockSkew, producer: Producing, topic: str, clock: Clock,
                 tolerance_ms: int = BROKER_TOLERANCE_MS) -> None:
        self._skew = skew
        self._producer = producer
        self._topic = topic
        self._clock = clock
        self._tolerance_ms = tolerance_ms
        self._in_flight = False
        self._said_waiting = False
        self._said_failed = False
        self._report = guarded(self._reported)

    def release_ms(self, now_ms: int) -> int | None:
        """Return the latest due time that may go out at service time ``now_ms``: the
        earlier of ``now_ms`` and the broker's time plus the tolerance; None (hold
        everything) until the broker's clock has been read once."""
        broker = self._skew.broker_now_ms()
        if broker is None:
            if not self._said_waiting:
                self._said_waiting = True
                log.info("delivery waits until the broker's clock is read (a probe record "
                         "to %s)", self._topic)
            return None
        return min(now_ms, broker + self._tolerance_ms)

    def probe(self) -> None:
        """Write a probe record whose acknowledgement carries the broker's time."""
        if self._in_flight:
            return
        self._in_flight = True
        produce(self._producer, self._topic, key=codec.CLOCK_PROBE, value=None,
                on_delivery=self._report)

    def poll(self) -> None:
        """Serve the probe's acknowledgement, if one is due (never blocks)."""
        if self._in_flight:
            self._producer.poll(0)

    def tick(self) -> None:
        """Probe again when the broker's clock has not been read for a while."""
        age = self._skew.read_age_ms()
        if age is None or age >= PROBE_EVERY_MS:
            self.probe()

    def close(self, timeout_s: float = 1.0) -> None:
        """Wait a little for a probe in flight; it carries no data, so nothing is lost."""
        self._producer.flush(timeout_s)

    def _reported(self, error: KafkaError | None, message: Message) -> None:
        self._in_flight = False
        if error is None:
            self._said_failed = False
            self._skew.observe(message)
        elif not self._said_failed:
            self._said_failed = True
            log.warning("cannot read the broker's clock from %s: %s; delivery waits for it, "
                        "retrying",
                        self._topic, error.str())


def unmeasured(changelog_topic: str) -> None:
    """Say that the skew is not measured: the changelog is not stamped by the broker."""
    log.warning("clock skew against the broker is not measured: changelog topic %s does not "
                "use LogAppendTime (kafka-configs.sh --alter --entity-type topics "
                "--entity-name %s --add-config message.timestamp.type=LogAppendTime)",
                changelog_topic, changelog_topic)
