"""The record page's payload preview: JSON, text or hex, cut at its cap."""

from __future__ import annotations

import orjson

from kdelay.web.reads import PREVIEW_BYTES, preview


def test_payloads_preview_as_json_text_or_hex_within_the_cap() -> None:
    shown = preview(b'{"id":42,"items":[1,2]}')
    assert (shown.kind, shown.cut) == ("json", False)
    assert orjson.loads(shown.text) == {"id": 42, "items": [1, 2]}
    assert preview("héllo".encode()).kind == "text"
    binary = preview(b"\x00\xff\xfe")
    assert (binary.kind, binary.text) == ("hex", "00 ff fe")
    big = preview(b"x" * (PREVIEW_BYTES + 10))
    assert (big.kind, big.cut, big.size, len(big.text)) == ("text", True, PREVIEW_BYTES + 10,
                                                           PREVIEW_BYTES)
