"""Builds the fold's modules and the connector's scheduler hooks with Cython (pure-Python mode: the same
.py files, compiled) where a C compiler is; anywhere else, or when the build fails, the package installs
with them interpreted.

Which folders install as which package (the repository's top-level folders as kvledger.*) is here too,
beside the compiled modules' names; everything else about the package is in pyproject.toml.
`KVLEDGER_INTERPRETED=1` at build time skips
the compiled modules altogether (and at run time loads the sources anyway: ledger/compiled.py).

Built modules are kept in a cache (`KVLEDGER_BUILD_CACHE`, default `~/.cache/kvledger/build`; `0` turns it off)
under a key made of everything the build reads: this file, every .py and .pxd of ledger/ and connector/,
Cython's and Python's versions and the compiler settings. An install whose key is there copies the modules
instead of translating and compiling them again (a clean clone's `pip install -e .` on 2 cores: about a
minute of CPU); any change to one of those inputs is another key, built afresh.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
from pathlib import Path
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


BUILD_CACHE_DEFAULT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvledger" / "build"


def _warn(message: str) -> None:
    print(f"WARNING: kvledger: {message}; the fold and the hooks run interpreted", file=sys.stderr)


BUILD_JOBS = os.cpu_count() or 1
"""Modules translated and compiled at once: one at a time, the 20 modules took over a minute of an install."""


def _cache_folder(cython_version: str) -> Path | None:
    """Where this build's modules are cached: a folder named by the hash of every input of the build (None: the
    cache is turned off)."""
    setting = os.environ.get("KVLEDGER_BUILD_CACHE", "")
    if setting == "0":
        return None
    key = hashlib.sha256()
    # Every file of the two folders, not only the compiled ones: the fold is built for the memory layout of
    # classes in interpreted modules too (ledger/compiled.py's LAYOUT_SOURCES).
    inputs = [Path("setup.py"), *sorted(Path("ledger").rglob("*.p*")), *sorted(Path("connector").rglob("*.p*"))]
    for path in inputs:
        if path.suffix in (".py", ".pxd") and path.is_file():
            key.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    settings = (cython_version, sys.version, sys.platform, sysconfig.get_config_var("EXT_SUFFIX"))
    compiler = tuple(os.environ.get(name, "") for name in ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED"))
    key.update(repr((settings, compiler, sorted(DIRECTIVES.items()))).encode())
    return Path(setting or BUILD_CACHE_DEFAULT) / key.hexdigest()[:32]


class OptionalBuildExt(build_ext):
    """A failed compile is a warning, not a failed install: the same modules run as Python. Modules found in
    the build cache (`cache`, set by `_extensions`) are copied from it; each module built is put there."""

    cache: Path | None = None

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
        target = Path(self.get_ext_fullpath(ext.name))
        cached = self.cache / ext.name if self.cache is not None else None
        if cached is not None and cached.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cached, target)
            return
        try:
            super().build_extension(ext)
        except Exception as error:
            _warn(f"compiling {ext.name} failed ({error})")
            return
        if cached is not None:
            _keep(target, cached)


def _keep(built: Path, cached: Path) -> None:
    """Put a built module in the cache: written aside and renamed, so a reader never sees half of one."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{cached.name}.{os.getpid()}")
        shutil.copyfile(built, partial)
        partial.replace(cached)
    except OSError as error:  # a cache that cannot be written costs the next build its time, nothing else
        print(f"kvledger: build cache not written ({error})", file=sys.stderr)


def _module_name(path: str) -> str:
    """ledger/fold.py -> kvledger.ledger.fold: the name the compiled module is imported by (and its cimports,
    which Cython resolves through kvledger/'s links)."""
    return "kvledger." + path[:-3].replace("/", ".")


def _extensions() -> list[Any]:
    if os.environ.get("KVLEDGER_INTERPRETED", "") not in ("", "0"):
        return []
    try:
        import Cython
        from Cython.Build import cythonize
    except ImportError:
        _warn("Cython is not installed")
        return []
    modules = [Extension(_module_name(path), [path]) for path in FOLD_SOURCES + HOOK_SOURCES]
    cache = OptionalBuildExt.cache = _cache_folder(str(getattr(Cython, "__version__", "")))
    if cache is not None and all((cache / module.name).is_file() for module in modules):
        return modules  # every one is cached: nothing to translate (build_extension copies them)
    return list(
        cythonize(modules, compiler_directives=DIRECTIVES, build_dir="build/cython", quiet=True, nthreads=BUILD_JOBS)
    )


setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
