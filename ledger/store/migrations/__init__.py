"""Alembic environment and versions of the kvledger store schema (see ledger.store.migrate)."""
