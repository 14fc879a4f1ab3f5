"""How the hot path runs: compiled only while the build matches its sources."""

from __future__ import annotations

import importlib.machinery
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import kdelay.engine.delivery
from kdelay import native

EXTENSION = importlib.machinery.EXTENSION_SUFFIXES[0]


@pytest.fixture(autouse=True)
def _mode_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`native.choose` sets the process's mode: each test's choice is undone."""
    monkeypatch.setattr(native, "mode", native.mode)


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A package tree with every hot-path source, compiled, and the manifest of that build."""
    root = tmp_path / "kdelay"
    for module in native.HOT_PATH:
        source = native.source_of(module, root)
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(f"NAME = {module!r}\n", encoding="utf-8")
        source.with_suffix(EXTENSION).write_bytes(b"")
    manifest = native.manifest_of(native.HOT_PATH, root)
    (root / native.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    return root


def test_a_build_that_matches_its_sources_runs_compiled(package: Path) -> None:
    finders: list[Any] = []
    assert native.choose({}, package, finders) == "compiled"
    assert finders == []


def test_a_source_changed_since_the_build_runs_everything_from_the_sources(
        package: Path) -> None:
    source = native.source_of("kdelay.engine.window", package)
    source.write_text("NAME = 'edited'\n", encoding="utf-8")
    finders: list[Any] = []
    mode = native.choose({}, package, finders)
    assert mode.startswith("interpreted (window.py changed since it was compiled")
    assert len(finders) == 1
    assert native.choose({}, package, finders) == mode
    assert len(finders) == 1, "one finder, however often it is chosen"


def test_the_environment_asks_for_the_sources(package: Path) -> None:
    finders: list[Any] = []
    mode = native.choose({native.PURE_PYTHON_ENV: "1"}, package, finders)
    assert mode == "interpreted (KDELAY_PURE_PYTHON is set)"
    assert len(finders) == 1


def test_a_build_without_its_manifest_is_not_trusted(package: Path) -> None:
    (package / native.MANIFEST).unlink()
    finders: list[Any] = []
    assert native.choose({}, package, finders).startswith("interpreted (book.py changed")
    assert len(finders) == 1


def test_nothing_compiled_needs_no_finder(package: Path) -> None:
    for module in native.HOT_PATH:
        native.source_of(module, package).with_suffix(EXTENSION).unlink()
    finders: list[Any] = []
    assert native.choose({}, package, finders) == "interpreted (not compiled at install)"
    assert finders == []


def test_the_finder_names_the_sources_of_its_modules_only(package: Path) -> None:
    finder = native.Sources(frozenset({"kdelay.engine.book"}), package)
    spec = finder.find_spec("kdelay.engine.book", None)
    assert spec is not None
    assert spec.origin == str(package / "engine" / "book.py")
    assert finder.find_spec("kdelay.engine.delivery", None) is None
    assert finder.find_spec("json", None) is None


def test_an_extension_left_by_an_earlier_build_never_loads(package: Path) -> None:
    stray = package / "state" / "index.py"
    stray.write_text("NAME = 'index'\n", encoding="utf-8")
    stray.with_suffix(EXTENSION).write_bytes(b"")
    finders: list[Any] = []
    assert native.choose({}, package, finders) == "compiled"
    assert [f.modules for f in finders] == [frozenset({"kdelay.state.index"})]
    native.choose({native.PURE_PYTHON_ENV: "1"}, package, finders)
    assert finders[0].modules == frozenset({*native.HOT_PATH, "kdelay.state.index"})


def test_this_process_runs_the_hot_path_as_its_mode_says() -> None:
    loaded = kdelay.engine.delivery.__file__
    assert loaded is not None
    if native.mode == "compiled":
        assert loaded.endswith(EXTENSION)
    else:
        assert loaded.endswith(".py")
    assert all(module not in sys.modules or native.mode == "compiled"
               or str(sys.modules[module].__file__).endswith(".py")
               for module in native.HOT_PATH)
