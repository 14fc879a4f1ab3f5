"""Fixtures for tests that build and run kdelay's container images with podman.

The images come from ``tools/images`` (cached: built once per machine). Where
containers cannot run (no podman, or podman cannot start a container), these
tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEALTHY_TIMEOUT_S = 180.0


def unavailable(reason: str) -> NoReturn:
    """Fail under CI, skip elsewhere: CI must never pass by skipping container tests."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"containers cannot run under CI: {reason}")
    pytest.skip(f"containers cannot run here: {reason}")


def podman(*args: str, timeout_s: float = 120.0, check: bool = True) -> str:
    """Run one podman command; return its stdout (stderr only in the failure message)."""
    proc = subprocess.run(["podman", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}: "
                             f"{proc.stderr.strip()[-2000:]}")
    return proc.stdout


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """``KDELAY_BASE_IMAGE``, ``KDELAY_IMAGE`` and ``KDELAY_KAFKA_IMAGE``, built if missing."""
    if shutil.which("podman") is None:
        unavailable("podman is not installed (tools/test installs it as root with apt)")
    probe = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                           capture_output=True, text=True, check=False, timeout=60)
    if probe.returncode != 0:
        unavailable(f"podman info failed: {probe.stderr.strip()[-500:]}")
    proc = subprocess.run([str(ROOT / "tools" / "images")], capture_output=True, text=True,
                          check=False, timeout=1800)
    if proc.returncode != 0:
        unavailable(f"tools/images failed: {proc.stderr.strip()[-2000:]}")
    found = dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)
    assert set(found) == {"KDELAY_BASE_IMAGE", "KDELAY_IMAGE", "KDELAY_KAFKA_IMAGE"}, found
    return found


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Compose:
    """One compose.yml project run with podman-compose under a name of its own.

    podman 4.3 (Debian 12) cannot evaluate compose's health conditions and
    mis-resolves chained ``--requires``, so services are brought up one by one
    with ``--no-deps``, each after what it depends on is healthy or done.
    """

    def __init__(self, images: dict[str, str]) -> None:
        self.project = f"kdelay-test-{uuid.uuid4().hex[:8]}"
        self.kafka_port = free_port()
        self.env = {**os.environ, **images, "KDELAY_KAFKA_PORT": str(self.kafka_port)}
        self.bootstrap = f"127.0.0.1:{self.kafka_port}"

    def run(self, *args: str, env: dict[str, str] | None = None) -> str:
        command = [sys.executable, "-m", "podman_compose", "-f", str(ROOT / "compose.yml"),
                   "-p", self.project, *args]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env={**self.env, **(env or {})}, check=False)
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stderr.strip()[-2000:]}"
        return proc.stdout

    def up(self, service: str, scale: int = 1, **env: str) -> None:
        self.run("up", "-d", "--no-deps", "--scale", f"{service}={scale}", service, env=env)

    def container(self, service: str, index: int = 1) -> str:
        return f"{self.project}_{service}_{index}"

    def state(self, name: str) -> dict[str, object]:
        found: list[dict[str, object]] = json.loads(podman("inspect", name))
        state: dict[str, object] = found[0]["State"]  # type: ignore[assignment]
        return state

    def wait_healthy(self, name: str, timeout_s: float = HEALTHY_TIMEOUT_S) -> float:
        """Run the image's health check until it passes; return the seconds it took.

        Without systemd, podman does not run health checks on its own;
        ``podman healthcheck run`` runs the configured check once.
        """
        started = time.monotonic()
        while True:
            probe = subprocess.run(["podman", "healthcheck", "run", name], capture_output=True,
                                   text=True, check=False, timeout=60)
            if probe.returncode == 0:
                return time.monotonic() - started
            assert self.state(name)["Running"], f"{name} exited: {self.logs(name)[-2000:]}"
            assert time.monotonic() - started < timeout_s, (
                f"{name} not healthy after {timeout_s}s: {probe.stdout}{probe.stderr}")
            time.sleep(1)

    def wait_exit(self, name: str, timeout_s: float = 120.0) -> int:
        return int(podman("wait", name, timeout_s=timeout_s).strip())

    def logs(self, name: str) -> str:
        proc = subprocess.run(["podman", "logs", name], capture_output=True, text=True,
                              check=False, timeout=60)
        return proc.stdout + proc.stderr

    def metrics_port(self, name: str) -> int:
        return int(podman("port", name, "9464/tcp").strip().rsplit(":", 1)[1])

    def metric(self, name: str, metric: str) -> float | None:
        """One unlabelled sample of a kdelay container's metrics; None if absent."""
        url = f"http://127.0.0.1:{self.metrics_port(name)}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(metric + " "):
                    return float(line.split()[1])
        return None

    def down(self) -> None:
        """Remove the project's containers with their anonymous volumes, then the rest."""
        names = podman("ps", "-a", "-q", "--filter",
                       f"label=io.podman.compose.project={self.project}", check=False).split()
        if names:
            podman("rm", "-f", "-v", "-t", "0", *names, check=False)
        self.run("down", "-v", "-t", "0")
        volumes = [v for v in podman("volume", "ls", "-q", check=False).split()
                   if v.startswith(f"{self.project}_")]
        if volumes:
            podman("volume", "rm", "-f", *volumes, check=False)


@pytest.fixture
def compose(images: dict[str, str]) -> Iterator[Compose]:
    """A compose.yml project on a free broker port; torn down (volumes too) at the end."""
    project = Compose(images)
    try:
        yield project
    finally:
        project.down()
