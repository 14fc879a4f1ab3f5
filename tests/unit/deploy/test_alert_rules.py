"""The shipped alert rules, checked and unit-tested by Prometheus's own ``promtool``.

``tools/test`` installs Debian's ``prometheus`` package, which brings promtool;
without it these tests skip locally and fail under CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

RULES_DIR = ROOT / "deploy" / "prometheus"


def promtool() -> str:
    """The path of promtool; skip (fail under CI) when it is not installed."""
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("promtool is not installed (tools/test installs it)")
        pytest.skip("promtool is not installed (tools/test installs it)")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=RULES_DIR, capture_output=True, text=True,
                          timeout=60, check=False)


def test_rules_are_valid() -> None:
    result = run_promtool("check", "rules", "kdelay-rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 19 rules found" in result.stdout


def test_rule_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", "kdelay-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
