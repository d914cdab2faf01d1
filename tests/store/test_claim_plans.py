"""The plans the claim engine keeps stay right when the queue grows under them.

Claims run on connections that keep one generic plan per statement of the claim function
(app/store/engine.py, `create_claim_engine`; docs/adr/0006 decision 7). Such a plan is made at
the connection's first claim, with the table as it is then, and kept until the connection is
replaced or the table's statistics change. A service starts on an empty queue, so its first
plans are made on an empty table: they must still find every row by a bounded index lookup once
the queue holds many runs, before autovacuum has analysed anything. (They did not: the claim's
UPDATE found its chosen runs through `ix_runs_tenant_claim`, the partial index of queued runs,
which an empty table makes look cheapest, filtering the tenant's whole queue by id: 55 ms a
claim at 200k queued runs, where the primary key takes 0.05.)"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

from app.store.database import positional
from app.store.engine import CLAIM_PLANNER_SETTINGS, plain_url
from tests.support.nested_plans import AutoExplainMissing, explaining
from tests.support.system_tools import require_or_skip

QUEUED = 50_000

FILL_SQL = """
WITH run AS (
    INSERT INTO runs (tenant_id, principal, status, priority, agent, input, max_attempts,
                      last_event_seq, inputs_count, created_at, updated_at)
    SELECT 'tenant', 'principal', 'queued', 10, 'scripted', '{}'::jsonb, 3, 1, 1,
           now() - interval '1 hour' + g * interval '1 millisecond', now()
    FROM generate_series(1, $1) AS g
    RETURNING tenant_id, priority
)
-- The tenant's count row, as the queue keeps it: work to claim now.
INSERT INTO tenant_class_counts AS c (tenant_id, band, running, has_work)
SELECT tenant_id, priority / 10, 0, true FROM run GROUP BY tenant_id, priority / 10
"""

ARGUMENTS: dict[str, Any] = {
    "owner": "plans-test",
    "priorities": list(range(10, 20)),
    "lease_seconds": 30.0,
    "now": None,
    "max_running": [None, None, None],
    "claim": None,
}


@pytest.mark.parametrize("limit", [1, 8], ids=["one", "batch"])
async def test_a_plan_made_on_an_empty_queue_stays_bounded_as_the_queue_grows(
    database_url: str, limit: int
) -> None:
    conn = await asyncpg.connect(plain_url(database_url), server_settings=CLAIM_PLANNER_SETTINGS)
    admin = await asyncpg.connect(plain_url(database_url))
    try:
        sql, names = positional("claim")
        arguments = [{**ARGUMENTS, "limit": limit}[n] for n in names]
        # The function's plans are made now, on an empty table, and kept for the session.
        await conn.fetch(sql, *arguments)
        await admin.execute(FILL_SQL, QUEUED)
        try:
            plans = await explaining(conn)
        except AutoExplainMissing as missing:
            require_or_skip("auto_explain", str(missing))
            raise
        # No ANALYZE: autovacuum has not caught up yet. The same session, so the same kept
        # plans, now over the grown queue; the first call after auto_explain's LOAD also reads
        # the catalog, so a claim rolled back comes first.
        transaction = conn.transaction()
        await transaction.start()
        await conn.fetch(sql, *arguments)
        await transaction.rollback()
        await conn.fetchval("SELECT 1")
        plans.clear()
        async with conn.transaction():
            await conn.fetch(sql, *arguments)
            claimed = await conn.fetchval(
                "SELECT count(*) FROM runs WHERE status = 'running' AND lease_owner = 'plans-test'"
            )
        assert claimed == limit
        outer = [p for p in plans if "FROM turnstile_claim(" in p.query]
        assert outer
        # A bounded claim touches some hundreds of pages at most (tests/store/test_claim_cost.py); a
        # walk over the tenant's queue touches thousands.
        assert outer[-1].buffers < 1000, [(p.buffers, p.query[:80]) for p in plans]
        # The UPDATE's lookup of the chosen runs (alias r): by primary key.
        lookups = [
            node
            for plan in plans
            for node in plan.nodes()
            if node.get("Alias") == "r" and node["Node Type"] != "ModifyTable"
        ]
        assert lookups, [p.plan for p in plans]
        for node in lookups:
            index = node.get("Index Name") or node["Plans"][0].get("Index Name")
            assert index == "pk_runs", json.dumps(node, indent=1)
    finally:
        await conn.close()
        await admin.close()
