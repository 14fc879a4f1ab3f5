"""The package's rooms and the directions imports may run between them.

Every module of ``src/kdelay`` belongs to one room (its first folder under
``kdelay``; the four client helpers at the top form the ``helpers`` room). A
module may import its own room and the rooms :data:`ALLOWED` lists for it,
nothing else: the engine never sees the CLI, the view or the helpers, and
the view and the helpers never see the engine. Lazy imports inside functions
count as much as those at the top of a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "kdelay"
HELPERS = frozenset({"client", "outcomes", "retry", "tasks", "recurring"})
ALLOWED: dict[str, frozenset[str]] = {
    "protocol": frozenset(),
    "plumbing": frozenset({"protocol"}),
    "state": frozenset({"protocol", "plumbing"}),
    "engine": frozenset({"protocol", "plumbing", "state", "native"}),
    "helpers": frozenset({"protocol", "plumbing"}),
    "view": frozenset({"protocol", "plumbing", "state", "helpers"}),
    "spark": frozenset({"protocol", "plumbing"}),
    "web": frozenset({"protocol", "plumbing", "state", "view", "helpers"}),
    "cli": frozenset({"protocol", "plumbing", "state", "engine", "helpers", "view", "spark",
                      "web", "native"}),
    "native": frozenset(),
    "package": frozenset({"cli", "native"}),
}


def room_of(module: str) -> str:
    """The room of a dotted module name under ``kdelay`` (``kdelay.engine.service`` -> engine)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "package"
    return "helpers" if parts[1] in HELPERS else parts[1]


def module_name(path: Path) -> str:
    """The dotted module name of a file under :data:`PACKAGE`."""
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imported(source: str) -> set[str]:
    """Every ``kdelay`` module a source imports, top-level or lazily, names resolved:
    ``from kdelay import recurring`` imports ``kdelay.recurring``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kdelay")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kdelay":
                found.update(f"kdelay.{a.name}" for a in node.names if a.name != "__version__")
            elif node.module.startswith("kdelay."):
                found.add(node.module)
    return found


def violations(module: str, source: str) -> list[str]:
    """The imports of ``module`` (whose text is ``source``) that cross the allowed directions."""
    room = room_of(module)
    wrong = []
    for target in sorted(imported(source)):
        other = room_of(target)
        if other != room and other != "package" and other not in ALLOWED[room]:
            wrong.append(f"{module} ({room}) imports {target} ({other})")
    return wrong


def modules() -> list[Path]:
    """Every Python module of the package."""
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_known_room() -> None:
    rooms = {room_of(module_name(path)) for path in modules()}
    assert rooms <= set(ALLOWED), rooms - set(ALLOWED)
    assert rooms == set(ALLOWED)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path: Path) -> None:
    assert violations(module_name(path), path.read_text()) == []


def test_every_room_says_what_it_holds_and_may_import() -> None:
    for folder in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert docstring, f"{folder.name}/__init__.py has no docstring"
        if folder.name not in ("cli", "spark"):
            assert "May import" in docstring, folder.name


@pytest.mark.parametrize(("module", "source"), [
    ("kdelay.engine.service", "from kdelay.view.pending import PendingView"),
    ("kdelay.engine.delivery._delivery", "def f():\n    from kdelay import client\n"),
    ("kdelay.view.pending", "import kdelay.engine.service"),
    ("kdelay.client", "from kdelay.state.index import PartitionIndex"),
    ("kdelay.protocol.codec", "from kdelay.plumbing import clock"),
    ("kdelay.spark.audit", "from kdelay.cli import app"),
])
def test_a_crossing_import_is_caught(module: str, source: str) -> None:
    assert len(violations(module, source)) == 1


def test_allowed_imports_pass() -> None:
    source = ("from kdelay.protocol import envelope\nfrom kdelay.state.index import CONSUMED\n"
              "from kdelay.engine.intake import Planner\nfrom kdelay import __version__\n")
    assert violations("kdelay.engine.service", source) == []
    assert violations("kdelay.view.lookup", "from kdelay.recurring import describe") == []


def _readme_layout() -> dict[str, str]:
    """The README's layout tree: each room's lines (``src/kdelay/`` for the top), joined."""
    text = (PACKAGE.parents[1] / "README.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    rooms: dict[str, str] = {}
    room = ""
    for line in block.splitlines():
        head = line[:14].strip()
        if head.startswith("src/kdelay/"):
            room = "."
        elif head.endswith("/") and line.startswith("  "):
            room = head.rstrip("/")
        elif head:
            room = ""
        if room:
            rooms[room] = rooms.get(room, "") + " " + line[14:]
    return rooms


def test_the_readme_layout_names_every_module_in_its_room() -> None:
    rooms = _readme_layout()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem.startswith("_"):
            continue
        room = "." if path.parent == PACKAGE else path.parent.name
        assert room in rooms, f"README's layout has no line for {room}/"
        if room != "spark":  # described as a whole
            assert re.search(rf"\b{path.stem}\b", rooms[room]), (
                f"README's layout misses {room}/{path.stem}")
