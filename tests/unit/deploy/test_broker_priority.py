"""The CPU priority ``tools/kafka`` gives its jar broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kafka_broker
import pytest


@pytest.mark.parametrize(("given", "nice"), [("", -10), ("0", 0), ("-5", -5), (" 19 ", 19)])
def test_the_niceness_comes_from_the_environment(
        given: str, nice: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDELAY_BROKER_NICE", given)
    assert kafka_broker.broker_nice() == nice


@pytest.mark.parametrize("given", ["high", "-21", "20"])
def test_a_niceness_out_of_range_is_refused_by_name(
        given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDELAY_BROKER_NICE", given)
    with pytest.raises(SystemExit, match="KDELAY_BROKER_NICE must be a niceness"):
        kafka_broker.broker_nice()


def fake_process(proc: Path, pid: int, nice: int, autogroup: bool = True) -> Path:
    """A ``/proc/<pid>`` with a stat line of niceness ``nice`` (and an autogroup file)."""
    root = proc / str(pid)
    root.mkdir(parents=True)
    fields = ["S", *["0"] * 15, str(nice), *["0"] * 30]
    (root / "stat").write_text(f"{pid} (java) {' '.join(fields)}\n")
    if autogroup:
        (root / "autogroup").write_text("/autogroup-7 nice 0\n")
    return root


def test_the_autogroup_gets_the_niceness_the_process_has(tmp_path: Path) -> None:
    root = fake_process(tmp_path, 42, -10)
    assert kafka_broker.prioritise(42, -10, tmp_path) is None
    assert (root / "autogroup").read_text() == "-10\n"


def test_a_process_the_kernel_left_at_its_niceness_is_reported(tmp_path: Path) -> None:
    root = fake_process(tmp_path, 42, 0)
    refused = kafka_broker.prioritise(42, -10, tmp_path)
    assert refused == "setting niceness -10 needs root or CAP_SYS_NICE"
    assert (root / "autogroup").read_text() == "/autogroup-7 nice 0\n"


def test_without_autogroups_the_process_niceness_is_enough(tmp_path: Path) -> None:
    fake_process(tmp_path, 42, -10, autogroup=False)
    assert kafka_broker.prioritise(42, -10, tmp_path) is None


def test_niceness_0_touches_nothing(tmp_path: Path) -> None:
    assert kafka_broker.prioritise(42, 0, tmp_path) is None  # no /proc/42 read


def test_a_real_child_and_its_session_get_the_niceness() -> None:
    # Raising niceness (lowering priority) needs no privilege: +5 shows the mechanism.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             start_new_session=True, preexec_fn=lambda: kafka_broker.niceness(5))
    try:
        assert kafka_broker.prioritise(child.pid, 5) is None
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        assert int(stat.rsplit(")", 1)[1].split()[16]) == 5
        group = Path(f"/proc/{child.pid}/autogroup")
        if group.exists():
            assert group.read_text().split()[-1] == "5"
    finally:
        child.kill()
        child.wait()
