"""The foundation: settings validation, per-transaction timeouts, health probes through a real
server, the CLI's one-line errors, and the throwaway-cluster fixture later issues rely on."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.main import create_app
from app.store.embedded import LocalCluster
from app.store.engine import async_url, plain_url
from app.store.migrate import upgrade
from tests.support.processes import run_cli
from tests.support.servers import running_server


def test_heartbeat_must_fit_three_times_in_the_lease() -> None:
    with pytest.raises(ValidationError, match="at most a third of TURNSTILE_LEASE_SECONDS"):
        Settings(lease_seconds=10, heartbeat_seconds=5)
    assert Settings(lease_seconds=30, heartbeat_seconds=10).heartbeat_seconds == 10


def test_lock_timeout_must_not_exceed_statement_timeout() -> None:
    with pytest.raises(ValidationError, match="lock_timeout_ms"):
        Settings(statement_timeout_ms=100, lock_timeout_ms=200)


def test_database_url_is_read_from_the_plain_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://u@db:5432/x")
    assert Settings().database_url == "postgresql://u@db:5432/x"


def test_non_postgres_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="must be a PostgreSQL URL"):
        async_url("sqlite:///x.db")
    assert async_url("postgres://u@h/d").drivername == "postgresql+asyncpg"


async def test_timeouts_apply_to_every_transaction(engine: AsyncEngine) -> None:
    for _ in range(3):  # whichever pooled connection a transaction draws
        async with engine.begin() as conn:
            assert await conn.scalar(text("SHOW statement_timeout")) == "30s"
            assert await conn.scalar(text("SHOW lock_timeout")) == "5s"
            assert await conn.scalar(text("SHOW idle_in_transaction_session_timeout")) == "1min"
            assert await conn.scalar(text("SHOW application_name")) == "turnstile"


async def test_statement_timeout_stops_a_stuck_query(database_url: str) -> None:
    from app.store.engine import create_engine

    engine = create_engine(Settings(statement_timeout_ms=200, lock_timeout_ms=100), database_url)
    try:
        with pytest.raises(Exception, match="statement timeout"):
            async with engine.begin() as conn:
                await conn.execute(text("SELECT pg_sleep(5)"))
    finally:
        await engine.dispose()


async def test_health_and_readiness_through_a_real_server(database_url: str) -> None:
    app = create_app(Settings(database_url=database_url))
    async with running_server(app) as base, httpx.AsyncClient(base_url=base) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        ready = await client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert (
            ready.json()["checks"]["schema"]["current"]
            == ready.json()["checks"]["schema"]["expected"]
        )
        docs = await client.get("/docs")
        assert docs.status_code == 200
        assert "/healthz" in (await client.get("/openapi.json")).text


async def test_readiness_fails_on_an_unmigrated_database(empty_database: str) -> None:
    # An API-only process: a worker pool could not even register in an unmigrated schema.
    app = create_app(Settings(database_url=empty_database, run_workers=False))
    async with running_server(app) as base, httpx.AsyncClient(base_url=base) as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["schema"]["current"] is None


async def _cli(*args: str, env: dict[str, str]) -> tuple[int, str]:
    code, out, err = await run_cli(*args, env=env)
    return code, out + err


async def test_cli_migrate_and_its_one_line_errors(database_url: str) -> None:
    code, output = await _cli("migrate", env={"DATABASE_URL": database_url})
    assert code == 0, output
    assert "schema at revision" in output

    code, output = await _cli(
        "migrate", env={"DATABASE_URL": database_url, "TURNSTILE_LEASE_SECONDS": "nope"}
    )
    assert code == 2
    assert output.strip().count("\n") == 0, output
    assert output.startswith("turnstile: invalid setting TURNSTILE_LEASE_SECONDS")


async def test_throwaway_cluster_restarts_without_touching_the_main_server(
    throwaway_cluster: LocalCluster,
) -> None:
    url = throwaway_cluster.url()
    await asyncio.to_thread(upgrade, url)
    conn = await asyncpg.connect(plain_url(url))
    await conn.execute("INSERT INTO sessions (tenant_id, principal) VALUES ('t', 'p')")
    await conn.close()

    await asyncio.to_thread(throwaway_cluster.stop, "immediate")
    assert not throwaway_cluster.running()
    with pytest.raises(OSError, match=r"Connect call failed|refused"):
        await asyncpg.connect(plain_url(url), timeout=2)
    await asyncio.to_thread(throwaway_cluster.start)

    conn = await asyncpg.connect(plain_url(url))
    try:
        assert await conn.fetchval("SELECT count(*) FROM sessions") == 1
    finally:
        await conn.close()
