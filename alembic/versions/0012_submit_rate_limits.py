"""Submission rate limits (issue "Fair shares between tenants", item 3): a token bucket per
tenant, kept in PostgreSQL and taken inside the submission's own round trip.

* `submit_buckets`: one row per tenant that has ever submitted under a rate limit: its tokens
  and when they were last refilled. A submission refills the bucket for the time since
  (`rate` tokens a second, at most `burst`) and takes one token, in one upsert that locks the
  row until the submission commits, so the limit is exact across API processes. The row is
  rewritten by every limited submission of its tenant, so it is kept at fillfactor 50 for HOT
  updates (the table holds one short row per tenant).
* `turnstile_submit_allowance(tenant, now, default rate, default burst)`: the tenant's
  effective limit (its `tenant_limits` overrides, else the process defaults the caller passes
  from TURNSTILE_SUBMIT_RATE_PER_SECOND / TURNSTILE_SUBMIT_BURST; with a rate and no burst,
  the burst is one second's worth, at least 1) and its bucket as it stands, without a lock.
  A tenant with no rate reads its `tenant_limits` row and nothing else: no bucket row.
* `turnstile_submit` (alembic/frozen/0012-turnstile_submit.sql) gains the bucket step: two
  parameters (the process defaults, NULL by default so an older process calling without them
  keeps working during a rolling upgrade), three results (rate, burst and the tokens left: what
  the RateLimit headers need, with no extra round trip), the allowance read at the top (a replay
  answers with it and spends nothing), and the spend after the idempotency key and before the
  session lock. A submission over the limit raises SQLSTATE `TS429` ('rate-limited', its rate,
  burst and tokens as JSON in the detail) before it writes a run, so a flood of refused
  submissions leaves no dead rows in `runs`; any later refusal rolls the token back with the
  rest. When the unlocked read at the top already finds less than a token, the refusal comes
  before the upsert: what other submissions commit meanwhile can only take tokens, never add any
  at this submission's time, so the locked answer would be the same, and a flood of refused
  submissions takes no lock and writes nothing. Every change is marked `[0012 rate limits]` in
  the function's text.

Lock order in a submission: the idempotency key, then the tenant's bucket row, then the
session row, then runs. Only submissions take a bucket row, always in that place, so it adds
no cycle. The bucket row is held from the spend to the commit (the session lock wait, the
routing, the run's insert and the commit itself): one tenant's limited submissions take turns
on it, other tenants' never meet it.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from app.store.migrate import frozen

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "submit_buckets",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("refilled_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", name="pk_submit_buckets"),
    )
    # Every limited submission rewrites its tenant's row: room on the page for HOT updates.
    op.execute("ALTER TABLE submit_buckets SET (fillfactor = 50)")
    op.execute(frozen("0012", "turnstile_submit_allowance"))
    # New results change the function's row type, which CREATE OR REPLACE cannot do.
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(frozen("0012", "turnstile_submit"))


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(frozen("0011", "turnstile_submit"))
    op.execute("DROP FUNCTION turnstile_submit_allowance")
    op.drop_table("submit_buckets")
