"""The package's rooms and the directions imports may run between them.

Every module of ``src/kdelay`` belongs to one room (its first folder under
``kdelay``; the four client helpers at the top form the ``helpers`` room). A
module may import its own room and the rooms :data:`ALLOWED` lists for it,
nothing else: the engine never sees the CLI, the view or the helpers, and
the view and the helpers never see the engine. Lazy imports inside functions
count as much as those at the top of a module.

Inside the engine, the same one level down: the wings (:data:`WINGS`) are
entered through their face (``engine/delivery/__init__.py``), never through
a private module, and a wing imports of the rest of the engine only what
:data:`WINGS` lists for it. The engine's map (docs/engine.md) names every
module it has.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "kdelay"
HELPERS = frozenset({"client", "outcomes", "retry", "tasks", "recurring", "controls"})
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
    "errors": frozenset(),
    "package": frozenset({"cli", "native"}),
}
for _room in ALLOWED:  # the root of every error with a code: every room may raise one
    if _room != "errors":
        ALLOWED[_room] = ALLOWED[_room] | {"errors"}

WINGS: dict[str, frozenset[str]] = {
    "delivery": frozenset({"kdelay.engine.metrics"}),
    "commit": frozenset({"kdelay.engine.metrics", "kdelay.engine.intake",
                         "kdelay.engine.delivery"}),
}
"""Each wing of the engine, and what of the engine outside it that it may import: delivery
only the metrics; commit also the plans it makes durable and delivery's face (it seals and
settles delivery's work). Never the loop (service, runner, ...), which imports both."""


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
                # ``from kdelay.engine.delivery import _book``: a private module, by name
                found.update(f"{node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_"))
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


def wing_of(module: str) -> str | None:
    """The wing of the engine a dotted module name belongs to (None: not in a wing)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" and parts[2] in WINGS else None


def wing_violations(module: str, source: str) -> list[str]:
    """The imports of ``module`` that enter a wing past its face, or leave a wing for a
    part of the engine it may not see."""
    wing = wing_of(module)
    wrong = []
    for target in sorted(imported(source)):
        other = wing_of(target)
        if other is not None and other != wing and target != f"kdelay.engine.{other}":
            wrong.append(f"{module} imports {target}, behind the face of engine/{other}/")
        elif (wing is not None and other != wing and room_of(target) == "engine"
              and target not in WINGS[wing]):
            wrong.append(f"{module} (engine/{wing}/) imports {target}")
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
    assert wing_violations(module_name(path), path.read_text()) == []


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


@pytest.mark.parametrize(("module", "source"), [
    ("kdelay.engine.service", "from kdelay.engine.delivery._book import Book"),
    ("kdelay.engine.service", "from kdelay.engine.delivery import _book"),
    ("kdelay.engine.commit._checkpoint", "from kdelay.engine.delivery._flights import Flight"),
    ("kdelay.engine.delivery._delivery", "from kdelay.engine.commit import Batch"),
    ("kdelay.engine.delivery._sender", "from kdelay.engine.intake import Plan"),
    ("kdelay.engine.commit._writer", "from kdelay.engine.service import Service"),
    ("kdelay.cli.service", "from kdelay.engine.commit._takeover import Takeover"),
])
def test_a_wing_entered_past_its_face_or_left_for_the_loop_is_caught(
        module: str, source: str) -> None:
    assert len(wing_violations(module, source)) == 1


def test_wings_may_use_faces_and_their_own_modules() -> None:
    assert wing_violations("kdelay.engine.service", (
        "from kdelay.engine.delivery import Delivery\nfrom kdelay.engine import commit\n")) == []
    assert wing_violations("kdelay.engine.commit._checkpoint", (
        "from kdelay.engine.delivery import Delivery\nfrom kdelay.engine.intake import Plan\n"
        "from kdelay.engine.commit._writer import ChangelogWriter\n")) == []
    assert wing_violations("kdelay.engine.delivery._sender", (
        "from kdelay.engine.delivery._book import Job\nfrom kdelay.engine.metrics import Metrics\n"
        )) == []


def test_allowed_imports_pass() -> None:
    source = ("from kdelay.protocol import envelope\nfrom kdelay.state.index import CONSUMED\n"
              "from kdelay.engine.intake import Planner\nfrom kdelay import __version__\n")
    assert violations("kdelay.engine.service", source) == []
    assert violations("kdelay.view.lookup", "from kdelay.recurring import describe") == []


def _layout_page() -> dict[str, str]:
    """The tree of docs/layout.md: each room's lines (``src/kdelay/`` for the top), joined."""
    text = (PACKAGE.parents[1] / "docs" / "layout.md").read_text(encoding="utf-8")
    block = text.split("```", 2)[1]
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


def test_the_layout_page_names_every_module_in_its_room() -> None:
    rooms = _layout_page()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem.startswith("_"):
            continue
        room = "." if path.parent == PACKAGE else path.parent.name
        assert room in rooms, f"docs/layout.md has no line for {room}/"
        if room != "spark":  # described as a whole
            assert re.search(rf"\b{path.stem}\b", rooms[room]), (
                f"docs/layout.md misses {room}/{path.stem}")


def test_the_engine_map_names_every_module() -> None:
    """docs/engine.md is the engine's map: a module it does not name is one a newcomer
    cannot find (and one it names that is gone, a page that misleads)."""
    text = (PACKAGE.parents[1] / "docs" / "engine.md").read_text(encoding="utf-8")
    engine = PACKAGE / "engine"
    named = set(re.findall(r"(?<![\w/.])((?:delivery/|commit/)?_?[a-z]+\.py)\b", text))
    present = {str(p.relative_to(engine)) for p in engine.rglob("*.py")
               if p.name != "__init__.py"}
    assert present - named == set(), "docs/engine.md misses these modules"
    assert named - present == set(), "docs/engine.md names modules that are gone"


def test_the_engine_map_follows_one_entry_through_every_stage() -> None:
    text = (PACKAGE.parents[1] / "docs" / "engine.md").read_text(encoding="utf-8")
    life = text.split("## The life of one entry", 1)[1].split("\n## ", 1)[0]
    stages = ["planned", "put", "read ahead", "dispatched", "landed", "sealed", "applied",
              "swept"]
    found = [life.find(f"**{stage}**") for stage in stages]
    assert -1 not in found, dict(zip(stages, found, strict=True))
    assert found == sorted(found), "the stages in the order an entry lives them"


ATTRIBUTE_BUDGET = 15
"""The most instance attributes a class of the engine may hold.

A class past it holds state that belongs together in a smaller named object
(as :class:`kdelay.engine.metrics.Metrics` holds one group per concern): state
that grows while behaviour moves out is how a loop class becomes unreadable.
"""


def instance_attributes(cls: ast.ClassDef) -> set[str]:
    """The names a class gives its instances: ``self.x = ...`` (plain, annotated or in a
    tuple) in any of its methods, and the annotated fields of its body (dataclasses)."""
    names: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for item in [target, *(target.elts if isinstance(target, ast.Tuple) else [])]:
                if (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name)
                        and item.value.id == "self"):
                    names.add(item.attr)
    names.update(statement.target.id for statement in cls.body
                 if isinstance(statement, ast.AnnAssign)
                 and isinstance(statement.target, ast.Name))
    return names


def over_budget(source: str) -> list[str]:
    """The classes of ``source`` with more than :data:`ATTRIBUTE_BUDGET` instance attributes."""
    return [f"{cls.name}: {len(names)} attributes ({', '.join(sorted(names))})"
            for cls in ast.walk(ast.parse(source)) if isinstance(cls, ast.ClassDef)
            and len(names := instance_attributes(cls)) > ATTRIBUTE_BUDGET]


@pytest.mark.parametrize("path", sorted((PACKAGE / "engine").rglob("*.py")),
                         ids=lambda path: module_name(path))
def test_no_engine_class_holds_more_than_its_budget_of_attributes(path: Path) -> None:
    assert over_budget(path.read_text()) == []


def test_a_class_over_the_budget_is_caught() -> None:
    fields = "\n".join(f"    f{n}: int" for n in range(ATTRIBUTE_BUDGET - 1))
    source = (f"class Wide:\n{fields}\n    def __init__(self) -> None:\n"
              "        self.a, self.b = 1, 2\n")
    assert [line.split(":")[0] for line in over_budget(source)] == ["Wide"]
    assert over_budget(source.replace("self.a, self.b = 1, 2", "self.a = 1")) == []
