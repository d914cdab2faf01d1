"""The plans the claim engine keeps stay right when the queue grows under them.

Claims run on connections that keep one generic plan per claim statement (app/store/engine.py,
`create_claim_engine`; docs/adr/0006 decision 7). Such a plan is made at the connection's
first claim, with the table as it is then, and kept until the connection is replaced or the
table's statistics change. A service starts on an empty queue, so its first plans are made on
an empty table: they must still find every row by a bounded index lookup once the queue holds
many runs, before autovacuum has analysed anything. (They did not: the claim's UPDATE found its
chosen runs through `ix_runs_tenant_claim`, the partial index of queued runs, which an empty
table makes look cheapest, filtering the tenant's whole queue by id: 55 ms a claim at 200k
queued runs, where the primary key takes 0.05.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from app.store.database import positional
from app.store.engine import CLAIM_PLANNER_SETTINGS, plain_url

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
-- The tenant's counts, as the queue keeps them (its row, then its 8 stripes).
INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued, has_work)
SELECT tenant_id, priority / 10, 0, count(*), true FROM run GROUP BY tenant_id, priority / 10
"""
STRIPES_SQL = """
INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)
SELECT 'tenant', 1, s, 0 FROM generate_series(0, 7) AS s
"""

ARGUMENTS = {
    "owner": "'plans-test'",
    "priorities": "'{10,11,12,13,14,15,16,17,18,19}'",
    "lease_seconds": "30.0",
    "now": "NULL",
    "max_running": "'{NULL,NULL,NULL}'",
    "limit": "8",
}


def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


@pytest.mark.parametrize("statement", ["claim_one", "claim_many"])
async def test_a_plan_made_on_an_empty_queue_stays_bounded_as_the_queue_grows(
    database_url: str, statement: str
) -> None:
    conn = await asyncpg.connect(plain_url(database_url), server_settings=CLAIM_PLANNER_SETTINGS)
    admin = await asyncpg.connect(plain_url(database_url))
    try:
        sql, names = positional(statement)
        await conn.execute(f"PREPARE kept AS {sql}")
        execute = "EXECUTE kept(" + ", ".join(ARGUMENTS[n] for n in names) + ")"
        await conn.execute(execute)  # the plan is made now, on an empty table
        await admin.execute(FILL_SQL, QUEUED)
        await admin.execute(STRIPES_SQL)
        # No ANALYZE: autovacuum has not caught up yet. The same prepared statement, so the
        # same kept plan, now over the grown queue; EXPLAIN ANALYZE really claims.
        found = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {execute}")
        claimed = await conn.fetchval(
            "SELECT count(*) FROM runs WHERE status = 'running' AND lease_owner = 'plans-test'"
        )
        (explained,) = json.loads(found)
        plan = explained["Plan"]
        assert claimed == (1 if statement == "claim_one" else 8)
        touched = int(plan["Shared Hit Blocks"]) + int(plan.get("Shared Read Blocks", 0))
        # A bounded claim touches a few dozen pages (tests/test_claim_cost.py); a walk over
        # the tenant's queue touches thousands.
        assert touched < 400, json.dumps(plan, indent=1)
        # The UPDATE's lookup of the chosen runs (alias r): by primary key.
        lookups = [
            node
            for node in nodes(plan)
            if node.get("Alias") == "r" and node["Node Type"] != "ModifyTable"
        ]
        assert lookups, json.dumps(plan, indent=1)
        for node in lookups:
            index = node.get("Index Name") or node["Plans"][0].get("Index Name")
            assert index == "pk_runs", json.dumps(node, indent=1)
    finally:
        await conn.close()
        await admin.close()
