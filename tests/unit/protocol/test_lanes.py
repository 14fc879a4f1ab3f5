"""Lanes: the kdelay-lane header, the lane table, and the policy that keeps lanes apart."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kdelay.client import DelayProducer, request_headers
from kdelay.plumbing.settings import Settings, SettingsError, build_settings
from kdelay.protocol import envelope
from kdelay.protocol.durations import Limits
from kdelay.protocol.envelope import ErrorCode, Headers, Rejection, Schedule, parse
from kdelay.protocol.targets import Lanes, TargetPolicy

LIMITS = Limits((1_000,), None)
LANES = Lanes({"dev1": "dev1.", "dev2": "dev2.", "staging": "stg-"})
OWN = ("kdelay.requests", "kdelay.changelog", "kdelay.dlq")


def code(policy: TargetPolicy, target: str, lane: str | None) -> ErrorCode | None:
    refused = policy.refusal(target, lane)
    return None if refused is None else refused.code


def test_lanes_parse_a_spec_and_say_who_owns_a_topic() -> None:
    lanes = Lanes.parse(" dev1 = dev1. , dev2=dev2.,,staging=stg-")
    assert lanes == LANES
    assert list(lanes) == ["dev1", "dev2", "staging"]
    assert lanes.spec() == "dev1=dev1.,dev2=dev2.,staging=stg-"
    assert Lanes.parse(lanes.spec()) == lanes
    assert [lanes.owner(t) for t in ("dev1.orders", "dev2.x", "stg-a", "orders", "dev1")] == [
        "dev1", "dev2", "staging", None, None]
    assert "dev1" in lanes
    assert "prod" not in lanes
    assert not Lanes()
    assert not Lanes.parse("")


@pytest.mark.parametrize(("spec", "message"), [
    ("dev1", "not lane=prefix"),
    ("dev1=dev1.,dev1=other.", "given twice"),
    ("-dev=dev.", "not a lane name"),
    ("dev 1=dev.", "not a lane name"),
    ("dev1=", "not a topic-name prefix"),
    ("dev1=dev/1", "not a topic-name prefix"),
    ("dev=dev.,deva=dev.a.", "overlap"),
    ("a=same.,b=same.", "overlap"),
])
def test_lanes_refuse_bad_names_prefixes_and_overlaps(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Lanes.parse(spec)


def test_a_request_of_a_lane_may_target_only_its_own_topics() -> None:
    policy = TargetPolicy(OWN, (), LANES)
    assert code(policy, "dev1.orders", "dev1") is None
    assert code(policy, "stg-orders", "staging") is None
    assert code(policy, "dev2.orders", "dev1") is ErrorCode.WRONG_LANE
    assert code(policy, "orders", "dev1") is ErrorCode.WRONG_LANE
    refused = policy.refusal("dev2.orders", "dev1")
    assert refused is not None
    assert "lane dev2" in refused.detail
    assert "dev1." in refused.detail


def test_a_request_without_a_lane_may_target_only_topics_no_lane_owns() -> None:
    policy = TargetPolicy(OWN, (), LANES)
    assert code(policy, "orders", None) is None
    assert code(policy, "dev1.orders", None) is ErrorCode.MISSING_LANE
    refused = policy.refusal("stg-a", None)
    assert refused is not None
    assert f"{envelope.LANE}: staging" in refused.detail


def test_an_unknown_lane_is_refused_and_never_cached() -> None:
    policy = TargetPolicy(OWN, (), LANES)
    for n in range(5_000):
        assert code(policy, "dev1.orders", f"prod{n}") is ErrorCode.UNKNOWN_LANE
    assert set(policy._known) == {None, "dev1", "dev2", "staging"}
    without = TargetPolicy(OWN, ())
    refused = without.refusal("orders", "dev1")
    assert refused is not None
    assert refused.code is ErrorCode.UNKNOWN_LANE
    assert "without --lanes" in refused.detail
    assert without.refusal("orders") is None


def test_kdelay_topics_stay_forbidden_and_the_allow_list_still_applies_in_a_lane() -> None:
    policy = TargetPolicy((*OWN, "dev1.own"), ("dev1.orders*", "plain"), LANES)
    assert code(policy, "dev1.own", "dev1") is ErrorCode.FORBIDDEN_TARGET
    assert code(policy, "__consumer_offsets", "dev1") is ErrorCode.FORBIDDEN_TARGET
    assert code(policy, "dev1.orders-eu", "dev1") is None
    assert code(policy, "dev1.payroll", "dev1") is ErrorCode.TARGET_NOT_ALLOWED
    assert code(policy, "dev2.orders", "dev1") is ErrorCode.WRONG_LANE
    assert code(policy, "plain", None) is None


def test_the_answers_are_the_same_from_the_cache() -> None:
    policy = TargetPolicy(OWN, (), LANES)
    cases = [("dev1.a", "dev1"), ("dev1.a", "dev2"), ("dev1.a", None), ("x", None),
             ("x", "dev1")]
    first = [policy.refusal(t, lane) for t, lane in cases]
    assert [policy.refusal(t, lane) for t, lane in cases] == first
    assert [r is None for r in first] == [True, False, False, True, False]


def test_the_envelope_reads_the_lane_on_both_paths() -> None:
    headers = envelope.schedule_headers("dev1.orders", due_ms=5, lane="dev1")
    assert headers[-1] == (envelope.LANE, b"dev1")
    expected = Schedule("dev1.orders", 5, None, None, "dev1")
    assert envelope._parse_common(headers, 0, LIMITS) == expected
    assert envelope.parse_general(headers, 0, LIMITS) == expected
    assert parse(envelope.schedule_headers("orders", due_ms=5), 0, LIMITS) == Schedule(
        "orders", 5, None, None, None)
    str_valued = [(envelope.TARGET, "dev1.orders"), (envelope.DUE_MS, "5"),
                  (envelope.LANE, "dev1")]
    assert parse(str_valued, 0, LIMITS) == expected


@pytest.mark.parametrize("value", [b"", b"-dev", b"dev 1", b"\xff", None, b"a" * 65])
def test_a_malformed_lane_header_is_a_bad_header(value: bytes | None) -> None:
    headers = [(envelope.TARGET, b"dev1.orders"), (envelope.DUE_MS, b"5"), (envelope.LANE, value)]
    refused = parse(headers, 0, LIMITS)
    assert isinstance(refused, Rejection)
    assert refused.code is ErrorCode.BAD_HEADER
    assert envelope.LANE in refused.detail


def test_a_lane_header_given_twice_is_a_bad_header() -> None:
    headers = [*envelope.schedule_headers("dev1.orders", due_ms=5, lane="dev1"),
               (envelope.LANE, b"dev2")]
    refused = parse(headers, 0, LIMITS)
    assert isinstance(refused, Rejection)
    assert refused.code is ErrorCode.BAD_HEADER


def test_a_cancel_and_a_reschedule_name_their_lane() -> None:
    headers = [*envelope.cancel_headers("o-1"), (envelope.LANE, b"dev1")]
    assert parse(headers, 0, LIMITS) == envelope.Cancel("o-1", "dev1")
    assert envelope.cancel_headers("o-1", "dev1") == headers
    assert parse(envelope.cancel_headers("o-1"), 0, LIMITS) == envelope.Cancel("o-1")
    moved = envelope.reschedule_headers("o-1", due_ms=9, lane="dev1")
    assert parse(moved, 0, LIMITS) == envelope.Reschedule("o-1", 9, "dev1")
    assert parse(envelope.reschedule_headers("o-1", due_ms=9), 0, LIMITS) == \
        envelope.Reschedule("o-1", 9)


@pytest.mark.parametrize("build", [
    lambda lane: [*envelope.cancel_headers("o-1"), (envelope.LANE, lane)],
    lambda lane: [*envelope.reschedule_headers("o-1", due_ms=9), (envelope.LANE, lane)],
])
def test_a_cancel_or_reschedule_with_a_malformed_lane_is_a_bad_header(
        build: Callable[[bytes], Headers]) -> None:
    refused = parse(build(b"a b"), 0, LIMITS)
    assert isinstance(refused, Rejection)
    assert refused.code is ErrorCode.BAD_HEADER


def test_routing_carries_the_lane() -> None:
    headers = envelope.schedule_headers("dev1.orders", due_ms=5, lane="dev1")
    found = envelope.routing([("trace", b"1"), *headers])
    assert found is not None
    assert (found.target, found.lane, found.user) == ("dev1.orders", "dev1", [("trace", b"1")])
    plain = envelope.routing(envelope.schedule_headers("orders", due_ms=5))
    assert plain is not None
    assert plain.lane is None


def test_settings_read_lanes_from_a_string_into_the_target_policy() -> None:
    settings = build_settings(lanes="dev1=dev1.,dev2=dev2.")
    assert settings.lanes == Lanes({"dev1": "dev1.", "dev2": "dev2."})
    assert Settings().lanes == Lanes()
    policy = settings.target_policy()
    assert policy.refusal("dev1.a", "dev1") is None
    refused = policy.refusal("dev2.a", "dev1")
    assert refused is not None
    assert refused.code is ErrorCode.WRONG_LANE


def test_bad_lanes_are_an_invalid_setting() -> None:
    with pytest.raises(SettingsError, match=r"lanes 'dev=dev\.,x=dev\.x': lanes dev") as raised:
        build_settings(lanes="dev=dev.,x=dev.x")
    assert raised.value.code == "invalid-setting"


def test_the_client_sends_its_lane_and_refuses_a_bad_one() -> None:
    headers = request_headers("dev1.orders", {"trace": "t"}, delay=10, lane="dev1")
    assert headers == [("trace", b"t"), (envelope.TARGET, b"dev1.orders"),
                       (envelope.DELAY_MS, b"10"), (envelope.LANE, b"dev1")]
    with pytest.raises(ValueError, match="lane"):
        request_headers("dev1.orders", None, delay=10, lane="dev 1")
    with pytest.raises(ValueError, match="not a lane name"):
        DelayProducer({"bootstrap.servers": "127.0.0.1:1"}, lane="-x")
    assert DelayProducer({"bootstrap.servers": "127.0.0.1:1"}, lane="dev1").lane == "dev1"
