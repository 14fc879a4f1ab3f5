"""How ``kdelay topics create`` replicates new topics, and what ``kdelay run`` warns about."""

from __future__ import annotations

import pytest

from kdelay.plumbing.topics import (
    AUTO_REPLICATION,
    Replication,
    _Existing,
    replication,
    replication_warnings,
)


@pytest.mark.parametrize(("brokers", "factor", "min_insync"), [
    (1, 1, None), (2, 2, None), (3, 3, 2), (6, 3, 2)])
def test_the_factor_is_chosen_from_the_cluster(brokers: int, factor: int,
                                               min_insync: int | None) -> None:
    chosen = replication(AUTO_REPLICATION, brokers)
    assert (chosen.factor, chosen.min_insync) == (factor, min_insync)
    assert f"a cluster of {brokers} broker" in chosen.line()


def test_a_given_factor_is_kept_and_three_copies_get_two_in_sync() -> None:
    assert replication(1, 3) == Replication(1, None, "as given")
    assert replication(5, 6) == Replication(5, 2, "as given")
    assert replication(-1, 3).line() == (
        "replication: factor the broker's default for new topics (as given)")


def test_the_report_line_names_the_factor_and_the_isr() -> None:
    assert replication(AUTO_REPLICATION, 3).line() == (
        "replication: factor 3 and min.insync.replicas=2 for new topics "
        "(chosen for a cluster of 3 brokers)")


def test_a_topic_with_fewer_copies_than_the_cluster_could_hold_is_named() -> None:
    existing = {"req": _Existing(3, {}, 1), "chg": _Existing(3, {}, 3),
                "dlq": _Existing(1, {}, 2)}
    warnings = replication_warnings(existing, 3)
    assert [w.split()[1] for w in warnings] == ["req", "dlq"]
    assert "replication factor 1 on a cluster of 3 brokers" in warnings[0]
    assert "raise it to 3" in warnings[0]


def test_a_single_broker_warns_about_nothing() -> None:
    assert replication_warnings({"req": _Existing(3, {}, 1)}, 1) == []
