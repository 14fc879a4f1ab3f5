"""A state dir on a volume that fills up: one clear line, a non-zero exit, nothing lost.

Needs root to mount a small tmpfs (the test containers run as root); skipped
elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kdelay.protocol import envelope
from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver, produce_requests

Deploy = Callable[..., Deployment]
Start = Callable[..., KdelayProcess]
Receive = Callable[[list[str]], Receiver]

TOTAL = 40_000
DELAY_MS = 20_000


def _mount(path: Path, size: str, *options: str) -> bool:
    opts = ",".join((*options, f"size={size}"))
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                            capture_output=True, check=False)
    return result.returncode == 0


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs under the test's tmp dir; unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    volume = tmp_path / "volume"
    volume.mkdir()
    if not _mount(volume, "1m"):
        pytest.skip("cannot mount a tmpfs here")
    yield volume
    subprocess.run(["umount", "-l", str(volume)], check=False)


@pytest.mark.kafka
def test_a_full_state_dir_stops_with_one_line_and_loses_nothing(
    deploy: Deploy, start_kdelay: Start, receiver: Receive, topic_factory: TopicFactory,
    small_volume: Path,
) -> None:
    deployment = dataclasses.replace(deploy(partitions=1), state_dir=small_volume / "state")
    target = topic_factory("e2e-target", 1)
    first = start_kdelay(deployment)
    first.wait_ready()
    records = [{"key": f"k{i}".encode(), "value": b"v",
                "headers": [(envelope.TARGET, target.encode()),
                            (envelope.DELAY_MS, str(DELAY_MS).encode())]}
               for i in range(TOTAL)]
    sent_at = time.monotonic()
    produce_requests(deployment, records)
    code = first.popen.wait(timeout=120)
    log = first.log()
    assert time.monotonic() - sent_at < DELAY_MS / 1000, "the volume did not fill in time"
    assert code != 0
    assert "Traceback" not in log
    [line] = [line for line in log.splitlines() if "error[state-dir-full]" in line]
    assert str(deployment.state_dir) in line
    assert "bytes free" in line
    assert "rebuilt from the changelog" in line
    assert not (deployment.state_dir / f"{deployment.requests}-0").exists(), (
        "the store whose write found no room is deleted, to be rebuilt")

    assert _mount(small_volume, "256m", "remount")
    out = receiver([target, deployment.dlq])
    second = start_kdelay(deployment)
    second.wait_ready()
    out.until(lambda: len(out.on(target)) >= TOTAL, "every request delivered", timeout_s=240)
    out.drain(2.0)
    keys = Counter(r.message.key() for r in out.on(target))
    assert len(keys) == TOTAL
    assert max(keys.values()) == 1, "delivered twice"
    assert out.on(deployment.dlq) == []
    assert second.terminate() == 0
