"""An idempotent target producer renewed after its fatal error (at-least-once).

confluent-kafka raises a producer's fatal error from the ``poll`` or ``flush``
that serves it instead of calling ``error_cb``; :class:`Renewing` keeps it, and
serves nothing more of that producer until its owner renews it.
"""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from kdelay.engine.commit._transactional import Renewing

FATAL = KafkaError(KafkaError._INCONSISTENT, "Unable to reconstruct MessageSet", fatal=True)


class Dying:
    """A producer whose polls and flushes raise ``raises``; counts its calls."""

    def __init__(self, raises: KafkaError | None = None) -> None:
        self.raises = raises
        self.polls = 0
        self.purged = 0
        self.held = 3

    def produce(self, topic: str, *args: object, **kwargs: object) -> None:
        self.held += 1

    def poll(self, timeout: float = -1) -> int:
        self.polls += 1
        if self.raises is not None:
            raise KafkaException(self.raises)
        return 0

    def flush(self, timeout: float = -1) -> int:
        return self.poll(timeout)

    def purge(self) -> None:
        self.purged += 1

    def __len__(self) -> int:
        return self.held

    def list_topics(self, topic: str, timeout: float = -1) -> None:
        return None


def test_a_fatal_error_raised_by_poll_is_kept_and_the_producer_is_polled_no_more() -> None:
    built = [Dying(FATAL)]
    producer = Renewing(lambda: built[-1])
    assert producer.poll(0) == 0
    assert producer.failed == FATAL
    assert producer.poll(0) == 0
    assert producer.flush(5) == 0
    assert built[0].polls == 1, "none of a failed producer's reports is served"
    assert len(producer) == 3, "what it held still counts: nothing of it has landed"


def test_renewing_purges_the_old_producer_and_produces_on_a_fresh_one() -> None:
    built = [Dying(FATAL)]
    producer = Renewing(lambda: built[-1])
    producer.flush(1)
    built.append(Dying())
    producer.renew()
    assert built[0].purged == 1
    assert built[0].polls == 1
    assert producer.failed is None
    producer.produce("orders")
    assert (built[0].held, built[1].held) == (3, 4), "the bound produce is the new one's"
    assert producer.poll(0) == 0
    assert built[1].polls == 1


def test_an_error_that_is_not_fatal_is_raised() -> None:
    producer = Renewing(lambda: Dying(KafkaError(KafkaError._TRANSPORT, "broken")))
    with pytest.raises(KafkaException):
        producer.poll(0)
    assert producer.failed is None
