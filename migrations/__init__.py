"""Alembic environment and versions of the kvledger store schema, installed as kvledger.migrations: the store
(kvledger.ledger.store.migrate) locates this folder and hands it to Alembic; nothing imports it."""
