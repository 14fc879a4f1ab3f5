"""Rereads: the entries delivered while their requests may still be read again.

After an assignment, intake reads again the requests that an instance before
it may have indexed without recording their offset (at-least-once records it
only once their changelog records are acknowledged): from the partition's
start offset up to a bound (see :class:`~kdelay.engine.intake.Planner`). A
request read again whose entry is still pending in the index is not put
again. Nor is one whose entry this instance delivered since the assignment:
it left the index before intake read its request again, and a new put would
send it a second time in the same run. Delivery notes here the keys it
settles whose requests lie in that range; the planner asks; the range is
forgotten once intake has applied a plan past it, or at the next assignment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kdelay.protocol import codec


class Rereads:
    """Per partition: the range of request offsets still to be read again, and the keys
    of those requests delivered (or dead-lettered) since the assignment."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[int, int, set[bytes]]] = {}

    def watch(self, partition: int, start: int, below: int | None) -> Callable[[bytes], bool]:
        """Requests of ``partition`` from offset ``start`` up to ``below`` may be read again
        (None: none is); return :meth:`delivered` for ``partition``, for its planner."""
        self.forget(partition)
        if below is not None:
            self._watched[partition] = (start, below, set())

        def delivered(key: bytes) -> bool:
            return self.delivered(partition, key)
        return delivered

    def note(self, partition: int, keys: Iterable[bytes]) -> None:
        """``keys`` of ``partition`` left the index, done: remember those in the range."""
        watched = self._watched.get(partition)
        if watched is None:
            return
        start, below, settled = watched
        for key in keys:
            if start <= codec.unpack_due_key(key)[2] < below:
                settled.add(key)

    def delivered(self, partition: int, key: bytes) -> bool:
        """Whether the entry ``key`` of a request read again left the index, done."""
        watched = self._watched.get(partition)
        return watched is not None and key in watched[2]

    def passed(self, partition: int, consumed: int) -> None:
        """Intake applied ``partition``'s requests up to ``consumed``: past the range,
        nothing in it is read again."""
        watched = self._watched.get(partition)
        if watched is not None and consumed >= watched[1]:
            self.forget(partition)

    def forget(self, partition: int) -> None:
        """Drop what is known of ``partition`` (lost, revoked, or read past)."""
        self._watched.pop(partition, None)
