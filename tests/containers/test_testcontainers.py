"""A handful of integration tests on a broker started through testcontainers.

The same tests as on ``tools/kafka``'s broker, selected by one variable,
``KDELAY_TEST_BROKER=testcontainers``; the container comes from the Kafka image
``tools/images`` builds, through podman's Docker-compatible socket here (or
Docker's, where one answers).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.containers.conftest import ROOT

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

HANDFUL = [
    "tests/integration/test_service.py::test_thousand_requests_delivered_once_intact_and_never_early",
    "tests/integration/test_service.py::test_cancel_and_dedup_by_schedule_id",
    "tests/integration/test_topics.py::test_topics_create_command_creates_six_topics_then_is_idempotent",
    "tests/integration/test_topics.py::test_check_layout_accepts_a_valid_layout",
    "tests/integration/test_client.py",
]


def test_integration_tests_pass_on_a_testcontainers_broker(images: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KDELAY_BOOTSTRAP_SERVERS"}
    env.update(KDELAY_TEST_BROKER="testcontainers", KDELAY_KAFKA_IMAGE=images["KDELAY_KAFKA_IMAGE"])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", *HANDFUL],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=800, check=False)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    print(f"testcontainers broker: {summary}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"broker from testcontainers: {images['KDELAY_KAFKA_IMAGE']}" in proc.stdout
    assert " passed" in summary, summary
    assert "skipped" not in summary, summary
