"""Fair shares between tenants (issue "Fair shares between tenants"): the two tables every part
of it reads.

* `tenant_limits`: an admin's per-tenant overrides (`PUT /tenants/{tenant}/limits`). A NULL
  column, or a class missing from `max_running`, means "the process default from the
  environment" (TURNSTILE_TENANT_MAX_RUNNING, TURNSTILE_TENANT_MAX_QUEUED,
  TURNSTILE_SUBMIT_RATE_PER_SECOND, TURNSTILE_SUBMIT_BURST). A row changes only when an admin
  changes a limit, so reading it never contends with submissions.
* `tenant_class_counts`: one row per (tenant, class band) with the tenant's running and queued
  runs of that class, kept exact by the statements that change them (claims, completions,
  failures, waits, releases, the sweep, cancellation, enqueues), so a claim reads a tenant's
  share from one row instead of counting the running set. `band` is priority / 10 (0
  interactive, 1 async, 2 maintenance: app/vocabulary/classes.py). `last_claimed_at` orders ties
  between tenants with as many running runs (least recently served first).

The counts of a database that already holds runs are filled in here from its queued and
running runs, so an upgrade starts exact.

Revision ID: 0010
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "0010"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_limits",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        # {"interactive": 4, "async": 20}: at most that many running runs of the class.
        sa.Column(
            "max_running",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("max_queued", sa.Integer(), nullable=True),
        sa.Column("submit_rate_per_second", sa.Float(), nullable=True),
        sa.Column("submit_burst", sa.Integer(), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("max_queued IS NULL OR max_queued >= 0", name="max_queued"),
        sa.CheckConstraint(
            "submit_rate_per_second IS NULL OR submit_rate_per_second > 0",
            name="submit_rate",
        ),
        sa.CheckConstraint("submit_burst IS NULL OR submit_burst >= 1", name="submit_burst"),
        sa.PrimaryKeyConstraint("tenant_id", name="pk_tenant_limits"),
    )
    op.create_table(
        "tenant_class_counts",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("band", sa.SmallInteger(), nullable=False),
        sa.Column("running", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("queued", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("band BETWEEN 0 AND 2", name="band"),
        sa.CheckConstraint("running >= 0 AND queued >= 0", name="non_negative"),
        sa.PrimaryKeyConstraint("tenant_id", "band", name="pk_tenant_class_counts"),
    )
    op.execute(
        """
        INSERT INTO tenant_class_counts (tenant_id, band, running, queued)
        SELECT tenant_id, priority / 10,
               count(*) FILTER (WHERE status = 'running'),
               count(*) FILTER (WHERE status = 'queued')
        FROM runs
        WHERE status IN ('queued', 'running')
        GROUP BY tenant_id, priority / 10
        """
    )


def downgrade() -> None:
    op.drop_table("tenant_class_counts")
    op.drop_table("tenant_limits")
