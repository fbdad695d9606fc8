"""The first schema: events keyed by (source, seq) with a store-wide cursor, and snapshots.

Revision ID: 0001_initial
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

# Spelled out rather than taken from kvledger.ledger.store.schema: a migration must not change when the code does.
_Cursor = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("cursor", _Cursor, primary_key=True, autoincrement=True),
        sa.Column("source", sa.String(200), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("ts", sa.Double, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("transfer_id", sa.String(200), nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("source", "seq", name="events_source_seq"),
    )
    op.create_index("events_transfer_id", "events", ["transfer_id"])
    op.create_index("events_ts", "events", ["ts"])
    op.create_table(
        "snapshots",
        sa.Column("source", sa.String(200), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("created_ts", sa.Double, nullable=False),
        sa.Column("format", sa.Integer, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("source", "seq", name="snapshots_pkey"),
    )


def downgrade() -> None:
    op.drop_table("snapshots")
    op.drop_index("events_ts", table_name="events")
    op.drop_index("events_transfer_id", table_name="events")
    op.drop_table("events")
