"""Errors with a root: every error with a stable code is a KdelayError, and the CLI's one
table turns each into its exit status."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from kdelay.cli.options import KAFKA_ERROR_EXIT, USER_ERROR_EXIT, exit_code_of
from kdelay.client import DeliveryError, RequestRefused
from kdelay.errors import KdelayError, ServiceError
from kdelay.outcomes import NO_OUTCOME_EXIT, NoOutcome
from kdelay.plumbing.connection import AUTHENTICATION_FAILED, BROKER_UNREACHABLE, ConnectionFailure
from kdelay.plumbing.settings import SettingsError
from kdelay.view.export import ExportError

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "kdelay"


def _sets_code(cls: ast.ClassDef) -> bool:
    """Whether a class gives its instances a ``code`` (class attribute or in ``__init__``)."""
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            if (isinstance(target, ast.Name) and target.id == "code") or (
                    isinstance(target, ast.Attribute) and target.attr == "code"
                    and isinstance(target.value, ast.Name) and target.value.id == "self"):
                return True
    return False


def test_every_exception_with_a_code_derives_from_the_root() -> None:
    orphans = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or not _sets_code(node):
                continue
            bases = {b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases}
            if (bases & {"Exception", "ValueError"} and not bases & {"KdelayError"}
                    and node.name != "KdelayError"):
                orphans.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert orphans == []


@pytest.mark.parametrize(("error", "status"), [
    (SettingsError("bad-setting", "no"), USER_ERROR_EXIT),
    (RequestRefused("delay-too-long", "no"), USER_ERROR_EXIT),
    (DeliveryError(KafkaError(KafkaError._MSG_TIMED_OUT), "requests"), KAFKA_ERROR_EXIT),
    (ExportError("late"), KAFKA_ERROR_EXIT),
    (NoOutcome("no-outcome", "none"), NO_OUTCOME_EXIT),
    (ServiceError("fenced", "another"), KAFKA_ERROR_EXIT),
    (ConnectionFailure(AUTHENTICATION_FAILED, "no"), USER_ERROR_EXIT),
    (ConnectionFailure(BROKER_UNREACHABLE, "no"), KAFKA_ERROR_EXIT),
])
def test_the_cli_maps_each_error_to_its_exit_status(error: KdelayError, status: int) -> None:
    assert isinstance(error, KdelayError)
    assert exit_code_of(error) == status
