"""Striped queued counts: one tenant's concurrent enqueues no longer serialise on its count row.

Every enqueue used to add 1 to its tenant's `tenant_class_counts.queued` and hold that row's
lock until its commit, so a tenant's submissions committed one at a time (docs/adr/0006,
"Striped queued counts"). Now:

* `tenant_queued_stripes (tenant_id, band, stripe, queued)`: 8 stripes per count row. A new run
  adds to the stripe `pg_backend_pid() % 8` of its (tenant, band); concurrent enqueues of one
  tenant from different connections take different stripe rows. A count row never exists
  without its 8 stripes (they are created together, in one transaction).
* `tenant_class_counts.queued` becomes bigint and may go negative: it holds the part of the
  queued count not in the stripes (claims and cancellations still subtract there). A tenant's
  queued runs of a band = its row's `queued` + the sum of its 8 stripes (the view
  `tenant_class_totals`).
* `tenant_class_counts.has_work`: "may have queued runs", the fair walk's filter
  (`ix_tenant_class_counts_fair` is re-created `WHERE has_work`). Set by every statement that
  adds queued runs; cleared only by `turnstile_clear_work`, which holds the count row and all 8
  stripes (SKIP LOCKED, so it never waits) and sees the exact total at 0.
* `turnstile_add_queued(tenant, band, n)`: the enqueue's side of the protocol, separate
  statements so that the last one (the mark) runs on a snapshot taken after the stripe write.
* `turnstile_submit` (alembic/frozen/0014-turnstile_submit.sql): a new
  run goes through `turnstile_add_queued`; its quota reads the total; an answer that requeues a
  waiting run still updates the count row, and sets `has_work` there.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from app.store.migrate import frozen

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

STRIPES = 8

TOTALS_VIEW = """
CREATE VIEW tenant_class_totals AS
-- A tenant's running and queued runs per class band: the count row plus its stripes
-- (migration 0014). For readers; the queue's statements read the two tables by key.
SELECT c.tenant_id, c.band, c.running,
       c.queued + coalesce((SELECT sum(s.queued) FROM tenant_queued_stripes s
                            WHERE s.tenant_id = c.tenant_id AND s.band = c.band), 0) AS queued,
       c.has_work, c.last_claimed_at
FROM tenant_class_counts c
"""


def upgrade() -> None:
    op.create_table(
        "tenant_queued_stripes",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("band", sa.SmallInteger(), nullable=False),
        sa.Column("stripe", sa.SmallInteger(), nullable=False),
        sa.Column("queued", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("band BETWEEN 0 AND 2", name="band"),
        sa.CheckConstraint(f"stripe >= 0 AND stripe < {STRIPES}", name="stripe"),
        sa.CheckConstraint("queued >= 0", name="non_negative"),
        sa.PrimaryKeyConstraint("tenant_id", "band", "stripe", name="pk_tenant_queued_stripes"),
    )
    # Stripes are rewritten by every enqueue: room for HOT updates, as the churned tables.
    op.execute("ALTER TABLE tenant_queued_stripes SET (fillfactor = 50)")
    op.execute(
        "INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued) "
        f"SELECT c.tenant_id, c.band, g, 0 FROM tenant_class_counts c, "
        f"generate_series(0, {STRIPES - 1}) AS g"
    )
    op.add_column(
        "tenant_class_counts",
        sa.Column("has_work", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.execute("UPDATE tenant_class_counts SET has_work = queued > 0")
    # The row's queued may go below 0 now (its stripes hold the rest); running may not.
    op.execute(
        "ALTER TABLE tenant_class_counts DROP CONSTRAINT ck_tenant_class_counts_non_negative, "
        "ADD CONSTRAINT ck_tenant_class_counts_non_negative CHECK (running >= 0)"
    )
    op.alter_column("tenant_class_counts", "queued", type_=sa.BigInteger())
    op.drop_index("ix_tenant_class_counts_fair", table_name="tenant_class_counts")
    op.execute(
        "CREATE INDEX ix_tenant_class_counts_fair ON tenant_class_counts "
        "(band, running, last_claimed_at NULLS FIRST, tenant_id) WHERE has_work"
    )
    op.execute(TOTALS_VIEW)
    op.execute(frozen("0014", "turnstile_add_queued"))
    op.execute(frozen("0014", "turnstile_clear_work"))
    # Same signature and results: CREATE OR REPLACE keeps every grant and caller.
    op.execute(frozen("0014", "turnstile_submit"))


def downgrade() -> None:
    op.execute(frozen("0013", "turnstile_submit"))
    op.execute("DROP FUNCTION turnstile_clear_work(text, smallint)")
    op.execute("DROP FUNCTION turnstile_add_queued(text, smallint, bigint)")
    op.execute("DROP VIEW tenant_class_totals")
    # Fold the stripes back into the rows, which then hold the whole count again.
    op.execute(
        "UPDATE tenant_class_counts c SET queued = c.queued + s.queued "
        "FROM (SELECT tenant_id, band, sum(queued) AS queued FROM tenant_queued_stripes "
        "      GROUP BY tenant_id, band) AS s "
        "WHERE s.tenant_id = c.tenant_id AND s.band = c.band"
    )
    op.drop_index("ix_tenant_class_counts_fair", table_name="tenant_class_counts")
    op.execute(
        "CREATE INDEX ix_tenant_class_counts_fair ON tenant_class_counts "
        "(band, running, last_claimed_at NULLS FIRST, tenant_id) WHERE queued > 0"
    )
    op.alter_column("tenant_class_counts", "queued", type_=sa.Integer())
    op.execute(
        "ALTER TABLE tenant_class_counts DROP CONSTRAINT ck_tenant_class_counts_non_negative, "
        "ADD CONSTRAINT ck_tenant_class_counts_non_negative "
        "CHECK (running >= 0 AND queued >= 0)"
    )
    op.drop_column("tenant_class_counts", "has_work")
    op.drop_table("tenant_queued_stripes")
