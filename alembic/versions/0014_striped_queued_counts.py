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
* `turnstile_submit` (migration 0013's text, patched at exact anchors as 0011-0013 did): a new
  run goes through `turnstile_add_queued`; its quota reads the total; an answer that requeues a
  waiting run still updates the count row, and sets `has_work` there.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa

from alembic import op

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

ADD_QUEUED = """
CREATE OR REPLACE FUNCTION turnstile_add_queued(p_tenant text, p_band smallint, p_n bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $fn$
-- The enqueue's side of the striped count (docs/adr/0006, "Striped queued counts"): p_n new
-- queued runs of (p_tenant, p_band), written by the caller's statement or transaction. Each
-- statement below runs on a snapshot of its own (READ COMMITTED), in this order:
BEGIN
    -- 1. A first run of the (tenant, band): the count row, then its 8 stripes, in this
    --    transaction, so they commit together. Row first, as count_moves creates them: a
    --    concurrent creator then waits on the row and never holds a stripe this one needs.
    --    ON CONFLICT DO NOTHING: a concurrent first run may have created them meanwhile.
    IF NOT EXISTS (SELECT 1 FROM tenant_class_counts c
                   WHERE c.tenant_id = p_tenant AND c.band = p_band) THEN
        INSERT INTO tenant_class_counts (tenant_id, band, running, queued, has_work)
        VALUES (p_tenant, p_band, 0, 0, true)
        ON CONFLICT (tenant_id, band) DO NOTHING;
        INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)
        SELECT p_tenant, p_band, g, 0 FROM generate_series(0, 7) AS g
        ON CONFLICT (tenant_id, band, stripe) DO NOTHING;
    END IF;
    -- 2. The runs, on this connection's stripe: concurrent enqueues of one tenant from other
    --    connections update other rows. The stripe stays locked to the commit.
    INSERT INTO tenant_queued_stripes AS s (tenant_id, band, stripe, queued)
    VALUES (p_tenant, p_band, pg_backend_pid() % 8, p_n)
    ON CONFLICT (tenant_id, band, stripe) DO UPDATE SET queued = s.queued + excluded.queued;
    -- 3. The mark, on a snapshot taken after step 2. A clear committed before it is seen here
    --    (has_work false: set it again); a clear that has not committed by now cannot happen,
    --    because it needs all 8 stripes and this transaction holds one (turnstile_clear_work).
    --    A no-op (no lock, no write) while the flag is already set: the common case.
    UPDATE tenant_class_counts c SET has_work = true
    WHERE c.tenant_id = p_tenant AND c.band = p_band AND NOT c.has_work;
END
$fn$
"""

CLEAR_WORK = """
CREATE OR REPLACE FUNCTION turnstile_clear_work(p_tenant text, p_band smallint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $fn$
-- Clears has_work of (p_tenant, p_band) when it provably has no queued run. Never waits: the
-- count row and the stripes are taken SKIP LOCKED, the row first (a caller that changed it
-- already holds it), then the stripes in order. It clears only when it holds all 8 stripes
-- and the exact total is 0: an enqueue in flight holds its stripe (so nothing is cleared
-- under it), and an enqueue that comes after waits on the stripe held here, then marks on a
-- fresh snapshot (turnstile_add_queued).
-- True when it cleared.
DECLARE
    v_queued bigint;
    v_stripes integer;
    v_striped bigint;
BEGIN
    SELECT c.queued INTO v_queued FROM tenant_class_counts c
    WHERE c.tenant_id = p_tenant AND c.band = p_band AND c.has_work
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT count(*), coalesce(sum(s.queued), 0) INTO v_stripes, v_striped
    FROM (SELECT s.queued FROM tenant_queued_stripes s
          WHERE s.tenant_id = p_tenant AND s.band = p_band
          ORDER BY s.stripe
          FOR UPDATE SKIP LOCKED) AS s;
    IF v_stripes < 8 OR v_queued + v_striped <> 0 THEN
        RETURN false;
    END IF;
    -- No fold (stripes to 0, the row's queued to 0): it would cost a claim that drains a
    -- tenant more writes, and without it stripes only ever grow, so a snapshot's sum of them
    -- is never above the latest one and the callers' pre-check never overestimates a total.
    UPDATE tenant_class_counts c SET has_work = false
    WHERE c.tenant_id = p_tenant AND c.band = p_band;
    RETURN true;
END
$fn$
"""

# turnstile_submit: the quota reads the total, the answer path sets has_work, a new run goes
# through turnstile_add_queued.
QUOTA_OLD = (
    "            SELECT coalesce(sum(c.queued), 0) INTO v_queued FROM tenant_class_counts c\n"
    "            WHERE c.tenant_id = p_tenant;\n"
)
QUOTA_NEW = (
    "            -- [0014] The total: count rows plus their stripes.\n"
    "            SELECT coalesce((SELECT sum(c.queued) FROM tenant_class_counts c\n"
    "                             WHERE c.tenant_id = p_tenant), 0)\n"
    "                 + coalesce((SELECT sum(s.queued) FROM tenant_queued_stripes s\n"
    "                             WHERE s.tenant_id = p_tenant), 0)\n"
    "            INTO v_queued;\n"
)
ANSWER_OLD = (
    "                INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued)\n"
    "                VALUES (the_run.tenant_id, the_run.priority / 10, 0, 1)\n"
    "                ON CONFLICT (tenant_id, band) DO UPDATE SET queued = c.queued + 1;\n"
)
ANSWER_NEW = (
    "                -- [0014] The row holds the lock anyway here (rare path): has_work too.\n"
    "                INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued,\n"
    "                                                     has_work)\n"
    "                VALUES (the_run.tenant_id, the_run.priority / 10, 0, 1, true)\n"
    "                ON CONFLICT (tenant_id, band) DO UPDATE\n"
    "                SET queued = c.queued + 1, has_work = true;\n"
    "                -- A count row never goes without its 8 stripes (a waiting run's row\n"
    "                -- exists with them: this is for a row created just now).\n"
    "                IF NOT EXISTS (SELECT 1 FROM tenant_queued_stripes s\n"
    "                               WHERE s.tenant_id = the_run.tenant_id\n"
    "                                 AND s.band = the_run.priority / 10) THEN\n"
    "                    INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)\n"
    "                    SELECT the_run.tenant_id, the_run.priority / 10, g, 0\n"
    "                    FROM generate_series(0, 7) AS g\n"
    "                    ON CONFLICT (tenant_id, band, stripe) DO NOTHING;\n"
    "                END IF;\n"
)
CREATED_OLD = (
    "        INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued)\n"
    "        VALUES (the_run.tenant_id, the_run.priority / 10, 0, 1)\n"
    "        ON CONFLICT (tenant_id, band) DO UPDATE SET queued = c.queued + 1;\n"
)
CREATED_NEW = (
    "        -- [0014] On a stripe, never on the count row: concurrent submissions of one\n"
    "        -- tenant do not serialise (turnstile_add_queued, docs/adr/0006).\n"
    "        PERFORM turnstile_add_queued(the_run.tenant_id,\n"
    "                                     CAST(the_run.priority / 10 AS smallint), 1);\n"
)


def _submit_0013() -> str:
    """Migration 0013's `turnstile_submit`, as CREATE OR REPLACE."""
    path = Path(__file__).with_name("0013_session_wake.py")
    spec = importlib.util.spec_from_file_location("turnstile_migration_0013", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module._patched())


def _patched() -> str:
    text = _submit_0013()
    for old, new in ((QUOTA_OLD, QUOTA_NEW), (ANSWER_OLD, ANSWER_NEW), (CREATED_OLD, CREATED_NEW)):
        if text.count(old) != 1:
            raise RuntimeError("turnstile_submit is not migration 0013's: update migration 0014")
        text = text.replace(old, new)
    return text


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
    op.execute(ADD_QUEUED)
    op.execute(CLEAR_WORK)
    # Same signature and results: CREATE OR REPLACE keeps every grant and caller.
    op.execute(_patched())


def downgrade() -> None:
    op.execute(_submit_0013())
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
