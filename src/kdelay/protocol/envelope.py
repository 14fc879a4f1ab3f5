"""The request envelope: the ``kdelay-*`` headers that say where and when.

kdelay reads only a request's headers, never its value. :func:`parse` turns
them into a :class:`Schedule`, a :class:`Cancel` or a :class:`Rejection` with a
stable :class:`ErrorCode`; it never raises, so a malformed record goes to the
DLQ instead of stopping its partition. The same module builds the headers of
requests (for the client library), of delivered records and of rejections, so
every header name and value format lives in one place.

Header values are ASCII, except schedule ids, which are UTF-8. Times are
integer milliseconds since the Unix epoch, UTC.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, NamedTuple, TypeAlias

from kdelay.protocol.durations import Limits

PREFIX: Final = "kdelay-"
TARGET: Final = "kdelay-target"
DUE_MS: Final = "kdelay-due-ms"
DELAY_MS: Final = "kdelay-delay-ms"
LEVEL: Final = "kdelay-level"
PARTITION: Final = "kdelay-partition"
SCHEDULE_ID: Final = "kdelay-id"
CANCEL: Final = "kdelay-cancel"
RESCHEDULE: Final = "kdelay-reschedule"
LANE: Final = "kdelay-lane"
ORIGIN: Final = "kdelay-origin"
ERROR: Final = "kdelay-error"
ERROR_DETAIL: Final = "kdelay-error-detail"
# The target an index entry was scheduled for, where no request is meant: on
# forward records and on the dead letters of originals kdelay could not read
# back. Not kdelay-target, so that such a record produced again is refused
# (missing-target) rather than delivered empty.
SCHEDULED_TARGET: Final = "kdelay-scheduled-target"
# The user header of a recurring series' occurrence (see kdelay.recurring): each
# occurrence is a new request under an id its series reuses by design.
SERIES: Final = "kdelay.series"

HeaderValue: TypeAlias = str | bytes | None
Headers: TypeAlias = list[tuple[str, HeaderValue]]
"""Headers as kdelay builds them: the list form confluent-kafka's ``produce()`` takes.

Values kdelay writes are always bytes; user values are passed through as given.
"""
AnyHeaders: TypeAlias = Sequence[tuple[str, HeaderValue]] | Mapping[str, HeaderValue] | None
"""Headers as ``Message.headers()`` may return them: pairs, a dict, or None."""

MAX_TIME_MS: Final = 2**63 - 1
"""The latest due time kdelay accepts: Kafka timestamps are signed 64-bit."""

_MAX_PARTITION: Final = 2**31 - 1
DETAIL_LIMIT: Final = 200
"""The most characters of a kdelay-error-detail header."""
_SHOWN_BYTES: Final = 60
_LEVEL_DIGITS: Final = 9

_REQUEST_HEADERS: Final = frozenset({TARGET, DUE_MS, DELAY_MS, LEVEL, PARTITION, SCHEDULE_ID,
                                     CANCEL, LANE, RESCHEDULE})
_TIME_HEADERS: Final = (DUE_MS, DELAY_MS, LEVEL)
# The fast path's kinds of request header (see _parse_common): one dict lookup a header
# instead of a set lookup and string comparisons; a cancel or reschedule is uncommon.
_TARGET_KIND: Final = 0
_TIME_KIND: Final = 1
_ID_KIND: Final = 2
_PARTITION_KIND: Final = 3
_LANE_KIND: Final = 4
_UNCOMMON_KIND: Final = 5
_HEADER_KINDS: Final[dict[str, int]] = {
    TARGET: _TARGET_KIND, DUE_MS: _TIME_KIND, DELAY_MS: _TIME_KIND, LEVEL: _TIME_KIND,
    SCHEDULE_ID: _ID_KIND, PARTITION: _PARTITION_KIND, LANE: _LANE_KIND,
    CANCEL: _UNCOMMON_KIND, RESCHEDULE: _UNCOMMON_KIND}
# Called through the method itself: compiled, that skips its lookup by name per request.
_ISDIGIT: Final = bytes.isdigit
_PARTITION_DIGITS: Final = 10
_TOPIC_CACHE: Final = 1_024
_KNOWN_TOPICS: Final[dict[bytes, str]] = {}
_MILLIS_DIGITS: Final = 19
_MILLIS: Final = re.compile(rb"0*([0-9]{1,19})")
_POSITIVE: Final = re.compile(rb"0*([1-9][0-9]*)")
_TOPIC: Final = re.compile(rb"[A-Za-z0-9._-]{1,249}")
LANE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a lane is called: a letter or digit, then up to 63 of ``A-Z a-z 0-9 . _ -``."""
_LANE_BYTES: Final = re.compile(LANE_NAME.pattern.encode())


class ErrorCode(StrEnum):
    """Stable reason codes carried by ``kdelay-error`` on DLQ records."""

    MISSING_TARGET = "missing-target"
    MISSING_TIME = "missing-time"
    CONFLICTING_TIME = "conflicting-time"
    BAD_TIME = "bad-time"
    UNKNOWN_LEVEL = "unknown-level"
    DELAY_TOO_LONG = "delay-too-long"
    BAD_CANCEL = "bad-cancel"
    BAD_PARTITION = "bad-partition"
    BAD_HEADER = "bad-header"
    MISMATCH = "mismatch"
    EXPIRED = "expired"
    UNDELIVERABLE = "undeliverable"
    FORBIDDEN_TARGET = "forbidden-target"
    TARGET_NOT_ALLOWED = "target-not-allowed"
    UNKNOWN_LANE = "unknown-lane"
    WRONG_LANE = "wrong-lane"
    MISSING_LANE = "missing-lane"
    BAD_FORWARD = "bad-forward"
    BAD_RESCHEDULE = "bad-reschedule"


MEANINGS: dict[ErrorCode, str] = {
    ErrorCode.MISSING_TARGET: "no `kdelay-target`",
    ErrorCode.MISSING_TIME: "none of due time, delay or level",
    ErrorCode.CONFLICTING_TIME: "more than one of due time, delay or level",
    ErrorCode.BAD_TIME: "a time that is not a non-negative integer, or no record timestamp "
                        "to count a delay from",
    ErrorCode.UNKNOWN_LEVEL: "a level that is not an integer of at least 1",
    ErrorCode.DELAY_TOO_LONG: "due later than the requests topic's retention allows",
    ErrorCode.BAD_CANCEL: "a cancel without an id, or with a target or time",
    ErrorCode.BAD_PARTITION: "`kdelay-partition` is not a partition number",
    ErrorCode.BAD_HEADER: "a `kdelay-*` header twice, an illegal target name, an empty id",
    ErrorCode.MISMATCH: "the record at the stored offset is not the one scheduled (topic "
                        "recreated, truncated)",
    ErrorCode.EXPIRED: "retention deleted the request before it came due",
    ErrorCode.UNDELIVERABLE: "the target kept refusing the record for the service's retry "
                             "window (15 minutes after the first failure by default)",
    ErrorCode.FORBIDDEN_TARGET: "the target is one of kdelay's own topics",
    ErrorCode.TARGET_NOT_ALLOWED: "the service runs with `--allowed-targets` and the target "
                                  "matches none of them",
    ErrorCode.UNKNOWN_LANE: "the request names a lane the service is not configured with",
    ErrorCode.WRONG_LANE: "the request's target is not one of its lane's topics",
    ErrorCode.MISSING_LANE: "the request names no lane, and its target is a lane's topic",
    ErrorCode.BAD_FORWARD: "a `kdelay-forward` record whose other forward headers are missing "
                           "or malformed",
    ErrorCode.BAD_RESCHEDULE: "a reschedule without an id or a new time, or with a target or "
                              "partition",
}
"""What each :class:`ErrorCode` means, in one line: the error-code reference is generated
from it (docs/reference/errors.md)."""


class Schedule(NamedTuple):
    """A valid request: deliver to ``target`` (optionally ``partition``) at ``due_ms``.

    ``lane`` is the lane the request names (``kdelay-lane``), None without one;
    whether the lane may reach ``target`` is the target policy's question.
    A named tuple rather than a dataclass: intake builds one per request.
    """

    target: str
    due_ms: int
    partition: int | None
    schedule_id: str | None
    lane: str | None = None


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel the schedule ``lane`` (None: no lane) holds under ``schedule_id``."""

    schedule_id: str
    lane: str | None = None


@dataclass(frozen=True, slots=True)
class Reschedule:
    """Move the pending schedule ``lane`` holds under ``schedule_id`` to ``due_ms``.

    The due time is not checked against the retention bound here: that bound
    counts from the original request's timestamp, which only the index knows."""

    schedule_id: str
    due_ms: int
    lane: str | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """A malformed request: a stable code and one sentence naming the bad header."""

    code: ErrorCode
    detail: str


class _Rejected(Exception):
    """Raised inside this module to abandon a parse; :func:`parse` turns it into a value."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        if len(detail) > DETAIL_LIMIT:
            detail = detail[: DETAIL_LIMIT - 3] + "..."
        self.rejection = Rejection(code, detail)


def _show(raw: bytes | None) -> str:
    """Quote a header value for a detail sentence: ASCII, escaped and shortened."""
    if raw is None:
        return "null"
    shown = repr(raw[:_SHOWN_BYTES])[1:]
    return shown + "..." if len(raw) > _SHOWN_BYTES else shown


def _utf8(raw: bytes | None) -> str | None:
    """Decode ``raw`` as UTF-8, or None when it is null or not UTF-8."""
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def parse(headers: AnyHeaders, timestamp_ms: int,
          limits: Limits) -> Schedule | Cancel | Reschedule | Rejection:
    """Read a request's envelope; never raises.

    ``timestamp_ms`` is the record's own timestamp: ``kdelay-delay-ms`` and
    ``kdelay-level`` count from it, so consumer lag never lengthens a delay, and
    ``limits.max_due_after_ms`` is measured from it. A due time in the past is
    valid (the request is due at once). Headers outside the request set, such
    as user headers, ``kdelay-origin`` and ``kdelay-error*``, are ignored.
    """
    if isinstance(headers, list):
        try:
            return _parse_common(headers, timestamp_ms, limits)
        except Uncommon:
            return parse_general(headers, timestamp_ms, limits)
    return parse_general(headers, timestamp_ms, limits)


def parse_general(
    headers: AnyHeaders, timestamp_ms: int, limits: Limits
) -> Schedule | Cancel | Reschedule | Rejection:
    """Parse any envelope, checking each rule in turn: the path every rejection takes,
    and what :func:`parse` gives for a request :func:`schedule_fields` does not accept."""
    try:
        found = _collect(headers)
        if CANCEL in found:
            return _cancel(found)
        if RESCHEDULE in found:
            return _reschedule(found, timestamp_ms, limits)
        return _schedule(found, timestamp_ms, limits)
    except _Rejected as rejected:
        return rejected.rejection


class Uncommon(Exception):
    """Raised by the fast path for anything it does not accept as it stands."""


ScheduleFields = tuple[str, int, int | None, str | None, str | None]
"""The fields of a :class:`Schedule`, in its order, as a plain tuple."""


def _parse_common(
    headers: list[tuple[str, HeaderValue]], timestamp_ms: int, limits: Limits
) -> Schedule:
    """:func:`schedule_fields` as a :class:`Schedule`."""
    # tuple.__new__ skips the generated Python-level __new__, a third of the cost.
    return tuple.__new__(Schedule, schedule_fields(headers, timestamp_ms, limits))


def schedule_fields(headers: AnyHeaders, timestamp_ms: int, limits: Limits) -> ScheduleFields:
    """Accept a well-formed schedule in one pass over its headers; return its fields.

    The fast path for the usual request: headers as a list (as a consumed
    record has them), request headers at most once each, bytes values, each
    valid as it stands. It returns the fields of a schedule only where
    :func:`parse_general` returns the same one, and raises :class:`Uncommon`
    for everything else (a cancel, a str value, a value the general path
    rejects or reads more leniently), which then goes the general way.
    Compiled, the fields pass to a compiled caller with no object made:
    intake's loop calls this, then :func:`parse_general` only when it raises.
    """
    if not isinstance(headers, list):
        raise Uncommon
    target = time_raw = partition = schedule_id = lane = None
    time_name = ""
    for name, value in headers:
        kind = _HEADER_KINDS.get(name)
        if kind is None:
            continue
        if type(value) is not bytes:
            raise Uncommon
        if kind == _TARGET_KIND and target is None:
            target = _topic_name(value)
            if target is None:
                raise Uncommon
        elif kind == _TIME_KIND and time_raw is None:
            time_name, time_raw = name, value
        elif kind == _ID_KIND and schedule_id is None:
            schedule_id = _common_id(value)
        elif kind == _PARTITION_KIND and partition is None:
            partition = _common_partition(value)
        elif kind == _LANE_KIND and lane is None and _LANE_BYTES.fullmatch(value) is not None:
            lane = value.decode("ascii")
        else:
            raise Uncommon
    if target is None or time_raw is None:
        raise Uncommon
    due_ms = _common_due_ms(time_name, time_raw, timestamp_ms, limits)
    return target, due_ms, partition, schedule_id, lane


def _common_due_ms(name: str, raw: bytes, timestamp_ms: int, limits: Limits) -> int:
    """Resolve a plain decimal time header to a due time within ``limits``."""
    if not _ISDIGIT(raw) or len(raw) > _MILLIS_DIGITS:
        raise Uncommon
    amount = _digits(raw)
    if name == DUE_MS:
        due_ms = amount
    elif timestamp_ms < 0:
        raise Uncommon
    elif name == DELAY_MS:
        due_ms = timestamp_ms + amount
    elif amount >= 1:
        due_ms = timestamp_ms + limits.levels[min(amount, len(limits.levels)) - 1]
    else:
        raise Uncommon
    after = limits.max_due_after_ms
    if due_ms > MAX_TIME_MS or (after is not None and due_ms > timestamp_ms + after):
        raise Uncommon
    return due_ms


def _common_partition(raw: bytes) -> int:
    """Return a plain decimal partition number in range."""
    if not _ISDIGIT(raw) or len(raw) > _PARTITION_DIGITS:
        raise Uncommon
    partition = _digits(raw)
    if partition > _MAX_PARTITION:
        raise Uncommon
    return partition


def _digits(raw: bytes) -> int:
    """The number ``raw`` writes, given ASCII digits only (``bytes.isdigit``).

    Read through a str: compiled, ``int(str)`` converts directly, where
    ``int(bytes)`` first looks for the conversion methods of bytes, at twice the
    cost, and a due time is read once a request.
    """
    return int(raw.decode("ascii"))


def _common_id(raw: bytes) -> str:
    """Return a non-empty UTF-8 schedule id."""
    schedule_id = _utf8(raw)
    if not schedule_id:
        raise Uncommon
    return schedule_id


def _topic_name(raw: bytes) -> str | None:
    """Return ``raw`` as a topic name, or None if it is not a legal one.

    A deployment has few targets and every request names one, so the first
    legal names seen are remembered; only legal names, which are short.
    """
    topic = _KNOWN_TOPICS.get(raw)
    if topic is not None:
        return topic
    if _TOPIC.fullmatch(raw) is None or raw in (b".", b".."):
        return None
    topic = raw.decode("ascii")
    if len(_KNOWN_TOPICS) < _TOPIC_CACHE:
        _KNOWN_TOPICS[raw] = topic
    return topic


def _pairs(headers: AnyHeaders) -> Iterable[tuple[str, HeaderValue]]:
    """Iterate ``headers`` as (name, value) pairs, whichever form they come in."""
    if headers is None:
        return ()
    return headers.items() if isinstance(headers, Mapping) else headers


def _collect(headers: AnyHeaders) -> dict[str, bytes | None]:
    """Map each request header to its value as bytes; a repeated one is BAD_HEADER.

    A str value is encoded as UTF-8, lone surrogates included, so that it never
    raises here and is rejected later wherever UTF-8 or ASCII is required.
    """
    found: dict[str, bytes | None] = {}
    for name, value in _pairs(headers):
        if name not in _REQUEST_HEADERS:
            continue
        if name in found:
            raise _Rejected(ErrorCode.BAD_HEADER, f"header {name} appears more than once")
        found[name] = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    return found


def _cancel(found: dict[str, bytes | None]) -> Cancel:
    """Validate a cancel: an id, no target or time, and no conflicting ``kdelay-id``."""
    clash = [name for name in (TARGET, *_TIME_HEADERS) if name in found]
    if clash:
        raise _Rejected(
            ErrorCode.BAD_CANCEL, f"a {CANCEL} request must not also carry {', '.join(clash)}"
        )
    raw = found[CANCEL]
    schedule_id = _utf8(raw)
    if not schedule_id:
        raise _Rejected(
            ErrorCode.BAD_CANCEL,
            f"header {CANCEL} must hold a non-empty UTF-8 schedule id, got {_show(raw)}",
        )
    if SCHEDULE_ID in found and _utf8(found[SCHEDULE_ID]) != schedule_id:
        raise _Rejected(
            ErrorCode.BAD_CANCEL,
            f"header {SCHEDULE_ID} {_show(found[SCHEDULE_ID])} differs from {CANCEL} {_show(raw)}",
        )
    return Cancel(schedule_id, _lane(found.get(LANE)) if LANE in found else None)


def _reschedule(found: dict[str, bytes | None], timestamp_ms: int,
                limits: Limits) -> Reschedule:
    """Validate a reschedule: an id, one time header and a lane, no target or partition."""
    clash = [name for name in (TARGET, PARTITION) if name in found]
    if clash:
        raise _Rejected(ErrorCode.BAD_RESCHEDULE,
                        f"a {RESCHEDULE} request must not also carry {', '.join(clash)}")
    raw = found[RESCHEDULE]
    schedule_id = _utf8(raw)
    if not schedule_id:
        raise _Rejected(ErrorCode.BAD_RESCHEDULE, f"header {RESCHEDULE} must hold a non-empty "
                        f"UTF-8 schedule id, got {_show(raw)}")
    if SCHEDULE_ID in found and _utf8(found[SCHEDULE_ID]) != schedule_id:
        raise _Rejected(ErrorCode.BAD_RESCHEDULE, f"header {SCHEDULE_ID} "
                        f"{_show(found[SCHEDULE_ID])} differs from {RESCHEDULE} {_show(raw)}")
    due_ms = _due_ms(found, timestamp_ms, Limits(limits.levels, None))  # unbounded: see Reschedule
    return Reschedule(schedule_id, due_ms, _lane(found.get(LANE)) if LANE in found else None)


def _schedule(found: dict[str, bytes | None], timestamp_ms: int, limits: Limits) -> Schedule:
    """Validate a schedule request, checking target, time, partition and id in turn."""
    return Schedule(
        target=_target(found),
        due_ms=_due_ms(found, timestamp_ms, limits),
        partition=_partition(found.get(PARTITION)) if PARTITION in found else None,
        schedule_id=_schedule_id(found.get(SCHEDULE_ID)) if SCHEDULE_ID in found else None,
        lane=_lane(found.get(LANE)) if LANE in found else None,
    )


def _target(found: dict[str, bytes | None]) -> str:
    """Return the target topic; MISSING_TARGET if absent, BAD_HEADER if not a topic name."""
    if TARGET not in found:
        raise _Rejected(
            ErrorCode.MISSING_TARGET, f"the request has no {TARGET} header naming its topic"
        )
    raw = found[TARGET]
    topic = None if raw is None else _topic_name(raw)
    if topic is None:
        raise _Rejected(
            ErrorCode.BAD_HEADER, f"header {TARGET} value {_show(raw)} is not a valid topic name"
        )
    return topic


def _due_ms(found: dict[str, bytes | None], timestamp_ms: int, limits: Limits) -> int:
    """Resolve the one time header to an absolute due time within ``limits``."""
    given = [name for name in _TIME_HEADERS if name in found]
    if not given:
        raise _Rejected(
            ErrorCode.MISSING_TIME, f"the request has none of {', '.join(_TIME_HEADERS)}"
        )
    if len(given) > 1:
        raise _Rejected(
            ErrorCode.CONFLICTING_TIME,
            f"the request has {' and '.join(given)}; exactly one time header is allowed",
        )
    name, raw = given[0], found[given[0]]
    if name == DUE_MS:
        due_ms = _millis(name, raw)
    else:
        delay = _level_ms(raw, limits.levels) if name == LEVEL else _millis(name, raw)
        due_ms = _after_record(name, timestamp_ms, delay)
    _check_horizon(due_ms, timestamp_ms, limits.max_due_after_ms)
    return due_ms


def _millis(name: str, raw: bytes | None) -> int:
    """Parse a non-negative decimal millisecond count; BAD_TIME otherwise."""
    # ASCII digits only (bytes.isdigit), at most 19 significant: int() then cannot
    # see signs, spaces or underscores, and the value fits before it is built.
    if raw is not None and raw.isdigit() and len(raw.lstrip(b"0")) <= _MILLIS_DIGITS:
        value = int(raw)
        if value <= MAX_TIME_MS:
            return value
    raise _Rejected(
        ErrorCode.BAD_TIME,
        f"header {name} value {_show(raw)} is not a non-negative integer of milliseconds",
    )


def _level_ms(raw: bytes | None, levels: tuple[int, ...]) -> int:
    """Map a 1-based level to its delay, clamping above the top; UNKNOWN_LEVEL if not >= 1."""
    match = _POSITIVE.fullmatch(raw) if raw is not None else None
    if match is None:
        raise _Rejected(
            ErrorCode.UNKNOWN_LEVEL, f"header {LEVEL} value {_show(raw)} is not an integer >= 1"
        )
    digits = match[1]
    level = int(digits) if len(digits) <= _LEVEL_DIGITS else len(levels)
    return levels[min(level, len(levels)) - 1]


def _after_record(name: str, timestamp_ms: int, delay_ms: int) -> int:
    """Add a relative delay to the record's timestamp; BAD_TIME if it has none."""
    if timestamp_ms < 0:
        raise _Rejected(ErrorCode.BAD_TIME, f"the record has no timestamp to measure {name} from")
    return timestamp_ms + delay_ms


def _check_horizon(due_ms: int, timestamp_ms: int, max_after_ms: int | None) -> None:
    """Reject a due time beyond 64 bits (BAD_TIME) or past the retention bound."""
    if due_ms > MAX_TIME_MS:
        raise _Rejected(ErrorCode.BAD_TIME, f"due time {due_ms} is beyond {MAX_TIME_MS}")
    if max_after_ms is not None and due_ms > timestamp_ms + max_after_ms:
        raise _Rejected(
            ErrorCode.DELAY_TOO_LONG,
            f"due time {due_ms} is {due_ms - timestamp_ms} ms after the record timestamp "
            f"{timestamp_ms}; the requests topic's retention allows at most {max_after_ms} ms",
        )


def _partition(raw: bytes | None) -> int:
    """Parse a target partition in ``[0, 2**31 - 1]``; BAD_PARTITION otherwise."""
    match = _MILLIS.fullmatch(raw) if raw is not None else None
    if match is None or int(match[1]) > _MAX_PARTITION:
        raise _Rejected(
            ErrorCode.BAD_PARTITION,
            f"header {PARTITION} value {_show(raw)} is not a partition number",
        )
    return int(match[1])


def _schedule_id(raw: bytes | None) -> str:
    """Decode a schedule id; BAD_HEADER unless it is non-empty UTF-8."""
    schedule_id = _utf8(raw)
    if not schedule_id:
        raise _Rejected(
            ErrorCode.BAD_HEADER,
            f"header {SCHEDULE_ID} value {_show(raw)} is not a non-empty UTF-8 schedule id",
        )
    return schedule_id


def _lane(raw: bytes | None) -> str:
    """Decode a lane name; BAD_HEADER unless it is one (see :data:`LANE_NAME`)."""
    if raw is None or _LANE_BYTES.fullmatch(raw) is None:
        raise _Rejected(
            ErrorCode.BAD_HEADER,
            f"header {LANE} value {_show(raw)} is not a lane name (a letter or digit, then "
            "up to 63 of A-Z a-z 0-9 . _ -)",
        )
    return raw.decode("ascii")


def user_headers(headers: AnyHeaders) -> Headers:
    """Return ``headers`` without any ``kdelay-*`` header, order and duplicates kept."""
    return [(name, value) for name, value in _pairs(headers) if not name.startswith(PREFIX)]


@dataclass(frozen=True, slots=True)
class Routing:
    """Where an accepted request goes, and the headers that travel with it."""

    target: str
    partition: int | None
    schedule_id: str | None
    user: Headers
    lane: str | None = None


def routing(headers: AnyHeaders) -> Routing | None:
    """Split an accepted request's headers in one pass: routing, and the user's headers.

    For records intake already validated (delivery checks the fingerprint, so it
    is the same record): only the target, target partition and schedule id are
    read, and the lane. Returns None when the target is missing or a value is unreadable.
    """
    found: dict[str, HeaderValue] = {}
    user: Headers = []
    for name, value in _pairs(headers):
        if name.startswith(PREFIX):
            found[name] = value
        else:
            user.append((name, value))
    try:
        target = text_of(found.get(TARGET))
        partition = found.get(PARTITION)
        schedule_id = found.get(SCHEDULE_ID)
        lane = found.get(LANE)
        return Routing(target, None if partition is None else int(partition),
                       None if schedule_id is None else text_of(schedule_id), user,
                       None if lane is None else text_of(lane))
    except (ValueError, TypeError):
        return None


def routing_headers(routing: Routing | None) -> Headers:
    """The target, target partition, schedule id and lane headers of a request, if readable."""
    if routing is None:
        return []
    headers: Headers = [(TARGET, routing.target.encode())]
    if routing.partition is not None:
        headers.append((PARTITION, str(routing.partition).encode()))
    if routing.schedule_id is not None:
        headers.append((SCHEDULE_ID, routing.schedule_id.encode()))
    if routing.lane is not None:
        headers.append((LANE, routing.lane.encode()))
    return headers


def text_of(value: HeaderValue) -> str:
    """Return a header value as text; ValueError when absent or not UTF-8."""
    if value is None:
        raise ValueError("no value")
    return value if isinstance(value, str) else value.decode("utf-8")


def origin_of(topic: str, partition: int, offset: int) -> str:
    """Return the ``kdelay-origin`` value of a request: ``topic/partition/offset``."""
    return f"{topic}/{partition}/{offset}"


def delivery_headers(headers: AnyHeaders, origin: str, due_ms: int) -> Headers:
    """Headers of a delivered record: the user's, then ``kdelay-origin`` and ``kdelay-due-ms``.

    Every ``kdelay-*`` header of the request is dropped, so a delivered record
    re-sent through kdelay does not carry stale request headers.
    """
    return [*user_headers(headers), *delivery_tail(origin, due_ms)]


def delivery_tail(origin: str, due_ms: int) -> Headers:
    """The headers kdelay adds to every record it delivers or dead-letters."""
    return [(ORIGIN, origin.encode("utf-8")), (DUE_MS, str(due_ms).encode("ascii"))]


_CHECK_LIMITS: Final = Limits(levels=(1,), max_due_after_ms=None)


def _validated(headers: Headers, lane: str | None = None) -> Headers:
    """``headers`` (and ``lane``'s header) if :func:`parse` accepts them; else ValueError."""
    if lane is not None:
        headers = [*headers, (LANE, lane.encode("utf-8"))]
    result = parse(headers, 0, _CHECK_LIMITS)
    if isinstance(result, Rejection):
        raise ValueError(f"{result.code}: {result.detail}")
    return headers


def schedule_headers(
    target: str,
    *,
    due_ms: int | None = None,
    delay_ms: int | None = None,
    level: int | None = None,
    partition: int | None = None,
    schedule_id: str | None = None,
    lane: str | None = None,
) -> Headers:
    """Build the headers of a schedule request, as the client library sends them.

    Exactly one of ``due_ms`` (absolute), ``delay_ms`` (after the record's
    timestamp) and ``level`` must be given. Raises ValueError for anything
    :func:`parse` would reject regardless of the service's limits: a bad topic
    name, a negative time, a level below 1, a negative partition, an empty id or
    a ``lane`` that is not a lane name.
    The level table and retention bound are the service's and are checked there.
    """
    given = zip(_TIME_HEADERS, (due_ms, delay_ms, level), strict=True)
    times = [(name, str(value).encode("ascii")) for name, value in given if value is not None]
    if len(times) != 1:
        raise ValueError("give exactly one of due_ms, delay_ms and level")
    headers: Headers = [(TARGET, target.encode("utf-8")), *times]
    if partition is not None:
        headers.append((PARTITION, str(partition).encode("ascii")))
    if schedule_id is not None:
        headers.append((SCHEDULE_ID, schedule_id.encode("utf-8")))
    return _validated(headers, lane)


def cancel_headers(schedule_id: str, lane: str | None = None) -> Headers:
    """Build the headers of a cancel of ``schedule_id`` in ``lane``; ValueError if malformed."""
    return _validated([(CANCEL, schedule_id.encode("utf-8"))], lane)


def reschedule_headers(schedule_id: str, *, due_ms: int | None = None,
                       delay_ms: int | None = None, lane: str | None = None) -> Headers:
    """Build a reschedule of ``schedule_id`` in ``lane``: one of ``due_ms`` and ``delay_ms``
    (after the reschedule record's timestamp); ValueError otherwise."""
    times = [(name, str(value).encode("ascii")) for name, value in
             ((DUE_MS, due_ms), (DELAY_MS, delay_ms)) if value is not None]
    if len(times) != 1:
        raise ValueError("give exactly one of due_ms and delay_ms")
    return _validated([(RESCHEDULE, schedule_id.encode("utf-8")), *times], lane)


def rejection_headers(rejection: Rejection) -> Headers:
    """Return the ``kdelay-error`` and ``kdelay-error-detail`` headers of a DLQ record."""
    return [
        (ERROR, rejection.code.value.encode("ascii")),
        (ERROR_DETAIL, rejection.detail.encode("utf-8")),
    ]
