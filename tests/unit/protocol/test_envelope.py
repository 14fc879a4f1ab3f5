"""The request envelope: parsing, rejection codes, limits and the headers kdelay writes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdelay.protocol import envelope
from kdelay.protocol.durations import (
    DEFAULT_LEVELS,
    Limits,
    duration_text,
    limits_for_retention,
    parse_duration_ms,
    parse_levels,
)
from kdelay.protocol.envelope import (
    CANCEL,
    DELAY_MS,
    DUE_MS,
    ERROR,
    ERROR_DETAIL,
    LEVEL,
    MAX_TIME_MS,
    ORIGIN,
    PARTITION,
    SCHEDULE_ID,
    TARGET,
    AnyHeaders,
    Cancel,
    ErrorCode,
    Headers,
    HeaderValue,
    Rejection,
    Schedule,
    cancel_headers,
    delivery_headers,
    origin_of,
    parse,
    rejection_headers,
    schedule_headers,
)
from kdelay.protocol.targets import TargetPolicy

TS = 1_700_000_000_000
LEVELS = parse_levels(DEFAULT_LEVELS)
UNLIMITED = Limits(LEVELS, None)


def hdrs(*pairs: tuple[str, HeaderValue]) -> Headers:
    """Headers from (name, value) pairs; str values are encoded as UTF-8."""
    return [(n, v.encode() if isinstance(v, str) else v) for n, v in pairs]


def parse_ok(headers: AnyHeaders, limits: Limits = UNLIMITED, ts: int = TS) -> Schedule:
    """Parse headers that must be a valid schedule."""
    result = parse(headers, ts, limits)
    assert isinstance(result, Schedule), result
    return result


def rejected(headers: AnyHeaders, limits: Limits = UNLIMITED, ts: int = TS) -> Rejection:
    """Parse headers that must be rejected."""
    result = parse(headers, ts, limits)
    assert isinstance(result, Rejection), result
    return result


# durations and level tables


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1500", 1500),
        ("1500ms", 1500),
        ("30s", 30_000),
        ("5m", 300_000),
        ("2h", 7_200_000),
        ("7d", 604_800_000),
        (" 1s ", 1000),
    ],
)
def test_parse_duration(text: str, expected: int) -> None:
    assert parse_duration_ms(text) == expected


@pytest.mark.parametrize(
    ("ms", "text"),
    [(3_600_000, "1h"), (90_000, "90s"), (1500, "1500ms"), (0, "0ms"), (86_400_000, "1d")],
)
def test_duration_text_uses_the_largest_exact_unit(ms: int, text: str) -> None:
    assert duration_text(ms) == text


@given(st.integers(min_value=0, max_value=10**15))
def test_duration_text_reads_back_as_the_same_duration(ms: int) -> None:
    assert parse_duration_ms(duration_text(ms)) == ms


@pytest.mark.parametrize("text", ["", "s", "1.5s", "-1s", "1w", "1S", "1 s", "1e3", "١٢"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration_ms(text)


def test_default_levels_are_rocketmqs() -> None:
    assert len(LEVELS) == 18
    assert LEVELS[:4] == (1_000, 5_000, 10_000, 30_000)
    assert LEVELS[-1] == 7_200_000


def test_parse_levels_accepts_commas_and_spaces() -> None:
    assert parse_levels("100ms, 1s,5s  1m") == (100, 1_000, 5_000, 60_000)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "at least one"),
        (" , ", "at least one"),
        ("5s 1s", "strictly increasing"),
        ("1s 1000ms", "strictly increasing"),
        ("0 1s", "positive"),
        ("1s 2x", "not a duration"),
    ],
)
def test_parse_levels_rejects(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_levels(spec)


def test_limits_validate() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Limits((), None)
    with pytest.raises(ValueError, match="must not be negative"):
        Limits(LEVELS, -1)


@pytest.mark.parametrize(
    ("retention_ms", "margin_ms", "expected"),
    [(None, 1000, None), (-1, 1000, None), (10_000, 1_000, 9_000), (1_000, 5_000, 0), (5, 5, 0)],
)
def test_limits_for_retention(
    retention_ms: int | None, margin_ms: int, expected: int | None
) -> None:
    limits = limits_for_retention(retention_ms, margin_ms, LEVELS)
    assert limits == Limits(LEVELS, expected)


def test_limits_for_retention_rejects_negatives() -> None:
    with pytest.raises(ValueError, match="margin"):
        limits_for_retention(10_000, -1, LEVELS)
    with pytest.raises(ValueError, match=r"retention\.ms"):
        limits_for_retention(-2, 0, LEVELS)


# valid schedules


def test_absolute_due_time() -> None:
    result = parse_ok(hdrs((TARGET, "orders"), (DUE_MS, str(TS + 60_000))))
    assert result == Schedule("orders", TS + 60_000, None, None)


def test_due_time_in_the_past_is_accepted() -> None:
    assert parse_ok(hdrs((TARGET, "t"), (DUE_MS, "0"))).due_ms == 0


def test_relative_delay_counts_from_the_record_timestamp() -> None:
    headers = hdrs((TARGET, "t"), (DELAY_MS, "5000"))
    assert parse_ok(headers, ts=TS).due_ms == TS + 5_000
    assert parse_ok(headers, ts=TS - 60_000).due_ms == TS - 55_000


@pytest.mark.parametrize(
    ("level", "delay_ms"),
    [("1", 1_000), ("2", 5_000), ("007", 180_000), ("18", 7_200_000)],
)
def test_level_counts_from_the_record_timestamp(level: str, delay_ms: int) -> None:
    assert parse_ok(hdrs((TARGET, "t"), (LEVEL, level))).due_ms == TS + delay_ms


@pytest.mark.parametrize("level", ["19", "1000", "9" * 40, "9" * 5000])
def test_level_above_the_top_is_clamped(level: str) -> None:
    assert parse_ok(hdrs((TARGET, "t"), (LEVEL, level))).due_ms == TS + 7_200_000


def test_custom_level_table() -> None:
    limits = Limits(parse_levels("100ms 1s"), None)
    for level, delay_ms in [("1", 100), ("2", 1_000), ("3", 1_000)]:
        assert parse_ok(hdrs((TARGET, "t"), (LEVEL, level)), limits).due_ms == TS + delay_ms


def test_partition_and_schedule_id() -> None:
    headers = hdrs((TARGET, "t"), (DUE_MS, "5"), (PARTITION, "3"), (SCHEDULE_ID, "ordre-é-42"))
    assert parse_ok(headers) == Schedule("t", 5, 3, "ordre-é-42")


def test_dict_headers_and_str_values_are_read() -> None:
    headers: dict[str, HeaderValue] = {
        TARGET: "t",
        DELAY_MS: "5",
        SCHEDULE_ID: "ordre-é",
        "user": b"x",
    }
    assert parse_ok(headers) == Schedule("t", TS + 5, None, "ordre-é")


def test_str_values_with_lone_surrogates_are_rejected_not_raised() -> None:
    result = rejected([(TARGET, "t"), (DUE_MS, "1"), (SCHEDULE_ID, "\ud800")])
    assert result.code is ErrorCode.BAD_HEADER


def test_other_headers_are_ignored() -> None:
    headers = hdrs(
        ("trace", "a"),
        ("trace", "b"),
        (ORIGIN, "kdelay.requests/0/1"),
        (ORIGIN, "kdelay.requests/0/2"),
        (ERROR, "bad-time"),
        (ERROR_DETAIL, None),
        ("kdelay-future-thing", b"\xff"),
        ("Kdelay-Target", "other"),
        (TARGET, "t"),
        (DELAY_MS, "1"),
    )
    assert parse_ok(headers) == Schedule("t", TS + 1, None, None)


# the retention bound


@pytest.mark.parametrize(
    ("name", "value"),
    [(DUE_MS, str(TS + 10_000)), (DELAY_MS, "10000"), (LEVEL, "3")],
)
def test_exactly_at_the_limit_is_accepted(name: str, value: str) -> None:
    limits = Limits(LEVELS, 10_000)
    assert parse_ok(hdrs((TARGET, "t"), (name, value)), limits).due_ms == TS + 10_000


@pytest.mark.parametrize(
    ("name", "value"),
    [(DUE_MS, str(TS + 10_001)), (DELAY_MS, "10001"), (LEVEL, "4")],
)
def test_one_ms_past_the_limit_is_rejected(name: str, value: str) -> None:
    result = rejected(hdrs((TARGET, "t"), (name, value)), Limits(LEVELS, 10_000))
    assert result.code is ErrorCode.DELAY_TOO_LONG
    assert "10000" in result.detail


def test_limit_is_measured_from_the_record_timestamp_not_now() -> None:
    headers = hdrs((TARGET, "t"), (DUE_MS, str(TS + 10_000)))
    assert parse_ok(headers, Limits(LEVELS, 10_000), ts=TS).due_ms == TS + 10_000
    assert rejected(headers, Limits(LEVELS, 10_000), ts=TS - 1).code is ErrorCode.DELAY_TOO_LONG


# rejections

T = (TARGET, "t")
D = (DUE_MS, "1")

MALFORMED: list[tuple[list[tuple[str, HeaderValue]], ErrorCode]] = [
    ([], ErrorCode.MISSING_TARGET),
    ([D], ErrorCode.MISSING_TARGET),
    ([(DELAY_MS, "abc")], ErrorCode.MISSING_TARGET),
    ([T], ErrorCode.MISSING_TIME),
    ([T, (PARTITION, "1")], ErrorCode.MISSING_TIME),
    ([T, D, (DELAY_MS, "1")], ErrorCode.CONFLICTING_TIME),
    ([T, (DELAY_MS, "1"), (LEVEL, "1")], ErrorCode.CONFLICTING_TIME),
    ([T, D, (DELAY_MS, "1"), (LEVEL, "1")], ErrorCode.CONFLICTING_TIME),
    ([T, (DUE_MS, "abc")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, "-5")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, "1.5")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, "1e3")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, " 5")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, "1_000")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, "")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, None)], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, "١٢")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, b"\xff")], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, str(MAX_TIME_MS + 1))], ErrorCode.BAD_TIME),
    ([T, (DUE_MS, "9" * 5000)], ErrorCode.BAD_TIME),
    ([T, (DELAY_MS, str(MAX_TIME_MS))], ErrorCode.BAD_TIME),
    ([T, (DELAY_MS, "-1")], ErrorCode.BAD_TIME),
    ([T, (LEVEL, "0")], ErrorCode.UNKNOWN_LEVEL),
    ([T, (LEVEL, "000")], ErrorCode.UNKNOWN_LEVEL),
    ([T, (LEVEL, "-1")], ErrorCode.UNKNOWN_LEVEL),
    ([T, (LEVEL, "1.5")], ErrorCode.UNKNOWN_LEVEL),
    ([T, (LEVEL, "one")], ErrorCode.UNKNOWN_LEVEL),
    ([T, (LEVEL, "")], ErrorCode.UNKNOWN_LEVEL),
    ([T, (LEVEL, None)], ErrorCode.UNKNOWN_LEVEL),
    ([T, D, (PARTITION, "-1")], ErrorCode.BAD_PARTITION),
    ([T, D, (PARTITION, "x")], ErrorCode.BAD_PARTITION),
    ([T, D, (PARTITION, "")], ErrorCode.BAD_PARTITION),
    ([T, D, (PARTITION, None)], ErrorCode.BAD_PARTITION),
    ([T, D, (PARTITION, "2147483648")], ErrorCode.BAD_PARTITION),
    ([(TARGET, ""), D], ErrorCode.BAD_HEADER),
    ([(TARGET, None), D], ErrorCode.BAD_HEADER),
    ([(TARGET, b"\xffx"), D], ErrorCode.BAD_HEADER),
    ([(TARGET, "tópico"), D], ErrorCode.BAD_HEADER),
    ([(TARGET, "two words"), D], ErrorCode.BAD_HEADER),
    ([(TARGET, ".."), D], ErrorCode.BAD_HEADER),
    ([(TARGET, "x" * 250), D], ErrorCode.BAD_HEADER),
    ([T, T, D], ErrorCode.BAD_HEADER),
    ([T, D, D], ErrorCode.BAD_HEADER),
    ([T, D, (SCHEDULE_ID, "a"), (SCHEDULE_ID, "a")], ErrorCode.BAD_HEADER),
    ([T, D, (SCHEDULE_ID, "")], ErrorCode.BAD_HEADER),
    ([T, D, (SCHEDULE_ID, None)], ErrorCode.BAD_HEADER),
    ([T, D, (SCHEDULE_ID, b"\xff")], ErrorCode.BAD_HEADER),
    ([(CANCEL, "")], ErrorCode.BAD_CANCEL),
    ([(CANCEL, None)], ErrorCode.BAD_CANCEL),
    ([(CANCEL, b"\xff\xfe")], ErrorCode.BAD_CANCEL),
    ([(CANCEL, "a"), T], ErrorCode.BAD_CANCEL),
    ([(CANCEL, "a"), D], ErrorCode.BAD_CANCEL),
    ([(CANCEL, "a"), (DELAY_MS, "1")], ErrorCode.BAD_CANCEL),
    ([(CANCEL, "a"), (LEVEL, "1")], ErrorCode.BAD_CANCEL),
    ([(CANCEL, "a"), (SCHEDULE_ID, "b")], ErrorCode.BAD_CANCEL),
    ([(CANCEL, "a"), (CANCEL, "a")], ErrorCode.BAD_HEADER),
]


@pytest.mark.parametrize(("pairs", "code"), MALFORMED)
def test_malformed_request(pairs: list[tuple[str, HeaderValue]], code: ErrorCode) -> None:
    result = rejected(hdrs(*pairs))
    assert result.code is code
    assert result.detail.isascii()
    assert len(result.detail) <= 200


def test_parse_without_headers_is_missing_target() -> None:
    assert rejected([]).code is rejected(None).code is ErrorCode.MISSING_TARGET


def test_relative_time_needs_a_record_timestamp() -> None:
    for name, value in [(DELAY_MS, "5"), (LEVEL, "1")]:
        result = rejected(hdrs(T, (name, value)), ts=-1)
        assert result.code is ErrorCode.BAD_TIME
        assert "no timestamp" in result.detail


def test_detail_names_the_header_and_value() -> None:
    detail = rejected(hdrs(T, (DUE_MS, "tomorrow"))).detail
    assert DUE_MS in detail
    assert "'tomorrow'" in detail


def test_detail_is_ascii_and_truncated() -> None:
    detail = rejected(hdrs((TARGET, "é" * 1000), D)).detail
    assert detail.isascii()
    assert len(detail) <= 200
    assert detail.startswith(f"header {TARGET} value ")


def test_error_codes_are_stable() -> None:
    assert {code.value for code in ErrorCode} == {
        "missing-target",
        "missing-time",
        "conflicting-time",
        "bad-time",
        "unknown-level",
        "delay-too-long",
        "bad-cancel",
        "bad-partition",
        "bad-header",
        "mismatch",
        "expired",
        "undeliverable",
        "forbidden-target",
        "target-not-allowed",
        "unknown-lane",
        "wrong-lane",
        "missing-lane",
        "bad-forward",
        "bad-reschedule",
    }


# cancels


@pytest.mark.parametrize(
    "pairs",
    [
        [(CANCEL, "order-7")],
        [(CANCEL, "order-7"), (SCHEDULE_ID, "order-7")],
        [("user", "x"), (CANCEL, "order-7"), (PARTITION, "2")],
    ],
)
def test_cancel(pairs: list[tuple[str, HeaderValue]]) -> None:
    assert parse(hdrs(*pairs), TS, UNLIMITED) == Cancel("order-7")


def test_cancel_headers() -> None:
    assert cancel_headers("order-7") == [(CANCEL, b"order-7")]
    assert parse(cancel_headers("ordre-é"), TS, UNLIMITED) == Cancel("ordre-é")
    with pytest.raises(ValueError, match="bad-cancel"):
        cancel_headers("")


# headers kdelay writes


def test_delivery_headers_keep_user_headers_in_order_and_strip_requests() -> None:
    headers = hdrs(
        ("a", "1"),
        (TARGET, "t"),
        ("b", None),
        (DUE_MS, "5"),
        ("a", "2"),
        (ORIGIN, "old/0/0"),
        ("kdelay-whatever", "x"),
    )
    assert delivery_headers(headers, "kdelay.requests/3/42", 1234) == [
        ("a", b"1"),
        ("b", None),
        ("a", b"2"),
        (ORIGIN, b"kdelay.requests/3/42"),
        (DUE_MS, b"1234"),
    ]


def test_delivery_headers_from_a_dict() -> None:
    headers: dict[str, HeaderValue] = {"a": "1", TARGET: b"t", "b": None}
    assert delivery_headers(headers, "r/0/1", 7) == [
        ("a", "1"),
        ("b", None),
        (ORIGIN, b"r/0/1"),
        (DUE_MS, b"7"),
    ]


def test_delivery_headers_without_headers() -> None:
    assert delivery_headers(None, "r/0/1", 7) == [(ORIGIN, b"r/0/1"), (DUE_MS, b"7")]


def test_delivery_headers_do_not_mutate_the_input() -> None:
    headers = hdrs(("a", "1"), T)
    delivery_headers(headers, "r/0/1", 7)
    assert headers == hdrs(("a", "1"), T)


def test_origin_of() -> None:
    assert origin_of("kdelay.requests", 3, 42) == "kdelay.requests/3/42"


def test_rejection_headers() -> None:
    rejection = Rejection(ErrorCode.BAD_TIME, "header kdelay-due-ms value 'x' is bad")
    assert rejection_headers(rejection) == [
        (ERROR, b"bad-time"),
        (ERROR_DETAIL, b"header kdelay-due-ms value 'x' is bad"),
    ]


def test_schedule_headers() -> None:
    assert schedule_headers("t", delay_ms=5, partition=1, schedule_id="id") == [
        (TARGET, b"t"),
        (DELAY_MS, b"5"),
        (PARTITION, b"1"),
        (SCHEDULE_ID, b"id"),
    ]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: schedule_headers("t"), "exactly one"),
        (lambda: schedule_headers("t", due_ms=1, delay_ms=1), "exactly one"),
        (lambda: schedule_headers("t", delay_ms=1, level=1), "exactly one"),
        (lambda: schedule_headers("t", due_ms=1, level=1), "exactly one"),
        (lambda: schedule_headers("", delay_ms=1), "bad-header"),
        (lambda: schedule_headers("bad topic", delay_ms=1), "bad-header"),
        (lambda: schedule_headers("t", delay_ms=-1), "bad-time"),
        (lambda: schedule_headers("t", due_ms=-1), "bad-time"),
        (lambda: schedule_headers("t", level=0), "unknown-level"),
        (lambda: schedule_headers("t", delay_ms=1, partition=-1), "bad-partition"),
        (lambda: schedule_headers("t", delay_ms=1, schedule_id=""), "bad-header"),
    ],
)
def test_schedule_headers_validate(build: Callable[[], Headers], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


# properties

topics = st.from_regex(r"[A-Za-z0-9._-]{1,249}", fullmatch=True).filter(
    lambda t: t not in {".", ".."}
)
ids = st.none() | st.text(st.characters(exclude_categories=["Cs"]), min_size=1)
partitions = st.none() | st.integers(0, 2**31 - 1)
level_tables = st.lists(st.integers(1, 2**40), min_size=1, max_size=20, unique=True).map(
    lambda xs: tuple(sorted(xs))
)
limits = st.builds(Limits, level_tables, st.none() | st.integers(0, 2**64))
names = st.sampled_from(
    [TARGET, DUE_MS, DELAY_MS, LEVEL, PARTITION, SCHEDULE_ID, CANCEL, ORIGIN, ERROR, "x"]
)
values = (
    st.none()
    | st.binary(max_size=40)
    | st.text(max_size=20)
    | st.from_regex(rb"-?[0-9]{1,25}", fullmatch=True)
    | st.sampled_from([b"", b"t", b"0", b"1", b"19", b"1000", b"..", b"a b"])
)
header_names = names | st.text(max_size=20)
header_lists = st.lists(st.tuples(header_names, values), max_size=12)
header_dicts = st.dictionaries(header_names, values, max_size=8)


@settings(max_examples=300)
@given(st.none() | header_lists | header_dicts, st.integers(-(2**65), 2**65), limits)
def test_parse_never_raises(headers: AnyHeaders, timestamp_ms: int, limits: Limits) -> None:
    result = parse(headers, timestamp_ms, limits)
    if isinstance(result, Rejection):
        assert isinstance(result.code, ErrorCode)
        assert result.detail.isascii()
        assert 0 < len(result.detail) <= 200
    elif isinstance(result, Schedule):
        assert 0 <= result.due_ms <= MAX_TIME_MS
        if limits.max_due_after_ms is not None:
            assert result.due_ms <= timestamp_ms + limits.max_due_after_ms
    else:
        assert isinstance(result, Cancel)
        assert result.schedule_id


@given(
    topics,
    st.sampled_from(["due_ms", "delay_ms", "level"]),
    st.integers(0, 2**40),
    partitions,
    ids,
    st.integers(0, 2**41),
)
def test_schedule_headers_round_trip(
    target: str, kind: str, amount: int, partition: int | None, sid: str | None, ts: int
) -> None:
    level = amount % 30 + 1
    headers = schedule_headers(
        target,
        due_ms=amount if kind == "due_ms" else None,
        delay_ms=amount if kind == "delay_ms" else None,
        level=level if kind == "level" else None,
        partition=partition,
        schedule_id=sid,
    )
    if kind == "due_ms":
        due_ms = amount
    elif kind == "delay_ms":
        due_ms = ts + amount
    else:
        due_ms = ts + LEVELS[min(level, len(LEVELS)) - 1]
    assert parse(headers, ts, UNLIMITED) == Schedule(target, due_ms, partition, sid)


def test_module_exports_header_prefix() -> None:
    assert envelope.PREFIX == "kdelay-"
    assert all(
        name.startswith(envelope.PREFIX)
        for name in (TARGET, DUE_MS, DELAY_MS, LEVEL, PARTITION, SCHEDULE_ID, CANCEL)
    )


def test_routing_splits_an_accepted_requests_headers_in_one_pass() -> None:
    headers: list[tuple[str, str | bytes | None]] = [
        ("trace", b"1"), (envelope.TARGET, b"orders"), (envelope.DUE_MS, b"5"),
        (envelope.PARTITION, b"2"), ("trace", None), (envelope.SCHEDULE_ID, b"o-1")]
    found = envelope.routing(headers)
    assert found == envelope.Routing("orders", 2, "o-1", [("trace", b"1"), ("trace", None)])


@pytest.mark.parametrize("headers", [
    [(envelope.DUE_MS, b"5")],
    [(envelope.TARGET, None)],
    [(envelope.TARGET, b"\xff")],
    [(envelope.TARGET, b"orders"), (envelope.PARTITION, b"two")],
])
def test_routing_of_unreadable_headers_is_none(headers: list[tuple[str, bytes | None]]) -> None:
    assert envelope.routing(headers) is None


# the fast path for well-formed requests agrees with the general path

near_numbers = (
    st.from_regex(rb"[0-9]{1,22}", fullmatch=True)
    | st.integers(0, 2**64).map(lambda n: str(n).encode())
    | st.sampled_from([b"", b"0", b"00", b"1", b"-1", b"+1", b" 1", b"1 ", b"1_0", b"\xd9\xa1"])
)
near_values = (
    near_numbers
    | topics.map(str.encode)
    | st.sampled_from([b".", b"..", b"a b", b"\xff", None, "1", "t"])
)
request_names = st.sampled_from([TARGET, DUE_MS, DELAY_MS, LEVEL, PARTITION, SCHEDULE_ID, CANCEL,
                                 envelope.LANE])
lanes = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True).map(str.encode)


@st.composite
def near_requests(draw: st.DrawFn) -> Headers:
    """Requests that are mostly well-formed: a target, a time, maybe a partition and an id,
    user headers, and now and then one header too many or one value slightly off."""
    headers: Headers = [
        (TARGET, draw(topics.map(str.encode) | near_values)),
        (draw(st.sampled_from([DUE_MS, DELAY_MS, LEVEL])), draw(near_numbers)),
    ]
    if draw(st.booleans()):
        headers.append((PARTITION, draw(near_numbers)))
    if draw(st.booleans()):
        headers.append((SCHEDULE_ID, draw(ids.map(lambda s: s and s.encode()) | near_values)))
    if draw(st.booleans()):
        headers.append((envelope.LANE, draw(lanes | near_values | st.just(b"a" * 65))))
    headers += draw(st.lists(st.tuples(request_names | header_names, near_values), max_size=2))
    return list(draw(st.permutations(headers)))


@settings(max_examples=1_000)
@given(near_requests() | header_lists, st.integers(-(2**64), 2**64) | st.just(TS), limits)
def test_fast_path_agrees_with_the_general_path(
    headers: Headers, timestamp_ms: int, limits: Limits
) -> None:
    general = envelope.parse_general(headers, timestamp_ms, limits)
    try:
        fast = envelope.schedule_fields(headers, timestamp_ms, limits)
    except envelope.Uncommon:
        assert parse(headers, timestamp_ms, limits) == general
        return
    assert Schedule(*fast) == general
    assert type(general) is Schedule
    parsed = parse(headers, timestamp_ms, limits)
    assert (parsed, type(parsed)) == (general, Schedule)


@pytest.mark.parametrize(
    "headers",
    [
        schedule_headers("orders", due_ms=TS),
        schedule_headers("orders", delay_ms=5, partition=2, schedule_id="ordre-é"),
        schedule_headers("orders", level=40),
        schedule_headers("dev1.orders", delay_ms=5, lane="dev1"),
        [("trace", b"x"), *schedule_headers("orders", due_ms=7), (ORIGIN, b"a/0/1")],
    ],
)
def test_fast_path_takes_the_usual_requests(headers: Headers) -> None:
    fields = envelope.schedule_fields(headers, TS, UNLIMITED)
    assert Schedule(*fields) == parse(headers, TS, UNLIMITED)


@pytest.mark.parametrize(("pairs", "code"), MALFORMED)
def test_fast_path_leaves_every_malformed_request_to_the_general_path(
    pairs: list[tuple[str, HeaderValue]], code: ErrorCode
) -> None:
    with pytest.raises(envelope.Uncommon):
        envelope.schedule_fields(hdrs(*pairs), TS, UNLIMITED)


def test_fast_path_takes_headers_as_a_consumed_record_has_them() -> None:
    """A list; as a mapping, or none at all, a request goes the general way."""
    headers = schedule_headers("orders", due_ms=TS)
    with pytest.raises(envelope.Uncommon):
        envelope.schedule_fields(dict(headers), TS, UNLIMITED)
    with pytest.raises(envelope.Uncommon):
        envelope.schedule_fields(None, TS, UNLIMITED)
    assert parse(dict(headers), TS, UNLIMITED) == Schedule(*envelope.schedule_fields(
        headers, TS, UNLIMITED))


def test_target_policy_refuses_kdelay_and_kafka_internal_topics() -> None:
    policy = TargetPolicy(("kdelay.requests", "kdelay.changelog"), ())
    for topic in ("kdelay.requests", "kdelay.changelog", "__consumer_offsets"):
        refused = policy.refusal(topic)
        assert refused is not None
        assert refused.code is ErrorCode.FORBIDDEN_TARGET
        assert topic in refused.detail
    assert policy.refusal("orders") is None
    assert policy.refusal("kdelay.requests2") is None


def test_target_policy_allow_list_of_names_globs_and_regexes() -> None:
    policy = TargetPolicy(("kdelay.changelog",), ("orders", "billing.*", "re:pay-[0-9]+"))
    assert [policy.refusal(t) for t in ("orders", "billing.eu", "pay-42")] == [None] * 3
    for topic in ("orders2", "Billing.eu", "pay-42x", "pay-", "xorders"):
        refused = policy.refusal(topic)
        assert refused is not None
        assert refused.code is ErrorCode.TARGET_NOT_ALLOWED, topic
    forbidden = TargetPolicy(("kdelay.changelog",), ("kdelay.*",)).refusal("kdelay.changelog")
    assert forbidden is not None
    assert forbidden.code is ErrorCode.FORBIDDEN_TARGET


def test_target_policy_rejects_a_bad_regex() -> None:
    with pytest.raises(ValueError, match="not a regular expression"):
        TargetPolicy((), ("re:(",))
