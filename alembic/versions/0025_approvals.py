"""Approval before a tool call (issue 33 item 2; docs/approvals.md).

* `sessions.approval` and `runs.approval` (new, nullable JSONB, no default: a catalog change,
  no rewrite): which tool calls wait for a user's approval, per session and per run (the
  turn's own). NULL: the session's, else the process default (TURNSTILE_APPROVAL_REQUIRED).
* `tool_journal.outcome_status` may be `rejected`: a call the user refused, never run (one
  'finished' entry, with its arguments).
* `turnstile_submit` (signature changed: a trailing `p_approval jsonb DEFAULT NULL`; the text
  of app/store/functions/ at this revision, alembic/frozen/0025-*): keeps the turn's policy on
  the run, and refuses a turn to a run waiting for an approval (TS409 approval-pending).

Safe for the release before it (an expand step): that release never reads either column, and
its calls of `turnstile_submit` name 25 arguments, which the new signature takes (the 26th
has a default). Its workers do not ask for approvals (they run every call as before), so a
fleet enforces approvals once every worker runs this release (docs/approvals.md).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op
from app.store.migrate import frozen, lock_up_front

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

OUTCOMES = "('succeeded', 'failed', 'uncertain', 'abandoned', 'rejected')"
OLDER_OUTCOMES = "('succeeded', 'failed', 'uncertain', 'abandoned')"


def upgrade() -> None:
    lock_up_front(
        op.get_bind(),
        "LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE",
        "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE",
        "LOCK TABLE tool_journal IN ACCESS EXCLUSIVE MODE",
    )
    op.add_column("sessions", sa.Column("approval", postgresql.JSONB(), nullable=True))
    op.add_column("runs", sa.Column("approval", postgresql.JSONB(), nullable=True))
    op.drop_constraint(op.f("ck_tool_journal_outcome_status"), "tool_journal", type_="check")
    op.create_check_constraint(
        op.f("ck_tool_journal_outcome_status"),
        "tool_journal",
        f"outcome_status IS NULL OR outcome_status IN {OUTCOMES}",
    )
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(frozen("0025", "turnstile_submit"))


def downgrade() -> None:
    lock_up_front(
        op.get_bind(),
        "LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE",
        "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE",
        "LOCK TABLE tool_journal IN ACCESS EXCLUSIVE MODE",
    )
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(frozen("0018", "turnstile_submit"))
    # The older release's outcomes: a refused call reads as one that failed.
    op.execute(
        "UPDATE tool_journal SET outcome_status = 'failed' WHERE outcome_status = 'rejected'"
    )
    op.drop_constraint(op.f("ck_tool_journal_outcome_status"), "tool_journal", type_="check")
    op.create_check_constraint(
        op.f("ck_tool_journal_outcome_status"),
        "tool_journal",
        f"outcome_status IS NULL OR outcome_status IN {OLDER_OUTCOMES}",
    )
    op.drop_column("runs", "approval")
    op.drop_column("sessions", "approval")
