"""The fingerprints' CRC-32: zlib-ng's where installed, the standard library's otherwise."""

from __future__ import annotations

import importlib
import sys
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kdelay.protocol import checksum


@given(st.binary(max_size=5_000), st.integers(min_value=0, max_value=2**32 - 1))
def test_the_crc_is_zlibs_for_any_bytes_and_start(data: bytes, start: int) -> None:
    assert checksum.crc32(data, start) == zlib.crc32(data, start)


def test_the_crc_chains_like_one_call_over_the_whole() -> None:
    head, tail = b"\x01\x00\x00\x00\x03key", b"\x01\x00\x00\x00\x05value"
    assert checksum.crc32(tail, checksum.crc32(head, 0)) == zlib.crc32(head + tail)


def test_an_install_of_kdelay_computes_it_with_zlib_ng() -> None:
    """zlib-ng is a dependency: an environment without it pays ~0.2 us a record."""
    assert checksum.ACCELERATED


def test_without_zlib_ng_the_standard_library_computes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zlib_ng", None)
    monkeypatch.setitem(sys.modules, "zlib_ng.zlib_ng", None)
    try:
        fallback = importlib.reload(checksum)
        assert not fallback.ACCELERATED
        assert fallback.crc32 is zlib.crc32
        assert fallback.crc32(b"kdelay", 7) == zlib.crc32(b"kdelay", 7)
    finally:
        monkeypatch.undo()
        importlib.reload(checksum)
    assert checksum.ACCELERATED
