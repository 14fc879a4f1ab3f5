"""The CRC-32 of kdelay's fingerprints (zlib's polynomial), at the speed of the CPU.

The standard library's ``zlib.crc32`` comes from the system's zlib, which on
most Linux distributions computes it a byte at a time: ~0.9 ns a byte, a third
of a microsecond for every request intake fingerprints and every original
delivery checks. zlib-ng computes the same CRC with the CPU's carry-less
multiply (~0.05 ns a byte) and is a dependency of kdelay; where it cannot be
imported (a platform without its wheels), the standard library's is used.
Both return the same value for the same bytes and start value, and
``tests/unit/protocol/test_checksum.py`` holds them to it: fingerprints are
persisted.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Final

Crc32 = Callable[[bytes, int], int]


def _implementation() -> tuple[Crc32, bool]:
    """zlib-ng's CRC-32 and True, or the standard library's and False."""
    try:
        from zlib_ng.zlib_ng import crc32
    except ImportError:  # pragma: no cover - without zlib-ng's wheels
        return zlib.crc32, False
    return crc32, True


_CHOSEN: Final = _implementation()
crc32: Final[Crc32] = _CHOSEN[0]
"""``crc32(data, start)``: the CRC-32 of ``data`` continuing from ``start`` (0 to begin)."""
ACCELERATED: Final = _CHOSEN[1]
"""Whether :data:`crc32` is zlib-ng's."""
