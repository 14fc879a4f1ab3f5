"""A state dir on a volume that fills up: one clear line, a non-zero exit, nothing lost.

Three partitions share the volume, so the write that finds no room ends the
applying of every partition's plans midway: each store may then record a
changelog position past plans it never applied, which is why every store is
rebuilt. The target is paused until the second instance serves: nothing goes
out before the volume fills, however slow the machine. Needs root to mount a
small tmpfs (the test containers run as root): under ``CI=true`` the test
fails when it cannot mount one, elsewhere it skips.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests, run_cli

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

TOTAL = 40_000
DELAY_MS = 2_000


PARTITIONS = 3


def _unmountable(reason: str) -> NoReturn:
    """Fail under CI (it must never pass by skipping), skip elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"cannot test a full state dir under CI: {reason}")
    pytest.skip(reason)


def _mount(path: Path, size: str, *options: str) -> bool:
    opts = ",".join((*options, f"size={size}"))
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                            capture_output=True, check=False)
    return result.returncode == 0


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs under the test's tmp dir; unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        _unmountable("mounting a small tmpfs needs root and mount(8)")
    volume = tmp_path / "volume"
    volume.mkdir()
    if not _mount(volume, "1m"):
        _unmountable("mount -t tmpfs failed here")
    yield volume
    subprocess.run(["umount", "-l", str(volume)], check=False)


@pytest.mark.kafka
def test_a_full_state_dir_of_several_partitions_stops_with_one_line_and_loses_nothing(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    small_volume: Path,
) -> None:
    deployment = dataclasses.replace(deploy(partitions=PARTITIONS),
                                     state_dir=small_volume / "state")
    target = topic_factory("e2e-target", PARTITIONS)
    paused = run_cli(deployment.env(), "target", "pause", target, "--reason", "filling")
    assert paused.returncode == 0, paused.stderr
    first = start_kdelay(deployment)
    first.wait_ready()
    records = [{"key": f"k{i}".encode(), "value": b"v",
                "headers": [(envelope.TARGET, target.encode()),
                            (envelope.DELAY_MS, str(DELAY_MS).encode())]}
               for i in range(TOTAL)]
    produce_requests(deployment, records)
    code = first.popen.wait(timeout=120)
    log = first.log()
    assert code != 0
    assert "Traceback" not in log
    [line] = [line for line in log.splitlines() if "error[state-dir-full]" in line]
    assert str(deployment.state_dir) in line
    assert "bytes free" in line
    assert "every index of this instance was deleted" in line
    kept = [p for p in range(PARTITIONS)
            if (deployment.state_dir / f"{deployment.requests}-{p}").exists()]
    assert kept == [], "every store is deleted, to be rebuilt from the changelog"

    assert _mount(small_volume, "256m", "remount")
    out = receiver([target, deployment.dlq])
    second = start_kdelay(deployment)
    second.wait_ready()
    resumed = run_cli(deployment.env(), "target", "resume", target)
    assert resumed.returncode == 0, resumed.stderr
    out.until(lambda: len(out.on(target)) >= TOTAL, "every request delivered", timeout_s=240)
    out.drain(2.0)
    keys = Counter(r.message.key() for r in out.on(target))
    assert len(keys) == TOTAL
    assert max(keys.values()) == 1, "delivered twice"
    assert out.on(deployment.dlq) == []
    assert second.terminate() == 0
