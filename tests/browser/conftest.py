"""Fixtures for the console's browser tests: one Chromium, one deployment, two consoles.

Chromium is Debian's (``/usr/bin/chromium``, or ``KDELAY_CHROMIUM``) driven by
Playwright through ``executable_path``: Playwright's own browser downloads are
never used. Without Chromium or Playwright these tests skip, except under
``CI=true``, where they fail.

The module's deployment is real: its topics made by ``kdelay topics create``,
the service run by ``kdelay run``, and two ``kdelay web`` processes on free
loopback ports, each configured only through ``KDELAY_*`` variables: one with
the default settings (open on loopback: everyone is the local operator), one
with users (an operator and a viewer, basic auth) that redacts the `card` field
and the `x-secret` header. Every process is killed
and every topic deleted at the end.

Screenshots go to ``KDELAY_SCREENSHOTS`` when set (the docs' pictures were
made with ``KDELAY_SCREENSHOTS=docs/console``), else under the test's tmp dir.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from kdelay.web.access import hash_secret
from tests.conftest import _unavailable
from tests.e2e.conftest import (
    Deployment,
    KdelayProcess,
    clean_environment,
    kdelay_command,
    run_cli,
)

READY_S = 90.0
RETRY_MS = 3_000
REDACT = "card,x-secret"
"""What the console with users redacts (the open one redacts nothing)."""
OPERATOR = ("olga", "operator-secret-1")
VIEWER = ("vera", "viewer-secret-2")


def chromium_path() -> str:
    """Debian's Chromium; skip (locally) or fail (CI) without it."""
    found = os.environ.get("KDELAY_CHROMIUM") or shutil.which("chromium")
    if not found:
        _unavailable("no chromium: apt-get install chromium")
    return found


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for every browser test."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (the dev extra)")
    executable = chromium_path()
    with sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go."""
    chosen = os.environ.get("KDELAY_SCREENSHOTS")
    where = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def free_port() -> int:
    """A port nothing listens on now, on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class WebProcess:
    """One ``kdelay web`` subprocess, its output in ``log_path``."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [*kdelay_command(), "web"], env={**env, "KDELAY_WEB_PORT": str(self.port)},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, headers: dict[str, str] | None = None) -> None:
        """Wait until the console answers its session endpoint."""
        deadline = time.monotonic() + READY_S
        request = urllib.request.Request(  # noqa: S310 (an http URL on loopback)
            f"{self.url}/api/v1/session", headers=headers or {})
        while True:
            assert self.popen.poll() is None, f"kdelay web exited:\n{self.log()}"
            try:
                with urllib.request.urlopen(request, timeout=5):  # noqa: S310
                    return
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"kdelay web not ready:\n{self.log()}"
                time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-4000:]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)


@dataclass(frozen=True)
class Stack:
    """A deployment with its service and two consoles (open, and with users)."""

    deployment: Deployment
    target: str
    audit: str
    open: WebProcess
    users: WebProcess
    view_dir: Path
    service: KdelayProcess


@pytest.fixture(scope="module")
def stack(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The module's deployment, service and consoles (see the module docstring)."""
    root = tmp_path_factory.mktemp("console")
    suffix = uuid.uuid4().hex[:12]
    deployment = Deployment(
        bootstrap=bootstrap, requests=f"web-req-{suffix}", changelog=f"web-chg-{suffix}",
        dlq=f"web-dlq-{suffix}", group_id=f"web-g-{suffix}", state_dir=root / "state",
        partitions=2, outcomes=f"web-out-{suffix}", status=f"web-sts-{suffix}")
    target, audit = f"web-orders-{suffix}", f"web-audit-{suffix}"
    made = run_cli(deployment.env(), "topics", "create", "--partitions", "2", "--target", target)
    assert made.returncode == 0, made.stderr
    # A target that fails is retried for 3 s, not the default 15 min, so that a dead
    # letter (a target topic created late) is made in a test's time; the consoles run
    # with their defaults.
    service = KdelayProcess("kdelay-run", deployment.env(KDELAY_DELIVERY_RETRY_MS=str(
        RETRY_MS)), root / "run.log")
    users = ",".join(f"{name}:{role}:{hash_secret(secret, iterations=1_000)}"
                     for (name, secret), role in ((OPERATOR, "operator"), (VIEWER, "viewer")))
    common = {"KDELAY_AUDIT_TOPIC": audit}
    opened = WebProcess(deployment.env(**common, KDELAY_VIEW_DIR=str(root / "view-open")),
                        root / "web-open.log")
    guarded = WebProcess(deployment.env(**common, KDELAY_VIEW_DIR=str(root / "view-users"),
                                        KDELAY_WEB_USERS=users, KDELAY_WEB_REDACT=REDACT),
                         root / "web-users.log")
    try:
        service.wait_ready()
        opened.wait_ready()
        guarded.wait_ready({"Authorization": "Bearer " + OPERATOR[1]})
        yield Stack(deployment, target, audit, opened, guarded, root / "view-cli", service)
    finally:
        for process in (opened, guarded):
            process.kill()
        service.kill()
        _delete_topics(bootstrap, [deployment.requests, deployment.changelog, deployment.dlq,
                                   deployment.outcomes, deployment.status, target, audit])


def _delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = set(admin.list_topics(timeout=30).topics)
    doomed = [name for name in names if name in existing]
    if doomed:
        for future in admin.delete_topics(doomed).values():
            future.result(timeout=30)


def cli_env(stack: Stack) -> dict[str, str]:
    """The environment of a ``kdelay`` command on the stack's deployment, own view dir."""
    return stack.deployment.env(KDELAY_VIEW_DIR=str(stack.view_dir))


__all__ = ["OPERATOR", "VIEWER", "Stack", "WebProcess", "browser", "clean_environment",
           "cli_env", "shots", "stack"]
