"""Helpers around the fake `mori.io` (mori/io.py): load it without installing it, or install it for one block."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from kvledger.connector.transports.mori import MoriTransport

FAKE_ROOT = Path(__file__).resolve().parent
"""The folder that holds the fake `mori` package: on sys.path it shadows any real mori."""


def fake_io() -> ModuleType:
    """The fake under its own package name, so `mori` never enters sys.modules and other tests never see it."""
    return importlib.import_module("tests.connector.fake_mori.mori.io")


def make_mori_transport() -> MoriTransport:
    """A mori transport on the fake (the contract suite's factory); pairs in one process reach each other."""
    return MoriTransport("127.0.0.1", 0, mori_io=fake_io())


@contextmanager
def installed_as_mori() -> Iterator[ModuleType]:
    """`import mori.io` yields the fake inside the block; sys.path and sys.modules are restored after it."""
    saved = {name: module for name, module in sys.modules.items() if name == "mori" or name.startswith("mori.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(FAKE_ROOT))
    try:
        yield importlib.import_module("mori.io")
    finally:
        sys.path.remove(str(FAKE_ROOT))
        for name in [name for name in sys.modules if name == "mori" or name.startswith("mori.")]:
            del sys.modules[name]
        sys.modules.update(saved)
