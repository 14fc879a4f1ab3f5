"""How far the service clock is from the broker's clock.

kdelay never delivers early by its own clock; whether that is also "never
early" for everybody else depends on how far its clock is from the rest of
the cluster. The changelog topic uses ``LogAppendTime``: the broker stamps
each record with its own time when it appends it, and the delivery report
carries that stamp back. The report arrives after the append, so
``broker stamp - service time at the report`` is the skew less the one-way
delay of the acknowledgement (a few milliseconds on a healthy cluster): the
estimate errs towards "the broker is behind".
"""

from __future__ import annotations

import logging

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Message
from prometheus_client import Gauge

from kdelay.plumbing.clock import Clock

log = logging.getLogger(__name__)

WARN_ABOVE_MS = 1_000
WARN_EVERY_MS = 60_000


class ClockSkew:
    """Keeps the latest skew estimate in a gauge and warns, at most once a minute, when large."""

    def __init__(self, clock: Clock, gauge: Gauge, warn_above_ms: int = WARN_ABOVE_MS) -> None:
        self._clock = clock
        self._gauge = gauge
        self._warn_above_ms = warn_above_ms
        self._next_warning_ms = 0
        self.last_ms: int | None = None

    def observe(self, message: Message) -> None:
        """Take a delivery report of a broker-stamped record; others are ignored."""
        kind, stamp = message.timestamp()
        if kind != TIMESTAMP_LOG_APPEND_TIME:
            return
        now = self._clock.now_ms()
        skew = stamp - now
        self.last_ms = skew
        self._gauge.set(skew / 1000)
        if abs(skew) > self._warn_above_ms and now >= self._next_warning_ms:
            self._next_warning_ms = now + WARN_EVERY_MS
            side = "ahead of" if skew > 0 else "behind"
            log.warning("the broker's clock is %.3f s %s this service's clock: records are "
                        "delivered by this service's clock; synchronise the clocks (NTP)",
                        abs(skew) / 1000, side)
