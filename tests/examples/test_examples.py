"""docs/examples/{java,go,node}: kdelay's protocol from Java's kafka-clients, Go's franz-go
and Node's kafkajs, each built and run against the test broker and a running service.

Each program schedules by due time, delay and level, schedules one with an id keyed by
a business key (the client's default partitioner), cancels one, reschedules another,
reads their outcomes, and checks the target. It exits 0 only when all of that held;
the test also reads the target itself: five records, none early, no cancelled one.
The dependencies are installed by ``tools/test``; a missing toolchain skips locally and
fails under ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TopicFactory
from tests.e2e.conftest import Deployment, KdelayProcess, Receiver

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
EXPECTED = {"by-due", "by-delay", "by-level", "with-id", "rescheduled"}
BUILD_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Example:
    """One language's example: its toolchain, how to build it and how to run it."""

    name: str
    tools: tuple[str, ...]
    build: tuple[str, ...]

    @property
    def directory(self) -> Path:
        return EXAMPLES / self.name

    def command(self) -> list[str]:
        """The built program's command line, without its target argument."""
        if self.name == "java":
            classpath = (self.directory / "target" / "classpath.txt").read_text().strip()
            return ["java", "-cp", f"target/classes{os.pathsep}{classpath}",
                    "kdelay.example.DelayExample"]
        if self.name == "go":
            return ["./delay-example"]
        return ["node", "delay-example.js"]


JAVA = Example("java", ("java", "mvn"), ("mvn", "-q", "-B", "package"))
GO = Example("go", ("go",), ("go", "build", "-o", "delay-example", "."))
NODE = Example("node", ("node", "npm"), ("npm", "ci", "--no-audit", "--no-fund", "--quiet"))


def _toolchain(example: Example) -> None:
    """Skip when the example's toolchain is absent, except under CI, where it fails."""
    missing = [tool for tool in example.tools if shutil.which(tool) is None]
    if missing:
        reason = f"{example.name} example: {', '.join(missing)} not installed"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def _build(example: Example) -> float:
    """Build the example (Node: install its locked dependencies); return the seconds taken."""
    started = time.monotonic()
    result = subprocess.run(example.build, cwd=example.directory, capture_output=True, text=True,
                            timeout=BUILD_TIMEOUT_S, check=False)
    assert result.returncode == 0, f"{example.name} build failed:\n{result.stdout}\n{result.stderr}"
    return time.monotonic() - started


@pytest.mark.kafka
@pytest.mark.parametrize("example", [JAVA, GO, NODE], ids=lambda e: e.name)
def test_example_schedules_cancels_reschedules_and_checks_the_target(
    example: Example, deploy: Callable[..., Deployment],
    start_kdelay: Callable[..., KdelayProcess], receiver: Callable[[list[str]], Receiver],
    topic_factory: TopicFactory,
) -> None:
    _toolchain(example)
    built_s = _build(example)
    deployment = deploy(partitions=3)
    target = topic_factory(f"example-{example.name}", 2)
    start_kdelay(deployment).wait_ready()

    started = time.monotonic()
    result = subprocess.run([*example.command(), target], cwd=example.directory,
                            env=deployment.env(), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, check=False)
    ran_s = time.monotonic() - started
    print(f"{example.name}: built in {built_s:.1f} s, ran in {ran_s:.1f} s")
    assert result.returncode == 0, f"{example.name}:\n{result.stdout}\n{result.stderr}"

    lines = result.stdout.splitlines()
    assert lines[-1] == "ok", lines
    outcomes = {line.split()[1].split("-")[0]: line.split()[2]
                for line in lines if line.startswith("outcome ")}
    assert outcomes == {"order": "scheduled", "cancel": "cancelled", "moved": "rescheduled"}
    arrived = {line.split()[1] for line in lines if line.startswith("arrived ")}
    assert arrived == EXPECTED
    assert "never arrived cancelled" in lines
    placed = next(line for line in lines if line.startswith("placed with-id key=customer-7 "))
    assert "forwarded by kdelay" in placed or "at home" in placed

    # The target as the test reads it: the five records, none before its due time.
    reading = receiver([target])
    reading.until(lambda: len(reading.on(target)) >= len(EXPECTED), "the example's records")
    reading.drain(1.0)
    records = [r.message for r in reading.on(target)]
    assert sorted((m.value() or b"").decode() for m in records) == sorted(EXPECTED)
    for message in records:
        due = dict(message.headers() or [])["kdelay-due-ms"]
        assert isinstance(due, bytes)
        assert message.timestamp()[1] >= int(due), message.value()
