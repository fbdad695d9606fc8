"""The house's floors, read from the source: every import arrow points down, and no modules import each other.

Floors (the top-level folders, installed as kvledger.<folder>): `ledger/` at the bottom (it imports none of the
others, nor `migrations/`, whose env.py imports the store: the store finds the scripts by name and hands them
to Alembic); `connector/` and `api/` on it, side by side, never importing each other; `cli/` and `proxy/` on
top, imported by nothing below. Every import counts:
module level, inside a function (a lazy import is still an arrow: the code cannot run without the module
above), and under `if TYPE_CHECKING:` (a type named from a floor above still ties the floor to it, and a
cycle through annotations is still a cycle a reader has to untangle). Read with `ast`, so the test runs
without importing anything it checks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ledger", "connector", "api", "cli", "proxy", "migrations")
"""The floors: the repository's top-level folders, each installed as kvledger.<folder>."""

FORBIDDEN: dict[str, frozenset[str]] = {
    "ledger": frozenset({"connector", "api", "cli", "proxy", "migrations"}),
    "connector": frozenset({"api", "cli", "proxy"}),
    "api": frozenset({"connector", "cli", "proxy"}),
    "proxy": frozenset({"connector", "api", "cli"}),
    "cli": frozenset(),
    "migrations": frozenset({"connector", "api", "cli", "proxy"}),
}
"""For each floor, the floors it must not import (kvledger.<floor>)."""


@dataclass(frozen=True)
class Arrow:
    """`importer` imports `imported` at `path:line`."""

    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.importer} -> {self.imported}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvledger", *parts])


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an `from ... import` names (relative imports resolved against the importer)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def arrows(path: Path, known: set[str], text: str | None = None) -> Iterator[Arrow]:
    """Every import in the file (or in `text`, read as that file), as arrows to the most specific module of
    ours it names (or to the outside name)."""
    importer = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8") if text is None else text, filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Arrow(importer, alias.name, path, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(importer, path.name == "__init__.py", node)
            for alias in node.names:
                # `from kvledger.ledger.store import migrate` imports the module kvledger.ledger.store.migrate.
                child = f"{target}.{alias.name}"
                yield Arrow(importer, child if child in known else target, path, node.lineno)


def all_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def all_arrows() -> list[Arrow]:
    files = all_files()
    known = {module_name(p) for p in files}
    return [arrow for path in files for arrow in arrows(path, known)]


def _floor(module: str) -> str | None:
    """kvledger.api.app -> api; None for a module not of ours."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvledger" else None


def wrong_way(found: list[Arrow]) -> list[str]:
    bad = []
    for arrow in found:
        floor, target = _floor(arrow.importer), _floor(arrow.imported)
        if target is not None and target in FORBIDDEN[floor]:
            bad.append(f"{arrow} ({floor}/ must not import {target}/)")
    return list(dict.fromkeys(bad))  # `from x import a, b` is one wrong arrow, said once


def cycles(found: list[Arrow]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    modules = {module_name(p) for p in all_files()}
    for arrow in found:
        if arrow.imported in modules and arrow.imported != arrow.importer:
            graph.setdefault(arrow.importer, set()).add(arrow.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        # Recursive: the import graph is a few hundred modules deep at most.
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(modules):
        if node not in index:
            visit(node)
    return components


def describe_cycle(component: list[str], found: list[Arrow]) -> str:
    members = set(component)
    inside = [str(a) for a in found if a.importer in members and a.imported in members and a.importer != a.imported]
    return "cycle between " + ", ".join(component) + ":\n    " + "\n    ".join(sorted(set(inside)))


def test_every_package_is_read() -> None:
    """The test reads the tree it guards: each package has files, and a known downward arrow is seen."""
    found = all_arrows()
    assert {module_name(p).split(".")[1] for p in all_files()} == set(PACKAGES)
    assert any(a.importer == "kvledger.cli.app" and a.imported == "kvledger.cli.replay" for a in found)
    assert any(
        a.importer.startswith("kvledger.connector.") and a.imported.startswith("kvledger.ledger.") for a in found
    )


def test_imports_point_down() -> None:
    bad = wrong_way(all_arrows())
    assert not bad, "imports that run the wrong way:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    found = all_arrows()
    assert not (components := cycles(found)), "\n".join(describe_cycle(c, found) for c in components)


def test_a_wrong_arrow_and_a_cycle_are_caught() -> None:
    """The checks themselves fail on what they guard against, naming the file, the line and the arrow."""
    here = ROOT / "ledger" / "x.py"
    up = Arrow("kvledger.ledger.x", "kvledger.api.app", here, 3)
    assert wrong_way([up]) == ["ledger/x.py:3: kvledger.ledger.x -> kvledger.api.app (ledger/ must not import api/)"]
    sideways = Arrow("kvledger.api.y", "kvledger.connector.store", ROOT / "api" / "y.py", 7)
    assert wrong_way([sideways]) == [
        "api/y.py:7: kvledger.api.y -> kvledger.connector.store (api/ must not import connector/)"
    ]
    a, b = ("kvledger.ledger.store.connect", "kvledger.ledger.store.sql")
    loop = [Arrow(a, b, ROOT / "ledger/store/connect.py", 1), Arrow(b, a, ROOT / "ledger/store/sql.py", 2)]
    assert cycles(loop) == [[a, b]]
    assert "ledger/store/sql.py:2: kvledger.ledger.store.sql -> kvledger.ledger.store.connect" in describe_cycle(
        [a, b], loop
    )


def test_lazy_and_type_checking_imports_are_arrows() -> None:
    text = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvledger.api.settings import Settings\n"
        "def f() -> None:\n    from . import audit\n    import kvledger.connector.store\n"
    )
    known = {module_name(p) for p in all_files()}
    found = sorted(arrows(ROOT / "ledger" / "probe.py", known, text), key=lambda a: a.line)
    assert [(a.imported, a.line) for a in found] == [
        ("typing", 1),
        ("kvledger.api.settings", 3),
        ("kvledger.ledger.audit", 5),
        ("kvledger.connector.store", 6),
    ]
    assert len(wrong_way(found)) == 2


def private_imports(path: Path) -> Iterator[str]:
    """`from x import _name`: another module's private, which that module may change without looking here."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}: imports {node.module}.{alias.name}"


def test_no_module_imports_another_modules_privates() -> None:
    bad = [line for path in all_files() for line in private_imports(path)]
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_routes_import_no_other_route() -> None:
    """Routes share helpers through api modules named for what they hold (api/params.py, ...), not each other."""
    routes = "kvledger.api.routes."
    found = [a for a in all_arrows() if a.importer.startswith(routes) and a.imported.startswith(routes)]
    assert not found, "routes importing routes:\n" + "\n".join(map(str, found))
