"""Forward records: their headers, read back exactly, and malformed ones refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kdelay.protocol import durations, envelope, forward
from kdelay.protocol.codec import Fingerprint
from kdelay.protocol.envelope import CANCEL, DUE_MS, SCHEDULE_ID, Cancel, ErrorCode, Rejection
from kdelay.protocol.forward import FINGERPRINT, FORWARD, Forward

FWD = Forward("order-7", 1_700_000_000_000, 2, 41, Fingerprint(1_699_999_999_000, 77))


@given(st.builds(Forward, st.text(st.characters(blacklist_categories=["Cs"]), min_size=1),
                 st.integers(0, envelope.MAX_TIME_MS), st.integers(0, 2**32 - 1),
                 st.integers(0, 2**64 - 1),
                 st.builds(Fingerprint, st.integers(-(2**63), 2**63 - 1),
                           st.integers(0, 2**32 - 1)),
                 st.none() | st.text(st.characters(blacklist_categories=["Cs"]), min_size=1),
                 st.none() | st.from_regex(envelope.LANE_NAME, fullmatch=True)))
def test_a_forward_reads_back_as_written(fwd: Forward) -> None:
    assert forward.parse(forward.schedule_headers(fwd)) == fwd


def test_a_forward_carries_no_target_so_older_instances_dead_letter_it() -> None:
    headers = forward.schedule_headers(FWD)
    assert envelope.TARGET not in dict(headers)
    parsed = envelope.parse(headers, 0, durations.Limits((1,), None))
    assert isinstance(parsed, Rejection)
    assert parsed.code is ErrorCode.MISSING_TARGET


def test_records_without_the_forward_header_are_no_forwards() -> None:
    assert forward.parse(None) is None
    assert forward.parse(envelope.schedule_headers("t", due_ms=1, schedule_id="a")) is None
    assert not forward.is_forward(None)
    assert not forward.is_forward({"x": b"1"})


def test_a_forwarded_cancel_is_a_cancel_and_no_schedule_forward() -> None:
    headers = forward.cancel_headers("order-7", 2, 9)
    assert forward.is_forward(headers)
    assert forward.parse(headers) is None
    assert envelope.parse(headers, 0, durations.Limits((1,), None)) == Cancel("order-7")


@pytest.mark.parametrize("change", [
    {FORWARD: b"2"}, {FORWARD: b"a/1"}, {FORWARD: b"-1/1"}, {FORWARD: b"2/-1"},
    {FINGERPRINT: b"1"}, {FINGERPRINT: b"1/4294967296"}, {DUE_MS: b"-5"}, {DUE_MS: b"x"},
    {DUE_MS: None}, {SCHEDULE_ID: b""}, {SCHEDULE_ID: b"\xff"}, {FORWARD: "2/\u00e9"},
])
def test_a_malformed_forward_is_bad_forward(change: dict[str, bytes | str | None]) -> None:
    headers = dict(forward.schedule_headers(FWD))
    headers.update(change)
    parsed = forward.parse(headers)
    assert isinstance(parsed, Rejection), parsed
    assert parsed.code is ErrorCode.BAD_FORWARD


def test_a_cancel_header_makes_a_record_no_schedule_forward() -> None:
    headers = [*forward.schedule_headers(FWD), (CANCEL, b"order-7")]
    assert forward.parse(headers) is None


def test_id_partition_refuses_a_topic_without_partitions() -> None:
    with pytest.raises(ValueError, match="at least one partition"):
        forward.id_partition("a", 0)
