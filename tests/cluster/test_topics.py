"""kdelay's topics on a three-node cluster: what ``topics create`` picks, what
``run --check`` warns about."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

# confluent_kafka.admin re-exports ConfigResource without listing it, which strict mypy rejects.
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from tests.e2e.conftest import clean_environment, run_cli

pytestmark = pytest.mark.kafka


def environment(bootstrap: str, suffix: str, state: Path) -> dict[str, str]:
    return clean_environment(
        KDELAY_BOOTSTRAP_SERVERS=bootstrap, KDELAY_REQUESTS_TOPIC=f"ct.req.{suffix}",
        KDELAY_CHANGELOG_TOPIC=f"ct.chg.{suffix}", KDELAY_DLQ_TOPIC=f"ct.dlq.{suffix}",
        KDELAY_OUTCOMES_TOPIC=f"ct.out.{suffix}", KDELAY_STATE_DIR=str(state))


def test_topics_get_three_copies_two_in_sync_and_the_choice_is_said(
        cluster_bootstrap: str, tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:8]
    env = environment(cluster_bootstrap, suffix, tmp_path)
    created = run_cli(env, "topics", "create", "--partitions", "2")
    assert created.returncode == 0, created.stderr
    assert created.stdout.splitlines()[-1] == (
        "replication: factor 3 and min.insync.replicas=2 for new topics "
        "(chosen for a cluster of 3 brokers)")
    admin = AdminClient({"bootstrap.servers": cluster_bootstrap})
    topics = [f"ct.{role}.{suffix}" for role in ("req", "chg", "dlq", "out")]
    metadata = admin.list_topics(timeout=30)
    for topic in topics:
        assert {len(p.replicas) for p in metadata.topics[topic].partitions.values()} == {3}
    resources = [ConfigResource("topic", t) for t in topics]
    for future in admin.describe_configs(resources).values():
        assert future.result(timeout=30)["min.insync.replicas"].value == "2"
    checked = run_cli(env, "run", "--check")
    assert checked.returncode == 0, checked.stderr
    assert "replication factor" not in checked.stderr


def test_run_check_warns_about_topics_with_one_copy(cluster_bootstrap: str,
                                                     tmp_path: Path) -> None:
    env = environment(cluster_bootstrap, uuid.uuid4().hex[:8], tmp_path)
    created = run_cli(env, "topics", "create", "--partitions", "1",
                      "--replication-factor", "1")
    assert created.returncode == 0, created.stderr
    assert "factor 1 for new topics (as given)" in created.stdout
    checked = run_cli(env, "run", "--check")
    assert checked.returncode == 0, checked.stderr
    warnings = [line for line in checked.stderr.splitlines() if "replication factor 1" in line]
    assert len(warnings) == 4, checked.stderr
    assert "on a cluster of 3 brokers" in warnings[0]
