"""setup.py's build cache: the key names every input the compiled modules are built from, so a cached module is
only ever one built from the same files (a stale one would run the fold with another memory layout)."""

from __future__ import annotations

import runpy
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of what the build reads, the current directory (as it is for pip's build)."""
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    for folder in ("ledger", "connector"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def cache_folder(tree: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path | None]:
    """setup.py's `_cache_folder`, the file run with `setup()` doing nothing and no module to build."""
    monkeypatch.setattr(setuptools, "setup", lambda **_: None)
    monkeypatch.setenv("KVLEDGER_INTERPRETED", "1")
    monkeypatch.delenv("KVLEDGER_BUILD_CACHE", raising=False)
    names = runpy.run_path(str(tree / "setup.py"))
    function: Callable[[str], Path | None] = names["_cache_folder"]
    return function


def test_the_same_inputs_give_the_same_folder_and_any_input_edited_another(
    tree: Path, cache_folder: Callable[[str], Path | None]
) -> None:
    first = cache_folder("3.1.0")
    assert first is not None and first == cache_folder("3.1.0")
    assert cache_folder("3.2.0") != first  # another Cython
    # An interpreted module whose layout the fold is built for, a compiled one, a .pxd, setup.py itself.
    for edited in ("ledger/events.py", "ledger/fold.py", "ledger/structs.pxd", "connector/maps.py", "setup.py"):
        path = tree / edited
        original = path.read_bytes()
        path.write_bytes(original + b"\n# edited\n")
        assert cache_folder("3.1.0") != first, edited
        path.write_bytes(original)
    assert cache_folder("3.1.0") == first
    (tree / "ledger" / "__pycache__").mkdir(exist_ok=True)
    (tree / "ledger" / "__pycache__" / "fold.cpython-311.pyc").write_bytes(b"bytecode")  # not an input
    assert cache_folder("3.1.0") == first


def test_the_cache_is_off_with_0_and_elsewhere_when_named(
    monkeypatch: pytest.MonkeyPatch, cache_folder: Callable[[str], Path | None], tmp_path: Path
) -> None:
    monkeypatch.setenv("KVLEDGER_BUILD_CACHE", "0")
    assert cache_folder("3.1.0") is None
    monkeypatch.setenv("KVLEDGER_BUILD_CACHE", str(tmp_path / "cache"))
    folder = cache_folder("3.1.0")
    assert folder is not None and folder.parent == tmp_path / "cache"
