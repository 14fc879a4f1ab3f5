"""The ports ``tools/kafka`` gives its broker's listeners (chosen once, all distinct)."""

from __future__ import annotations

import socket
from pathlib import Path

import kafka_broker
import pytest


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "broker"
    monkeypatch.setattr(kafka_broker, "RUN", run)
    monkeypatch.setenv("KDELAY_BROKER_PORT", "0")
    return run


def test_ports_chosen_at_once_are_distinct_even_when_the_kernel_repeats_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    handed = iter([41001, 41001, 41002, 41001, 41003])

    class Repeating(socket.socket):
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(handed))

    monkeypatch.setattr(socket, "socket", Repeating)
    assert kafka_broker.free_ports(3) == [41001, 41002, 41003]


def test_ports_to_avoid_are_never_chosen() -> None:
    first = kafka_broker.free_ports(3)
    assert len(set(first)) == 3
    assert not set(kafka_broker.free_ports(20, avoid=first)) & set(first)


def test_the_four_listeners_get_distinct_ports_that_are_kept(run: Path) -> None:
    ports = kafka_broker.broker_ports()
    assert len(set(ports)) == 4
    assert kafka_broker.broker_ports() == ports
    assert (run / "ports").read_text().split() == [str(p) for p in ports]


def test_an_older_layout_keeps_its_ports_and_a_repeated_tls_port_is_replaced(
        run: Path) -> None:
    run.mkdir()
    (run / "ports").write_text("9092 36421 49325\n")
    (run / "tls_port").write_text("36421\n")  # the controller's: that broker never started
    ports = kafka_broker.broker_ports()
    assert ports[:3] == (9092, 36421, 49325)
    assert ports[3] not in (9092, 36421, 49325)


def test_an_older_layout_keeps_a_distinct_tls_port(run: Path) -> None:
    run.mkdir()
    (run / "ports").write_text("9092 36421 49325\n")
    (run / "tls_port").write_text("40000\n")
    assert kafka_broker.broker_ports() == (9092, 36421, 49325, 40000)


def test_the_offsets_and_transaction_logs_roll_small_segments(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One partition each: 100 MB segments made the cleaner stall the clients for most
    # of a second at a time (docs/benchmarks.md); 2 MB keep each cleaning small.
    monkeypatch.setenv("KDELAY_BROKER_DATA_DIR", str(tmp_path / "data"))
    run.mkdir()
    config = kafka_broker.write_config(*kafka_broker.free_ports(4))
    settings = dict(line.split("=", 1) for line in config.read_text().splitlines())
    assert settings["offsets.topic.num.partitions"] == "1"
    assert settings["offsets.topic.segment.bytes"] == "2097152"
    assert settings["transaction.state.log.segment.bytes"] == "2097152"
