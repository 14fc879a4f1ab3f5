"""What an index write is made of: fresh puts side by side, and the views of all puts."""

from __future__ import annotations

from kdelay.protocol import codec
from kdelay.protocol.codec import Fingerprint, IndexValue
from kdelay.state.changes import Changes, Entry, FreshPuts

NOW = 1_700_000_000_000


def raw(stamp_ms: int, target: str = "orders") -> bytes:
    return codec.encode_index_value(IndexValue(Fingerprint(stamp_ms, 7), None, target))


def test_fresh_puts_keep_their_keys_values_and_extremes() -> None:
    fresh = FreshPuts(3)
    assert (len(fresh), fresh.extremes()) == (0, (0, 0, 0, 0))
    for offset, (due, stamp) in enumerate([(50, -5), (10, 20), (90, 0), (10, 30)]):
        fresh.add(codec.encode_due_key(NOW + due, 3, offset), raw(NOW + stamp),
                  NOW + due, NOW + stamp)
    assert len(fresh) == 4
    assert fresh.extremes() == (NOW + 10, NOW + 90, NOW - 5, NOW + 30)
    assert fresh.values[1] == raw(NOW + 20)
    assert [codec.decode_due_key(k).offset for k in fresh.keys] == [0, 1, 2, 3]


def test_one_fresh_put_is_every_extreme() -> None:
    fresh = FreshPuts(0)
    fresh.add(codec.encode_due_key(NOW, 0, 1), raw(NOW - 9), NOW, NOW - 9)
    assert fresh.extremes() == (NOW, NOW, NOW - 9, NOW - 9)


def test_every_view_of_the_puts_names_entries_first_then_fresh_puts() -> None:
    entry = Entry(codec.encode_due_key(NOW + 5, 0, 9), IndexValue(Fingerprint(NOW, 1), "a"))
    fresh = FreshPuts(0)
    fresh.add(codec.encode_due_key(NOW + 1, 0, 1), raw(NOW), NOW + 1, NOW)
    changes = Changes(puts=[entry], fresh=fresh)
    keys, values = changes.put_fields()
    assert keys == [entry.key, fresh.keys[0]]
    assert values == [codec.encode_index_value(entry.value), fresh.values[0]]
    assert changes.put_fields() == (keys, values), "the same order every time"
    assert changes.entries() == [entry, Entry(fresh.keys[0], codec.decode_index_value(raw(NOW)))]
    assert changes.encoded_puts() == dict(zip(keys, values, strict=True))
    assert changes


def test_fresh_puts_alone_are_handed_over_as_they_are() -> None:
    fresh = FreshPuts(0)
    fresh.add(codec.encode_due_key(NOW, 0, 1), raw(NOW), NOW, NOW)
    keys, values = Changes(fresh=fresh).put_fields()
    assert keys is fresh.keys
    assert values is fresh.values
    assert not Changes(fresh=FreshPuts(4)), "no put: nothing to write"
    assert FreshPuts(4) == FreshPuts(0), "equal by their puts: the keys name the origin"
