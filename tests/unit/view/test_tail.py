"""How ``kdelay tail`` shows a record: one line, text where the bytes are text."""

from __future__ import annotations

from confluent_kafka import Message

from kdelay.view.tail import describe


def test_a_delivered_record_is_one_line_with_its_headers() -> None:
    message = Message(topic="orders", partition=1, offset=5, key=b"customer-7",
                      value=b'{"id": 42}', timestamp=(1, 1795403209254),
                      headers=[("trace-id", b"4bf9"), ("kdelay-origin", b"kdelay.requests/1/0")])
    assert describe(message) == (
        'orders/1/5 2026-11-23T03:06:49.254Z key=customer-7 value={"id": 42} '
        "trace-id=4bf9 kdelay-origin=kdelay.requests/1/0")


def test_null_key_and_value_and_undecodable_bytes() -> None:
    message = Message(topic="t", partition=0, offset=0, key=None, value=b"\xff\x00o\nk",
                      timestamp=(1, 0), headers=[("h", None)])
    assert describe(message) == (
        "t/0/0 1970-01-01T00:00:00.000Z key=null value=\\xff\\x00o\\nk h=null")
