"""Builds the fold's modules and the connector's scheduler hooks with Cython (pure-Python mode: the same
.py files, compiled) where a C compiler is; anywhere else, or when the build fails, the package installs
with them interpreted.

Which folders install as which package (the repository's top-level folders as kvledger.*) is here too,
beside the compiled modules' names; everything else about the package is in pyproject.toml.
`KVLEDGER_INTERPRETED=1` at build time skips
the compiled modules altogether (and at run time loads the sources anyway: ledger/compiled.py).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext

TOP_LEVEL = ("ledger", "connector", "api", "cli", "proxy", "migrations")
"""The repository's top-level folders: each installs as kvledger.<folder>, so that an environment gets the one
name kvledger (vLLM's may already hold an `api` or a `cli` of its own)."""

PACKAGE_DIR = {"kvledger": "kvledger"} | {f"kvledger.{name}": name for name in TOP_LEVEL}
"""Where each package's files are: kvledger/ holds its `__init__.py` (and, for a checkout, links to the same
folders), the rest are the top-level folders themselves."""

PACKAGES = ["kvledger"] + [
    f"kvledger.{package}"
    for package in find_namespace_packages(include=[*TOP_LEVEL, *(f"{name}.*" for name in TOP_LEVEL)])
    if "__pycache__" not in package
]
"""Every package under them (api/templates, which holds no Python, included: its pages are package data)."""

FOLD_SOURCES = (
    "ledger/decisions.py",
    "ledger/lifecycle.py",
    "ledger/transfer_state.py",
    "ledger/side.py",
    "ledger/indexes.py",
    "ledger/tombstone.py",
    "ledger/upkeep.py",
    "ledger/fold.py",
    "ledger/log.py",
    "ledger/ledger.py",
    "ledger/valid.py",
    "ledger/jsonl.py",
    "ledger/advice.py",
    "ledger/replay.py",
    "ledger/series.py",
    "ledger/projection.py",
    "ledger/ownership.py",
    "ledger/partition.py",
    "ledger/summary.py",
)
"""The modules ledger/compiled.py knows as FOLD_MODULES (this file runs before the package imports)."""

HOOK_SOURCES = (
    "connector/params.py",
    "connector/index.py",
    "connector/maps.py",
    "connector/scheduler.py",
)
"""The scheduler hooks' modules, connector/compiled.py's HOOK_MODULES: what vLLM's step runs of ours."""

DIRECTIVES = {
    "language_level": 3,
    "annotation_typing": False,  # types are declared with cython.declare/locals: hints stay hints
    "boundscheck": False,
    "wraparound": True,
    "nonecheck": True,  # a side or event that is None raises as it does interpreted, never reads memory
    "initializedcheck": True,
}


def _warn(message: str) -> None:
    print(f"WARNING: kvledger: {message}; the fold and the hooks run interpreted", file=sys.stderr)


BUILD_JOBS = os.cpu_count() or 1
"""Modules translated and compiled at once: one at a time, the 20 modules took over a minute of an install."""


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install: the same modules run as Python."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = BUILD_JOBS

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # no compiler, no headers: any of distutils' errors
            _warn(f"building the compiled fold failed ({error})")

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:
            _warn(f"compiling {ext.name} failed ({error})")


def _module_name(path: str) -> str:
    """ledger/fold.py -> kvledger.ledger.fold: the name the compiled module is imported by (and its cimports,
    which Cython resolves through kvledger/'s links)."""
    return "kvledger." + path[:-3].replace("/", ".")


def _extensions() -> list[Any]:
    if os.environ.get("KVLEDGER_INTERPRETED", "") not in ("", "0"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _warn("Cython is not installed")
        return []
    modules = [Extension(_module_name(path), [path]) for path in FOLD_SOURCES + HOOK_SOURCES]
    return list(
        cythonize(modules, compiler_directives=DIRECTIVES, build_dir="build/cython", quiet=True, nthreads=BUILD_JOBS)
    )


setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
