"""Which modules run compiled: the delivery hot path, built with mypyc where it can be.

``pip install`` compiles the modules of :data:`HOT_PATH` (``setup.py``) into
extension modules beside their sources, where a C compiler is at hand, and
records a hash of each source it compiled in :data:`MANIFEST`. The sources
stay, and are the same program: the compiled form only runs it with less
Python per record (docs/benchmarks.md).

Python prefers an extension module to its source, so a source edited after
the build (an editable install, a checkout of another commit) would silently
run the code it was compiled from. :func:`choose` runs first, from the
package's ``__init__``: when any hot-path source differs from its recorded
hash, or when :data:`PURE_PYTHON_ENV` is set, it makes the whole hot path load
from its sources. All of it or none: compiled modules call each other's
functions directly, not through the modules Python sees.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HOT_PATH = (
    "kdelay.engine.book",
    "kdelay.engine.checkpoint",
    "kdelay.engine.delivery",
    "kdelay.engine.failures",
    "kdelay.engine.flights",
    "kdelay.engine.intake",
    "kdelay.engine.readahead",
    "kdelay.engine.runs",
    "kdelay.engine.sealing",
    "kdelay.engine.sender",
    "kdelay.engine.service",
    "kdelay.engine.watermarks",
    "kdelay.engine.window",
    "kdelay.engine.writer",
    "kdelay.protocol.codec",
    "kdelay.protocol.envelope",
    "kdelay.state.changes",
    "kdelay.state.originals",
    "kdelay.state.tally",
)
"""The compiled modules. Not the RocksDB index: compiled code frees a local after
its last use, and rocksdict's iterators read options that must outlive them.
Nor :mod:`kdelay.protocol.targets`: its frozen dataclasses travel to
``--workers`` processes by pickle, which compiled dataclasses refuse."""

MANIFEST = "compiled.json"
"""Beside this module: ``{module: sha256 of the source it was compiled from}``."""

PURE_PYTHON_ENV = "KDELAY_PURE_PYTHON"
"""Set (to anything but empty): build nothing at install, and run interpreted."""

_PACKAGE = Path(__file__).resolve().parent

mode = "interpreted"
"""How the hot path runs, set by :func:`choose`: ``compiled``, or ``interpreted (why)``."""


def source_of(module: str, package: Path = _PACKAGE) -> Path:
    """Return the source file of a ``kdelay`` module."""
    return package.parent.joinpath(*module.split(".")).with_suffix(".py")


def digest(path: Path) -> str:
    """Return the hash the manifest records for a source file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_of(modules: Sequence[str], package: Path = _PACKAGE) -> dict[str, str]:
    """Return the manifest of ``modules`` as their sources are now."""
    return {module: digest(source_of(module, package)) for module in modules}


def changed(package: Path = _PACKAGE) -> list[str]:
    """Return the hot-path modules whose source differs from what was compiled
    (every one, when the manifest is missing or unreadable)."""
    try:
        recorded = json.loads((package / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return list(HOT_PATH)
    now = manifest_of(HOT_PATH, package)
    return [module for module in HOT_PATH if recorded.get(module) != now[module]]


def extension_modules(package: Path = _PACKAGE) -> set[str]:
    """Return every ``kdelay`` module with an extension module beside its source."""
    found: set[str] = set()
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for folder, _, files in os.walk(package):
        for name in files:
            suffix = next((s for s in suffixes if name.endswith(s)), None)
            if suffix is not None:
                relative = (Path(folder) / name[:-len(suffix)]).relative_to(package.parent)
                found.add(".".join(relative.parts))
    return found


class Sources(importlib.abc.MetaPathFinder):
    """Finds the sources of ``modules`` ahead of their extension modules."""

    def __init__(self, modules: frozenset[str], package: Path = _PACKAGE) -> None:
        self.modules = modules
        self._package = package

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname,
                                                      source_of(fullname, self._package))


def choose(environ: Mapping[str, str] = os.environ, package: Path = _PACKAGE,
           finders: list[Any] = sys.meta_path) -> str:
    """Decide how the hot path runs, before any of it is imported; return :data:`mode`.

    Interpreted, a finder of the sources goes first in ``finders``. So it does,
    compiled, for extension modules no longer in :data:`HOT_PATH` (left by an
    earlier build): they belong to another build, which must not load.
    """
    global mode  # decided once per process, read by ``kdelay run``
    built = extension_modules(package)
    strays = built - set(HOT_PATH)
    if not built & set(HOT_PATH):
        mode = "interpreted (not compiled at install)"
    elif environ.get(PURE_PYTHON_ENV):
        mode = f"interpreted ({PURE_PYTHON_ENV} is set)"
    elif stale := changed(package):
        mode = (f"interpreted ({source_of(stale[0], package).name} changed since it was "
                "compiled: pip install again to compile it)")
    else:
        mode = "compiled"
    sources = frozenset(strays if mode == "compiled" else built)
    if sources and not any(isinstance(f, Sources) and f.modules == sources for f in finders):
        finders.insert(0, Sources(sources, package))
    return mode
