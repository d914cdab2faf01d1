"""The fair walk visits only tenants with work to claim now; runs are created and holds ended
in one place each (issue 32; docs/adr/0009 and 0010).

* `tenant_class_counts.has_work` now means "has a queued run eligible now" (it meant "has
  queued runs", so every tenant with a schedule's tick due tomorrow stayed in the walk and
  cost every claim a probe). `due_at` (new) holds, for a pair out of the walk, when its
  earliest queued run becomes eligible; the walk takes in the pairs come due from
  `ix_tenant_class_counts_due`. Both are recomputed from the runs here.
* The marks keep their own protocol (`turnstile_mark_work` for new runs, under a shared
  advisory lock of the pair; `turnstile_settle_work` to take a pair out, holding that lock
  exclusively; transitions that requeue set the mark in the same update that moves the
  running count). Queued runs are no longer counted: the quota counts them, bounded by the
  quota, and the stats count them, bounded.
* New functions, each the text of app/store/functions/ at this revision (alembic/frozen/0016-*):
  the claim (`turnstile_claim`, `turnstile_claim_heads`), the one way to create runs
  (`turnstile_create_runs`), to deliver an answer (`turnstile_deliver_input`) and to take an
  idempotency key (`turnstile_claim_key`); `turnstile_submit` uses them.

* `ix_runs_waiting` (new): the runs waiting for their users, which the depth reads count
  instead of scanning every active run.
* `tenant_limits` gains three nullable overrides (issue 40 item 2): `max_schedules` and
  `max_webhook_endpoints` (how many a tenant may hold) and `min_schedule_interval_seconds` (the
  shortest gap between two fire times of one of its schedules). NULL is the process default.
  The older release reads the table by column name and never sees them.
* `tool_journal.outcome_status` may be 'abandoned' (issue 33): a safe or keyed call left open
  by a run's end for good (a cancel, a dead letter), as an unsafe one is 'uncertain'. The
  older release never reads the journal of a finished run (recovery reads the running run's),
  and its history shows any other status as it is.
* `schema_compatibility` (new, one row): the oldest release whose code still works on the
  schema. A process whose code is older than the schema runs when its release is at least
  that (readiness and worker start ask; docs/deployment.md); every later migration sets it.
  Here: 0015.

Safe for the release before it (an expand step): that release's statements read `has_work`
and keep `running` exactly as this one does, and its calls into the database keep their
signatures. `turnstile_add_queued` (its enqueues and ticks) now marks the pair as having work
now, whatever the run's time (a settle later gives a future-only pair its due time);
`turnstile_clear_work` (its claims' drain, its backstop) is the new settle. It still writes the
queued counts, the stripes and reads `tenant_class_totals`, which stay (unread by this
release; dropped by a later contract migration once no process of that release runs): its
queued quota is not enforced while both releases run. The tables are locked EXCLUSIVE while
the marks are recomputed, so an enqueue of the older release in flight waits and marks again
afterwards. To run the older release alone again, downgrade first: the downgrade recomputes
the counts and marks it reads.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from app.store.migrate import frozen, lock_up_front

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

NEW_FUNCTIONS = (
    "turnstile_mark_work",
    "turnstile_settle_work",
    "turnstile_claim_heads",
    "turnstile_claim",
    "turnstile_create_runs",
    "turnstile_deliver_input",
    "turnstile_claim_key",
)
# The holdings' overrides and what each must be (a minimum interval of 0 would mean none).
HOLDING_LIMITS = {
    "max_schedules": ">= 0",
    "max_webhook_endpoints": ">= 0",
    "min_schedule_interval_seconds": ">= 1",
}
# The journal's outcomes: 'abandoned' is new, and the downgrade goes back to the older ones.
OUTCOMES = "('succeeded', 'failed', 'uncertain', 'abandoned')"
OLDER_OUTCOMES = "('succeeded', 'failed', 'uncertain')"
REPLACED = ("turnstile_add_queued", "turnstile_clear_work", "turnstile_submit")

SIGNATURES = {
    "turnstile_mark_work": "(text, smallint, timestamptz, timestamptz)",
    "turnstile_settle_work": "(text, smallint, timestamptz)",
    "turnstile_claim_heads": "(text, smallint[], timestamptz, integer, uuid[])",
    "turnstile_claim": (
        "(text, smallint[], double precision, integer, integer[], timestamptz, uuid)"
    ),
    "turnstile_create_runs": (
        "(timestamptz, uuid[], text[], text[], uuid[], smallint[], text[], jsonb[], "
        "integer[], timestamptz[], uuid[], timestamptz[], uuid[], text[], jsonb[], boolean, "
        "integer)"
    ),
    "turnstile_deliver_input": "(timestamptz, uuid, jsonb, text, text)",
    "turnstile_claim_key": "(timestamptz, text, text, text, text, double precision)",
}

# The earliest queued run of a (tenant, band), one probe of ix_runs_tenant_claim per priority.
FIRST_QUEUED = """
    (SELECT min(h.at) FROM generate_series(c.band * 10, c.band * 10 + 9) AS p(priority)
     CROSS JOIN LATERAL (
         SELECT coalesce(q.scheduled_for, q.created_at) AS at FROM runs q
         WHERE q.tenant_id = c.tenant_id AND q.status = 'queued' AND q.priority = p.priority
         ORDER BY 1 LIMIT 1) AS h)
"""


def upgrade() -> None:
    # Every lock up front (app/store/migrate.py): the tables altered below, then the counts.
    # The older release's enqueues write the stripes and then mark: they wait here, and mark
    # on a snapshot taken after this commits. Its transitions wait on the count rows.
    lock_up_front(
        op.get_bind(),
        "LOCK TABLE tenant_limits, tool_journal IN ACCESS EXCLUSIVE MODE",
        "LOCK TABLE tenant_queued_stripes, tenant_class_counts IN EXCLUSIVE MODE",
    )
    op.add_column(
        "tenant_class_counts", sa.Column("due_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.execute(
        "CREATE INDEX ix_tenant_class_counts_due ON tenant_class_counts (band, due_at) "
        "WHERE NOT has_work AND due_at IS NOT NULL"
    )
    # The depth reads count waiting runs through it, not by a scan of the active runs.
    op.execute(
        "CREATE INDEX ix_runs_waiting ON runs (tenant_id, priority) "
        "WHERE status = 'waiting_for_user'"
    )
    op.add_column("tenant_limits", sa.Column("max_schedules", sa.Integer(), nullable=True))
    op.add_column("tenant_limits", sa.Column("max_webhook_endpoints", sa.Integer(), nullable=True))
    op.add_column(
        "tenant_limits", sa.Column("min_schedule_interval_seconds", sa.Integer(), nullable=True)
    )
    for column, rule in HOLDING_LIMITS.items():
        op.create_check_constraint(
            op.f(f"ck_tenant_limits_{column}"),
            "tenant_limits",
            f"{column} IS NULL OR {column} {rule}",
        )
    op.drop_constraint(op.f("ck_tool_journal_outcome_status"), "tool_journal", type_="check")
    op.create_check_constraint(
        op.f("ck_tool_journal_outcome_status"),
        "tool_journal",
        f"outcome_status IS NULL OR outcome_status IN {OUTCOMES}",
    )
    op.create_table(
        "schema_compatibility",
        sa.Column("id", sa.SmallInteger(), server_default=sa.text("1"), nullable=False),
        sa.Column("oldest_release", sa.Text(), nullable=False),
        sa.CheckConstraint("id = 1", name="one_row"),
        sa.PrimaryKeyConstraint("id", name="pk_schema_compatibility"),
    )
    op.execute("INSERT INTO schema_compatibility (oldest_release) VALUES ('0015')")
    for name in NEW_FUNCTIONS + REPLACED:
        op.execute(frozen("0016", name))
    op.execute(
        f"""
        UPDATE tenant_class_counts c
        SET has_work = coalesce(f.first_at <= now(), false),
            due_at = CASE WHEN f.first_at > now() THEN f.first_at END
        FROM (SELECT c.tenant_id, c.band, {FIRST_QUEUED} AS first_at
              FROM tenant_class_counts c) AS f
        WHERE f.tenant_id = c.tenant_id AND f.band = c.band
        """
    )


def downgrade() -> None:
    lock_up_front(
        op.get_bind(),
        "LOCK TABLE tenant_limits, tool_journal IN ACCESS EXCLUSIVE MODE",
        "LOCK TABLE tenant_queued_stripes, tenant_class_counts IN EXCLUSIVE MODE",
    )
    for name in REPLACED:
        op.execute(frozen("0014", name))
    for name in reversed(NEW_FUNCTIONS):
        op.execute(f"DROP FUNCTION {name}{SIGNATURES[name]}")
    # The counts the older release reads: every row's queued runs on the row, stripes at 0
    # (and created where this release made a row without them), has_work for any queued run.
    op.execute(
        "INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued) "
        "SELECT c.tenant_id, c.band, g, 0 FROM tenant_class_counts c, generate_series(0, 7) g "
        "ON CONFLICT (tenant_id, band, stripe) DO UPDATE SET queued = 0"
    )
    op.execute(
        """
        UPDATE tenant_class_counts c
        SET queued = coalesce(n.queued, 0), has_work = coalesce(n.queued, 0) > 0
        FROM tenant_class_counts c2
        LEFT JOIN (SELECT tenant_id, priority / 10 AS band, count(*) AS queued FROM runs
                   WHERE status = 'queued' GROUP BY 1, 2) AS n
               ON n.tenant_id = c2.tenant_id AND n.band = c2.band
        WHERE c2.tenant_id = c.tenant_id AND c2.band = c.band
        """
    )
    # The older release's outcomes: an abandoned call reads as one whose outcome is unknown.
    op.execute(
        "UPDATE tool_journal SET outcome_status = 'uncertain' WHERE outcome_status = 'abandoned'"
    )
    op.drop_constraint(op.f("ck_tool_journal_outcome_status"), "tool_journal", type_="check")
    op.create_check_constraint(
        op.f("ck_tool_journal_outcome_status"),
        "tool_journal",
        f"outcome_status IS NULL OR outcome_status IN {OLDER_OUTCOMES}",
    )
    op.drop_table("schema_compatibility")
    for column in HOLDING_LIMITS:  # their CHECKs go with them
        op.drop_column("tenant_limits", column)
    op.drop_index("ix_runs_waiting", table_name="runs")
    op.drop_index("ix_tenant_class_counts_due", table_name="tenant_class_counts")
    op.drop_column("tenant_class_counts", "due_at")
