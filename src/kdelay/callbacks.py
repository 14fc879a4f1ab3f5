"""Callbacks handed to librdkafka, and the latch for errors raised inside them.

confluent-kafka runs delivery reports and rebalance callbacks inside ``poll``;
an exception there is easy to lose. Every callback kdelay registers is wrapped
by :func:`guarded`, which records the error in a process-wide latch before
re-raising it. The test suite's autouse guard fails any test whose latch is not
empty, so an error swallowed somewhere up the stack still fails the test.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from confluent_kafka import KafkaError

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_errors: list[BaseException] = []


def guarded(callback: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``callback`` so that any exception it raises is latched, then re-raised."""

    @functools.wraps(callback)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return callback(*args, **kwargs)
        except BaseException as exc:
            with _lock:
                _errors.append(exc)
            raise

    return wrapper


def drain_errors() -> list[BaseException]:
    """Return and clear every error latched since the last call."""
    with _lock:
        errors = list(_errors)
        _errors.clear()
    return errors


# Fatal errors that mean another process took this one's place in Kafka.
_FENCED = frozenset({KafkaError.FENCED_INSTANCE_ID, KafkaError._FENCED,
                     KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})


def fatal_code(error: KafkaError) -> str:
    """The stable code of a fatal client error: ``fenced`` when another process with this
    instance's ids took its place, else ``kafka-fatal``.

    A consumer's fatal error reaches ``consume`` as ``_FATAL``, naming the
    cause only in its text.
    """
    if error.code() in _FENCED or "fenced" in error.str().lower():
        return "fenced"
    return "kafka-fatal"


class ClientErrors:
    """The errors librdkafka reports outside any call, through each client's ``error_cb``.

    A fatal error means the client can never work again (a static group
    member fenced by another with the same ``group.instance.id``, an
    idempotent or transactional producer fenced or out of sequence): it is
    kept, with the name of the client that reported it, until
    :meth:`take_fatal`. The service ends on it, so that a supervisor starts
    it again, instead of running on and serving nothing. Other errors are
    librdkafka telling of trouble it retries by itself; they are dropped here
    (its logger says what it does about them).
    """

    def __init__(self) -> None:
        self._fatal: tuple[str, KafkaError] | None = None

    def callback(self, client: str) -> Callable[[KafkaError], None]:
        """Return the ``error_cb`` of the client named ``client``."""

        def on_error(error: KafkaError) -> None:
            if error.fatal() and self._fatal is None:
                self._fatal = (client, error)

        return guarded(on_error)

    def take_fatal(self) -> tuple[str, KafkaError] | None:
        """Return the first fatal error reported (and which client reported it), if any."""
        return self._fatal
