"""Instance status records: encoded, decoded, and refused when they are not one."""

from __future__ import annotations

import pytest

from kdelay.protocol.status import (
    RESTORING,
    SERVING,
    InstanceStatus,
    PartitionStatus,
    StatusError,
    decode,
    encode,
)


def test_a_status_round_trips_keyed_by_its_instance() -> None:
    status = InstanceStatus("host-1a2b", 1_764_300_000_000, {
        0: PartitionStatus(SERVING), 3: PartitionStatus(RESTORING, 120, 400),
        5: PartitionStatus(RESTORING)})
    key, value = encode(status)
    assert key == b"host-1a2b"
    assert decode(value) == status
    assert decode(value).partitions[3].percent == 30.0
    assert decode(value).partitions[5].percent is None
    assert decode(value).partitions[0].percent is None


def test_a_stopped_instance_names_no_partition() -> None:
    assert decode(encode(InstanceStatus("a", 1, {}))[1]).partitions == {}


@pytest.mark.parametrize("value", [
    None, b"", b"not json", b"[]", b'{"v": 2, "instance": "a", "at_ms": 1, "partitions": {}}',
    b'{"v": 1, "at_ms": 1, "partitions": {}}',
    b'{"v": 1, "instance": "a", "at_ms": 1, "partitions": {"x": {"state": "serving"}}}',
    b'{"v": 1, "instance": "a", "at_ms": 1, "partitions": {"0": {"state": "dozing"}}}',
    b'{"v": 1, "instance": "a", "at_ms": 1, "partitions": {"0": {"state": "restoring", '
    b'"done": "half"}}}',
])
def test_what_is_no_status_is_refused_with_its_code(value: bytes | None) -> None:
    with pytest.raises(StatusError) as caught:
        decode(value)
    assert caught.value.code == "bad-status"
