"""The settings and ports ``tools/kafka cluster`` gives its nodes."""

from __future__ import annotations

from pathlib import Path

import chaos_harness
import kafka_cluster
import pytest


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "cluster"
    monkeypatch.setattr(kafka_cluster, "CLUSTER", home)
    return home


def test_nodes_take_their_client_ports_then_their_controller_ports() -> None:
    nodes = kafka_cluster.plan_nodes([9001, 9002, 9003, 9101, 9102, 9103])
    assert [(n.node_id, n.port, n.controller_port) for n in nodes] == [
        (1, 9001, 9101), (2, 9002, 9102), (3, 9003, 9103)]
    assert kafka_cluster.bootstrap(nodes) == "127.0.0.1:9001,127.0.0.1:9002,127.0.0.1:9003"


@pytest.mark.parametrize("ports", [[], [9001, 9002, 9003]])
def test_a_plan_needs_two_ports_per_node(ports: list[int]) -> None:
    with pytest.raises(ValueError, match="two ports per node"):
        kafka_cluster.plan_nodes(ports)


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, 1)), (2, (2, 2)), (3, (3, 2)),
                                                   (5, (3, 2))])
def test_internal_topics_are_replicated_as_far_as_the_brokers_allow(
        brokers: int, expected: tuple[int, int]) -> None:
    assert kafka_cluster.replication(brokers) == expected


def test_every_node_knows_every_voter_and_listens_on_its_own_ports(tmp_path: Path) -> None:
    nodes = kafka_cluster.plan_nodes([9001, 9002, 9003, 9101, 9102, 9103])
    settings = kafka_cluster.node_settings(nodes[1], nodes, tmp_path / "node-2")
    assert settings["node.id"] == "2"
    assert settings["process.roles"] == "broker,controller"
    assert settings["controller.quorum.voters"] == (
        "1@127.0.0.1:9101,2@127.0.0.1:9102,3@127.0.0.1:9103")
    assert settings["listeners"] == (
        "PLAINTEXT://127.0.0.1:9002,CONTROLLER://127.0.0.1:9102")
    assert settings["log.dirs"] == str(tmp_path / "node-2")


def test_internal_topics_have_production_replication_on_three_nodes(tmp_path: Path) -> None:
    nodes = kafka_cluster.plan_nodes([9001, 9002, 9003, 9101, 9102, 9103])
    settings = kafka_cluster.node_settings(nodes[0], nodes, tmp_path)
    assert settings["offsets.topic.replication.factor"] == "3"
    assert settings["transaction.state.log.replication.factor"] == "3"
    assert settings["transaction.state.log.min.isr"] == "2"
    assert settings["min.insync.replicas"] == "2"
    assert settings["default.replication.factor"] == "3"


def test_ports_are_chosen_once_and_kept(cluster: Path) -> None:
    first = kafka_cluster.planned_nodes(3)
    assert len({p for n in first for p in (n.port, n.controller_port)}) == 6
    assert kafka_cluster.planned_nodes(3) == first
    assert kafka_cluster.known_nodes() == first


def test_a_cluster_keeps_its_node_count_until_reset(cluster: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    first = kafka_cluster.planned_nodes(3)
    assert kafka_cluster.planned_nodes(5) == first
    assert "made with 3 nodes" in capsys.readouterr().err


def test_the_heap_and_log_settings_are_the_nodes_own(cluster: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDELAY_CLUSTER_HEAP", "384m")
    command = kafka_cluster.node_java(2, "kafka.Kafka", "server.properties")
    assert "-Xms384m" in command
    assert "-Xmx384m" in command
    assert f"-Dlog4j2.configurationFile={cluster / 'node-2' / 'log4j2.properties'}" in command
    assert command[-2:] == ["kafka.Kafka", "server.properties"]


def test_a_duplicate_is_explained_until_the_partitions_are_lost_after_an_event() -> None:
    windows = chaos_harness.replay_windows([100_000, 300_000], [112_000, 400_000])
    assert windows == [(90_000, 112_000), (290_000, 310_000)]


def test_the_coordinator_partition_is_javas_string_hash() -> None:
    # Kafka: Utils.abs("my-group".hashCode()) % 50; "my-group".hashCode() == -1906497762
    assert chaos_harness.coordinator_partition("my-group", 50) == 1906497762 % 50
    # A negative hash: "polygenelubricants".hashCode() == Integer.MIN_VALUE, abs -> 0
    assert chaos_harness.coordinator_partition("polygenelubricants", 7) == 0


def test_the_active_controller_is_the_newest_epochs_leader_among_running_nodes(
        cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = kafka_cluster.plan_nodes([9001, 9002, 9003, 9101, 9102, 9103])
    (cluster / "data_dir").parent.mkdir(parents=True)
    (cluster / "data_dir").write_text(f"{cluster / 'data'}\n")
    epochs = {1: (3, 7), 2: (1, 9), 3: (2, 8)}  # node 2 stopped: its file is the newest
    for node_id, (leader, epoch) in epochs.items():
        state = cluster / "data" / f"node-{node_id}" / "__cluster_metadata-0" / "quorum-state"
        state.parent.mkdir(parents=True)
        state.write_text(f'{{"leaderId":{leader},"leaderEpoch":{epoch}}}')
    monkeypatch.setattr(kafka_cluster, "node_pid", lambda node_id: None if node_id == 2 else 1)
    assert kafka_cluster.active_controller(nodes) == 2  # node 3's view, epoch 8
    monkeypatch.setattr(kafka_cluster, "node_pid", lambda node_id: None)
    assert kafka_cluster.active_controller(nodes) is None
