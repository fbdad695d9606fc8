"""Which build of the fold runs: its modules compiled by Cython, or the same files interpreted.

The fold's modules (`FOLD_MODULES`) are plain Python that Cython also compiles (its pure-Python mode;
setup.py builds them where a C compiler is, and a failed build leaves them interpreted). Python finds
an extension module before its source, so this finder, installed by `ledger/__init__.py` before
anything imports the fold, decides which of the two loads (for the fold, and for any other group of
compiled modules a package installs it for: the connector's scheduler hooks, connector/compiled.py):

- `KVLEDGER_INTERPRETED=1` in the environment: the source, always (the tests compare the two builds;
  a debugger or coverage sees the source lines);
- a source newer than its compiled module (edited since the last build): the source, with a warning,
  so that an edit is never shadowed by a stale build;
- otherwise the ordinary finders (the compiled module where there is one).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import GetSetDescriptorType, ModuleType
from typing import Final

FOLD_MODULES: Final = (
    "kvledger.ledger.decisions",
    "kvledger.ledger.lifecycle",
    "kvledger.ledger.transfer_state",
    "kvledger.ledger.side",
    "kvledger.ledger.indexes",
    "kvledger.ledger.tombstone",
    "kvledger.ledger.upkeep",
    "kvledger.ledger.fold",
    "kvledger.ledger.log",
    "kvledger.ledger.ledger",
    "kvledger.ledger.valid",
    "kvledger.ledger.jsonl",
    "kvledger.ledger.advice",
    "kvledger.ledger.replay",
    "kvledger.ledger.series",
    "kvledger.ledger.projection",
    "kvledger.ledger.ownership",
    "kvledger.ledger.partition",
    "kvledger.ledger.summary",
)
"""The modules setup.py compiles, in import order: the fold's, an append's numbering loop (log) and the
shell that appends and folds under one lock (ledger: every scheduler hook's event goes through it), a
replay's hot path (reading a JSONL log, its chunk check, the latency histograms, the loop that folds a
chunk), the service's loop that folds the store's rows with its bookkeeping (the holding series,
the projection), and the block ownership a partitioned fold's merge judges `double_owner` on (ownership:
the one loop over every map and release that a `--jobs` replay runs in one process), and which partition
each event goes to (partition: a store's append and every splitter run it over every event), and the
count of sides by phase and mode (summary: a partition worker's every answer, over a state never compacted)."""

LAYOUT_SOURCES: Final = ("events.py", "claims.py")
"""Interpreted modules whose classes' memory layout the compiled fold is built for (ledger/structs.pxd,
with transfer_state.py's; claims.py's the compiled ownership reads): edited after the build, they make it
stale too."""

INTERPRETED_ENV: Final = "KVLEDGER_INTERPRETED"
"""Set (to anything but empty or 0) to run the fold's sources even where they are compiled."""

STALE_SLACK_S: Final = 2.0
"""A source this much newer than its compiled module was edited after the build (an installer writes
both within moments, in either order)."""


@dataclass(frozen=True)
class CompiledGroup:
    """Modules setup.py compiles that load together, from one folder: all compiled, or all from their
    sources (forced, a source edited since the build, or one module that did not compile)."""

    modules: tuple[str, ...]
    layout_sources: tuple[str, ...] = ()
    """Interpreted modules of the same folder whose classes' memory layout the group is built for."""
    layout_bound: bool = False
    """Whether the group reads msgspec Structs as C structs (ledger/structs.pxd): it then loads compiled only
    where msgspec lays Structs out as declared."""


FOLD: Final = CompiledGroup(FOLD_MODULES, LAYOUT_SOURCES, layout_bound=True)


def interpreted_forced() -> bool:
    return os.environ.get(INTERPRETED_ENV, "") not in ("", "0")


def _compiled_twin(folder: str, stem: str) -> str | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = os.path.join(folder, stem + suffix)
        if os.path.isfile(candidate):
            return candidate
    return None


class SourceFirst(importlib.abc.MetaPathFinder):
    """Loads a group's modules from their sources when told to, or when one compiled module is stale:
    all of them then, because the compiled ones are bound to each other's compiled types."""

    def __init__(self, group: CompiledGroup) -> None:
        self.group = group
        self._decided: dict[str, bool] = {}
        """Per folder: whether the group there runs from its sources."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.group.modules or not path:
            return None
        stem = fullname.rpartition(".")[2]
        for folder in path:
            source = os.path.join(folder, stem + ".py")
            if not os.path.isfile(source):
                continue
            if _compiled_twin(folder, stem) is None or not self._from_sources(folder):
                return None  # the ordinary finders load what is there
            return importlib.util.spec_from_file_location(fullname, source)
        return None

    def _from_sources(self, folder: str) -> bool:
        decided = self._decided.get(folder)
        if decided is None:
            decided = self._decided[folder] = interpreted_forced() or _unusable(folder, self.group)
        return decided


def _unusable(folder: str, group: CompiledGroup) -> bool:
    """Whether the compiled group in `folder` must not load (stale, incomplete, or built for another
    layout of msgspec's Structs), with a warning saying why."""
    stale = _stale(folder, group)
    if stale:
        what = "the fold was" if group.layout_bound else "its modules were"
        warnings.warn(
            f"{', '.join(stale)} in {folder} changed after {what} compiled, or did not compile: "
            "running them interpreted (rebuild with `python setup.py build_ext --inplace`)",
            stacklevel=4,
        )
        return True
    if group.layout_bound and not struct_layout_holds():
        warnings.warn(
            "this msgspec lays out its Structs otherwise than ledger/structs.pxd declares: the fold runs interpreted",
            stacklevel=4,
        )
        return True
    return False


def _stale(folder: str, group: CompiledGroup) -> list[str]:
    """The group's sources in `folder` newer than their compiled modules, or without one where others have
    one (a build that failed part way), and the layout sources newer than the oldest compiled module."""
    out = []
    built = []
    for name in group.modules:
        stem = name.rpartition(".")[2]
        source, compiled = os.path.join(folder, stem + ".py"), _compiled_twin(folder, stem)
        if compiled is None or os.stat(source).st_mtime > os.stat(compiled).st_mtime + STALE_SLACK_S:
            out.append(stem + ".py")
        if compiled is not None:
            built.append(os.stat(compiled).st_mtime)
    for name in group.layout_sources:
        source = os.path.join(folder, name)
        if built and os.path.isfile(source) and os.stat(source).st_mtime > min(built) + STALE_SLACK_S:
            out.append(name)
    return out


def struct_layout_holds() -> bool:
    """Whether msgspec lays a Struct out as ledger/structs.pxd declares (the compiled fold reads sides and
    events as those C structs): after the object header, its base class's fields and then its own, each
    sorted by name, one object pointer each. Checked on a throwaway pair of Structs, by address
    (CPython's `id`, which the compiled fold needs anyway)."""
    import ctypes

    import msgspec

    class Base(msgspec.Struct, gc=False):
        b: object = None
        a: object = None

    class Probe(Base, gc=False):
        d: object = None
        c: object = None

    values = {name: object() for name in ("a", "b", "c", "d")}
    probe = Probe(**values)
    pointer = ctypes.sizeof(ctypes.c_void_p)
    if Probe.__basicsize__ != object.__basicsize__ + len(values) * pointer:
        return False
    at = id(probe) + object.__basicsize__
    return all(
        ctypes.c_void_p.from_address(at + i * pointer).value == id(values[name])
        for i, name in enumerate(("a", "b", "c", "d"))
    )


def install(group: CompiledGroup = FOLD) -> None:
    """Put `group`'s finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, SourceFirst) and finder.group == group for finder in sys.meta_path):
        sys.meta_path.insert(0, SourceFirst(group))


def compiled(group: CompiledGroup = FOLD) -> bool:
    """Whether every module of `group` (the fold's by default) that runs here is the compiled one."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for name in group.modules:
        module = importlib.import_module(name)
        if not (module.__file__ or "").endswith(suffixes):
            return False
    return True


def declared_fields(cls: type) -> tuple[str, ...]:
    """The data attributes of a compiled class and its bases: its extension types' settable fields
    (a read-only property is left out), which interpreted would be the keys of an instance's dict."""
    cached = _FIELDS.get(cls)
    if cached is not None:
        return cached
    probe = cls()
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if name.startswith("__") or not isinstance(attribute, GetSetDescriptorType) or name in names:
                continue
            try:
                setattr(probe, name, getattr(probe, name))
            except AttributeError:
                continue  # a property
            names.append(name)
    fields = _FIELDS[cls] = tuple(names)
    return fields


_FIELDS: dict[type, tuple[str, ...]] = {}
