"""Commit: how one step's writes become durable, the only wing that knows the guarantee.

The face is the :class:`Checkpoint` that :func:`for_settings` builds for a
guarantee, the :class:`Batch` a step hands it, and the takeover of
partitions from an instance that left (exactly-once); behind it, private,
are the changelog writer, the durability of delivery's flights, the
renewable transactional producer and the takeover's offsets.

May import: :mod:`kdelay.protocol`, :mod:`kdelay.plumbing`, :mod:`kdelay.state`,
:mod:`kdelay.engine.metrics`, :mod:`kdelay.engine.intake` (the plans it makes
durable) and the face of :mod:`kdelay.engine.delivery` (which it seals and
settles). Never the rest of the loop.
"""

from kdelay.engine.commit._checkpoint import (
    MAX_UNACKED_RECORDS,
    Batch,
    Checkpoint,
    Fate,
    for_settings,
)
from kdelay.engine.commit._takeover import Takeover, owner_metadata
from kdelay.engine.commit._writer import Receipts

__all__ = ["MAX_UNACKED_RECORDS", "Batch", "Checkpoint", "Fate", "Receipts", "Takeover",
           "for_settings", "owner_metadata"]
