"""Build kdelay; compile the delivery hot path with mypyc where a C compiler is at hand.

The modules of ``kdelay.native.HOT_PATH`` become extension modules beside
their sources, and ``src/kdelay/compiled.json`` records the hash of each
source compiled, so that ``kdelay.native`` can tell a build that no longer
matches its sources. With ``KDELAY_PURE_PYTHON=1``, without mypyc or
without a C compiler, nothing is compiled and every module runs interpreted;
a compile that fails leaves the whole hot path interpreted too (``kdelay.native``
finds the build incomplete at import and says so).

pip runs this file three times an install (the build's requirements, its metadata,
the build itself); mypyc translates the modules (about 15 s of CPU) only in the last,
once.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import shlex
import shutil
import sysconfig
import tempfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

PACKAGE = Path(__file__).resolve().parent / "src" / "kdelay"
native = runpy.run_path(str(PACKAGE / "native.py"))


def compiler_found() -> bool:
    """Whether the C compiler Python was built with (or ``$CC``) is on PATH."""
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    return bool(compiler) and shutil.which(compiler[0]) is not None


def clear_earlier_builds() -> None:
    """Remove what an earlier in-place build (an editable install) left beside the sources."""
    (PACKAGE / native["MANIFEST"]).unlink(missing_ok=True)
    for module in native["extension_modules"](PACKAGE):
        for suffix in EXTENSION_SUFFIXES:
            native["source_of"](module, PACKAGE).with_suffix(suffix).unlink(missing_ok=True)
    for suffix in EXTENSION_SUFFIXES:  # mypyc's shared library of each build
        for library in PACKAGE.parent.glob(f"*__mypyc{suffix}"):
            library.unlink()


@functools.cache
def compiling() -> bool:
    """Whether this build compiles the hot path: asked for, a compiler and mypyc at hand."""
    if os.environ.get(native["PURE_PYTHON_ENV"]) or not compiler_found():
        return False
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def translated() -> list[Any]:
    """The hot path's extension modules, or none where they cannot be built."""
    if not compiling():
        return []
    from mypyc.build import mypycify

    manifest = PACKAGE / native["MANIFEST"]
    modules = native["HOT_PATH"]
    sources = [str(native["source_of"](module, PACKAGE).relative_to(PACKAGE.parent.parent))
               for module in modules]
    # pip builds in an environment of its own, without kdelay's dependencies:
    # their types are unknown there (Any), which compiles the same calls. The
    # project's strict settings are for the source tree (tools/test runs them).
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "mypy.ini"
        config.write_text("[mypy]\nignore_missing_imports = True\n", encoding="utf-8")
        try:
            extensions = mypycify([f"--config-file={config}", *sources], opt_level="3",
                                  group_name=native["LIBRARY"].removesuffix("__mypyc"))
        except (Exception, SystemExit) as exc:  # mypyc found an error: build nothing
            print(f"setup.py: not compiling the hot path: {exc}")
            return []
    for extension in extensions:
        # A failed compile leaves its modules interpreted: kdelay.native checks at import
        # that every extension (mypyc's shared library too) loads, else runs the sources.
        extension.optional = True
    manifest.write_text(json.dumps(native["manifest_of"](modules, PACKAGE), indent=1) + "\n")
    return extensions


class HotPathDistribution(Distribution):
    """A distribution with extension modules where the hot path will be compiled.

    They are made by ``build_ext`` itself, so setuptools is told here that there
    are some: else it would skip ``build_ext`` and tag the wheel pure Python.
    """

    def has_ext_modules(self) -> bool:
        return bool(self.ext_modules) or compiling()


METADATA_ONLY = frozenset({"egg_info", "dist_info", "sdist"})
"""Commands that build nothing (they finalize ``build_ext`` all the same)."""


class HotPathBuild(build_ext):
    """``build_ext`` with the hot path's extension modules, translated by mypyc once a build."""

    def finalize_options(self) -> None:
        if not METADATA_ONLY.issuperset(self.distribution.commands):
            self.distribution.ext_modules = translated()
        super().finalize_options()


# Whatever runs this file (an install, a metadata step, a pure build) starts from sources
# alone: an earlier in-place build (an editable install) would outlive its sources.
clear_earlier_builds()
setup(distclass=HotPathDistribution, cmdclass={"build_ext": HotPathBuild})
