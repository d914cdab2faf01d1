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
  creates. Its text as installed here is alembic/frozen/0005-turnstile_submit.sql; a
  downgrade puts 0007's back.

Revision ID: 0005
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from app.store.migrate import frozen

revision = "0005"
# After 0007, whose function it replaces (the revision ids were handed out before 0006 and
# 0007 were written).
down_revision = "0007"
branch_labels = None
depends_on = None


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
    op.execute(frozen("0005", "turnstile_submit"))


def downgrade() -> None:
    op.execute(frozen("0007", "turnstile_submit"))
    op.drop_index("ix_sessions_last_activity_at", table_name="sessions")
    op.drop_column("sessions", "last_activity_at")
    op.drop_index("uq_runs_session_id_session_run_no", table_name="runs")
    op.drop_constraint("session_run_no", "runs", type_="check")
    op.drop_column("runs", "session_run_no")
