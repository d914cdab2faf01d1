"""Sessions as conversations: a run number within its session, and the session's last activity.

- `runs.session_run_no`: the run's number within its session (1, 2, ...), assigned by
  `enqueue` under the session lock the submission already holds, NULL for sessionless runs.
  With each event's per-run sequence it orders a session's transcript as (run number, seq),
  and `uq_runs_session_id_session_run_no` is the backstop for the lock. Existing session runs
  are numbered in creation order.
- `sessions.last_activity_at`: when a turn last reached the session (set when it is created
  and by every submission that locks it). Retention deletes a session idle past its own period
  whole (app/maintenance/pruners.py: SessionRetention), scanning `ix_sessions_last_activity_at`.
  Existing sessions take their latest run's update time (or their creation time).
- `turnstile_submit` (migration 0007) is replaced by the same function doing both under the
  session lock it already takes: it sets the session's last activity, and numbers the run it
  creates. The new text is 0007's with those two changes applied (`_patched`), and a downgrade
  puts 0007's back, so there is one source of the function's text.

Revision ID: 0005
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa

from alembic import op

revision = "0005"
# After 0007, whose function it replaces (the revision ids were handed out before 0006 and
# 0007 were written).
down_revision = "0007"
branch_labels = None
depends_on = None

# The session lock in turnstile_submit, and the same statement followed by the activity mark.
LOCK = """        FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'session-not-found' USING ERRCODE = 'TS404',
                DETAIL = jsonb_build_object('session_id', p_session)::text;
        END IF;
"""
LOCK_AND_MARK = LOCK + (
    "        -- The session's last activity (session retention reads it), under this lock.\n"
    "        UPDATE sessions SET last_activity_at = greatest(last_activity_at, v_now)\n"
    "        WHERE id = p_session;\n"
)
# The run's insert, and the same with the session's next run number: read from the session's
# runs (uq_runs_session_id_session_run_no) under the session lock this function holds.
INSERT = (
    "            INSERT INTO runs AS r (id, tenant_id, principal, session_id, status, priority,\n"
    "                                   agent, input, max_attempts, scheduled_for, "
    "last_event_seq,\n"
    "                                   inputs_count, traceparent, created_at, updated_at)\n"
    "            VALUES (p_run_id, p_tenant, v_owner, p_session, 'queued',\n"
)
NUMBERED_INSERT = (
    "            INSERT INTO runs AS r (id, tenant_id, principal, session_id, session_run_no,\n"
    "                                   status, priority, agent, input, max_attempts,\n"
    "                                   scheduled_for, last_event_seq, inputs_count,\n"
    "                                   traceparent, created_at, updated_at)\n"
    "            VALUES (p_run_id, p_tenant, v_owner, p_session,\n"
    "                    CASE WHEN p_session IS NOT NULL THEN\n"
    "                        (SELECT coalesce(max(n.session_run_no), 0) + 1 FROM runs n\n"
    "                         WHERE n.session_id = p_session)\n"
    "                    END,\n"
    "                    'queued',\n"
)


def _submit_0007() -> str:
    """Migration 0007's `turnstile_submit`, as CREATE OR REPLACE."""
    path = Path(__file__).with_name("0007_submit_in_one_round_trip.py")
    spec = importlib.util.spec_from_file_location("turnstile_migration_0007", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = str(module.SUBMIT)
    assert text.lstrip().startswith("CREATE FUNCTION turnstile_submit(")
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _patched() -> str:
    text = _submit_0007()
    for old, new in ((LOCK, LOCK_AND_MARK), (INSERT, NUMBERED_INSERT)):
        if text.count(old) != 1:
            raise RuntimeError("turnstile_submit is not migration 0007's: update migration 0005")
        text = text.replace(old, new)
    return text


def upgrade() -> None:
    op.add_column("runs", sa.Column("session_run_no", sa.Integer(), nullable=True))
    op.execute(
        """
        UPDATE runs SET session_run_no = numbered.n
        FROM (SELECT id, row_number() OVER (PARTITION BY session_id
                                            ORDER BY created_at, id) AS n
              FROM runs WHERE session_id IS NOT NULL) AS numbered
        WHERE runs.id = numbered.id
        """
    )
    op.create_check_constraint(
        "session_run_no", "runs", "(session_id IS NULL) = (session_run_no IS NULL)"
    )
    op.create_index(
        "uq_runs_session_id_session_run_no",
        "runs",
        ["session_id", "session_run_no"],
        unique=True,
        postgresql_where=sa.text("session_id IS NOT NULL"),
    )
    op.add_column(
        "sessions",
        sa.Column(
            "last_activity_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
    )
    op.execute(
        """
        UPDATE sessions s
        SET last_activity_at = greatest(s.created_at,
                                        (SELECT max(r.updated_at) FROM runs r
                                         WHERE r.session_id = s.id))
        """
    )
    op.create_index("ix_sessions_last_activity_at", "sessions", ["last_activity_at"])
    op.execute(_patched())


def downgrade() -> None:
    op.execute(_submit_0007())
    op.drop_index("ix_sessions_last_activity_at", table_name="sessions")
    op.drop_column("sessions", "last_activity_at")
    op.drop_index("uq_runs_session_id_session_run_no", table_name="runs")
    op.drop_constraint("session_run_no", "runs", type_="check")
    op.drop_column("runs", "session_run_no")
