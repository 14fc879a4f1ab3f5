"""Target controls: their records, and the pure scheduling logic delivery asks."""

from __future__ import annotations

import pytest

from kdelay.engine.delivery import Controls
from kdelay.engine.delivery._controls import SHELF_AT, TokenBucket
from kdelay.protocol import codec
from kdelay.protocol.controls import (
    Control,
    ControlError,
    Pause,
    Scope,
    Subject,
    decode_control,
    decode_subject,
    encode_control,
    parse_rate,
)

ORDERS = Subject(Scope.TARGET, "orders")
GOLD = Subject(Scope.LANE, "gold")
PAUSED = Control(paused=Pause(1_000, "alice", "db maintenance"), changed_ms=1_000,
                 changed_by="alice")


def key(due_ms: int, offset: int = 0) -> bytes:
    return codec.encode_due_key(due_ms, 0, offset)


# -- the records --------------------------------------------------------------------


def test_a_control_survives_its_record() -> None:
    control = Control(PAUSED.paused, 1000.0, 250.0, 5, "bob")
    assert decode_control(encode_control(control)) == control
    assert decode_subject(ORDERS.encode()) == ORDERS
    assert decode_subject(b"lane:gold") == GOLD


def test_a_control_of_nothing_is_a_tombstone() -> None:
    assert encode_control(Control(changed_ms=5)) is None
    assert decode_control(None).empty


@pytest.mark.parametrize("value", [b"[1]", b"{", b'{"rate_per_s": -1}',
                                   b'{"rate_per_s": true}', b'{"paused": 3}',
                                   b'{"changed_ms": "x"}', b'{"paused": {"by": 7}}'])
def test_a_bad_control_value_is_refused_with_its_code(value: bytes) -> None:
    with pytest.raises(ControlError) as caught:
        decode_control(value)
    assert caught.value.code == "bad-control"


@pytest.mark.parametrize("raw", [None, b"", b"orders", b"topic:orders", b"target:", b"\xff"])
def test_a_bad_control_key_is_refused(raw: bytes | None) -> None:
    with pytest.raises(ControlError):
        decode_subject(raw)


def test_unknown_fields_are_ignored() -> None:
    assert decode_control(b'{"v": 2, "rate_per_s": 5, "colour": "red"}').rate_per_s == 5.0


@pytest.mark.parametrize(("text", "rate"), [("500", 500.0), ("500/s", 500.0),
                                            ("30000/m", 500.0), ("3600/h", 1.0)])
def test_rates_are_read_per_second(text: str, rate: float) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["0", "-5/s", "x/s", "5/d", "nan", "inf"])
def test_a_bad_rate_is_refused(text: str) -> None:
    with pytest.raises(ControlError):
        parse_rate(text)


# -- the token bucket -------------------------------------------------------------------


def test_a_bucket_admits_its_rate_over_time_after_a_small_burst() -> None:
    bucket = TokenBucket(100.0, 0)
    admitted = sum(bucket.take(0) for _ in range(1000))
    assert admitted == 10  # a tenth of a second's worth at once
    admitted = 0
    for now in range(1, 10_001):  # ten seconds, a take a millisecond
        admitted += bucket.take(now)
    assert 995 <= admitted <= 1010


def test_a_bucket_says_when_its_next_token_comes() -> None:
    bucket = TokenBucket(10.0, 0)
    assert bucket.take(0)
    assert not bucket.take(0)
    at = bucket.next_ms(0)
    assert 100 <= at <= 101
    assert bucket.take(at)


# -- the controls -----------------------------------------------------------------------


def test_nothing_controlled_admits_everything() -> None:
    controls = Controls()
    assert not controls
    assert controls.admit("orders", None, 0) is None


def test_a_paused_target_holds_its_records_and_others_go() -> None:
    controls = Controls()
    controls.apply(ORDERS, PAUSED, 0)
    assert controls.admit("orders", None, 0) == ORDERS
    assert controls.admit("billing", None, 0) is None
    assert controls.rate_of(ORDERS) == 0.0


def test_a_paused_lane_holds_every_target_of_the_lane() -> None:
    controls = Controls()
    controls.apply(GOLD, PAUSED, 0)
    assert controls.admit("orders", "gold", 0) == GOLD
    assert controls.admit("orders", "silver", 0) is None
    assert controls.admit("orders", None, 0) is None


def holder(controls: Controls, keys: dict[bytes, Subject]) -> list[bytes]:
    """Hold ``keys`` back, as delivery does, and return what the controls let go at once."""
    for k, subject in keys.items():
        controls.hold(subject, k)
    return controls.release(0, lambda k, s: keys.get(k) == s)


def test_held_records_stay_held_while_paused() -> None:
    controls = Controls()
    controls.apply(ORDERS, PAUSED, 0)
    assert holder(controls, {key(5): ORDERS, key(3): ORDERS}) == []
    assert controls.holding(ORDERS) == 2
    assert controls.next_release_ms(0) is None


def test_resume_releases_oldest_first_at_the_catch_up_rate_then_normally() -> None:
    controls = Controls()
    controls.apply(ORDERS, PAUSED, 0)
    held = {key(due): ORDERS for due in range(100, 0, -1)}  # newest first
    for k in held:
        controls.hold(ORDERS, k)
    controls.apply(ORDERS, Control(catch_up_per_s=50.0), 0)
    still = dict(held)

    def holds(k: bytes, s: Subject) -> bool:
        return still.get(k) == s

    released: list[bytes] = []
    now = 0
    while len(released) < 100:
        assert now <= 3_000, "catch-up at 50/s takes about two seconds"
        out = controls.release(now, holds)
        for k in out:
            # Delivery sends a released record: admitted, its token spent.
            assert controls.admit("orders", None, now, released=True) is None
            del still[k]
        released.extend(out)
        now += 10
    assert released == sorted(held)  # oldest first
    assert 1_800 <= now <= 2_100  # 100 records at 50/s, after a burst of 5
    assert controls.release(now, holds) == []  # caught up: no catch-up rate any more
    assert controls.rate_of(ORDERS) is None  # the catch-up over: no cap


def test_a_newer_record_waits_behind_held_ones_of_its_target() -> None:
    controls = Controls()
    controls.apply(ORDERS, Control(rate_per_s=10.0), 0)
    assert controls.admit("orders", None, 0) is None  # the bucket's one token
    assert controls.admit("orders", None, 0) == ORDERS  # out of tokens: held
    controls.hold(ORDERS, key(1))
    assert controls.admit("orders", None, 500) == ORDERS  # a token, but an older one waits
    assert controls.release(500, lambda k, s: k == key(1)) == [key(1)]


def test_a_cap_on_one_target_leaves_the_other_alone() -> None:
    controls = Controls()
    controls.apply(ORDERS, Control(rate_per_s=10.0), 0)
    orders = sum(controls.admit("orders", None, now) is None for now in range(0, 1000, 1))
    billing = sum(controls.admit("billing", None, now) is None for now in range(0, 1000, 1))
    assert 10 <= orders <= 12
    assert billing == 1000


def test_a_cap_change_takes_effect_at_once() -> None:
    controls = Controls()
    controls.apply(ORDERS, Control(rate_per_s=1.0), 0)
    assert controls.admit("orders", None, 0) is None
    assert controls.admit("orders", None, 0) == ORDERS
    controls.apply(ORDERS, Control(), 0)  # the cap lifted (a tombstone)
    assert controls.admit("orders", None, 0) is None
    assert not controls


def test_dropped_keys_do_not_block_a_release() -> None:
    controls = Controls()
    controls.apply(ORDERS, PAUSED, 0)
    controls.hold(ORDERS, key(1))
    controls.hold(ORDERS, key(2))
    controls.apply(ORDERS, Control(), 0)
    # key(1) was cancelled meanwhile: only key(2) is still held.
    assert controls.release(0, lambda k, s: k == key(2)) == [key(2)]


def _value(target: str | None) -> bytes:
    return codec.encode_index_value(codec.IndexValue(codec.Fingerprint(1, 2), "id-1", target))


def test_a_shelf_holds_the_full_subjects_targets_and_their_lanes_topics() -> None:
    controls = Controls()
    controls.apply(ORDERS, PAUSED, 0)
    controls.apply(GOLD, PAUSED, 0)
    assert controls.shelf({"gold": "gold."}) is None, "nothing held back yet"
    for due in range(SHELF_AT):
        controls.hold(ORDERS, key(due))
        controls.hold(GOLD, key(due, 1))
    shelf = controls.shelf({"gold": "gold."})
    assert shelf is not None
    assert shelf(key(1), _value("orders"))
    assert shelf(key(1), _value("gold.billing"))
    assert not shelf(key(1), _value("billing"))
    assert not shelf(key(1), _value(None))
    assert shelf.subject_of(b"orders") == ORDERS
    assert shelf.subject_of(b"gold.billing") == GOLD
    assert shelf.subject_of(b"billing") is None
