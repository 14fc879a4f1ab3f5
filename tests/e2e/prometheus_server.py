"""A real Prometheus server for tests: loopback only, temporary config and storage.

The binary comes from Debian's ``prometheus`` package, which ``tools/test``
installs. Without it a test skips locally and fails under CI.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def binary(name: str) -> str:
    """The path of a Prometheus binary; skip (fail under CI) when it is missing."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed (tools/test installs Debian's prometheus)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (host:port) as job ``kdelay`` every second."""

    def __init__(self, directory: Path, targets: list[str], rules: Path | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "kdelay", "scrape_interval": "1s",
                                "static_configs": [{"targets": targets}]}],
        }
        if rules is not None:
            config["rule_files"] = [str(rules)]
        config_path = directory / "prometheus.yml"
        config_path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
        self.log_path = directory / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [binary("prometheus"), f"--config.file={config_path}",
                 f"--storage.tsdb.path={directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.popen.poll() is None, f"prometheus exited: {self.log()[-2000:]}"
            try:
                with urllib.request.urlopen(  # noqa: S310 - http on loopback
                        f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready: {self.log()[-2000:]}"
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate an instant PromQL query; return the result vector's samples."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
            body = json.load(response)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        """The value of a query that yields at most one sample, or None when it yields none."""
        samples = self.query(expr)
        assert len(samples) <= 1, samples
        return float(samples[0]["value"][1]) if samples else None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=15)
