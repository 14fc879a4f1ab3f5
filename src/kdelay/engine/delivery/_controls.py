"""Target controls in delivery: which due records may go out now, and which are held back.

:class:`Controls` is the controls topic's state (:mod:`kdelay.protocol.controls`)
as delivery asks it, a pure object over the injected clock: :meth:`Controls.admit`
answers, per record, whether it may go out now (and spends the rate's token
when it may); a record it refuses is *held*: it stays pending in the index and
the changelog, untouched, and waits in delivery's book until its subject is
released (see :class:`~kdelay.engine.delivery._book.Book`).

A paused subject admits nothing. A capped one admits what its
:class:`TokenBucket` allows. A resumed one admits its held-back records at the
catch-up rate, oldest first, until delivery reports that none is held any more
(:meth:`Controls.caught_up`); then its standing cap (or none) applies again.
While a subject holds records back, a newer one of it is held too, so that
records over a cap go out in due order.

The rates are per instance: each instance applies the whole cap to what it
serves (documented in docs/protocol.md).

A subject holds at most about a batch of records back in memory: once it
holds :data:`SHELF_AT` or more (paused for long, or far behind its cap), its
further due records stay in the index, unread, on the :class:`Shelf` that the
read-ahead passes over; they are read again once it holds fewer. So a paused
target never fills a partition's read-ahead, and the other targets of that
partition go out as before.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from kdelay.protocol import codec
from kdelay.protocol.controls import Control, Scope, Subject

BURST_S = 0.1
"""A bucket holds at most this many seconds' worth of tokens (and at least one)."""

SHELF_AT: Final = 1_000
"""A subject that holds this many records back or more has its further ones shelved."""


class TokenBucket:
    """At most ``rate_per_s`` admissions a second on average, in bursts of at most
    :data:`BURST_S` seconds' worth, by the injected clock's milliseconds."""

    def __init__(self, rate_per_s: float, now_ms: int) -> None:
        self.rate_per_s = rate_per_s
        self._capacity = max(1.0, rate_per_s * BURST_S)
        self._tokens = self._capacity
        self._at_ms = now_ms

    def _refill(self, now_ms: int) -> None:
        if now_ms > self._at_ms:
            self._tokens = min(self._capacity,
                               self._tokens + (now_ms - self._at_ms) * self.rate_per_s / 1000)
            self._at_ms = now_ms

    def take(self, now_ms: int) -> bool:
        """Spend one token if there is one at ``now_ms``; return whether there was."""
        self._refill(now_ms)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def available(self, now_ms: int) -> int:
        """Return how many admissions the bucket allows at ``now_ms``, without spending."""
        self._refill(now_ms)
        return int(self._tokens)

    def next_ms(self, now_ms: int) -> int:
        """Return when the next token is there (``now_ms`` if it is now)."""
        self._refill(now_ms)
        missing = 1.0 - self._tokens
        return now_ms if missing <= 0 else now_ms + int(missing * 1000 / self.rate_per_s) + 1


@dataclass(slots=True)
class _Gate:
    """One subject's control and the bucket applying its rate now."""

    control: Control
    bucket: TokenBucket | None = None
    catching_up: bool = False
    held: list[bytes] = field(default_factory=list)
    """The due keys held back, a heap: the oldest first."""


class Shelf:
    """The due records a read-ahead scan leaves in the index: those whose target is
    held back enough already, by its own control or its lane's.

    Called with a key and its encoded index value, it answers from the target
    the value names (:func:`~kdelay.protocol.codec.index_value_target`); a
    lane's records are known by the prefix of the topics it owns (``lanes``:
    lane to prefix), since a record of a lane only ever goes to those. A value
    that names no target (written by an older version) is never shelved.

    It also counts what it shelves, per target, into the :class:`Shelved`
    given by :meth:`counting`, keys below that count's ``to`` aside (counted
    by an earlier scan of the same stretch).
    """

    __slots__ = ("_count", "_lanes", "_prefixes", "_targets", "subjects")

    def __init__(self, subjects: frozenset[Subject], lanes: Mapping[str, str]) -> None:
        self.subjects = subjects
        self._targets = frozenset(subject.name.encode() for subject in subjects
                                  if subject.scope is Scope.TARGET)
        # Each shelved lane with the prefix of the topics it owns (a lane not configured
        # owns none: its records are refused, never held).
        self._lanes = tuple((subject, lanes[subject.name].encode()) for subject in subjects
                            if subject.scope is Scope.LANE and subject.name in lanes)
        self._prefixes = tuple(prefix for _, prefix in self._lanes)
        self._count: Shelved | None = None

    def counting(self, count: Shelved) -> None:
        """Count what the next scan shelves into ``count``."""
        self._count = count

    def __call__(self, key: bytes, raw: bytes) -> bool:
        target = codec.index_value_target(raw)
        if not self.holds(target):
            return False
        count = self._count
        if count is not None and key >= count.to:
            count.counts[target] = count.counts.get(target, 0) + 1
            count.first.setdefault(target, key)
        return True

    def holds(self, target: bytes) -> bool:
        """Whether records to ``target`` (UTF-8) are shelved."""
        return bool(target) and (target in self._targets or target.startswith(self._prefixes))

    def subject_of(self, target: bytes) -> Subject | None:
        """The shelved subject records to ``target`` (UTF-8) fall under: the target's
        own control first, else its lane's; None when they are not shelved."""
        if target in self._targets:
            return Subject(Scope.TARGET, target.decode())
        return next((subject for subject, prefix in self._lanes if target.startswith(prefix)),
                    None)


@dataclass(slots=True)
class Shelved:
    """What one partition's scans shelved: how many records per target and the first
    (smallest key) of each, every one below ``to``."""

    counts: dict[bytes, int] = field(default_factory=dict)
    first: dict[bytes, bytes] = field(default_factory=dict)
    to: bytes = b""

    def passed(self, last: bytes) -> None:
        """A scan shelved keys up to ``last``: they are counted."""
        after = codec.key_after(last)
        if after > self.to:
            self.to = after

    def forgot(self, key: bytes) -> None:
        """A shelved record's entry left the index (a cancel): count it out, when the
        count tells whose it was (one target shelved here); else it stays counted
        until the records are read again."""
        if key < self.to and len(self.counts) == 1:
            [(target, count)] = self.counts.items()
            self.counts[target] = max(0, count - 1)


class Controls:
    """The controls in force, as delivery asks them, and the records each holds back."""

    def __init__(self) -> None:
        self._gates: dict[Subject, _Gate] = {}

    def __bool__(self) -> bool:
        """Whether any control is in force or any record held: the hot path's one check."""
        return bool(self._gates)

    @property
    def subjects(self) -> dict[Subject, Control]:
        """Every subject with a control in force or records held, and its control."""
        return {subject: gate.control for subject, gate in self._gates.items()}

    def apply(self, subject: Subject, control: Control, now_ms: int) -> None:
        """A control record for ``subject`` was read: it is in force from ``now_ms``.

        A pause lifted starts the catch-up (at ``catch_up_per_s``, or the cap,
        or unbounded); a changed rate takes effect at once.
        """
        gate = self._gates.get(subject)
        was_paused = gate is not None and gate.control.paused is not None
        if gate is None:
            gate = self._gates[subject] = _Gate(control)
        gate.control = control
        if was_paused and control.paused is None:
            gate.catching_up = True
        self._rebucket(gate, now_ms)
        self._drop_if_idle(subject)

    def _rebucket(self, gate: _Gate, now_ms: int) -> None:
        """Give ``gate`` the bucket of the rate that applies now (None: no limit)."""
        control = gate.control
        rate = control.rate_per_s
        if gate.catching_up and control.catch_up_per_s is not None:
            rate = control.catch_up_per_s
        if rate is None:
            gate.bucket = None
        elif gate.bucket is None or gate.bucket.rate_per_s != rate:
            gate.bucket = TokenBucket(rate, now_ms)

    def _drop_if_idle(self, subject: Subject) -> None:
        gate = self._gates[subject]
        if gate.control.empty and not gate.held:
            del self._gates[subject]

    def subjects_of(self, target: str, lane: str | None) -> list[Subject]:
        """The controlled subjects a record to ``target`` (of ``lane``) falls under."""
        found = [subject for subject in (Subject(Scope.TARGET, target),
                                         None if lane is None else Subject(Scope.LANE, lane))
                 if subject is not None and subject in self._gates]
        return found

    def admit(self, target: str, lane: str | None, now_ms: int, *,
              released: bool = False) -> Subject | None:
        """Decide whether a record to ``target`` (of ``lane``) may go out at ``now_ms``.

        Returns None when it may (its tokens are spent), else the subject that
        holds it back: paused, out of tokens, or (unless ``released``: the record
        is itself a held one let go) holding older records back.
        """
        subjects = self.subjects_of(target, lane)
        for subject in subjects:
            gate = self._gates[subject]
            if gate.control.paused is not None or (gate.held and not released):
                return subject
            if gate.bucket is not None and gate.bucket.available(now_ms) < 1:
                return subject
        for subject in subjects:
            gate = self._gates[subject]
            if gate.bucket is not None:
                gate.bucket.take(now_ms)
        return None

    def hold(self, subject: Subject, key: bytes) -> None:
        """``subject`` holds the record of due key ``key`` back, until :meth:`release`."""
        gate = self._gates.get(subject)
        if gate is None:
            gate = self._gates[subject] = _Gate(Control())
        heapq.heappush(gate.held, key)

    def release(self, now_ms: int, holds: Callable[[bytes, Subject], bool]) -> list[bytes]:
        """Return the held keys that may go out at ``now_ms``, oldest first per subject.

        ``holds(key, subject)`` tells whether the key is still held by that
        subject (a cancel or a lost partition drops keys without telling);
        keys that are not are forgotten. Admitting a released key spends its
        tokens later, in :meth:`admit` (``released=True``). A subject that
        holds nothing any more has caught up: its catch-up rate ends.
        """
        out: list[bytes] = []
        for subject in list(self._gates):
            gate = self._gates[subject]
            heap = gate.held
            while heap and not holds(heap[0], subject):
                heapq.heappop(heap)
            if not heap:
                self.caught_up(subject, now_ms)
                continue
            if gate.control.paused is not None:
                continue
            room = len(heap) if gate.bucket is None else gate.bucket.available(now_ms)
            while heap and room > 0:
                key = heapq.heappop(heap)
                if holds(key, subject):
                    out.append(key)
                    room -= 1
        return out

    def shelf(self, lanes: Mapping[str, str]) -> Shelf | None:
        """The shelf of the subjects that hold :data:`SHELF_AT` records back or more
        (``lanes``: each lane's topic prefix); None when there are none."""
        full = frozenset(subject for subject, gate in self._gates.items()
                         if len(gate.held) >= SHELF_AT)
        return Shelf(full, lanes) if full else None

    def holding(self, subject: Subject) -> int:
        """Return how many keys ``subject`` holds back (dropped ones may still count)."""
        gate = self._gates.get(subject)
        return 0 if gate is None else len(gate.held)

    def caught_up(self, subject: Subject, now_ms: int) -> None:
        """``subject`` holds nothing back any more: its catch-up, if any, is over."""
        gate = self._gates.get(subject)
        if gate is None:
            return
        if gate.catching_up:
            gate.catching_up = False
            self._rebucket(gate, now_ms)
        self._drop_if_idle(subject)

    def next_ms(self, subject: Subject, now_ms: int) -> int | None:
        """Return when ``subject`` may let a held record go next (None: paused)."""
        gate = self._gates.get(subject)
        if gate is None or gate.bucket is None:
            return now_ms if gate is None or gate.control.paused is None else None
        return None if gate.control.paused is not None else gate.bucket.next_ms(now_ms)

    def next_release_ms(self, now_ms: int) -> int | None:
        """Return when a subject that holds records back may let one go next (None: none
        may: nothing held, or every holder paused)."""
        times = [self.next_ms(subject, now_ms) for subject, gate in self._gates.items()
                 if gate.held]
        return min((at for at in times if at is not None), default=None)

    def rate_of(self, subject: Subject) -> float | None:
        """Return the rate applied to ``subject`` now (0 while paused, None: no limit)."""
        gate = self._gates.get(subject)
        if gate is None:
            return None
        if gate.control.paused is not None:
            return 0.0
        return None if gate.bucket is None else gate.bucket.rate_per_s
