"""Every transition finds its tenants' count rows by key, whatever the number of tenants.

Fair shares (docs/adr/0006) keep a row per (tenant, class band) in tenant_class_counts, and
every statement that moves a run between queued, running and anything else updates its rows
in the same statement. That must cost the rows it moves, not the table: a service with many
tenants holds many count rows, most of them idle, and a transition that scanned them all would
grow slower with every tenant ever served. It did, up to the point where the planner's costs
turned: at 1,000 tenants the batch claim locked and updated its count rows through hash joins
over two sequential scans of the table (0.45 ms of a 1.8 ms claim of 8), and the bulk enqueue
and the FIFO claim's `count_moves` did the same; at a few hundred tenants every transition did.
A few hundred rows are a few pages, where a scan is the planner's right choice; so the table
here holds 1,000 tenants' rows.

This module fills the table with the rows of many tenants, analyses it, and asks the planner
for the plan of every statement that touches the table, both the plan made for the bind
parameters (a custom plan, what a statement gets on its first executions), the generic plan
a prepared statement may keep, and the claims' plans under the claim engine's settings
(app/store/engine.py, CLAIM_PLANNER_SETTINGS: generic plans, planned once per connection and kept).
No plan may read tenant_class_counts, or its stripes (tenant_queued_stripes, migration 0014:
8 rows per count row, read by the claims, the quotas and count_moves), but through an index.
The exceptions are `tenant_depth`, the operators' read of the busiest tenants, which ranks
them all on purpose, and `clear_idle_work`, the maintenance backstop, which walks the
flagged rows on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import dialect

from app.store.engine import CLAIM_PLANNER_SETTINGS, plain_url
from app.store.statements import statements

TENANTS = 1_000

# A literal for every bind parameter of the statements checked, of the type the statement
# casts it to (or infers). The values need not name real rows: the plans are not executed.
LITERALS: dict[str, str] = {
    "actor": "'actor'",
    "agent": "'scripted'",
    "agents": "ARRAY['scripted']",
    "backoff_base": "1.0",
    "backoff_max": "60.0",
    "epoch": "1",
    "epochs": "ARRAY[1, 1]",
    "failure": "'{}'::jsonb",
    "fire_ats": "ARRAY[now()]",
    "hook_attempts": "8",
    "hook_backoff_base": "1.0",
    "hook_backoff_max": "60.0",
    "id": "'00000000-0000-0000-0000-000000000001'",
    "ids": "ARRAY['00000000-0000-0000-0000-000000000001'::uuid]",
    "input": "'{}'",
    "inputs": "ARRAY['{}'::jsonb]",
    "lease_seconds": "30.0",
    "limit": "8",
    "max_attempts": "3",
    "max_queued": "NULL",
    "max_running": "'{NULL,NULL,NULL}'",
    "now": "NULL",
    "owner": "'owner'",
    "principal": "'principal'",
    "priorities": "'{20,21,22,23,24,25,26,27,28,29}'",
    "priority": "20",
    "question": "'{}'",
    "reason": "'reason'",
    "result": "'{}'",
    "results": "ARRAY['{}'::jsonb, '{}'::jsonb]",
    "resubmitted_from": "NULL",
    "run_id": "'00000000-0000-0000-0000-000000000001'",
    "run_ids": "ARRAY['00000000-0000-0000-0000-000000000001'::uuid, "
    "'00000000-0000-0000-0000-000000000002'::uuid]",
    "schedule_ids": "ARRAY['00000000-0000-0000-0000-000000000001'::uuid]",
    "scheduled": "ARRAY[NULL::timestamptz]",
    "scheduled_for": "NULL",
    "session_id": "NULL",
    "state": "'{}'",
    "step": "0",
    "tenant_id": "'tenant-42'",
    "traceparent": "NULL",
    "unknown": "false",
}
EXEMPT = {"tenant_depth", "clear_idle_work"}
TABLES = ("tenant_class_counts", "tenant_queued_stripes")
# How a plan may read the table: through an index, or as the table a statement modifies (whose
# rows its children found).
BY_INDEX = ("Index Scan", "Index Only Scan", "Bitmap Heap Scan", "ModifyTable")


def touching() -> list[str]:
    return sorted(
        name
        for name, statement in statements().items()
        if any(table in statement.sql for table in TABLES) and name not in EXEMPT
    )


def positional(name: str) -> tuple[str, list[str]]:
    """The statement with `$n` placeholders, and its parameters' names in their order."""
    compiled = statements()[name].clause.compile(dialect=dialect())  # type: ignore[no-untyped-call]
    return compiled.string, list(compiled.positiontup or ())


def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


async def plan_of(conn: asyncpg.Connection, name: str, mode: str) -> dict[str, Any]:
    sql, names = positional(name)
    await conn.execute("RESET ALL")
    if mode == "claim engine":
        for setting, value in CLAIM_PLANNER_SETTINGS.items():
            await conn.execute(f"SET {setting} = '{value}'")
    else:
        await conn.execute(f"SET plan_cache_mode = {mode}")
    await conn.execute(f"PREPARE checked AS {sql}")
    try:
        args = ", ".join(LITERALS[n] for n in names)
        found = await conn.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE checked({args})")
        plan: dict[str, Any] = json.loads(found)[0]["Plan"]
        return plan
    finally:
        await conn.execute("DEALLOCATE checked")


@pytest.fixture
async def many_tenants(database_url: str) -> str:
    conn = await asyncpg.connect(plain_url(database_url))
    try:
        # Each tenant with a row per class band, as a service that served them all has; a few
        # with queued and running runs (the walk's partial index), most idle.
        await conn.execute(
            """
            INSERT INTO tenant_class_counts (tenant_id, band, running, queued, has_work)
            SELECT 'tenant-' || t, b, CASE WHEN t % 50 = 0 THEN 2 ELSE 0 END,
                   CASE WHEN t % 100 = 0 THEN 5 ELSE 0 END, t % 100 = 0
            FROM generate_series(1, $1) AS t, generate_series(0, 2) AS b
            """,
            TENANTS,
        )
        # Their 8 stripes each, a few holding queued runs.
        await conn.execute(
            """
            INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)
            SELECT tenant_id, band, s, CASE WHEN tenant_id LIKE '%7' THEN s ELSE 0 END
            FROM tenant_class_counts, generate_series(0, 7) AS s
            """
        )
        await conn.execute("ANALYZE tenant_class_counts")
        await conn.execute("ANALYZE tenant_queued_stripes")
    finally:
        await conn.close()
    return database_url


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan", "claim engine"])
async def test_every_transition_finds_its_count_rows_by_key(many_tenants: str, mode: str) -> None:
    names = touching()
    # The statements that move runs: a new one that forgot the counts would not be checked.
    assert {"enqueue", "claim_one", "claim_many", "complete_many", "sweep_expired"} <= set(names)
    conn = await asyncpg.connect(plain_url(many_tenants))
    try:
        scans = {}
        for name in names:
            if mode == "claim engine" and not name.startswith("claim_"):
                continue  # only the claims run on the claim engine
            plan = await plan_of(conn, name, mode)
            found = [
                node["Node Type"]
                for node in nodes(plan)
                if node.get("Relation Name") in TABLES and node["Node Type"] not in BY_INDEX
            ]
            if found:
                scans[name] = found
        assert not scans, f"read count rows or stripes other than by an index: {scans}"
    finally:
        await conn.close()
