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
parameters (a custom plan, what a statement gets on its first executions) and the generic plan
a prepared statement may keep; and it runs the functions that touch it (the claim, the one way
to create runs and its marks, the settle, the answer, the submission) under auto_explain, with
custom plans, generic plans, and the claim engine's settings (app/store/engine.py,
CLAIM_PLANNER_SETTINGS: generic plans, planned once per connection and kept). No plan may read
tenant_class_counts but through an index. The exceptions are `tenant_depth`, the operators'
read of the busiest tenants, which ranks them all on purpose, `queue_depth`, which sums every
tenant's running count on purpose, and `settle_idle_work`, the maintenance backstop, which walks
the marked rows on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.dialects.postgresql.asyncpg import dialect

from app.config import Settings
from app.queue.core import Queue
from app.store.engine import CLAIM_PLANNER_SETTINGS, create_engine, plain_url
from app.store.statements import statements
from app.vocabulary.records import NewRun
from tests.support.nested_plans import AutoExplainMissing, start_explaining
from tests.support.system_tools import require_or_skip

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
    "overdue": "false",
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
    "start_before": "NULL",
    "state": "'{}'",
    "step": "0",
    "tenant_id": "'tenant-42'",
    "traceparent": "NULL",
    "unknown": "false",
    "claim": "NULL",
    "outcomes": "ARRAY['succeeded', 'retry']",
    "values": "ARRAY['{}'::jsonb, '{}'::jsonb]",
    "steps": "ARRAY[NULL::integer, NULL]",
    "states": "ARRAY[NULL::jsonb, NULL]",
}
EXEMPT = {"tenant_depth", "settle_idle_work", "queue_depth"}
TABLES = ("tenant_class_counts",)
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
            INSERT INTO tenant_class_counts (tenant_id, band, running, has_work, due_at)
            SELECT 'tenant-' || t, b, CASE WHEN t % 50 = 0 THEN 2 ELSE 0 END, t % 100 = 0,
                   CASE WHEN t % 7 = 0 THEN now() + interval '1 day' END
            FROM generate_series(1, $1) AS t, generate_series(0, 2) AS b
            """,
            TENANTS,
        )
        await conn.execute("ANALYZE tenant_class_counts")
    finally:
        await conn.close()
    return database_url


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan", "claim engine"])
async def test_every_transition_finds_its_count_rows_by_key(many_tenants: str, mode: str) -> None:
    names = touching()
    # The statements that move runs: a new one that forgot the counts would not be checked.
    assert {"end_holds", "cancel_runs", "claim_fifo"} <= set(names)
    conn = await asyncpg.connect(plain_url(many_tenants))
    try:
        scans = {}
        for name in names:
            if mode == "claim engine":
                continue  # only the claim runs on the claim engine: see the functions' test
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


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan", "claim engine"])
async def test_every_function_finds_its_count_rows_by_key(many_tenants: str, mode: str) -> None:
    """The functions that touch the count rows, run for real (and rolled back) on a tenant
    among many: a run created and marked, claimed (the walk, its settles of idle pairs), asked
    a question, answered, a submission, a settle."""
    engine = create_engine(Settings(database_url=None), many_tenants, pool_size=1)
    queue = Queue(engine)
    try:
        async with engine.connect() as conn:
            try:
                plans = await start_explaining(conn)
            except AutoExplainMissing as missing:
                require_or_skip("auto_explain", str(missing))
                raise
            settings = (
                CLAIM_PLANNER_SETTINGS if mode == "claim engine" else {"plan_cache_mode": mode}
            )
            transaction = await conn.begin()
            for setting, value in settings.items():
                await conn.exec_driver_sql(f"SET LOCAL {setting} = '{value}'")
            run = await queue.enqueue(
                NewRun(
                    tenant_id="tenant-42", principal="p", agent="scripted", input={}, priority=20
                ),
                conn=conn,
            )
            rows = await queue.db.rows(
                "claim",
                {
                    "owner": "o",
                    "priorities": list(range(20, 30)),
                    "lease_seconds": 30.0,
                    "limit": 8,
                    "max_running": [None, None, None],
                    "claim": None,
                },
                conn,
            )
            (claimed,) = [row for row in rows if row["id"] == run.id]
            await queue.db.rows(
                "end_holds",
                {
                    "run_ids": [run.id],
                    "epochs": [claimed["lease_epoch"]],
                    "outcomes": ["waiting"],
                    "values": ['{"ask": 1}'],
                    "steps": [1],
                    "states": ["{}"],
                    "backoff_base": 1.0,
                    "backoff_max": 2.0,
                    "unknown": "?",
                    "hook_attempts": 3,
                    "hook_backoff_base": 1.0,
                    "hook_backoff_max": 2.0,
                },
                conn,
            )
            await queue.deliver_input(run.id, {"answer": 1}, principal="p", conn=conn)
            await conn.execute(
                text(
                    "SELECT r.outcome FROM turnstile_submit("
                    " p_now => NULL, p_tenant => 'tenant-43', p_principal => 'p',"
                    " p_own_sessions_only => false, p_actor => 'k', p_session => NULL,"
                    " p_key => NULL, p_request_hash => NULL, p_ttl_seconds => 60,"
                    " p_wait_ms => 1000, p_lock_timeout_ms => 60000,"
                    " p_run_id => gen_random_uuid(), p_agent => 'scripted',"
                    " p_default_agent => 'scripted', p_priority => CAST(20 AS smallint),"
                    " p_default_priority => CAST(20 AS smallint), p_scheduled_for => NULL,"
                    " p_input => CAST('{}' AS jsonb), p_max_attempts => 3,"
                    " p_traceparent => NULL, p_max_queued => NULL) r"
                )
            )
            await conn.execute(
                text("SELECT turnstile_settle_work('tenant-44', CAST(2 AS smallint), NULL)")
            )
            await transaction.rollback()
        checked = [
            p.query.split("\n")[0][:80]
            for p in plans
            if any(node.get("Relation Name") in TABLES for node in p.nodes())
        ]
        assert len(checked) >= 5, checked  # the functions' statements on the count rows ran
        scans = [
            (p.query[:120], node["Node Type"])
            for p in plans
            for node in p.nodes()
            if node.get("Relation Name") in TABLES and node["Node Type"] not in BY_INDEX
        ]
        assert not scans, f"read count rows other than by an index: {scans}"
    finally:
        await engine.dispose()
