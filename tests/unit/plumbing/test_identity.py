"""The ids an instance presents to Kafka: stable across restarts, distinct per instance."""

from __future__ import annotations

from pathlib import Path

from kdelay.engine.factory import INTAKE_FETCH_BACKOFF_MS, membership, prefetch
from kdelay.plumbing.identity import derive
from kdelay.plumbing.settings import Settings


def test_the_same_host_and_state_dir_give_the_same_ids_every_time(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "state")
    assert derive(settings, "node-1") == derive(Settings(state_dir=tmp_path / "state"), "node-1")


def test_containers_of_one_image_get_distinct_ids() -> None:
    settings = Settings(state_dir=Path("/state"))
    a, b = derive(settings, "3f2a9c1d0b7e"), derive(settings, "9c1d0b7e3f2a")
    assert a.member_id != b.member_id
    assert a.transactional_id != b.transactional_id


def test_two_state_dirs_on_one_host_get_distinct_ids(tmp_path: Path) -> None:
    a = derive(Settings(state_dir=tmp_path / "a"), "node-1")
    b = derive(Settings(state_dir=tmp_path / "b"), "node-1")
    assert a.member_id != b.member_id
    assert a.transactional_id != b.transactional_id


def test_a_relative_state_dir_counts_by_its_absolute_path() -> None:
    relative = derive(Settings(state_dir=Path("state")), "node-1")
    absolute = derive(Settings(state_dir=Path("state").resolve()), "node-1")
    assert relative == absolute


def test_the_member_id_names_the_host_readably() -> None:
    me = derive(Settings(state_dir=Path("/state")), "kdelay_7 (prod)")
    assert me.member_id.startswith("kdelay_7-prod-")
    assert me.transactional_id == f"kdelay-kdelay-{me.member_id}"


def test_an_explicit_instance_id_gives_both_ids() -> None:
    me = derive(Settings(instance_id="east-1", group_id="orders"), "anything")
    assert me.member_id == "east-1"
    assert me.transactional_id == "kdelay-orders-east-1"


def test_an_explicit_transactional_id_wins_for_transactions_only() -> None:
    me = derive(Settings(instance_id="east-1", transactional_id="tx-7"), "anything")
    assert (me.member_id, me.transactional_id) == ("east-1", "tx-7")


def test_membership_is_static_with_a_short_session_and_frequent_heartbeats() -> None:
    me = derive(Settings(instance_id="east-1"), "h")
    assert membership(me, 10_000, given={}) == {
        "group.instance.id": "east-1", "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 1_000}
    assert membership(me, 3_000, given={})["heartbeat.interval.ms"] == 300


def test_membership_leaves_what_the_kafka_config_sets_to_it() -> None:
    me = derive(Settings(instance_id="east-1"), "h")
    chosen = membership(me, 10_000, given={"session.timeout.ms": "6000"})
    assert "session.timeout.ms" not in chosen
    assert chosen["group.instance.id"] == "east-1"


def test_intake_fetches_again_soon_after_a_full_queue_unless_the_kafka_config_says() -> None:
    assert prefetch(given={}) == {"fetch.queue.backoff.ms": INTAKE_FETCH_BACKOFF_MS}
    assert INTAKE_FETCH_BACKOFF_MS < 1_000, "librdkafka's default starves a backlog's intake"
    assert prefetch(given={"fetch.queue.backoff.ms": "500"}) == {}
