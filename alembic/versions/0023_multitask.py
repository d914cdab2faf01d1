"""Multitask policies (issue 33 item 1; docs/turn-control.md): what a turn does when its
session's run is queued or running.

* `sessions.multitask` (new, default 'reject'): the session's policy, one of reject, enqueue,
  interrupt, steer. A turn's own `multitask` overrides it.
* `pending_turns` (new): turns accepted under enqueue, interrupt or steer while the session's
  run was active. Not runs, so the partial unique index still allows one active run per
  session; each becomes the next run in the transaction that ends the run before it.
* `turnstile_promote_turns` (new, the text of app/store/functions/ at this revision,
  alembic/frozen/0023-*): that promotion, which the ending statements call.

Safe for the release before it (an expand step): that release never reads either the column
(inserted sessions take its default) or the table, and creates no pending turn. While both
run, a run that the older release ends does not promote its session's pending turns; this
release's sweep promotes such leftovers (`promote_stranded_turns`).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op
from app.store.migrate import frozen, lock_up_front

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

POLICIES = "('reject', 'enqueue', 'interrupt', 'steer')"


def upgrade() -> None:
    lock_up_front(op.get_bind(), "LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE")
    # A constant default: a catalog change, no rewrite of the table.
    op.add_column(
        "sessions",
        sa.Column("multitask", sa.Text(), server_default=sa.text("'reject'"), nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_sessions_multitask"), "sessions", f"multitask IN {POLICIES}"
    )
    op.create_table(
        "pending_turns",
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("seq", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("session_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("submitted_by", sa.Text(), nullable=False),
        sa.Column("actor", sa.Text(), nullable=True),
        sa.Column("policy", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("agent", sa.Text(), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("input", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("traceparent", sa.Text(), nullable=True),
        sa.Column("active_run_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=True),
        sa.Column("input_idx", sa.Integer(), nullable=True),
        sa.Column("at_step", sa.Integer(), nullable=True),
        sa.Column("interrupt_by", sa.DateTime(timezone=True), nullable=True),
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
        sa.CheckConstraint(
            "policy IN ('enqueue', 'interrupt', 'steer')", name=op.f("ck_pending_turns_policy")
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'started', 'delivered', 'cancelled')",
            name=op.f("ck_pending_turns_status"),
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_pending_turns_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pending_turns")),
    )
    op.create_index(
        "ix_pending_turns_session_id_seq",
        "pending_turns",
        ["session_id", "seq"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "ix_pending_turns_interrupt_by",
        "pending_turns",
        ["interrupt_by"],
        postgresql_where=sa.text("status = 'pending' AND policy = 'interrupt'"),
    )
    op.execute(frozen("0023", "turnstile_promote_turns"))
    op.execute("UPDATE schema_compatibility SET oldest_release = '0016'")


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_promote_turns(timestamptz, uuid[])")
    op.drop_table("pending_turns")
    op.drop_constraint(op.f("ck_sessions_multitask"), "sessions", type_="check")
    op.drop_column("sessions", "multitask")
    op.execute("UPDATE schema_compatibility SET oldest_release = '0015'")
