"""Callbacks handed to librdkafka, and the latch for errors raised inside them.

confluent-kafka runs delivery reports and rebalance callbacks inside ``poll``;
an exception there is easy to lose. Every callback kdelay registers is wrapped
by :func:`guarded`, which records the error in a process-wide latch before
re-raising it (the per-record delivery reports of the hot path do the same
themselves, through :func:`latch`). The test suite's autouse guard fails any test whose latch is not
empty, so an error swallowed somewhere up the stack still fails the test.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from confluent_kafka import KafkaError

from kdelay.plumbing.clientconfig import RareLines

P = ParamSpec("P")
R = TypeVar("R")

# What librdkafka says while a new broker loads its coordinators (its first minute): it
# retries by itself, and a user needs to hear of it once, not as a warning per client.
COORDINATOR_LOADING = "Coordinator load in progress"
# How long after a group consumer's session timed out its fence counts as its own.
OWN_FENCE_WINDOW_S = 60.0

_lock = threading.Lock()
_errors: list[BaseException] = []


def guarded(callback: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``callback`` so that any exception it raises is latched, then re-raised."""

    @functools.wraps(callback)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return callback(*args, **kwargs)
        except BaseException as exc:
            latch(exc)
            raise

    return wrapper


def latch(exc: BaseException) -> None:
    """Record an error raised inside a callback, for callbacks that guard themselves.

    A delivery report served once per record catches its own errors and
    calls this, instead of paying for :func:`guarded`'s wrapper on every call.
    """
    with _lock:
        _errors.append(exc)


def unheard(_: str) -> None:
    """Tell no one: the default listener of a ``why`` (Kafka away, a call waiting)."""


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
    (its logger says what it does about them), except ``_ALL_BROKERS_DOWN``:
    from it on, Kafka counts as unreachable (:meth:`unreachable`) until the
    service, probing, finds it back (:meth:`reachable`). Meanwhile the clients'
    connection failures are not logged (see :meth:`quiet`): the service says
    once that it waits.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._fatal: tuple[str, KafkaError] | None = None
        self._down: str | None = None
        self._monotonic = monotonic
        self._session_lost_s: float | None = None
        self._said_loading = False
        self._rare_lines: dict[str, RareLines] = {}

    def loading_first_said(self) -> bool:
        """Return True the first time a client says the coordinators are loading, False
        after: every client of the process says it, once is enough."""
        first, self._said_loading = not self._said_loading, True
        return first

    def callback(self, client: str, *, watch: bool = True,
                 renewable: bool = False) -> Callable[[KafkaError], None]:
        """Return the ``error_cb`` of the client named ``client``.

        Without ``watch``, the client's ``_ALL_BROKERS_DOWN`` reports are
        ignored: a client polled only now and then (the restorer) serves
        reports of an outage long over. A ``renewable`` client's fatal errors
        are kept only when it was fenced: its own calls raise the others, and
        its owner replaces it (the transactional producer).
        """

        def on_error(error: KafkaError) -> None:
            if renewable and error.fatal() and fatal_code(error) != "fenced":
                return
            if error.fatal() and self._fatal is None:
                self._fatal = (client, error)
            elif (watch and error.code() == KafkaError._ALL_BROKERS_DOWN
                  and self._down is None):
                self._down = f"{client}: {error.str()}"

        return guarded(on_error)

    def take_fatal(self) -> tuple[str, KafkaError] | None:
        """Return the first fatal error reported (and which client reported it), if any."""
        return self._fatal

    def forgive(self) -> None:
        """Forget the fatal error reported: its client was replaced."""
        self._fatal = None

    def unreachable(self) -> str | None:
        """Return why Kafka counts as unreachable (a client's report), or None if it does not."""
        return self._down

    def unreachable_now(self, why: str) -> None:
        """Learn from a call that timed out that Kafka is unreachable (unless known already)."""
        if self._down is None:
            self._down = why

    def reachable(self) -> None:
        """Learn that a broker answers again."""
        self._down = None

    def session_lost(self) -> None:
        """Learn that a group consumer's session timed out (librdkafka's ``SESSTMOUT``)."""
        self._session_lost_s = self._monotonic()

    def session_lost_lately(self) -> bool:
        """Whether a group consumer's session timed out in the last
        ``OWN_FENCE_WINDOW_S``. On a cluster, the broker that coordinates the group
        can die while the others answer: the consumer's session times out before
        the coordinator moves, it rejoins under the same static id, and that
        rejoin fences it (librdkafka issue 3437). Kafka as a whole was never
        unreachable, so only this tells that the fence is its own."""
        lost = self._session_lost_s
        return lost is not None and self._monotonic() - lost < OWN_FENCE_WINDOW_S

    def quiet(self, logger: Any, client: str = "") -> Any:
        """Wrap a client's ``logger`` so that it drops connection failures while Kafka is away.

        librdkafka logs every failed connection attempt of every client, about
        one line a second each (facility ``FAIL``); during an outage that is
        thousands of lines saying the same thing. The wrapper drops them while
        Kafka is unreachable, and passes at most one a minute otherwise (a
        client polled rarely serves the lines of a whole outage at once). The
        clients named ``client`` share that minute: a client replaced by a new
        one (a renewed producer, a consumer rejoining) does not say it again.
        """
        rare = self._rare_lines.setdefault(client, RareLines()) if client else RareLines()
        return _QuietLogger(logger, self, rare)


class _QuietLogger:
    """A librdkafka ``logger`` that drops ``FAIL`` lines while :class:`ClientErrors` says
    Kafka is unreachable, and passes every other line to the logger it wraps."""

    def __init__(self, logger: Any, errors: ClientErrors, rare: RareLines) -> None:
        """``rare`` says when the next line of each rare kind may pass (shared by the
        clients of one name)."""
        self._logger = logger
        self._errors = errors
        self._rare = rare

    def log(self, level: int, message: str, *args: object) -> None:
        """Pass the line on, unless it is a connection failure during an outage, a line
        of a rare kind (:class:`~kdelay.plumbing.clientconfig.RareLines`) within a minute
        of the last one of its kind passed, or a coordinator still loading (said once per
        process, as INFO); note a session timeout."""
        facility = args[0] if args else None
        if facility == "SESSTMOUT":
            self._errors.session_lost()
        if any(isinstance(arg, str) and COORDINATOR_LOADING in arg for arg in args):
            if self._errors.loading_first_said():
                self._logger.log(logging.INFO, "waiting for the broker to load its group and "
                                 "transaction coordinators (a new broker's first minute)")
            return
        if facility == "FAIL" and self._errors.unreachable() is not None:
            return
        if not self._rare.passes(facility):
            return
        self._logger.log(level, message, *args)
