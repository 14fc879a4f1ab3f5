"""How the hot path runs: compiled only while the build matches its sources."""

from __future__ import annotations

import _ctypes
import importlib.machinery
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kdelay
import kdelay.engine.delivery._delivery
from kdelay import native

EXTENSION = importlib.machinery.EXTENSION_SUFFIXES[0]
LOADABLE = Path(str(_ctypes.__file__)).read_bytes()
"""A shared object the dynamic loader opens: what an extension module of a build is to it."""


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
        source.with_suffix(EXTENSION).write_bytes(LOADABLE)
    (tmp_path / native.LIBRARY).with_suffix(EXTENSION).write_bytes(LOADABLE)
    manifest = native.manifest_of(native.HOT_PATH, root)
    (root / native.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    return root


def test_a_build_that_matches_its_sources_runs_compiled(package: Path) -> None:
    finders: list[Any] = []
    assert native.choose({}, package, finders) == "compiled"
    assert finders == []


def test_a_source_changed_since_the_build_runs_everything_from_the_sources(
        package: Path) -> None:
    source = native.source_of("kdelay.engine.delivery._book", package)
    source.write_text("NAME = 'edited'\n", encoding="utf-8")
    finders: list[Any] = []
    mode = native.choose({}, package, finders)
    assert mode.startswith("interpreted (_book.py changed since it was compiled")
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
    assert native.choose({}, package, finders).startswith("interpreted (_checkpoint.py changed")
    assert len(finders) == 1


def test_nothing_compiled_needs_no_finder(package: Path) -> None:
    for module in native.HOT_PATH:
        native.source_of(module, package).with_suffix(EXTENSION).unlink()
    finders: list[Any] = []
    assert native.choose({}, package, finders) == "interpreted (not compiled at install)"
    assert finders == []


def test_a_build_without_its_shared_library_runs_everything_from_the_sources(
        package: Path, caplog: pytest.LogCaptureFixture) -> None:
    """mypyc's shared library failed to compile, its modules' own small extensions did not."""
    (package.parent / native.LIBRARY).with_suffix(EXTENSION).unlink()
    finders: list[Any] = []
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        mode = native.choose({}, package, finders)
    assert mode == ("interpreted (the compiled build does not load: "
                    "kdelay__mypyc is missing beside the package)")
    assert [f.modules for f in finders] == [frozenset(native.HOT_PATH)]
    assert [r.getMessage() for r in caplog.records] == [
        "kdelay: the delivery hot path runs interpreted: its compiled build does not load "
        "(kdelay__mypyc is missing beside the package); pip install kdelay again with a C "
        "compiler to fix it"]


def test_a_build_missing_one_module_runs_everything_from_the_sources(package: Path) -> None:
    native.source_of("kdelay.engine.delivery._readahead", package).with_suffix(EXTENSION).unlink()
    finders: list[Any] = []
    assert native.choose({}, package, finders) == (
        "interpreted (the compiled build does not load: kdelay.engine.delivery._readahead has no "
        "extension module)")
    assert [f.modules for f in finders] == [
        frozenset(native.HOT_PATH) - {"kdelay.engine.delivery._readahead"}]


def test_an_extension_the_loader_refuses_runs_everything_from_the_sources(package: Path) -> None:
    """A truncated file: the dynamic loader's own words say which and why."""
    stub = native.source_of("kdelay.engine.delivery._book", package).with_suffix(EXTENSION)
    stub.write_bytes(LOADABLE[:100])
    mode = native.choose({}, package, [])
    assert mode.startswith(f"interpreted (the compiled build does not load: {stub}: ")


def test_a_half_failed_build_imports_from_its_sources_with_one_warning_line(
        tmp_path: Path) -> None:
    """The build as ``setup.py`` leaves it when mypyc's shared library fails to compile
    and every module's extension (which only imports that library) builds: a fresh
    process imports the whole hot path, interpreted, and warns once."""
    package = tmp_path / "kdelay"
    shutil.copytree(Path(kdelay.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", native.MANIFEST))
    for module in native.HOT_PATH:
        native.source_of(module, package).with_suffix(EXTENSION).write_bytes(LOADABLE)
    manifest = native.manifest_of(native.HOT_PATH, package)
    (package / native.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    code = ("import importlib, sys; from kdelay import native; "
            "[importlib.import_module(m) for m in native.HOT_PATH]; "
            "import kdelay.cli; print(native.mode)")
    env = {k: v for k, v in os.environ.items() if k != native.PURE_PYTHON_ENV}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**env, "PYTHONPATH": str(tmp_path)}, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("interpreted (the compiled build does not load: ")
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("kdelay: the delivery hot path runs interpreted: ")


def test_the_finder_names_the_sources_of_its_modules_only(package: Path) -> None:
    finder = native.Sources(frozenset({"kdelay.engine.delivery._book"}), package)
    spec = finder.find_spec("kdelay.engine.delivery._book", None)
    assert spec is not None
    assert spec.origin == str(package / "engine" / "delivery" / "_book.py")
    assert finder.find_spec("kdelay.engine.delivery._delivery", None) is None
    assert finder.find_spec("json", None) is None


def test_an_extension_left_by_an_earlier_build_never_loads(package: Path) -> None:
    stray = package / "state" / "index.py"
    stray.write_text("NAME = 'index'\n", encoding="utf-8")
    stray.with_suffix(EXTENSION).write_bytes(LOADABLE)
    finders: list[Any] = []
    assert native.choose({}, package, finders) == "compiled"
    assert [f.modules for f in finders] == [frozenset({"kdelay.state.index"})]
    native.choose({native.PURE_PYTHON_ENV: "1"}, package, finders)
    assert finders[0].modules == frozenset({*native.HOT_PATH, "kdelay.state.index"})


def test_this_process_runs_the_hot_path_as_its_mode_says() -> None:
    loaded = kdelay.engine.delivery._delivery.__file__
    assert loaded is not None
    if native.mode == "compiled":
        assert loaded.endswith(EXTENSION)
    else:
        assert loaded.endswith(".py")
    assert all(module not in sys.modules or native.mode == "compiled"
               or str(sys.modules[module].__file__).endswith(".py")
               for module in native.HOT_PATH)


def test_every_hot_path_module_has_its_source() -> None:
    """A module moved or merged away from :data:`native.HOT_PATH`'s list would leave it
    naming nothing: setup.py would not compile, and ``choose`` would never trust a build."""
    missing = [m for m in native.HOT_PATH if not native.source_of(m).is_file()]
    assert missing == []
    assert list(native.HOT_PATH) == sorted(set(native.HOT_PATH)), "sorted, each once"
