"""Migrations: up, down, up again; no drift from the table definitions; the partial indexes and
CHECK constraints that autogenerate cannot compare, read back from the catalog."""

from __future__ import annotations

import asyncio
import sys
import uuid
from datetime import UTC, datetime

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import CheckConstraint, Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.engine import plain_url
from app.store.migrate import downgrade, head_revision, upgrade
from app.store.tables import metadata


async def _tables(url: str) -> set[str]:
    conn = await asyncpg.connect(plain_url(url))
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r["tablename"] for r in rows}
    finally:
        await conn.close()


async def test_upgrade_downgrade_upgrade(empty_database: str) -> None:
    await asyncio.to_thread(upgrade, empty_database)
    assert "runs" in await _tables(empty_database)
    await asyncio.to_thread(downgrade, empty_database)
    assert await _tables(empty_database) == {"alembic_version"}
    await asyncio.to_thread(upgrade, empty_database)
    tables = await _tables(empty_database)
    assert {
        "sessions",
        "runs",
        "run_events",
        "run_inputs",
        "checkpoints",
        "tool_journal",
        "idempotency_keys",
        "api_keys",
        "workers",
        "maintenance_leases",
    } <= tables


async def test_concurrent_upgrades_serialise_on_the_advisory_lock(empty_database: str) -> None:
    # Separate processes, as in production: Alembic's context is process-global.
    code = "import sys; from app.store.migrate import upgrade; upgrade(sys.argv[1])"
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            empty_database,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(3)
    ]
    outcomes = [await p.communicate() for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], outcomes
    conn = await asyncpg.connect(plain_url(empty_database))
    try:
        assert await conn.fetchval("SELECT version_num FROM alembic_version") == head_revision()
    finally:
        await conn.close()


# SQLAlchemy reflects a NOT VALID check constraint (ck_runs_finite_times, migration 0015) with
# a `dialect_options` argument it then fails to validate, as a warning; the comparison is
# unaffected.
@pytest.mark.filterwarnings("ignore:Can't validate argument 'dialect_options'")
async def test_no_drift_between_tables_and_migrations(engine: AsyncEngine) -> None:
    def diff(sync_conn: Connection) -> list[object]:
        context = MigrationContext.configure(sync_conn, opts={"compare_type": True})
        return list(compare_metadata(context, metadata))

    async with engine.connect() as conn:
        differences = await conn.run_sync(diff)
    assert differences == []


async def _catalog(engine: AsyncEngine, sql: str) -> dict[str, str]:
    async with engine.connect() as conn:
        rows = (await conn.exec_driver_sql(sql)).all()
    return {str(r[0]): str(r[1]) for r in rows}


async def test_partial_indexes_in_catalog(engine: AsyncEngine) -> None:
    indexes = await _catalog(
        engine, "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'runs'"
    )
    assert indexes["uq_runs_session_id_active"].endswith(
        "(session_id) WHERE (status = ANY (ARRAY['queued'::text, 'running'::text, "
        "'waiting_for_user'::text]))"
    )
    assert "UNIQUE" in indexes["uq_runs_session_id_active"]
    assert indexes["ix_runs_claim"].endswith(
        "(priority, COALESCE(scheduled_for, created_at)) WHERE (status = 'queued'::text)"
    )
    assert indexes["ix_runs_lease_expires_at"].endswith(
        "(lease_expires_at) WHERE (status = 'running'::text)"
    )


async def test_check_constraints_in_catalog(engine: AsyncEngine) -> None:
    checks = await _catalog(
        engine,
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE contype = 'c'",
    )
    # Every CHECK declared in the table definitions exists in the migrated database, by name.
    declared = {
        str(c.name)
        for table in metadata.tables.values()
        for c in table.constraints
        if isinstance(c, CheckConstraint)
    }
    assert len(declared) >= 13
    assert declared <= set(checks)
    assert checks["ck_runs_priority_band"] == "CHECK (((priority >= 0) AND (priority <= 29)))"
    assert "'waiting_for_user'::text" in checks["ck_runs_status"]
    assert "'cancelled'::text" in checks["ck_runs_status"]
    assert checks["ck_runs_lease_only_when_running"].startswith("CHECK (((status = 'running'")
    assert "'uncertain'::text" in checks["ck_tool_journal_outcome_status"]


async def test_upgrading_a_database_with_repeated_resubmissions(empty_database: str) -> None:
    """Before migration 0002 one failed run could be resubmitted twice: the upgrade keeps the
    link on the earliest resubmission (the later one keeps it in its run.created event) and
    builds the unique index instead of failing."""
    await asyncio.to_thread(upgrade, empty_database, "0001")
    conn = await asyncpg.connect(plain_url(empty_database))
    try:
        insert = (
            "INSERT INTO runs (id, tenant_id, principal, status, agent, input, created_at, "
            "resubmitted_from, failure, finished_at) VALUES ($1, 't', 'p', $2, 'scripted', "
            "'{}', now() + make_interval(secs => $3), $4, $5, $6)"
        )
        failed, first, second = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        await conn.execute(insert, failed, "failed", 0, None, '{"kind": "x"}', datetime.now(UTC))
        await conn.execute(insert, first, "succeeded", 1, failed, None, datetime.now(UTC))
        await conn.execute(insert, second, "queued", 2, failed, None, None)
    finally:
        await conn.close()
    await asyncio.to_thread(upgrade, empty_database)
    conn = await asyncpg.connect(plain_url(empty_database))
    try:
        rows = await conn.fetch("SELECT id, resubmitted_from FROM runs ORDER BY created_at")
    finally:
        await conn.close()
    assert [(r["id"], r["resubmitted_from"]) for r in rows] == [
        (failed, None),
        (first, failed),
        (second, None),
    ]


_RELOPTIONS = (
    "SELECT relname, coalesce(array_to_string(reloptions, ','), '') FROM pg_class "
    "WHERE relname IN ('runs', 'run_events', 'run_inputs') AND relkind = 'r'"
)


async def test_storage_parameters_of_the_churned_tables(engine: AsyncEngine) -> None:
    """Migration 0008: room for HOT updates on runs and eager autovacuum on the three tables
    every run churns through (docs/operations.md, "Churn")."""
    options = {
        table: dict(option.split("=", 1) for option in value.split(",") if option)
        for table, value in (await _catalog(engine, _RELOPTIONS)).items()
    }
    assert options["runs"] == {
        "fillfactor": "80",
        "autovacuum_vacuum_scale_factor": "0.02",
        "autovacuum_vacuum_threshold": "1000",
        "autovacuum_vacuum_cost_limit": "2000",
        "autovacuum_analyze_scale_factor": "0.02",
    }
    for table in ("run_events", "run_inputs"):
        assert options[table] == {
            "autovacuum_vacuum_scale_factor": "0.05",
            "autovacuum_vacuum_cost_limit": "2000",
            "autovacuum_analyze_scale_factor": "0.05",
        }


async def test_downgrading_0008_resets_the_storage_parameters(empty_database: str) -> None:
    await asyncio.to_thread(upgrade, empty_database, "0008")
    await asyncio.to_thread(downgrade, empty_database, "0009")
    conn = await asyncpg.connect(plain_url(empty_database))
    try:
        rows = await conn.fetch(_RELOPTIONS)
    finally:
        await conn.close()
    assert {r["relname"]: r["coalesce"] for r in rows} == {
        "runs": "",
        "run_events": "",
        "run_inputs": "",
    }


async def test_0012_adds_the_bucket_step_and_its_downgrade_removes_it(
    empty_database: str,
) -> None:
    """Migration 0012 replaces turnstile_submit with 0005's text plus the bucket step (its
    changes marked in the text), and a downgrade to 0010 puts 0005's back."""
    functions = (
        "SELECT p.proname, p.prosrc, pg_get_function_arguments(p.oid) AS args FROM pg_proc p "
        "WHERE p.proname IN ('turnstile_submit', 'turnstile_submit_allowance')"
    )
    await asyncio.to_thread(upgrade, empty_database, "0012")
    conn = await asyncpg.connect(plain_url(empty_database))
    try:
        found = {r["proname"]: r for r in await conn.fetch(functions)}
        assert set(found) == {"turnstile_submit", "turnstile_submit_allowance"}
        assert found["turnstile_submit"]["prosrc"].count("[0012 rate limits]") == 2
        assert "p_submit_rate double precision DEFAULT NULL" in found["turnstile_submit"]["args"]
        assert "OUT rate_tokens double precision" in found["turnstile_submit"]["args"]
        options = await conn.fetchval(
            "SELECT array_to_string(reloptions, ',') FROM pg_class WHERE relname = 'submit_buckets'"
        )
        assert options == "fillfactor=50"
    finally:
        await conn.close()
    await asyncio.to_thread(downgrade, empty_database, "0010")
    conn = await asyncpg.connect(plain_url(empty_database))
    try:
        found = {r["proname"]: r for r in await conn.fetch(functions)}
        assert set(found) == {"turnstile_submit"}
        assert "[0012" not in found["turnstile_submit"]["prosrc"]
        assert "p_submit_rate" not in found["turnstile_submit"]["args"]
        assert await conn.fetchval("SELECT to_regclass('submit_buckets')") is None
    finally:
        await conn.close()
