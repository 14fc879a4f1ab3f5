"""The record page's payload preview: JSON, text or hex, cut at its cap."""

from __future__ import annotations

import orjson

from kdelay.web.reads import PREVIEW_BYTES, Redaction, preview


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


def test_redacted_json_fields_and_headers_show_as_stars_at_any_depth() -> None:
    redaction = Redaction.of(["Card", "authorization"])
    value = b'{"id": 42, "card": "4111", "items": [{"CARD": "5500", "sku": "a"}]}'
    shown = preview(value, redaction)
    assert shown.kind == "json"
    assert "4111" not in shown.text
    assert "5500" not in shown.text
    assert '"sku": "a"' in shown.text
    assert shown.text.count('"***"') == 2
    assert redaction.header("Authorization", "Bearer x") == "***"
    assert redaction.header("trace", "t1") == "t1"


def test_a_payload_that_is_not_json_is_not_shown_while_fields_are_redacted() -> None:
    shown = preview(b"card=4111", Redaction.of(["card"]))
    assert (shown.kind, "4111" in shown.text) == ("redacted", False)
    assert preview(b"card=4111").kind == "text", "without a redaction, text is shown"
