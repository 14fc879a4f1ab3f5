"""The console's inputs, checked: times, filters, buckets and pages.

Each parser turns text from a query string, a form or a JSON body into a
value, or raises :class:`~kdelay.web.problems.Problem` 400 with a stable code
(``invalid-time``, ``invalid-filter``, ``invalid-bucket``, ``invalid-page``,
``invalid-window``, ``invalid-target``, ``invalid-sort``)
and a sentence. The API and the pages share them, so both refuse the same
input with the same code.
"""

from __future__ import annotations

import datetime as dt
import re

from kdelay.protocol import envelope
from kdelay.protocol.durations import parse_duration_ms
from kdelay.protocol.envelope import ErrorCode
from kdelay.view.listing import SCAN_DEPTH, SORTS, Filter, KeyMatch, Order
from kdelay.web.problems import Problem, bad_input

BUCKETS = {"1m": 60_000, "1h": 3_600_000, "1d": 86_400_000}
MAX_LIMIT = 1_000
MAX_SKIP = 1_000_000
MAX_WINDOW_MS = 7 * 86_400_000
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_LOCAL = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?")


def parse_time(text: str) -> int:
    """Epoch ms from epoch ms, ISO-8601 with a timezone, or a date-time picker's
    ``YYYY-MM-DDTHH:MM[:SS]``, read as UTC. Raises 400 ``invalid-time``."""
    stripped = text.strip()
    if stripped.isdigit() and len(stripped) <= 16:
        return int(stripped)
    try:
        moment = dt.datetime.fromisoformat(stripped.replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is not None and moment.tzinfo is None and _LOCAL.fullmatch(stripped):
        moment = moment.replace(tzinfo=dt.UTC)
    if moment is None or moment.tzinfo is None:
        raise bad_input("invalid-time", f"not a time: {stripped[:40]!r}; give epoch ms, "
                        "ISO-8601 with a timezone, or YYYY-MM-DDTHH:MM (UTC)")
    return int(moment.timestamp() * 1000)


def optional_time(text: str | None) -> int | None:
    """:func:`parse_time` of a field that may be absent or empty."""
    return None if text is None or not text.strip() else parse_time(text)


def _blank(text: str | None) -> str | None:
    return None if text is None or not text.strip() else text.strip()


def parse_filter(target: str | None = None, lane: str | None = None,
                 due_from: str | None = None, due_to: str | None = None,
                 id_prefix: str | None = None) -> Filter:
    """A :class:`Filter` from its fields as text (empty means absent). Raises 400
    ``invalid-filter`` for a target that is no topic name, a lane that is no lane
    name, an id prefix that is not printable, or a window that ends before it starts."""
    target, lane, prefix = _blank(target), _blank(lane), _blank(id_prefix)
    if target is not None and not _TOPIC.fullmatch(target):
        raise bad_input("invalid-filter", "target: a topic name is 1 to 249 of A-Z a-z 0-9 . _ -")
    if lane is not None and envelope.LANE_NAME.fullmatch(lane) is None:
        raise bad_input("invalid-filter", "lane: not a lane name")
    if prefix is not None and (len(prefix) > 512 or not prefix.isprintable()):
        raise bad_input("invalid-filter", "id prefix: 1 to 512 printable characters")
    low, high = optional_time(due_from), optional_time(due_to)
    if low is not None and high is not None and high < low:
        raise bad_input("invalid-filter", "the due window ends before it starts")
    return Filter(target, lane, low, high, prefix)


def parse_order(sort: str | None, order: str | None) -> Order:
    """An :class:`Order` from ``sort`` (one of :data:`SORTS`, default ``due``) and ``order``
    (``asc``, the default, or ``desc``); 400 ``invalid-sort`` otherwise."""
    sort, order = _blank(sort) or "due", _blank(order) or "asc"
    if sort not in SORTS or order not in ("asc", "desc"):
        raise bad_input("invalid-sort", f"sort is one of {', '.join(SORTS)}; order is asc "
                        "or desc")
    return Order(sort, order == "desc")


def parse_key(key: str | None, key_prefix: str | None) -> KeyMatch | None:
    """The record key to keep (its UTF-8 bytes): ``key`` exactly or ``key_prefix`` as a
    prefix (None: no key filter); 400 ``invalid-filter`` for both, or for more than 1 024
    characters."""
    exact, prefix = _blank(key), _blank(key_prefix)
    if exact is not None and prefix is not None:
        raise bad_input("invalid-filter", "give key or key_prefix, not both")
    given = exact if exact is not None else prefix
    if given is None:
        return None
    if len(given) > 1_024:
        raise bad_input("invalid-filter", "key: at most 1 024 characters")
    return KeyMatch(given.encode(), prefix is not None)


def parse_sorted_page(skip: int, limit: int, order: Order) -> tuple[int, int]:
    """:func:`parse_page`, and for a sort other than by due time, pages within the first
    :data:`SCAN_DEPTH` matches (400 ``invalid-page``)."""
    skip, limit = parse_page(skip, limit)
    if order.sort != "due" and skip + limit > SCAN_DEPTH:
        raise bad_input("invalid-page", f"sorted by {order.sort}, the pages reach the first "
                        f"{SCAN_DEPTH} matches: filter more, or sort by due time")
    return skip, limit


def parse_bucket(name: str) -> int:
    """The bucket's length in ms for ``1m``, ``1h`` or ``1d``; 400 ``invalid-bucket``."""
    if name not in BUCKETS:
        raise bad_input("invalid-bucket", "the bucket is one of 1m, 1h, 1d")
    return BUCKETS[name]


def parse_page(skip: int, limit: int) -> tuple[int, int]:
    """``(skip, limit)`` within bounds; 400 ``invalid-page`` otherwise."""
    if not 0 <= skip <= MAX_SKIP or not 1 <= limit <= MAX_LIMIT:
        raise bad_input("invalid-page", f"skip is 0 to {MAX_SKIP} and limit 1 to {MAX_LIMIT}")
    return skip, limit


def not_pending(schedule_id: str, lane: str | None = None) -> Problem:
    """The refusal of an action on a schedule the view does not hold as pending (409)."""
    of_lane = "" if lane is None else f" in lane {lane}"
    return Problem(409, "not-pending", f"{schedule_id!r}{of_lane} is not pending (delivered, "
                   "cancelled or unknown, as the operator view sees it): nothing was written")


def parse_code(code: str | None) -> str | None:
    """A DLQ code to filter by (None or empty: every code); 400 ``invalid-code`` when it is
    not one of the protocol's."""
    if code is None or not code.strip():
        return None
    if code.strip() not in {member.value for member in ErrorCode}:
        raise bad_input("invalid-code", f"{code[:70]!r} is not a DLQ code (see "
                        "docs/reference/errors.md)")
    return code.strip()


def parse_window(text: str) -> int:
    """A recent window's length in ms (``15m``, ``1h``, ``1d``, or ms), 1 s to 7 days;
    400 ``invalid-window`` otherwise."""
    try:
        window_ms = parse_duration_ms(text.strip())
    except ValueError:
        window_ms = -1
    if not 1_000 <= window_ms <= MAX_WINDOW_MS:
        raise bad_input("invalid-window", f"{text[:40]!r} is no window: give 1s to 7d, "
                        "such as 15m, 1h or 1d")
    return window_ms


def parse_target(target: str | None) -> str | None:
    """A target to read (None or empty: every target the screens know); 400
    ``invalid-target`` when it is no topic name."""
    if target is None or not target.strip():
        return None
    if not _TOPIC.fullmatch(target.strip()):
        raise bad_input("invalid-target", "a topic name is 1 to 249 of A-Z a-z 0-9 . _ -")
    return target.strip()
