"""What delivery does with a target that fails: back off, check the topic, log once a while.

A target may fail for minutes (a topic created late, a broker away): every
record bound for it fails again and again. The waits double up to a cap
(:func:`backoff_ms`), a missing topic is found by one cached metadata
request instead of a produce that times out (:class:`TopicCheck`), the
failures are logged together (:class:`FailureLog`), never a line each, and
:class:`Retries` decides, per failed record, when it goes again or whether
it goes to the DLQ instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException

from kdelay.engine.delivery._book import Book, Job, Sink, State
from kdelay.engine.metrics import Metrics
from kdelay.plumbing.callbacks import unheard
from kdelay.plumbing.clients import AWAY, Producing
from kdelay.plumbing.clock import Clock
from kdelay.protocol import codec
from kdelay.protocol.envelope import ErrorCode

log = logging.getLogger("kdelay.engine.delivery")  # the wing, not its private module

# Failed deliveries are logged together, at most once per this many seconds.
FAILURE_LOG_EVERY_S = 30.0
# How long a metadata request the cluster did not answer is answered from memory.
AWAY_TTL_S = 1.0


def backoff_ms(attempt: int, base_ms: int, cap_ms: int) -> int:
    """Return the wait before retry number ``attempt`` (1-based): doubling, capped."""
    return int(min(cap_ms, base_ms * 2 ** max(0, attempt - 1)))


class TopicCheck:
    """Asks the cluster whether a target topic exists, and remembers the answer a while.

    A produce to a missing topic would only fail after librdkafka gives up on
    its metadata; checking first turns that into an immediate, retryable
    failure, and keeps a transaction from being aborted for it.
    """

    def __init__(self, producer: Producing, clock: Clock, ttl_s: float = 30.0,
                 away: Callable[[str], None] = unheard) -> None:
        """``away`` is told when the cluster does not answer; the answer is then kept
        for :data:`AWAY_TTL_S`, so a batch of records to one target waits once."""
        self._producer = producer
        self._clock = clock
        self._ttl_s = ttl_s
        self._away = away
        self._known: dict[str, tuple[float, KafkaError | None]] = {}

    def missing(self, topic: str) -> KafkaError | None:
        """Return the error that says ``topic`` cannot be produced to, or None."""
        now = self._clock.monotonic()
        cached = self._known.get(topic)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            metadata = self._producer.list_topics(topic, timeout=5)
            error: KafkaError | None = metadata.topics[topic].error
        except KafkaException as exc:
            failed = KafkaError(exc.args[0].code(), f"metadata for {topic}: {exc.args[0].str()}")
            if failed.code() in AWAY:
                self._away(f"targets: {failed.str()}")
                self._known[topic] = (now + AWAY_TTL_S, failed)
            return failed
        if error is not None and error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        self._known[topic] = (now + (self._ttl_s if error is None else 1.0), error)
        return error


class FailureLog:
    """Failed deliveries, logged together: one line per :data:`FAILURE_LOG_EVERY_S` at most.

    A broker outage fails every record in flight at once; one line per record
    would bury the one line that says what happened. The first failure of a
    quiet period is logged at once; those that follow are counted and logged
    as one line, with the last one's reason, when the period is over.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._count = 0
        self._outages = 0
        self._last = ""
        self._next_s = 0.0

    def add(self, due: codec.DueKey, reason: str, attempts: int, wait_ms: int,
            outage: bool) -> None:
        """Count one failure (``outage``: while Kafka was unreachable, no attempt spent)."""
        self._count += 1
        self._outages += outage
        spent = "Kafka unreachable, no attempt spent" if outage else f"attempt {attempts}"
        self._last = f"{due} failed ({reason}, {spent}); retry in {wait_ms} ms"

    def flush(self) -> None:
        """Log what was counted, if the last line is old enough."""
        if not self._count:
            return
        now = self._clock.monotonic()
        if now < self._next_s:
            return
        self._next_s = now + FAILURE_LOG_EVERY_S
        if self._count == 1:
            log.warning("delivery of %s", self._last)
        else:
            log.warning("%d deliveries failed (%d while Kafka was unreachable); last: %s",
                        self._count, self._outages, self._last)
        self._count = self._outages = 0


class Retries:
    """What becomes of a failed delivery: a retry after a backoff, or the DLQ.

    A record is retried for ``retry_ms`` after its first failure (and at most
    ``attempts`` times, if set), unless its partition already holds
    ``max_waiting`` records waiting for a retry: memory stays bounded and
    entries of working targets keep their room. A failure while Kafka is
    unreachable (``outage``) spends no attempt: it is no fault of the target's.
    """

    def __init__(self, book: Book, clock: Clock, metrics: Metrics, outage: Callable[[], bool],
                 attempts: int, base_ms: int, cap_ms: int, retry_ms: int,
                 max_waiting: int) -> None:
        self._book = book
        self._metrics = metrics
        self._outage = outage
        self._attempts = attempts
        self._base_ms = base_ms
        self._cap_ms = cap_ms
        self._retry_ms = retry_ms
        self._max_waiting = max_waiting
        self._log = FailureLog(clock)

    def failed(self, job: Job, sink: Sink, reason: str, now: int) -> None:
        """The job's produce failed at ``now``: back it off, or give it up (undeliverable)."""
        outage = self._outage()
        if not outage:
            job.attempts += 1
        job.detail = reason
        if job.first_failed_ms is None:
            job.first_failed_ms = now
        given_up = self._given_up(job, now) if sink is Sink.TARGET else None
        if given_up is not None:
            job.failure = (ErrorCode.UNDELIVERABLE,
                           f"{job.attempts} attempts {given_up}; last: {reason}")
            wait = 0
        else:
            wait = backoff_ms(max(1, job.attempts), self._base_ms, self._cap_ms)
            # The last attempt falls at the end of the retry window, not after it.
            wait = max(0, min(wait, job.first_failed_ms + self._retry_ms - now))
        self._log.add(job.entry.due, reason, job.attempts, wait, outage)
        self._metrics.delivery.retries.inc()
        job.not_before_ms = now + wait
        self._book.move(job, State.BACKING_OFF)

    def flush(self) -> None:
        """Log the failures counted since the last line, if it is time."""
        self._log.flush()

    def _given_up(self, job: Job, now: int) -> str | None:
        """Return why a failed record is not retried any more, or None to retry it."""
        assert job.first_failed_ms is not None  # noqa: S101 - set by failed
        if self._attempts and job.attempts >= self._attempts:
            return "failed"
        if now - job.first_failed_ms >= self._retry_ms:
            return f"failed over {(now - job.first_failed_ms) // 1000} s"
        waiting = self._book.count(job.partition, State.BACKING_OFF)
        if waiting >= self._max_waiting:
            return (f"failed, and {waiting} records of partition {job.partition} already "
                    "wait for a retry")
        return None
