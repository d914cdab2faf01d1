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
* `turnstile_submit` (migration 0011's text, which is 0005's with the queued quota; `_patched()`
  below, in the style 0005 used on 0007's) gains the bucket step: two parameters (the process
  defaults, NULL by default so an
  older process calling without them keeps working during a rolling upgrade), three results
  (rate, burst and the tokens left: what the RateLimit headers need, with no extra round
  trip), the allowance read at the top (a replay answers with it and spends nothing), and the
  spend after the idempotency key and before the session lock. A submission over the limit
  raises SQLSTATE `TS429` ('rate-limited', its rate, burst and tokens as JSON in the detail)
  before it writes a run, so a flood of refused submissions leaves no dead rows in `runs`; any
  later refusal rolls the token back with the rest. When the unlocked read at the top already
  finds less than a token, the refusal comes before the upsert: what other submissions commit
  meanwhile can only take tokens, never add any at this submission's time, so the locked
  answer would be the same, and a flood of refused submissions takes no lock and writes
  nothing. Every change is marked `[0012 rate
  limits]` in the function's text.

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

import importlib.util
from pathlib import Path

import sqlalchemy as sa

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

ALLOWANCE = r"""
CREATE FUNCTION turnstile_submit_allowance(
    p_tenant text,
    p_now timestamptz,                    -- NULL: now()
    p_default_rate double precision,      -- TURNSTILE_SUBMIT_RATE_PER_SECOND (NULL: none)
    p_default_burst integer               -- TURNSTILE_SUBMIT_BURST (NULL: a second's worth)
)
-- rate: tokens a second, NULL for no limit; burst: the bucket's size; tokens: in the bucket
-- now (a full bucket when it has no row yet). One row. A set-returning SQL function of one
-- SELECT, so PostgreSQL inlines it into the statement that calls it: no function call of its
-- own in turnstile_submit.
RETURNS TABLE (rate double precision, burst integer, tokens double precision)
LANGUAGE sql STABLE AS $fn$
    SELECT s.rate, s.burst,
           -- The same refill as turnstile_submit's spend: `rate` a second since the last
           -- refill, at most `burst`; a clock behind the bucket's earns nothing. Without a
           -- rate the bucket is not read at all.
           CASE WHEN s.rate IS NOT NULL THEN
               coalesce((SELECT least(s.burst::double precision,
                                      b.tokens + s.rate
                                          * greatest(0, extract(epoch FROM coalesce(p_now, now())
                                                                           - b.refilled_at)
                                                            ::double precision))
                         FROM submit_buckets b WHERE b.tenant_id = p_tenant),
                        s.burst)
           END
    FROM (SELECT o.rate,
                 CASE WHEN o.rate IS NOT NULL
                      THEN coalesce(o.burst, greatest(1, ceil(o.rate)::integer)) END AS burst
          -- A NULL override column means the process default (tenant_limits, migration 0010).
          FROM (SELECT coalesce(l.submit_rate_per_second, p_default_rate) AS rate,
                       coalesce(l.submit_burst, p_default_burst) AS burst
                FROM (SELECT 1) AS one
                LEFT JOIN tenant_limits l ON l.tenant_id = p_tenant) AS o) AS s
$fn$;
"""

# --- turnstile_submit: 0011's text with the bucket step, each change an (old, new) pair ---------
PARAMETERS = "    p_max_queued integer,\n"  # the last input parameter (migration 0011's)
PARAMETERS_RATED = PARAMETERS + (
    "    -- [0012 rate limits] the process defaults of the submission rate limit (NULL: none);\n"
    "    -- the tenant's tenant_limits row overrides either. NULL by default: a process of the\n"
    "    -- previous release calls without them during a rolling upgrade.\n"
    "    p_submit_rate double precision DEFAULT NULL,\n"
    "    p_submit_burst integer DEFAULT NULL,\n"
)
RESULTS = "    OUT stored_run_id uuid\n)"
RESULTS_RATED = (
    "    OUT stored_run_id uuid,\n"
    "    -- [0012 rate limits] the tenant's submission rate limit, for the RateLimit headers: its\n"
    "    -- rate (NULL: no limit), its burst, and the tokens left after this submission (a\n"
    "    -- replay's: as the bucket stands).\n"
    "    OUT rate_limit double precision,\n"
    "    OUT rate_burst integer,\n"
    "    OUT rate_tokens double precision\n"
    ")"
)
TOP = "\nBEGIN\n    IF p_key IS NOT NULL THEN\n"
TOP_RATED = (
    "\nBEGIN\n"
    "    -- [0012 rate limits] The tenant's limit and its bucket as they stand, without a lock:\n"
    "    -- a replay answers with them. A tenant with no rate costs one tenant_limits read.\n"
    "    SELECT a.rate, a.burst, a.tokens INTO rate_limit, rate_burst, rate_tokens\n"
    "    FROM turnstile_submit_allowance(p_tenant, v_now, p_submit_rate, p_submit_burst) a;\n"
    "\n"
    "    IF p_key IS NOT NULL THEN\n"
)
SESSION = (
    "\n    IF p_session IS NOT NULL THEN\n"
    "        -- Every submission to a session takes its row first"
)
SPEND_THEN_SESSION = (
    "\n"
    "    -- [0012 rate limits] A token from the tenant's bucket: after the key (a replay spends\n"
    "    -- none), before the session lock and the run's rows (a refused submission has written\n"
    "    -- nothing to runs). The upsert refills and spends in one statement and holds the row to\n"
    "    -- the commit, so concurrent submissions of the tenant, from any process, take turns;\n"
    "    -- any refusal below rolls the token back with everything else.\n"
    "    IF rate_limit IS NOT NULL THEN\n"
    "        -- Short already as read above: spends committed since can only have taken more,\n"
    "        -- so this is refused without a lock or a write (a flood of refused submissions\n"
    "        -- neither queues on the row nor leaves dead versions of it).\n"
    "        IF rate_tokens < 1 THEN\n"
    "            RAISE EXCEPTION 'rate-limited' USING ERRCODE = 'TS429',\n"
    "                DETAIL = jsonb_build_object('rate', rate_limit, 'burst', rate_burst,\n"
    "                                            'tokens', rate_tokens)::text;\n"
    "        END IF;\n"
    "        INSERT INTO submit_buckets AS b (tenant_id, tokens, refilled_at)\n"
    "        VALUES (p_tenant, rate_burst - 1, v_now)\n"
    "        ON CONFLICT (tenant_id) DO UPDATE\n"
    "        SET tokens = least(rate_burst::double precision,\n"
    "                           b.tokens + rate_limit\n"
    "                               * greatest(0, extract(epoch FROM v_now - b.refilled_at)\n"
    "                                                 ::double precision)) - 1,\n"
    "            -- never backwards: a submission whose clock is behind the bucket's gains\n"
    "            -- nothing\n"
    "            refilled_at = greatest(b.refilled_at, v_now)\n"
    "        RETURNING b.tokens INTO rate_tokens;\n"
    "        IF rate_tokens < 0 THEN\n"
    "            -- Less than one token was left: refused, and rolled back with the spend.\n"
    "            RAISE EXCEPTION 'rate-limited' USING ERRCODE = 'TS429',\n"
    "                DETAIL = jsonb_build_object('rate', rate_limit, 'burst', rate_burst,\n"
    "                                            'tokens', rate_tokens + 1)::text;\n"
    "        END IF;\n"
    "    END IF;\n" + SESSION
)
CHANGES = (
    (PARAMETERS, PARAMETERS_RATED),
    (RESULTS, RESULTS_RATED),
    (TOP, TOP_RATED),
    (SESSION, SPEND_THEN_SESSION),
)


def _migration(name: str, file: str) -> object:
    path = Path(__file__).with_name(file)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _submit_0011() -> str:
    """Migration 0011's `turnstile_submit` (0005's with the queued quota), as CREATE OR
    REPLACE: the migrations were written in parallel, and this one follows 0011."""
    module = _migration("turnstile_migration_0011", "0011_fair_claim.py")
    text = str(module._patched())  # type: ignore[attr-defined]
    assert text.lstrip().startswith("CREATE OR REPLACE FUNCTION turnstile_submit(")
    return text


def _patched() -> str:
    text = _submit_0011()
    for old, new in CHANGES:
        if text.count(old) != 1:
            raise RuntimeError("turnstile_submit is not migration 0011's: update migration 0012")
        text = text.replace(old, new)
    return text


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
    op.execute(ALLOWANCE)
    # New results change the function's row type, which CREATE OR REPLACE cannot do.
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(_patched())


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(_submit_0011())
    op.execute("DROP FUNCTION turnstile_submit_allowance")
    op.drop_table("submit_buckets")
