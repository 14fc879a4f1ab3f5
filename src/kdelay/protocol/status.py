"""Instance status records: which request partitions an instance serves and which it restores.

Each instance of the service writes its status to the compacted status topic
(``kdelay.status`` by default, one partition), keyed by its group member id
(the ``group.instance.id`` the consumer group reports), on change and at most
every few seconds, so the topic keeps the latest status of every instance and
a reader with Kafka access alone (the console) learns, per request partition,
whether its index is being restored from the changelog and how far that has
got. The value is a UTF-8 JSON object:

```
{"v": 1, "instance": "host-1a2b3c4d5e6f", "at_ms": 1764300000000,
 "partitions": {"0": {"state": "serving"},
                "3": {"state": "restoring", "done": 120000, "total": 400000}}}
```

``done`` and ``total`` count changelog offsets: those replayed so far and
those the restore must replay (``total`` is absent while the restore waits
for its turn). An instance that stops cleanly writes an empty ``partitions``.
A record that is not such an object is refused with :class:`StatusError`
(code ``bad-status``): a reader skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kdelay.errors import KdelayError

VERSION = 1
CODE = "bad-status"
SERVING = "serving"
RESTORING = "restoring"
STATES = (SERVING, RESTORING)


class StatusError(KdelayError, ValueError):
    """A status record that cannot be read (code ``bad-status``)."""

    code = CODE


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    """One request partition of an instance: ``serving`` or ``restoring``, with the
    changelog offsets replayed (``done``) of the ``total`` to replay (None: not known yet)."""

    state: str
    done: int = 0
    total: int | None = None

    @property
    def percent(self) -> float | None:
        """How far a restore has got, 0-100; None when not restoring or its total is unknown."""
        if self.state != RESTORING or not self.total:
            return None
        return min(100.0, 100.0 * self.done / self.total)


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """What one instance said of its partitions at ``at_ms`` (its clock)."""

    instance: str
    at_ms: int
    partitions: dict[int, PartitionStatus]


def encode(status: InstanceStatus) -> tuple[bytes, bytes]:
    """The record (key, value) of ``status``."""
    partitions: dict[str, dict[str, Any]] = {}
    for partition, found in sorted(status.partitions.items()):
        entry: dict[str, Any] = {"state": found.state}
        if found.state == RESTORING:
            entry["done"] = found.done
            if found.total is not None:
                entry["total"] = found.total
        partitions[str(partition)] = entry
    value = {"v": VERSION, "instance": status.instance, "at_ms": status.at_ms,
             "partitions": partitions}
    return status.instance.encode(), orjson.dumps(value)


def decode(value: bytes | None) -> InstanceStatus:
    """The status a record's value holds; :class:`StatusError` when it is none."""
    if value is None:
        raise StatusError("a status record without a value")
    try:
        found = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise StatusError(f"not JSON: {exc}") from exc
    if not isinstance(found, dict) or found.get("v") != VERSION:
        raise StatusError(f"not a version {VERSION} status object")
    instance, at_ms, partitions = found.get("instance"), found.get("at_ms"), \
        found.get("partitions")
    if not isinstance(instance, str) or not isinstance(at_ms, int) or \
            not isinstance(partitions, dict):
        raise StatusError("instance, at_ms and partitions are required")
    return InstanceStatus(instance, at_ms, {_partition(k): _state(v)
                                            for k, v in partitions.items()})


def _partition(key: str) -> int:
    if not key.isdigit():
        raise StatusError(f"partition {key!r} is not a number")
    return int(key)


def _state(entry: object) -> PartitionStatus:
    if not isinstance(entry, dict) or entry.get("state") not in STATES:
        raise StatusError(f"a partition's state must be one of {', '.join(STATES)}")
    done, total = entry.get("done", 0), entry.get("total")
    if not isinstance(done, int) or not (total is None or isinstance(total, int)):
        raise StatusError("done and total must be integers")
    return PartitionStatus(entry["state"], done, total)
