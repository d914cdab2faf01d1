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
  an overload). The new text is 0005's with those changes applied (`_patched`), and a
  downgrade puts 0005's back, so there is one source of the function's text.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

OLD_SIGNATURE = (
    "turnstile_submit(timestamptz, text, text, boolean, text, uuid, text, text, "
    "double precision, integer, integer, uuid, text, text, smallint, smallint, timestamptz, "
    "jsonb, integer, text)"
)

# (anchor, replacement) pairs applied once each to 0005's text.
PARAMETER = (
    "    p_traceparent text,            "
    "-- the W3C trace context the run's work continues (or NULL)\n"
)
PARAMETER_AND_QUOTA = PARAMETER + (
    "    -- Fair shares (0011): the tenant's queued quota when its tenant_limits row sets none\n"
    "    -- (the process default, TURNSTILE_TENANT_MAX_QUEUED; NULL: no quota).\n"
    "    p_max_queued integer,\n"
)
DECLARE = "    v_stored idempotency_keys;\n"
DECLARE_QUOTA = DECLARE + (
    "    -- Fair shares (0011): the tenant's queued quota and queued total.\n"
    "    v_quota integer;\n"
    "    v_queued bigint;\n"
)
DELIVERED = "                outcome := 'delivered';\n"
COUNTED_DELIVERED = (
    "                -- Fair shares (0011): the requeued run counts in its tenant's queued\n"
    "                -- runs (runs.sql's count_moves), its count row locked after the run.\n"
    "                -- Never refused by the quota: an answer resumes work already admitted.\n"
    "                INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued)\n"
    "                VALUES (the_run.tenant_id, the_run.priority / 10, 0, 1)\n"
    "                ON CONFLICT (tenant_id, band) DO UPDATE SET queued = c.queued + 1;\n"
) + DELIVERED
NEW_RUN = (
    "    IF outcome IS NULL THEN\n"
    "        -- A new queued run, its run.created event and its first input "
    "(as runs.sql enqueue).\n"
)
QUOTA_THEN_NEW_RUN = NEW_RUN + (
    "        -- Fair shares (0011): a tenant whose queued runs reached its quota gets no new run.\n"
    "        -- The total is the sum of its count rows (one per class), read now; concurrent\n"
    "        -- submissions of the tenant may each pass it once (docs/adr/0006).\n"
    "        v_quota := coalesce((SELECT l.max_queued FROM tenant_limits l\n"
    "                             WHERE l.tenant_id = p_tenant), p_max_queued);\n"
    "        IF v_quota IS NOT NULL THEN\n"
    "            SELECT coalesce(sum(c.queued), 0) INTO v_queued FROM tenant_class_counts c\n"
    "            WHERE c.tenant_id = p_tenant;\n"
    "            IF v_queued >= v_quota THEN\n"
    "                RAISE EXCEPTION 'queue-quota' USING ERRCODE = 'TS429',\n"
    "                    DETAIL = jsonb_build_object('tenant_id', p_tenant,\n"
    "                                                'max_queued', v_quota,\n"
    "                                                'queued', v_queued)::text;\n"
    "            END IF;\n"
    "        END IF;\n"
)
CREATED = "        outcome := 'created';\n"
COUNTED_CREATED = (
    "        -- Fair shares (0011): the new run counts in its tenant's queued runs (runs.sql's\n"
    "        -- count_moves), its count row locked after the run.\n"
    "        INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued)\n"
    "        VALUES (the_run.tenant_id, the_run.priority / 10, 0, 1)\n"
    "        ON CONFLICT (tenant_id, band) DO UPDATE SET queued = c.queued + 1;\n"
) + CREATED


def _submit_0005() -> str:
    """Migration 0005's `turnstile_submit`, as CREATE OR REPLACE."""
    path = Path(__file__).with_name("0005_session_conversations.py")
    spec = importlib.util.spec_from_file_location("turnstile_migration_0005", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module._patched()
    return text


def _patched() -> str:
    text = _submit_0005()
    for old, new in (
        (PARAMETER, PARAMETER_AND_QUOTA),
        (DECLARE, DECLARE_QUOTA),
        (DELIVERED, COUNTED_DELIVERED),
        (NEW_RUN, QUOTA_THEN_NEW_RUN),
        (CREATED, COUNTED_CREATED),
    ):
        if text.count(old) != 1:
            raise RuntimeError("turnstile_submit is not migration 0005's: update migration 0011")
        text = text.replace(old, new)
    return text


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
    op.execute(_patched())


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(_submit_0005())
    op.drop_index("ix_runs_tenant_exempt", table_name="runs")
    op.drop_index("ix_runs_tenant_claim", table_name="runs")
    op.drop_index("ix_tenant_class_counts_fair", table_name="tenant_class_counts")
