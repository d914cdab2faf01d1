"""Initial schema: sessions, runs with every fencing column, events, inputs, checkpoints,
the tool journal, idempotency keys, API keys, workers and maintenance leases.

Every column ADR-0004 needs (priority, attempts, scheduled_for, lease_epoch) is here from the
first migration: a fencing token retrofitted after a queue exists cannot cover in-flight runs.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NOW = sa.text("now()")
UUID_DEFAULT = sa.text("gen_random_uuid()")


def _ts(name: str, *, nullable: bool = True, default_now: bool = False) -> sa.Column[object]:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        nullable=nullable,
        server_default=NOW if default_now else None,
    )


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", pg.UUID(as_uuid=True), server_default=UUID_DEFAULT, nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        _ts("created_at", nullable=False, default_now=True),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_tenant_id_created_at", "sessions", ["tenant_id", "created_at"])

    op.create_table(
        "runs",
        sa.Column("id", pg.UUID(as_uuid=True), server_default=UUID_DEFAULT, nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("session_id", pg.UUID(as_uuid=True), nullable=True),
        sa.Column("status", sa.Text(), server_default=sa.text("'queued'"), nullable=False),
        sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("agent", sa.Text(), nullable=False),
        sa.Column("input", pg.JSONB(), nullable=False),
        sa.Column("question", pg.JSONB(), nullable=True),
        sa.Column("result", pg.JSONB(), nullable=True),
        sa.Column("failure", pg.JSONB(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default=sa.text("3"), nullable=False),
        _ts("scheduled_for"),
        sa.Column("lease_epoch", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("lease_owner", sa.Text(), nullable=True),
        _ts("lease_expires_at"),
        sa.Column("last_event_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("inputs_count", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("resubmitted_from", pg.UUID(as_uuid=True), nullable=True),
        _ts("created_at", nullable=False, default_now=True),
        _ts("updated_at", nullable=False, default_now=True),
        _ts("started_at"),
        _ts("finished_at"),
        _ts("dismissed_at"),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_runs_session_id_sessions"
        ),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'waiting_for_user', 'succeeded', 'failed', "
            "'cancelled')",
            name="status",
        ),
        sa.CheckConstraint("priority BETWEEN 0 AND 29", name="priority_band"),
        sa.CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="attempts"),
        sa.CheckConstraint(
            "(status = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name="lease_only_when_running",
        ),
        sa.CheckConstraint(
            "(status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)",
            name="finished_when_terminal",
        ),
        sa.CheckConstraint("status <> 'failed' OR failure IS NOT NULL", name="failed_has_failure"),
        sa.CheckConstraint(
            "status = 'waiting_for_user' OR question IS NULL",
            name="question_only_when_waiting",
        ),
    )
    # One non-terminal run per session (ADR-0004 decision 10).
    op.execute(
        "CREATE UNIQUE INDEX uq_runs_session_id_active ON runs (session_id) "
        "WHERE status IN ('queued', 'running', 'waiting_for_user')"
    )
    # The claim index: class, then eligibility time (docs/adr/0001).
    op.execute(
        "CREATE INDEX ix_runs_claim ON runs (priority, coalesce(scheduled_for, created_at)) "
        "WHERE status = 'queued'"
    )
    op.execute(
        "CREATE INDEX ix_runs_lease_expires_at ON runs (lease_expires_at) WHERE status = 'running'"
    )
    op.create_index("ix_runs_session_id_created_at", "runs", ["session_id", "created_at"])
    op.create_index(
        "ix_runs_tenant_id_status_created_at", "runs", ["tenant_id", "status", "created_at"]
    )
    op.execute(
        "CREATE INDEX ix_runs_finished_at ON runs (finished_at) WHERE finished_at IS NOT NULL"
    )

    op.create_table(
        "run_events",
        sa.Column("run_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("data", pg.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        _ts("created_at", nullable=False, default_now=True),
        sa.PrimaryKeyConstraint("run_id", "seq", name="pk_run_events"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_run_events_run_id_runs", ondelete="CASCADE"
        ),
    )

    op.create_table(
        "run_inputs",
        sa.Column("run_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("input", pg.JSONB(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        _ts("created_at", nullable=False, default_now=True),
        sa.PrimaryKeyConstraint("run_id", "idx", name="pk_run_inputs"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_run_inputs_run_id_runs", ondelete="CASCADE"
        ),
    )

    op.create_table(
        "checkpoints",
        sa.Column("run_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("state", pg.JSONB(), nullable=False),
        _ts("created_at", nullable=False, default_now=True),
        sa.PrimaryKeyConstraint("run_id", "event_seq", name="pk_checkpoints"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_checkpoints_run_id_runs", ondelete="CASCADE"
        ),
    )

    op.create_table(
        "tool_journal",
        sa.Column("run_id", pg.UUID(as_uuid=True), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("entry", sa.Text(), nullable=False),
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("idempotency_class", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("args", pg.JSONB(), nullable=True),
        sa.Column("outcome_status", sa.Text(), nullable=True),
        sa.Column("outcome", pg.JSONB(), nullable=True),
        _ts("created_at", nullable=False, default_now=True),
        sa.PrimaryKeyConstraint("run_id", "event_seq", name="pk_tool_journal"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_tool_journal_run_id_runs", ondelete="CASCADE"
        ),
        sa.CheckConstraint("entry IN ('started', 'finished')", name="entry"),
        sa.CheckConstraint(
            "idempotency_class IN ('safe', 'keyed', 'unsafe')",
            name="idempotency_class",
        ),
        sa.CheckConstraint(
            "outcome_status IS NULL OR outcome_status IN ('succeeded', 'failed', 'uncertain')",
            name="outcome_status",
        ),
        sa.CheckConstraint(
            "(entry = 'finished') = (outcome_status IS NOT NULL)",
            name="outcome_when_finished",
        ),
    )
    op.create_index("ix_tool_journal_run_id_step", "tool_journal", ["run_id", "step"])

    op.create_table(
        "idempotency_keys",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("request_hash", sa.Text(), nullable=False),
        sa.Column("run_id", pg.UUID(as_uuid=True), nullable=True),
        sa.Column("response_status", sa.SmallInteger(), nullable=False),
        sa.Column("response_body", pg.JSONB(), nullable=False),
        _ts("created_at", nullable=False, default_now=True),
        _ts("expires_at", nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "principal", "key", name="pk_idempotency_keys"),
        sa.CheckConstraint("char_length(key) BETWEEN 1 AND 255", name="key_length"),
    )
    op.create_index("ix_idempotency_keys_expires_at", "idempotency_keys", ["expires_at"])

    op.create_table(
        "api_keys",
        sa.Column("id", pg.UUID(as_uuid=True), server_default=UUID_DEFAULT, nullable=False),
        sa.Column("key_hash", sa.LargeBinary(), nullable=False),
        sa.Column("prefix", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column(
            "scopes", pg.ARRAY(sa.Text()), server_default=sa.text("'{}'::text[]"), nullable=False
        ),
        sa.Column("name", sa.Text(), nullable=True),
        _ts("created_at", nullable=False, default_now=True),
        _ts("revoked_at"),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
        sa.CheckConstraint("scopes <@ ARRAY['operator', 'admin']::text[]", name="scopes"),
    )

    op.create_table(
        "workers",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("role", sa.Text(), nullable=False),
        sa.Column("slot_groups", pg.JSONB(), nullable=False),
        _ts("started_at", nullable=False, default_now=True),
        _ts("last_seen_at", nullable=False, default_now=True),
        _ts("stopped_at"),
        sa.PrimaryKeyConstraint("id", name="pk_workers"),
    )

    op.create_table(
        "maintenance_leases",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        _ts("expires_at", nullable=False),
        _ts("last_success_at"),
        sa.PrimaryKeyConstraint("name", name="pk_maintenance_leases"),
    )


def downgrade() -> None:
    for table in (
        "maintenance_leases",
        "workers",
        "api_keys",
        "idempotency_keys",
        "tool_journal",
        "checkpoints",
        "run_inputs",
        "run_events",
        "runs",
        "sessions",
    ):
        op.drop_table(table)
