"""A restore's runs of new puts: what continues one, and the tally it counts."""

from __future__ import annotations

import pytest

from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.state.replay import FreshRun
from kdelay.state.tally import Change

T0 = 1_700_000_000_000
PART = 3


def key(offset: int, due_ms: int = T0, partition: int = PART) -> bytes:
    return codec.encode_due_key(due_ms, partition, offset)


def value(timestamp_ms: int = T0 - 5_000, schedule_id: str | None = None,
          target: str | None = "orders") -> bytes:
    return codec.encode_index_value(IndexValue(Fingerprint(timestamp_ms, 7), schedule_id, target))


def counted(keys: list[bytes], values: list[bytes]) -> Change:
    change = Change()
    for k, v in zip(keys, values, strict=True):
        change.count(k, v, 1)
    return change


def test_increasing_puts_of_one_partition_make_a_run_with_their_tally() -> None:
    keys = [key(offset, T0 + offset * 37_000) for offset in range(10, 400, 3)]
    values = [value(T0 - offset * 90_000, target=None if offset % 2 else "orders")
              for offset in range(10, 400, 3)]
    run = FreshRun()
    assert run.extend(list(keys[:50]), list(values[:50]))
    assert run.extend(list(keys[50:]), list(values[50:]))
    assert (run.keys, run.values) == (keys, values)
    assert (run.first_due, run.last_due) == (T0 + 10 * 37_000, T0 + 397 * 37_000)
    assert len(run) == len(keys)
    expected = counted(keys, values)
    change = run.change()
    assert (change.due, change.slack, change.origin) == (
        expected.due, expected.slack, {PART: len(keys)})


def test_a_negative_request_timestamp_counts_in_its_slack_minute() -> None:
    keys, values = [key(1), key(2, T0 + 1)], [value(-120_001), value(5)]
    run = FreshRun()
    assert run.extend(list(keys), list(values))
    assert run.change().slack == counted(keys, values).slack


def test_the_latest_consumed_offset_is_kept_and_clock_probes_passed_over() -> None:
    run = FreshRun()
    assert run.extend([key(1), codec.CONSUMED_MARKER, codec.CLOCK_PROBE, key(2),
                       codec.CONSUMED_MARKER],
                      [value(), codec.encode_offset(2), None, value(), codec.encode_offset(3)])
    assert run.keys == [key(1), key(2)]
    assert run.consumed == codec.encode_offset(3)
    assert len(run) == 3


@pytest.mark.parametrize(("record", "why"), [
    ((key(9), None), "a tombstone"),
    ((None, value()), "a record without a key"),
    ((codec.WATERMARK_MARKER, codec.encode_watermark(codec.Watermark(key(1), frozenset()))),
     "a watermark"),
    ((codec.id_record_key("order-1"), None), "an ended id"),
    ((codec.CONSUMED_MARKER, None), "a consumed offset's tombstone"),
    ((b"odd", value()), "a key that is no due key"),
    ((key(9), value(schedule_id="order-1")), "a value with a schedule id"),
    ((key(9), value(target=None)[:11]), "a value too short"),
    ((key(9), value(target=None) + b"order-1"), "a value of the first layout (an id)"),
    ((key(9, partition=PART + 1), value()), "a key of another request partition"),
    ((key(5), value()), "an offset not above the last"),
    ((key(5, T0 - 60_000), value()), "the last offset again, due earlier"),
])
def test_anything_else_ends_the_run_and_adds_nothing(
        record: tuple[bytes | None, bytes | None], why: str) -> None:
    run = FreshRun()
    assert run.extend([key(4), key(5)], [value(), value()])
    before = (list(run.keys), list(run.values), run.change().due, run.consumed, run.last)
    assert not run.extend([key(6), codec.CONSUMED_MARKER, record[0]],
                          [value(), codec.encode_offset(7), record[1]]), why
    assert (run.keys, run.values, run.change().due, run.consumed, run.last) == before, why


def test_a_run_begins_at_any_partition_and_offset() -> None:
    run = FreshRun()
    assert run.extend([codec.CONSUMED_MARKER], [codec.encode_offset(1)])
    assert run.keys == []
    assert run.partition == -1
    assert run.extend([key(0, partition=0)], [value()])
    assert (run.partition, run.last) == (0, 0)


def test_keys_and_values_must_pair() -> None:
    with pytest.raises(ValueError, match="1 keys but 0 values"):
        FreshRun().extend([key(1)], [])
