"""The quarantine: events a store refused for their content, kept aside with the reason.

Revision ID: 0002_quarantine
Revises: 0001_initial
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_quarantine"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

# Spelled out rather than taken from kvledger.ledger.store.schema: a migration must not change when the code does.
_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "quarantine",
        sa.Column("id", _Id, primary_key=True, autoincrement=True),
        sa.Column("created_ts", sa.Double, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("quarantine")
