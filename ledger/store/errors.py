"""Translate SQLAlchemy and driver errors into the store's own hierarchy, naming the URL."""

from __future__ import annotations

from sqlalchemy import exc

from kvledger.ledger.store.base import ConflictError, NotALedger, StoreError, StoreUnavailable, UnstorableEvent

_NOT_A_DATABASE = ("file is not a database", "file is encrypted or is not a database")


def translate(error: Exception, where: str) -> StoreError:
    """The StoreError that says what went wrong at `where` (a URL with its password hidden)."""
    if isinstance(error, StoreError):
        return error
    text = str(getattr(error, "orig", None) or error).strip().splitlines()[0] if str(error) else repr(error)
    if isinstance(error, exc.IntegrityError):
        return ConflictError(f"{where}: an event with the same (source, seq) is already stored ({text})")
    if isinstance(error, exc.DataError):
        # A value the database's columns cannot hold (the validity rules should have caught it first).
        return UnstorableEvent(f"{where}: the database refused a value: {text}")
    if any(marker in text for marker in _NOT_A_DATABASE):
        return NotALedger(f"{where}: not a kvledger store: {text}")
    if isinstance(error, (exc.OperationalError, exc.InterfaceError)) or (
        isinstance(error, exc.DBAPIError) and error.connection_invalidated
    ):
        return StoreUnavailable(f"{where}: store unavailable: {text}")
    if isinstance(error, OSError):
        return StoreUnavailable(f"{where}: {text}")
    return StoreError(f"{where}: {type(error).__name__}: {text}")
