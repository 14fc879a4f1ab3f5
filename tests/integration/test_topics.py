"""Topic layout against a real broker: ``topics create`` and the service's layout check."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

# confluent_kafka.admin re-exports these without listing them, which strict mypy rejects.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.plumbing.settings import Settings
from kdelay.plumbing.topics import Layout, LayoutError, check_layout, create_topics, retention_ms
from tests.conftest import TopicFactory, wait_visible

pytestmark = pytest.mark.kafka

DAY_MS = 86_400_000
TIMEOUT_S = 30.0


def describe(admin: AdminClient, topic: str) -> tuple[int, dict[str, str]]:
    """A topic's partition count and configuration, read straight from the broker."""
    partitions = len(admin.list_topics(topic, timeout=TIMEOUT_S).topics[topic].partitions)
    resource = ConfigResource(ResourceType.TOPIC, topic)
    entries = admin.describe_configs([resource])[resource].result(timeout=TIMEOUT_S)
    return partitions, {key: str(entry.value) for key, entry in entries.items()}


def create(admin: AdminClient, topic: str, partitions: int, config: dict[str, str]) -> None:
    """Create one topic with ``config``."""
    futures = admin.create_topics([NewTopic(topic, partitions, 1, config=config)])
    futures[topic].result(timeout=TIMEOUT_S)
    wait_visible(admin, topic, partitions)


@pytest.fixture
def fresh(admin: AdminClient, bootstrap: str) -> Iterator[Settings]:
    """Settings naming five topics that do not exist yet; whichever exist are deleted after."""
    suffix = uuid.uuid4().hex[:12]
    settings = Settings(bootstrap_servers=bootstrap, requests_topic=f"req-{suffix}",
                        changelog_topic=f"chg-{suffix}", dlq_topic=f"dlq-{suffix}",
                        outcomes_topic=f"out-{suffix}", controls_topic=f"ctl-{suffix}",
                        status_topic=f"sts-{suffix}")
    yield settings
    names = [settings.requests_topic, settings.changelog_topic, settings.dlq_topic,
             settings.outcomes_topic, settings.controls_topic, settings.status_topic]
    existing = [name for name in names if name in admin.list_topics(timeout=TIMEOUT_S).topics]
    if existing:
        for future in admin.delete_topics(existing).values():
            future.result(timeout=TIMEOUT_S)


def settings_for(
    bootstrap: str, topic_factory: TopicFactory, *,
    requests: tuple[int, dict[str, str]] | None = (3, {"cleanup.policy": "delete"}),
    changelog: tuple[int, dict[str, str]] | None = (3, {"cleanup.policy": "compact"}),
    dlq: tuple[int, dict[str, str]] | None = (1, {"cleanup.policy": "delete"}),
    outcomes: tuple[int, dict[str, str]] | None = None,
) -> Settings:
    """Settings over topics made by ``topic_factory``; ``None`` leaves that topic missing."""

    def made(prefix: str, layout: tuple[int, dict[str, str]] | None) -> str:
        if layout is None:
            return f"{prefix}-missing-{uuid.uuid4().hex[:12]}"
        return topic_factory(prefix, layout[0], layout[1])

    return Settings(bootstrap_servers=bootstrap, requests_topic=made("req", requests),
                    changelog_topic=made("chg", changelog), dlq_topic=made("dlq", dlq),
                    outcomes_topic=made("out", outcomes),
                    status_topic=f"sts-missing-{uuid.uuid4().hex[:12]}")


# --- topics create ---------------------------------------------------------------------


def test_topics_create_command_creates_six_topics_then_is_idempotent(
    fresh: Settings, admin: AdminClient
) -> None:
    args = ["topics", "create", "--partitions", "3", "--retention-ms", str(2 * DAY_MS),
            "--bootstrap-servers", fresh.bootstrap_servers,
            "--requests-topic", fresh.requests_topic,
            "--changelog-topic", fresh.changelog_topic, "--dlq-topic", fresh.dlq_topic,
            "--outcomes-topic", fresh.outcomes_topic, "--controls-topic", fresh.controls_topic,
            "--status-topic", fresh.status_topic]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert [line.split()[0] for line in first.stdout.splitlines()] == ["created"] * 6 + [
        "replication:"]
    assert first.stdout.splitlines()[-1] == (
        "replication: factor 1 for new topics (chosen for a cluster of 1 broker)")

    requests = describe(admin, fresh.requests_topic)
    changelog = describe(admin, fresh.changelog_topic)
    dlq = describe(admin, fresh.dlq_topic)
    assert (requests[0], changelog[0], dlq[0]) == (3, 3, 3)
    assert requests[1]["cleanup.policy"] == "delete"
    assert requests[1]["retention.ms"] == str(2 * DAY_MS)
    assert requests[1]["retention.bytes"] == "-1"
    assert changelog[1]["cleanup.policy"] == "compact"
    assert changelog[1]["min.compaction.lag.ms"] == "0"
    assert dlq[1]["cleanup.policy"] == "delete"
    outcomes = describe(admin, fresh.outcomes_topic)
    assert outcomes[0] == 3
    assert outcomes[1]["cleanup.policy"] == "compact,delete"
    assert outcomes[1]["retention.ms"] == str(2 * DAY_MS), "the id window: requests' retention"
    controls = describe(admin, fresh.controls_topic)
    assert controls[0] == 1
    assert controls[1]["cleanup.policy"] == "compact"
    status = describe(admin, fresh.status_topic)
    assert status[0] == 1
    assert status[1]["cleanup.policy"] == "compact"

    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0, second.output
    assert [line.split()[0] for line in second.stdout.splitlines()] == ["exists"] * 6 + [
        "replication:"]
    assert changelog[1]["message.timestamp.type"] == "LogAppendTime"
    assert check_layout(admin, fresh) == Layout(partitions=3, retention_ms=2 * DAY_MS,
                                                broker_time=True, outcomes=3, status=True)


def test_create_topics_creates_only_what_is_missing(fresh: Settings, admin: AdminClient) -> None:
    create(admin, fresh.requests_topic, 2, {"cleanup.policy": "delete", "retention.ms": "-1"})
    lines = create_topics(admin, fresh, partitions=2, replication_factor=1, retention_ms=DAY_MS)
    assert [line.split()[:2] for line in lines] == [
        ["exists", fresh.requests_topic], ["created", fresh.changelog_topic],
        ["created", fresh.dlq_topic], ["created", fresh.outcomes_topic],
        ["created", fresh.controls_topic], ["created", fresh.status_topic],
        ["replication:", "factor"],
    ]
    wait_visible(admin, fresh.changelog_topic, 2)  # metadata of a new topic can lag a moment
    assert describe(admin, fresh.changelog_topic)[0] == 2
    assert describe(admin, fresh.requests_topic)[1]["retention.ms"] == "-1"  # left alone


def test_create_topics_refuses_a_partition_mismatch_and_creates_nothing(
    fresh: Settings, admin: AdminClient
) -> None:
    create(admin, fresh.requests_topic, 2, {"cleanup.policy": "delete"})
    with pytest.raises(LayoutError, match="2 partitions, 3 requested") as raised:
        create_topics(admin, fresh, partitions=3, replication_factor=1, retention_ms=DAY_MS)
    assert raised.value.code == "requests-mismatch"
    assert "--partitions 2" in str(raised.value)
    assert fresh.changelog_topic not in admin.list_topics(timeout=TIMEOUT_S).topics


def test_create_topics_refuses_a_changelog_that_is_not_compacted(
    fresh: Settings, admin: AdminClient
) -> None:
    create(admin, fresh.changelog_topic, 3, {"cleanup.policy": "delete"})
    with pytest.raises(LayoutError, match=r"cleanup\.policy is delete") as raised:
        create_topics(admin, fresh, partitions=3, replication_factor=1, retention_ms=DAY_MS)
    assert raised.value.code == "changelog-mismatch"


def test_create_topics_reports_a_broker_refusal(fresh: Settings, admin: AdminClient) -> None:
    with pytest.raises(LayoutError) as raised:
        create_topics(admin, fresh, partitions=1, replication_factor=5, retention_ms=DAY_MS)
    assert raised.value.code == "create-failed"


# --- check_layout ----------------------------------------------------------------------


def test_check_layout_accepts_a_valid_layout(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory
) -> None:
    settings = settings_for(bootstrap, topic_factory,
                            requests=(3, {"cleanup.policy": "delete", "retention.ms": "-1"}))
    assert check_layout(admin, settings) == Layout(partitions=3, retention_ms=None)


@pytest.mark.parametrize("missing", ["requests", "changelog", "dlq"])
def test_check_layout_names_the_missing_topic(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory, missing: str
) -> None:
    settings = settings_for(bootstrap, topic_factory, **{missing: None})
    with pytest.raises(LayoutError, match="kdelay topics create") as raised:
        check_layout(admin, settings)
    assert raised.value.code == f"{missing}-missing"


def test_check_layout_missing_changelog_says_which_partition_count(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory
) -> None:
    settings = settings_for(bootstrap, topic_factory, changelog=None)
    with pytest.raises(LayoutError, match="kdelay topics create --partitions 3"):
        check_layout(admin, settings)


@pytest.mark.parametrize(("partitions", "fix"), [
    (2, "run `kdelay topics grow --partitions 3`"),
    (4, "a `kdelay topics grow --partitions 4` did not finish: run it again")])
def test_check_layout_detects_a_changelog_with_another_partition_count(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory, partitions: int, fix: str
) -> None:
    settings = settings_for(bootstrap, topic_factory,
                            changelog=(partitions, {"cleanup.policy": "compact"}))
    with pytest.raises(LayoutError, match=fix) as raised:
        check_layout(admin, settings)
    assert raised.value.code == "not-copartitioned"


@pytest.mark.parametrize("policy", ["delete", "compact,delete"])
def test_check_layout_detects_a_changelog_that_is_not_only_compacted(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory, policy: str
) -> None:
    settings = settings_for(bootstrap, topic_factory, changelog=(3, {"cleanup.policy": policy}))
    with pytest.raises(LayoutError, match=r"cleanup\.policy=compact") as raised:
        check_layout(admin, settings)
    assert raised.value.code == "changelog-not-compacted"


def test_check_layout_detects_a_compacted_requests_topic(
    bootstrap: str, admin: AdminClient, topic_factory: TopicFactory
) -> None:
    settings = settings_for(bootstrap, topic_factory, requests=(3, {"cleanup.policy": "compact"}))
    with pytest.raises(LayoutError) as raised:
        check_layout(admin, settings)
    assert raised.value.code == "requests-compacted"


def test_retention_ms(admin: AdminClient, topic_factory: TopicFactory) -> None:
    assert retention_ms(admin, topic_factory("ret", 1, {"retention.ms": "12345"})) == 12345
    assert retention_ms(admin, topic_factory("ret", 1, {"retention.ms": "-1"})) is None
    with pytest.raises(LayoutError) as raised:
        retention_ms(admin, f"missing-{uuid.uuid4().hex}")
    assert raised.value.code == "topic-missing"
