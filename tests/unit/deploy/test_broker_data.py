"""Where ``tools/kafka`` keeps its broker's log directories (pure path logic)."""

from __future__ import annotations

import os
from pathlib import Path

import kafka_broker
import pytest


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "broker"
    monkeypatch.setattr(kafka_broker, "RUN", run)
    monkeypatch.setattr(kafka_broker, "MEMORY", tmp_path / "shm")
    monkeypatch.delenv("KDELAY_BROKER_DATA_DIR", raising=False)
    (tmp_path / "shm").mkdir()
    return run


def test_data_goes_to_memory_when_it_has_room_and_the_choice_is_kept(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_broker, "MEMORY_DATA_MIN_FREE", 1)
    chosen = kafka_broker.data_dir()
    assert chosen.parent == tmp_path / "shm"
    assert chosen.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("KDELAY_BROKER_DATA_DIR", str(tmp_path / "elsewhere"))
    assert kafka_broker.data_dir() == chosen  # recorded until reset


def test_data_stays_on_disk_when_memory_lacks_room(
        run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_broker, "MEMORY_DATA_MIN_FREE", 1 << 62)
    assert kafka_broker.data_dir() == run / "data"


def test_a_broker_formatted_on_disk_keeps_its_data(
        run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_broker, "MEMORY_DATA_MIN_FREE", 1)
    (run / "data").mkdir(parents=True)
    (run / "data" / "meta.properties").write_text("cluster.id=x\n")
    assert kafka_broker.data_dir() == run / "data"


def test_the_setting_names_the_directory(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDELAY_BROKER_DATA_DIR", str(tmp_path / "given"))
    assert kafka_broker.data_dir() == tmp_path / "given"


def test_a_memory_directory_someone_else_made_is_not_used(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_broker, "MEMORY_DATA_MIN_FREE", 1)
    monkeypatch.setattr(kafka_broker, "own_dir", lambda path: False)
    assert kafka_broker.data_dir() == run / "data"


def test_the_memory_directory_names_its_checkout_and_an_orphan_is_removed(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout deleted without ``reset`` would hold its broker's data in memory until
    a reboot: the next start of any checkout removes it, and keeps the live ones'."""
    monkeypatch.setattr(kafka_broker, "MEMORY_DATA_MIN_FREE", 1)
    shm = tmp_path / "shm"
    gone = shm / f"kdelay-{os.getuid()}-broker-0000dead"
    gone.mkdir()
    (shm / (gone.name + ".owner")).write_text(f"{tmp_path / 'deleted-checkout'}\n")
    live_run = tmp_path / "other-checkout"
    live = shm / f"kdelay-{os.getuid()}-broker-0000beef"
    live.mkdir()
    (shm / (live.name + ".owner")).write_text(f"{live_run}\n")
    live_run.mkdir()
    (live_run / "data_dir").write_text(f"{live}\n")
    chosen = kafka_broker.data_dir()
    assert (shm / (chosen.name + ".owner")).read_text().strip() == str(run)
    assert not gone.exists()
    assert not (shm / (gone.name + ".owner")).exists()
    assert live.exists(), "a checkout that still records it keeps its data"
