"""Fair claim between tenants (issue "Fair shares between tenants", docs/adr/0006): the indexes
the fair claim walks, and `turnstile_submit` keeping the tenants' counts and queued quota.

* `ix_tenant_class_counts_fair`: the claim's walk over tenants with queued runs of a class, in
  the fair order (fewest running first, then least recently served).
* `ix_runs_tenant_claim`: the head of one tenant's queue at one priority, by eligibility: the
  probe the walk makes for each tenant it passes. As `ix_runs_claim` (which stays, for
  `next_due`, the unfair claim and the reads) with the tenant in front.
* `ix_runs_tenant_exempt`: the same for a tenant's webhook deliveries and schedule ticks only,
  which a tenant at its concurrency limit still gets (they are exempt from limits).
* `turnstile_submit` (last defined by migration 0005) is replaced by the same function with
  three changes, each marked `Fair shares (0011)` in its text: a new run is refused with
  SQLSTATE TS429 'queue-quota' when its tenant's queued runs reached the quota (the tenant's
  `tenant_limits.max_queued`, else the new last parameter `p_max_queued`, the process default);
  and the run it creates, or the waiting run an answer requeues, counts in its tenant's
  `tenant_class_counts` row, in the same call. An answer is never refused by the quota. The
  parameter list changes, so the old function is dropped first (CREATE OR REPLACE would add
  an overload). Its text as installed here is alembic/frozen/0011-turnstile_submit.sql; a
  downgrade puts 0005's back.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op
from app.store.migrate import frozen

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

OLD_SIGNATURE = (
    "turnstile_submit(timestamptz, text, text, boolean, text, uuid, text, text, "
    "double precision, integer, integer, uuid, text, text, smallint, smallint, timestamptz, "
    "jsonb, integer, text)"
)


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_tenant_class_counts_fair ON tenant_class_counts "
        "(band, running, last_claimed_at NULLS FIRST, tenant_id) WHERE queued > 0"
    )
    op.execute(
        "CREATE INDEX ix_runs_tenant_claim ON runs "
        "(tenant_id, priority, coalesce(scheduled_for, created_at)) WHERE status = 'queued'"
    )
    op.execute(
        "CREATE INDEX ix_runs_tenant_exempt ON runs "
        "(tenant_id, priority, coalesce(scheduled_for, created_at)) "
        "WHERE status = 'queued' AND (agent = 'webhook' OR schedule_id IS NOT NULL)"
    )
    op.execute(f"DROP FUNCTION {OLD_SIGNATURE}")
    op.execute(frozen("0011", "turnstile_submit"))


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(frozen("0005", "turnstile_submit"))
    op.drop_index("ix_runs_tenant_exempt", table_name="runs")
    op.drop_index("ix_runs_tenant_claim", table_name="runs")
    op.drop_index("ix_tenant_class_counts_fair", table_name="tenant_class_counts")
