"""The two durabilities: how delivery's flights go out and land, per guarantee.

:mod:`kdelay.engine.commit` picks one (the only module that reads the
guarantee); delivery only asks it, through the
:class:`~kdelay.engine.delivery._flights.Durability` protocol, which producer a flight
goes out on, when it has landed, and where a seal's records are written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kdelay.engine.commit._writer import ChangelogWriter
from kdelay.engine.delivery import STALL_S, Channel, Flight
from kdelay.plumbing.clients import Producing
from kdelay.protocol.codec import IdRecord, Watermark

log = logging.getLogger("kdelay.engine.commit")  # the wing, not its private module


class Transacted:
    """Exactly-once: delivery produces within the step's transaction, and seals into it.

    Every flight goes out on the transactional producer and lands with the
    transaction: when it is about to commit (if any record fails, the
    transaction aborts and delivery takes every flight of it back).
    """

    def __init__(self, writer: ChangelogWriter, producer: Producing) -> None:
        self._writer = writer
        self._channel = Channel(producer, bulk=False)

    def channel(self, airborne: Sequence[Flight], now_s: float, few: bool) -> Channel | None:
        """The transactional producer, always."""
        return self._channel

    def landed(self, flight: Flight) -> bool:
        """When asked (at commit), unless a record failed: the transaction decides for
        every record, and one that failed aborts it (then delivery takes it all back)."""
        return not flight.errors

    def seal(self, partition: int, mark: Watermark | None, tombstones: list[bytes],
             ended: list[IdRecord]) -> None:
        """Write the seal's records (into the open transaction, under exactly-once)."""
        self._writer.seal(partition, mark, tombstones, ended)

    def position(self, partition: int) -> int | None:
        """The writer's confirmed changelog position."""
        return self._writer.position(partition)

    def has_failures(self) -> bool:
        """Whether a changelog write failed since the failures were last taken."""
        return self._writer.has_failures()


class Acknowledged(Transacted):
    """At-least-once: flights go out on the bulk lane, one generation at a time.

    While a generation is in the air, a dispatch of :data:`~kdelay.engine.delivery._flights.FEW`
    entries goes out on the producer that reports each record, rather than wait
    for it to land (so a steady rate is as prompt as before; a burst's large
    dispatches wait).

    The bulk producer reports failures only (``delivery.report.only.error``):
    a record that lands costs no Python call, and a generation has landed
    once the producer holds no record any more. A generation still in the air
    after :data:`~kdelay.engine.delivery._flights.STALL_S` (a target partition without a
    leader keeps its records until their timeout) must not hold every other
    delivery back: the flights that follow go out on a producer that reports
    every record (counted per flight, any number in the air) until both
    producers are empty again.
    """

    def __init__(self, writer: ChangelogWriter, bulk: Producing, each: Producing,
                 failed: Callable[[], bool] = lambda: False,
                 position: Callable[[int], int | None] | None = None) -> None:
        """``failed`` tells whether a target producer failed for good and awaits its
        renewal: no flight lands meanwhile (see :meth:`landed`). ``position`` is the
        changelog position a seal may record (default: the writer's confirmed one;
        the checkpoint's keeps it below the records of plans not yet applied)."""
        super().__init__(writer, each)
        self._position = writer.position if position is None else position
        self._bulk = Channel(bulk, bulk=True)
        self._each = self._channel
        self._stalled = False
        self._failed = failed

    def position(self, partition: int) -> int | None:
        """The changelog position a seal may record (see the checkpoint's ``position``)."""
        return self._position(partition)

    def channel(self, airborne: Sequence[Flight], now_s: float, few: bool) -> Channel | None:
        """The bulk lane when nothing is in the air on it; else the reporting producer
        for ``few`` flights (a steady rate need not wait for a generation to land), or
        for any while a bulk generation is stalled (and until everything in the air
        landed); None: a large dispatch waits for the generation in the air."""
        bulk = [flight.since for flight in airborne if flight.bulk]
        if self._stalled:
            if bulk or len(self._each.producer) or any(not f.bulk for f in airborne):
                return self._each
            self._stalled = False
            log.info("deliveries go out on the bulk lane again")
        if not bulk:
            return self._bulk
        if few:
            return self._each
        if now_s - min(bulk) < STALL_S:
            return None
        self._stalled = True
        log.warning("deliveries have awaited their acknowledgements for over %.0f s (a target "
                    "partition without a leader?): the others go out one report each meanwhile",
                    STALL_S)
        return self._each

    def landed(self, flight: Flight) -> bool:
        """Whether every record of ``flight`` has reported (on the bulk lane: whether the
        bulk producer holds no record any more, failures' reports served).

        Never while a target producer failed for good: what it reported, or no longer
        holds, is not trusted; its renewal takes every flight back
        (:meth:`~kdelay.engine.delivery.Delivery.take_back`)."""
        if flight.dead_letters > 0 or self._failed():
            return False
        if flight.bulk:
            return len(self._bulk.producer) == 0
        return flight.reported >= flight.produced
