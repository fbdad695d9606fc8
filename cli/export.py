"""`kvledger export`: a store to a JSONL incident log and back, lossless, to hand an incident over."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated

import typer

from kvledger.cli.replay import guarded
from kvledger.ledger.events import Event
from kvledger.ledger.inputs import is_sqlite_file
from kvledger.ledger.jsonl import LogWriter, open_log
from kvledger.ledger.limits import EXPORT_BATCH_EVENTS

Source = Annotated[str, typer.Argument(help="A store URL or SQLite file, or a JSONL incident log")]
Target = Annotated[str, typer.Argument(help="A .jsonl file, or a store URL / SQLite file to load into")]


def _is_jsonl_path(target: str) -> bool:
    return "://" not in target and Path(target).suffix in (".jsonl", ".ndjson")


def _batches(events: Iterable[Event], size: int) -> Iterator[list[Event]]:
    batch: list[Event] = []
    for event in events:
        batch.append(event)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def store_to_jsonl(url: str, path: Path) -> int:
    """Every event of the store, in its cursor order, into a new JSONL file (atomic rename)."""
    from kvledger.ledger.store.connect import open_store

    store = open_store(url)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        sources = sorted(store.sources())
        with LogWriter(tmp, source=sources[0] if len(sources) == 1 else None, exported_from=url) as writer:
            n = 0
            for batch in _batches(store.read(), EXPORT_BATCH_EVENTS):
                n += writer.write_many(batch)
            writer.flush(fsync=True)
        os.replace(tmp, path)
        return n
    finally:
        tmp.unlink(missing_ok=True)
        store.close()


def jsonl_to_store(path: Path, url: str) -> tuple[int, int]:
    """Load a JSONL log into a store (created if new). The whole file is checked before any
    row is written, so a bad line leaves the store untouched. Returns (read, inserted)."""
    from kvledger.ledger.store.connect import open_store

    reader = open_log(path)
    try:
        checked = sum(1 for _ in reader)
    finally:
        reader._stream.close()
    store = open_store(url, create=True)
    inserted = 0
    reader = open_log(path)
    try:
        for batch in _batches(reader, EXPORT_BATCH_EVENTS):
            inserted += store.append(batch)
    finally:
        reader._stream.close()
        store.close()
    return checked, inserted


def export_command(source: Source, target: Target) -> None:
    """Copy a ledger between a store and a JSONL incident log (either way), losslessly."""
    src_is_log = Path(source).is_file() and not is_sqlite_file(source)
    if src_is_log:
        if _is_jsonl_path(target):
            raise typer.BadParameter("both sides are JSONL logs; copy the file instead", param_hint="TARGET")
        read, inserted = guarded(lambda: jsonl_to_store(Path(source), target))
        typer.echo(
            f"loaded {read} events from {source} into {target} ({inserted} new, {read - inserted} already there)"
        )
        return
    if not _is_jsonl_path(target):
        raise typer.BadParameter(
            "export a store to a .jsonl file, or load a .jsonl log into a store", param_hint="TARGET"
        )
    n = guarded(lambda: store_to_jsonl(source, Path(target)))
    typer.echo(f"exported {n} events from {source} to {target}")
