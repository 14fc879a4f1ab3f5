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
