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
functions directly, not through the modules Python sees. So it does, with one
warning line, when the build is incomplete: ``setup.py`` makes every extension
optional, and a compile that failed for some of them (mypyc's shared library,
say) leaves extension modules that cannot be imported (:func:`unloadable`).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HOT_PATH = (
    "kdelay.engine.commit._checkpoint",
    "kdelay.engine.commit._writer",
    "kdelay.engine.delivery._book",
    "kdelay.engine.delivery._delivery",
    "kdelay.engine.delivery._failures",
    "kdelay.engine.delivery._flights",
    "kdelay.engine.delivery._readahead",
    "kdelay.engine.delivery._runs",
    "kdelay.engine.delivery._sealing",
    "kdelay.engine.delivery._sender",
    "kdelay.engine.intake",
    "kdelay.engine.service",
    "kdelay.protocol.codec",
    "kdelay.protocol.envelope",
    "kdelay.protocol.idkeys",
    "kdelay.state.changes",
    "kdelay.state.originals",
    "kdelay.state.replay",
    "kdelay.state.tally",
)
"""The compiled modules. Not the RocksDB index: compiled code frees a local after
its last use, and rocksdict's iterators read options that must outlive them.
Nor :mod:`kdelay.protocol.targets`: its frozen dataclasses travel to
``--workers`` processes by pickle, which compiled dataclasses refuse."""

LIBRARY = "kdelay__mypyc"
"""mypyc's shared library, beside the package (``setup.py`` names the build's group
``kdelay``): the compiled code of every module of :data:`HOT_PATH`, whose own extension
modules only load it and call into it."""

MANIFEST = "compiled.json"
"""Beside this module: ``{module: sha256 of the source it was compiled from}``."""

PURE_PYTHON_ENV = "KDELAY_PURE_PYTHON"
"""Set (to anything but empty): build nothing at install, and run interpreted."""

_PACKAGE = Path(__file__).resolve().parent

log = logging.getLogger(__name__)

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


def extension_of(stem: Path) -> Path | None:
    """Return the extension module Python would load for ``stem`` (a path whose suffix is
    replaced), or None when there is none."""
    found = (stem.with_suffix(suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    return next((path for path in found if path.is_file()), None)


def unloadable(package: Path = _PACKAGE) -> str | None:
    """Return why the compiled hot path cannot load as a whole, or None when it can.

    Each module of :data:`HOT_PATH` needs its extension module, and (with more
    than one module) they all need :data:`LIBRARY`. Each file is opened with
    the dynamic loader, which runs none of it: a missing, truncated or
    unlinkable one is found here, before the first import of the hot path,
    after which there is no way back to the sources.
    """
    found = {module: extension_of(source_of(module, package)) for module in HOT_PATH}
    files = [path for path in found.values() if path is not None]
    if len(files) < len(found):
        return f"{next(m for m, path in found.items() if path is None)} has no extension module"
    if len(HOT_PATH) > 1:
        library = extension_of(package.parent / LIBRARY)
        if library is None:
            return f"{LIBRARY} is missing beside the package"
        files.append(library)
    for path in files:
        try:
            ctypes.CDLL(str(path))
        except OSError as exc:
            return str(exc)
    return None


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
    earlier build): they belong to another build, which must not load. A
    build that does not load as a whole (:func:`unloadable`) runs interpreted,
    with one warning line.
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
    elif broken := unloadable(package):
        mode = f"interpreted (the compiled build does not load: {broken})"
        log.warning("kdelay: the delivery hot path runs interpreted: its compiled build does "
                    "not load (%s); pip install kdelay again with a C compiler to fix it", broken)
    else:
        mode = "compiled"
    sources = frozenset(strays if mode == "compiled" else built)
    if sources and not any(isinstance(f, Sources) and f.modules == sources for f in finders):
        finders.insert(0, Sources(sources, package))
    return mode
