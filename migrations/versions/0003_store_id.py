"""The store's id: one row naming the store, drawn once here, so that a snapshot can name the store it was
taken of (a snapshot copied into another store is then refused, not believed).

Revision ID: 0003_store_id
Revises: 0002_quarantine
Create Date: 2026-12-05
"""

from __future__ import annotations

import time
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0003_store_id"
down_revision = "0002_quarantine"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Spelled out rather than taken from kvledger.ledger.store.schema: a migration must not change when the code does.
    table = op.create_table(
        "kvledger_store",
        sa.Column("store_id", sa.String(64), primary_key=True),
        sa.Column("created_ts", sa.Double, nullable=False),
    )
    op.bulk_insert(table, [{"store_id": uuid.uuid4().hex, "created_ts": time.time()}])


def downgrade() -> None:
    op.drop_table("kvledger_store")
