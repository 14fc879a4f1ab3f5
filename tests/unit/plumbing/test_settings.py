"""Settings: validation, client configuration precedence, and the client.properties reader."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kdelay.plumbing.clientconfig import ClientLogger
from kdelay.plumbing.settings import (
    DEFAULT_BOOTSTRAP_SERVERS,
    Guarantee,
    Settings,
    SettingsError,
    build_settings,
    load_properties,
    resolve_kafka_config,
)
from kdelay.protocol.durations import DEFAULT_LEVELS, parse_levels


def write(tmp_path: Path, text: str) -> Path:
    """Write ``text`` to a client.properties file and return its path."""
    path = tmp_path / "client.properties"
    path.write_text(text, encoding="utf-8")
    return path


# --- load_properties -------------------------------------------------------------------


def test_properties_separators_comments_and_whitespace(tmp_path: Path) -> None:
    path = write(tmp_path, "\n".join([
        "# a comment",
        "! another comment",
        "",
        "   ",
        "security.protocol=SASL_SSL",
        "  sasl.mechanism : PLAIN  ",
        "client.id   kdelay-test",
        "ssl.endpoint.identification.algorithm=",
        "\tlinger.ms\t=\t5",
    ]))
    assert load_properties(path) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
        "client.id": "kdelay-test",
        "ssl.endpoint.identification.algorithm": "",
        "linger.ms": "5",
    }


def test_properties_line_continuation(tmp_path: Path) -> None:
    path = write(tmp_path, (
        "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \\\n"
        "    required username=\"u\" \\\n"
        "    password=\"p\";\n"
        "after=1\n"
    ))
    assert load_properties(path) == {
        "sasl.jaas.config": 'org.apache.kafka.common.security.plain.PlainLoginModule '
                            'required username="u" password="p";',
        "after": "1",
    }


def test_properties_escapes(tmp_path: Path) -> None:
    path = write(tmp_path, "\n".join([
        r"path=C:\\kafka\\ssl",
        r"tab=a\tb",
        r"unicode=caf\u00e9",
        r"key\=with\:separators=v",
        r"even.backslashes=x\\",
        r"kept.space=secret\ ",
        "dropped.space=secret   ",
    ]))
    assert load_properties(path) == {
        "path": "C:\\kafka\\ssl",
        "tab": "a\tb",
        "unicode": "café",
        "key=with:separators": "v",
        "even.backslashes": "x\\",
        "kept.space": "secret ",
        "dropped.space": "secret",
    }


def test_properties_later_key_wins_and_comment_never_continues(tmp_path: Path) -> None:
    path = write(tmp_path, "a=1\n# comment \\\na=2\n")
    assert load_properties(path) == {"a": "2"}


def test_properties_trailing_continuation_at_end_of_file(tmp_path: Path) -> None:
    assert load_properties(write(tmp_path, "a=1\\")) == {"a": "1"}


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("a=1\n\njustakey\n", 3, "has no value"),
        ("a=1\n=secret\n", 2, "empty key"),
        ("bad=\\u12\n", 1, "malformed \\u escape"),
        ("# c\nx=1 \\\n  y\nbad=\\uZZZZ\n", 4, "malformed \\u escape"),
    ],
)
def test_properties_malformed_line_names_file_and_line(
    tmp_path: Path, text: str, line: int, fragment: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SettingsError, match=re.escape(fragment)) as raised:
        load_properties(path)
    assert raised.value.code == "kafka-config-malformed"
    assert f"{path}:{line}:" in str(raised.value)


def test_properties_malformed_line_does_not_echo_the_value(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as raised:
        load_properties(write(tmp_path, "=hunter2\n"))
    assert "hunter2" not in str(raised.value)


def test_properties_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.properties"
    with pytest.raises(SettingsError, match="no such file") as raised:
        load_properties(missing)
    assert raised.value.code == "kafka-config-missing"
    assert str(missing) in str(raised.value)


def test_properties_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as raised:
        load_properties(tmp_path)
    assert raised.value.code == "kafka-config-unreadable"


# --- Settings validation ---------------------------------------------------------------


def test_defaults() -> None:
    settings = Settings()
    assert settings.bootstrap_servers == DEFAULT_BOOTSTRAP_SERVERS == "127.0.0.1:9092"
    assert settings.guarantee is Guarantee.AT_LEAST_ONCE
    assert settings.levels == parse_levels(DEFAULT_LEVELS)
    assert settings.state_dir == Path("state")
    assert settings.metrics_port is None
    assert settings.transactional_id is None
    assert dict(settings.kafka_config) == {}
    # A target created minutes after its records came due still gets them.
    assert settings.delivery_retry_ms == 15 * 60_000
    assert settings.delivery_attempts == 0


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"batch_size": 0}, "batch_size must be at least 1"),
        ({"delivery_attempts": -1}, "delivery_attempts must be at least 0"),
        ({"delivery_retry_ms": -1}, "delivery_retry_ms must be at least 0"),
        ({"lookahead_ms": -1}, "lookahead_ms must be at least 0"),
        ({"retention_margin_ms": -5}, "retention_margin_ms must be at least 0"),
        ({"retry_backoff_ms": 0}, "retry_backoff_ms must be at least 1"),
        ({"retry_backoff_ms": 1_000, "retry_backoff_max_ms": 10}, "must not be below"),
        ({"metrics_port": 70_000}, "metrics_port must be between"),
        ({"bootstrap_servers": " "}, "bootstrap_servers must not be empty"),
        ({"group_id": ""}, "group_id must not be empty"),
        ({"requests_topic": "has space"}, "not a valid Kafka topic name"),
        ({"dlq_topic": "kdelay.requests"}, "must differ"),
        ({"levels": ()}, "at least one delay"),
        ({"levels": (5_000, 1_000)}, "strictly ascending"),
        ({"levels": (0, 1_000)}, "positive"),
        ({"guarantee": "at-most-once"}, "guarantee must be one of"),
        ({"transactional_id": ""}, "transactional_id"),
        ({"instance_id": ""}, "instance_id"),
        ({"partitioner": "murmur3"}, "partitioner must be one of murmur2_random"),
        ({"session_timeout_ms": 0}, "session_timeout_ms must be at least 1"),
    ],
)
def test_invalid_settings_raise_a_clear_value_error(
    overrides: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment) as raised:
        Settings(**overrides)  # type: ignore[arg-type]
    assert isinstance(raised.value, SettingsError)
    assert raised.value.code == "invalid-setting"


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SettingsError) as raised:
        Settings(batch_size=0, delivery_attempts=-1)
    assert "batch_size" in str(raised.value)
    assert "delivery_attempts" in str(raised.value)


def test_guarantee_given_as_string_is_normalised() -> None:
    settings = Settings(guarantee="exactly-once")  # type: ignore[arg-type]
    assert settings.guarantee is Guarantee.EXACTLY_ONCE


def test_settings_are_immutable() -> None:
    settings = Settings(kafka_config={"linger.ms": "5"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.batch_size = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.kafka_config["linger.ms"] = "10"  # type: ignore[index]


def test_kafka_config_is_copied() -> None:
    source = {"linger.ms": "5"}
    settings = Settings(kafka_config=source)
    source["linger.ms"] = "10"
    assert settings.kafka_config["linger.ms"] == "5"


# --- client_config and bootstrap precedence -------------------------------------------


def test_client_config_precedence() -> None:
    settings = Settings(bootstrap_servers="b:9092",
                        kafka_config={"linger.ms": "5", "client.id": "from-file"})
    config = settings.client_config()
    assert isinstance(config.pop("logger"), ClientLogger)
    assert config == {
        "bootstrap.servers": "b:9092", "linger.ms": "5", "client.id": "from-file",
    }
    extra: dict[str, str | int | bool] = {"client.id": "override", "enable.idempotence": True}
    overridden = settings.client_config(**extra)
    overridden.pop("logger")
    assert overridden == {
        "bootstrap.servers": "b:9092", "linger.ms": "5", "client.id": "override",
        "enable.idempotence": True,
    }


def test_client_config_returns_a_fresh_dict() -> None:
    settings = Settings()
    settings.client_config()["bootstrap.servers"] = "mutated"
    assert settings.client_config()["bootstrap.servers"] == DEFAULT_BOOTSTRAP_SERVERS


def test_kafka_config_bootstrap_must_agree_with_the_field() -> None:
    assert Settings(bootstrap_servers="b:1", kafka_config={"bootstrap.servers": "b:1"})
    with pytest.raises(SettingsError, match="give the address once"):
        Settings(bootstrap_servers="b:1", kafka_config={"bootstrap.servers": "other:2"})


def test_resolve_kafka_config_flag_wins_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "bootstrap.servers=file:9092\nlinger.ms=5\n")
    assert resolve_kafka_config(path, "flag:9092") == ("flag:9092", {"linger.ms": "5"})
    assert resolve_kafka_config(path, None) == ("file:9092", {"linger.ms": "5"})
    assert resolve_kafka_config(None, None) == (DEFAULT_BOOTSTRAP_SERVERS, {})


def test_build_settings_ignores_values_not_given(tmp_path: Path) -> None:
    path = write(tmp_path, "bootstrap.servers=file:9092\nsecurity.protocol=SSL\n")
    settings = build_settings(kafka_config_path=path, bootstrap_servers=None,
                              levels="1s 1m", batch_size=None, requests_topic="r")
    assert settings.bootstrap_servers == "file:9092"
    assert settings.client_config()["bootstrap.servers"] == "file:9092"
    assert settings.client_config()["security.protocol"] == "SSL"
    assert settings.levels == (1_000, 60_000)
    assert settings.batch_size == Settings().batch_size
    assert settings.requests_topic == "r"


def test_build_settings_bad_levels_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="levels '1s 5x'") as raised:
        build_settings(levels="1s 5x")
    assert raised.value.code == "invalid-setting"


def test_allowed_targets_from_a_comma_separated_string() -> None:
    settings = build_settings(allowed_targets=" orders, billing.* ,,re:pay-[0-9]+")
    assert settings.allowed_targets == ("orders", "billing.*", "re:pay-[0-9]+")
    assert Settings().allowed_targets == ()


def test_allowed_targets_bad_regex_is_an_invalid_setting() -> None:
    with pytest.raises(SettingsError, match="allowed_targets: re:\\[ is not a regular"):
        Settings(allowed_targets=("re:[",))


def test_reserved_topics_name_kdelay_and_the_worker_topics() -> None:
    from kdelay import recurring, tasks

    settings = Settings(requests_topic="r", changelog_topic="c", dlq_topic="d",
                        outcomes_topic="o", controls_topic="k", status_topic="s")
    assert set(settings.reserved_topics) == {
        "r", "c", "d", "o", "k", "s", recurring.CANCELS_TOPIC, tasks.WORKER_DLQ_TOPIC}
    for topic in ("c", "k", "s"):
        refused = settings.target_policy().refusal(topic)
        assert refused is not None
        assert refused.code == "forbidden-target"


def test_renamed_worker_and_outcomes_topics_are_refused_under_their_names() -> None:
    settings = Settings(outcomes_topic="acme.answers", series_cancels_topic="acme.stops",
                        worker_dlq_topic="acme.failed-tasks")
    policy = settings.target_policy()
    for own in ("acme.answers", "acme.stops", "acme.failed-tasks"):
        refused = policy.refusal(own)
        assert refused is not None, own
        assert refused.code == "forbidden-target"
    # The default names are plain topics once the worker runs under others.
    assert policy.refusal("kdelay.tasks.dlq") is None
    assert policy.refusal("kdelay.series.cancels") is None


def test_worker_topics_must_be_topic_names_and_differ() -> None:
    with pytest.raises(SettingsError, match="not a valid Kafka topic name"):
        Settings(worker_dlq_topic="has space")
    with pytest.raises(SettingsError, match="series cancels and worker dlq topics must differ"):
        Settings(series_cancels_topic="x", worker_dlq_topic="x")
