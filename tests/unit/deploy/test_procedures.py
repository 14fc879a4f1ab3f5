"""Alerts, runbook lines and error messages name the procedure that is current.

An operator follows the words of an alert at the worst moment; a procedure
that was replaced (because it lost data) must not survive in one. Two checks
over everything an operator reads: the alert rules and dashboards (deploy/),
the docs and the README, and the messages in the sources. No procedure in
:data:`RETIRED` is named, and every backquoted `kdelay ...` command exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from kdelay.cli import app
from tests.conftest import ROOT

RETIRED = {
    "kafka-topics.sh --alter": "`kdelay topics grow`: adding changelog partitions by hand "
                               "leaves each schedule id in its old home partition",
    "kafka-topics --alter": "`kdelay topics grow` (as above)",
}
"""Replaced procedures, and what replaced them."""

COMMAND = re.compile(r"`kdelay ([a-z][a-z-]*(?: [a-z][a-z-]*)*)")


def read_by_operators() -> Iterator[Path]:
    """Every file whose text an operator reads: alerts, dashboards, docs, messages."""
    yield ROOT / "README.md"
    yield from sorted((ROOT / "deploy").rglob("*.yml"))
    yield from sorted((ROOT / "deploy").rglob("*.json"))
    yield from sorted((ROOT / "docs").rglob("*.md"))
    yield from sorted((ROOT / "src" / "kdelay").rglob("*.py"))


def resolves(words: list[str], command: Any) -> bool:
    """Whether ``words`` start with a path of subcommands that ends at a command."""
    commands = getattr(command, "commands", None)
    if commands is None:  # a command, not a group
        return True
    return bool(words) and words[0] in commands and resolves(words[1:], commands[words[0]])


def test_the_files_are_found() -> None:
    names = {path.name for path in read_by_operators()}
    assert {"kdelay-rules.yml", "security.md", "service.py", "topics.py"} <= names


@pytest.mark.parametrize(("old", "current"), RETIRED.items())
def test_no_retired_procedure_is_named(old: str, current: str) -> None:
    named = [f"{path.relative_to(ROOT)}:{number}"
             for path in read_by_operators()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if old in line]
    assert not named, f"{old} is retired, the procedure is {current}; named in {named}"


def test_every_kdelay_command_named_exists() -> None:
    top = typer.main.get_command(app)
    named = [(path, words) for path in read_by_operators()
             for words in COMMAND.findall(path.read_text(encoding="utf-8"))]
    unknown = [f"{path.relative_to(ROOT)}: kdelay {words}" for path, words in named
               if not resolves(words.split(), top)]
    assert not unknown, unknown
    assert len(named) > 200, "the pattern finds the commands the docs name"


def test_the_alert_for_added_partitions_names_topics_grow() -> None:
    rules = (ROOT / "deploy" / "prometheus" / "kdelay-rules.yml").read_text(encoding="utf-8")
    alert = rules.split("- alert: KdelayRequestPartitionsAdded", 1)[1].split("- alert:", 1)[0]
    assert "`kdelay topics grow --partitions" in alert
