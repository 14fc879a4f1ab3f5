"""``kdelay web``'s refusals before it serves anything, and ``--hash-secret``."""

from __future__ import annotations

import getpass

import pytest
from typer.testing import CliRunner

from kdelay.cli import app
from kdelay.web.access import verify_secret


def test_an_open_console_off_loopback_is_refused_at_start() -> None:
    result = CliRunner().invoke(app, ["web", "--web-host", "0.0.0.0"])  # noqa: S104
    assert result.exit_code == 2
    assert "error[auth-required]" in result.output


def test_malformed_users_are_refused_at_start_without_echoing_them() -> None:
    result = CliRunner().invoke(app, ["web"], env={"KDELAY_WEB_USERS": "a:boss:pbkdf2_sha256$x"})
    assert result.exit_code == 2
    assert "error[invalid-users]" in result.output
    assert "pbkdf2_sha256$x" not in result.output


def test_hash_secret_prints_a_hash_of_the_secret_it_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getpass", lambda prompt: "correct horse")
    result = CliRunner().invoke(app, ["web", "--hash-secret"])
    assert result.exit_code == 0
    assert verify_secret("correct horse", result.output.strip())
    assert "correct horse" not in result.output
