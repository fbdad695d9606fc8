"""Persistence of ledger events: one contract (`base.EventStore`), memory/SQLite/PostgreSQL backends."""
