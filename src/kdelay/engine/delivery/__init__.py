"""Delivery: read what is due ahead from the indexes, produce it, and settle the outcomes.

The face is :class:`Delivery`, with what the loop and the checkpoint hand it
or read from it; everything behind it (``_book``, ``_readahead``,
``_sender``, ...) is private to this wing.

May import: :mod:`kdelay.protocol`, :mod:`kdelay.plumbing`, :mod:`kdelay.state`,
and :mod:`kdelay.engine.metrics`. Never the commit wing or the loop: the
checkpoint drives delivery, not the other way round.
"""

from kdelay.engine.delivery._controls import Controls
from kdelay.engine.delivery._delivery import Delivery, DeliveryConfig, by_service_clock
from kdelay.engine.delivery._flights import FEW, STALL_S, Channel, Durability, Flight
from kdelay.engine.delivery._sealing import Seals

__all__ = ["FEW", "STALL_S", "Channel", "Controls", "Delivery", "DeliveryConfig", "Durability",
           "Flight", "Seals", "by_service_clock"]
