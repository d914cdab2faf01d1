"""Trace context kept with the run: `runs.traceparent`, the W3C trace context of the submission
that created the run (or of the answer that resumed it), so every claim of the run, in any
process and after any recovery, joins the caller's trace (docs/operations.md, "Tracing").

Nullable and unconstrained beyond its length: most runs carry none, and the API stores only a
header it parsed as valid (version 00, 55 characters).

Revision ID: 0006
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0006"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Adding a nullable column without a default rewrites nothing: instant on a large table.
    op.add_column("runs", sa.Column("traceparent", sa.String(length=55), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "traceparent")
