"""Schedules: recurring sessionless runs, exactly one run per tick.

- `schedules` holds a cron expression, its IANA time zone, and the run every tick creates
  (agent, input, priority), for a tenant and the principal that created it. `anchor_at` is the
  time of its creation or last resume: no tick at or before it ever fires (a resumed schedule
  does not catch up on the ticks it skipped while paused). `paused_at` is set while paused.
- `runs` gains `schedule_id` and `fire_at`, both set on a schedule's ticks and on nothing
  else, and UNIQUE (schedule_id, fire_at): two processes can never create the same tick twice.
  There is no foreign key: a deleted schedule's runs keep its id, so an operator can still find
  them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column(
            "id", pg.UUID(as_uuid=True), server_default=sa.text("gen_random_uuid()"), nullable=False
        ),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("cron", sa.Text(), nullable=False),
        sa.Column("timezone", sa.Text(), server_default=sa.text("'UTC'"), nullable=False),
        sa.Column("agent", sa.Text(), nullable=False),
        sa.Column("input", pg.JSONB(), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("anchor_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name="pk_schedules"),
        sa.CheckConstraint("priority BETWEEN 0 AND 29", name="priority_band"),
    )
    op.create_index("ix_schedules_tenant_id_created_at", "schedules", ["tenant_id", "created_at"])
    op.add_column("runs", sa.Column("schedule_id", pg.UUID(as_uuid=True), nullable=True))
    op.add_column("runs", sa.Column("fire_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint("schedule_tick", "runs", "(schedule_id IS NULL) = (fire_at IS NULL)")
    op.create_unique_constraint("uq_runs_schedule_id_fire_at", "runs", ["schedule_id", "fire_at"])


def downgrade() -> None:
    op.drop_constraint("uq_runs_schedule_id_fire_at", "runs", type_="unique")
    op.drop_constraint("schedule_tick", "runs", type_="check")
    op.drop_column("runs", "fire_at")
    op.drop_column("runs", "schedule_id")
    op.drop_table("schedules")
