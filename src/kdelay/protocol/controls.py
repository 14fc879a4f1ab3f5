"""Target controls as records: a pause, a catch-up rate, a standing rate cap.

A control lives in the compacted controls topic (``kdelay.controls`` by
default), keyed by what it controls, so the topic keeps exactly the controls
in force and every instance that reads it from the beginning knows them all:

- key ``target:<topic>``: deliveries to one target topic;
- key ``lane:<lane>``: deliveries of one lane's requests, whatever their target.

The value is a UTF-8 JSON object; every field but ``v`` is optional:

```
{"v": 1,
 "paused": {"since_ms": 1764300000000, "by": "alice", "reason": "orders-db maintenance"},
 "rate_per_s": 1000,        # a standing cap: at most this many deliveries a second
 "catch_up_per_s": 500,     # after a pause: what was held back goes out at this rate
 "changed_ms": 1764300000000, "changed_by": "alice"}
```

A tombstone (no value) clears every control of its key; a record without
``paused`` resumes a paused key. Rates are per instance serving the target
(see docs/protocol.md): with N instances, the whole deployment delivers at
most N times the cap. Bad records are refused with :class:`ControlError`
(code ``bad-control``), so a reader skips them and says so; it never stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from kdelay.errors import KdelayError

VERSION = 1
CODE = "bad-control"


class ControlError(KdelayError, ValueError):
    """A control record or request that cannot be understood; ``code`` is stable."""

    code = CODE


class Scope(Enum):
    """What a control applies to."""

    TARGET = "target"
    LANE = "lane"


@dataclass(frozen=True, slots=True)
class Subject:
    """A controlled target topic or lane: the key of its control record."""

    scope: Scope
    name: str

    def encode(self) -> bytes:
        """The record key, ``target:<topic>`` or ``lane:<lane>``."""
        return f"{self.scope.value}:{self.name}".encode()

    def __str__(self) -> str:
        return f"{self.scope.value} {self.name}"


@dataclass(frozen=True, slots=True)
class Pause:
    """Who paused a subject, when and why."""

    since_ms: int
    by: str
    reason: str


@dataclass(frozen=True, slots=True)
class Control:
    """The controls in force for one subject (none of them: a cleared control)."""

    paused: Pause | None = None
    rate_per_s: float | None = None
    catch_up_per_s: float | None = None
    changed_ms: int = 0
    changed_by: str = ""

    @property
    def empty(self) -> bool:
        """Whether nothing is controlled: the record may as well be a tombstone."""
        return self.paused is None and self.rate_per_s is None and self.catch_up_per_s is None


def decode_subject(key: bytes | None) -> Subject:
    """Decode a control record's key; ControlError when it is not ``target:`` or ``lane:``."""
    try:
        text = (key or b"").decode()
    except UnicodeDecodeError as exc:
        raise ControlError(f"a control key must be UTF-8: {key!r}") from exc
    scope, _, name = text.partition(":")
    if not name or scope not in {s.value for s in Scope}:
        raise ControlError(f"a control key is target:<topic> or lane:<lane>, got {text!r}")
    return Subject(Scope(scope), name)


def parse_rate(text: str) -> float:
    """Parse ``500``, ``500/s`` or ``30000/m`` into records a second; ControlError if not
    a positive rate."""
    number, _, unit = text.strip().partition("/")
    per = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}.get(unit.strip())
    try:
        rate = float(number) / per if per is not None else -1.0
    except ValueError:
        rate = -1.0
    if not rate > 0 or rate != rate or rate == float("inf"):
        raise ControlError(f"a rate is a positive number a second (500/s) or minute "
                           f"(30000/m), got {text!r}")
    return rate


def encode_control(control: Control) -> bytes | None:
    """Encode a control as its record value; None (a tombstone) when it controls nothing."""
    if control.empty:
        return None
    value: dict[str, Any] = {"v": VERSION, "changed_ms": control.changed_ms,
                             "changed_by": control.changed_by}
    if control.paused is not None:
        pause = control.paused
        value["paused"] = {"since_ms": pause.since_ms, "by": pause.by, "reason": pause.reason}
    if control.rate_per_s is not None:
        value["rate_per_s"] = control.rate_per_s
    if control.catch_up_per_s is not None:
        value["catch_up_per_s"] = control.catch_up_per_s
    return orjson.dumps(value)


def decode_control(value: bytes | None) -> Control:
    """Decode a control record's value (None: a tombstone, nothing controlled).

    ControlError for anything but a JSON object of the documented fields with
    the documented types; unknown fields are ignored, so a newer writer's
    additions do not stop an older reader.
    """
    if value is None:
        return Control()
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ControlError(f"a control value must be JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ControlError("a control value must be a JSON object")
    return Control(_pause(raw.get("paused")), _rate(raw, "rate_per_s"),
                   _rate(raw, "catch_up_per_s"), _int(raw, "changed_ms", 0),
                   _text(raw, "changed_by"))


def _pause(raw: object) -> Pause | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ControlError("paused must be an object with since_ms, by and reason")
    return Pause(_int(raw, "since_ms", 0), _text(raw, "by"), _text(raw, "reason"))


def _rate(raw: dict[str, object], name: str) -> float | None:
    rate = raw.get(name)
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise ControlError(f"{name} must be a positive number, got {rate!r}")
    return float(rate)


def _int(raw: dict[str, object], name: str, default: int) -> int:
    number = raw.get(name, default)
    if isinstance(number, bool) or not isinstance(number, int):
        raise ControlError(f"{name} must be an integer, got {number!r}")
    return number


def _text(raw: dict[str, object], name: str) -> str:
    text = raw.get(name, "")
    if not isinstance(text, str):
        raise ControlError(f"{name} must be a string, got {text!r}")
    return text
