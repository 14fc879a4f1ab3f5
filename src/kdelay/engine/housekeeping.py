"""The service's housekeeping round: gauges and stores marked in step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kdelay.engine.metrics import Metrics
from kdelay.engine.outlook import Outlook
from kdelay.plumbing.clients import Watermarks
from kdelay.plumbing.clock import Clock
from kdelay.state.index import PartitionIndex
from kdelay.state.statedir import free_bytes

HOUSEKEEPING_EVERY_MS = 5_000


class Housekeeper:
    """Every few seconds (service clock): refresh the gauges and mark every owned
    store in step with the changelog.

    An owned store lacks only the effects of the changelog writes in flight,
    so the mark (:meth:`PartitionIndex.mark_synced`) is true; the next
    assignment of the partition to this state dir trusts the store only while
    the mark is younger than the changelog keeps tombstones.
    """

    def __init__(self, clock: Clock, metrics: Metrics, outlook: Outlook,
                 state_dir: Path | None = None) -> None:
        self._state_dir = state_dir
        self._clock = clock
        self._metrics = metrics
        self._outlook = outlook
        self._next_ms = 0

    def tick(self, indexes: Mapping[int, PartitionIndex], consumed: Mapping[int, int],
             consumer: Watermarks) -> bool:
        """Do the round if it is time; return whether it was."""
        now = self._clock.now_ms()
        if now < self._next_ms:
            return False
        self._next_ms = now + HOUSEKEEPING_EVERY_MS
        for index in indexes.values():
            index.mark_synced(now)
        self._outlook.refresh(now, indexes, consumed, consumer)
        if self._state_dir is not None:
            self._metrics.outlook.state_dir_free.set(free_bytes(self._state_dir))
        return True
