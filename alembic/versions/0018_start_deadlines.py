"""Start deadlines (issue 33 item 3; docs/start-deadlines.md): a run may carry a deadline to
start, and one still queued and never claimed at its deadline ends `cancelled` (reason
`expired`).

* `runs.start_before` (new, nullable): the run's deadline to start; NULL, none. Set when the
  run is created, never changed. `ix_runs_start_before` (new, partial: queued runs never
  claimed that have one) is the expirer's: the earliest deadline in one probe, and the overdue
  runs in deadline order. It holds only the runs with a deadline.
* `turnstile_create_runs` takes the deadlines as a last array (`p_start_before`, default
  NULL: none), `turnstile_submit` takes `p_start_within` and `p_start_before` (defaults NULL)
  and names a new run's deadline in its notification; each replaces the function of the older
  signature (dropped, so a call naming the older parameters finds the one function).
* `turnstile_claim_heads` never takes a run whose deadline to start has passed (a filter on
  the rows its index range reads).

Safe for the release before it (an expand step): its calls name only parameters the new
signatures keep, with the same meaning, its runs have no deadline, and it reads runs by column
name. Here the oldest release is 0016.

Revision ID: 0018
Revises: 0016
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from app.store.migrate import frozen, lock_up_front

revision = "0018"
down_revision = "0016"
branch_labels = None
depends_on = None

# Dropped and created again (their signatures change); claim_heads only replaced.
RESIGNED = ("turnstile_create_runs", "turnstile_submit")
REPLACED = ("turnstile_claim_heads",)
OVERDUE = "status = 'queued' AND start_before IS NOT NULL AND started_at IS NULL"


def upgrade() -> None:
    lock_up_front(op.get_bind(), "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
    op.add_column("runs", sa.Column("start_before", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        op.f("ck_runs_start_before_finite"), "runs", "isfinite(start_before)"
    )
    op.execute(f"CREATE INDEX ix_runs_start_before ON runs (start_before) WHERE {OVERDUE}")
    for name in RESIGNED:
        op.execute(f"DROP FUNCTION {name}")
    for name in RESIGNED + REPLACED:
        op.execute(frozen("0018", name))
    op.execute("UPDATE schema_compatibility SET oldest_release = '0016'")


def downgrade() -> None:
    lock_up_front(op.get_bind(), "LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
    for name in RESIGNED:
        op.execute(f"DROP FUNCTION {name}")
    for name in RESIGNED + REPLACED:
        op.execute(frozen("0016", name))
    op.drop_index("ix_runs_start_before", table_name="runs")
    op.drop_column("runs", "start_before")  # its CHECK goes with it
    op.execute("UPDATE schema_compatibility SET oldest_release = '0015'")
