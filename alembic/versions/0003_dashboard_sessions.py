"""Dashboard sessions: the dashboard's cookie holds an opaque, revocable session token instead
of the API key itself.

- `dashboard_sessions` keeps a SHA-256 hash of each token (never the token), the API key it was
  opened with and when it expires. Signing out deletes the row, so a copied cookie stops working
  everywhere at once; revoking the key deletes its sessions, and a lookup also requires the key
  to be unrevoked; deleting a key cascades to its sessions.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dashboard_sessions",
        sa.Column("token_hash", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("token_hash", name="pk_dashboard_sessions"),
        sa.ForeignKeyConstraint(
            ["key_id"],
            ["api_keys.id"],
            name="fk_dashboard_sessions_key_id_api_keys",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_dashboard_sessions_key_id", "dashboard_sessions", ["key_id"])
    op.create_index("ix_dashboard_sessions_expires_at", "dashboard_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_table("dashboard_sessions")
