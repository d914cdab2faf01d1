"""Real OS processes against one PostgreSQL: an API-only `serve --no-workers` and two
`turnstile worker` processes drain a few hundred runs submitted over HTTP, each run executed
once (attempts == 1) with a clean log."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.security.api_keys import create_key
from app.store.embedded import LocalCluster, free_port
from app.store.engine import create_engine
from app.store.migrate import upgrade
from tests.support.invariants import check_all_runs
from tests.support.processes import turnstile
from tests.support.waiting import eventually

RUNS = 300


@asynccontextmanager
async def process(
    *args: str, ready: bytes, **env: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    async with turnstile(*args, ready=ready, env=env) as child:
        yield child.process


async def test_api_replica_and_two_workers_drain_hundreds_of_runs(
    database_url: str, engine: AsyncEngine
) -> None:
    port = free_port()
    env = {"DATABASE_URL": database_url, "TURNSTILE_SLOTS": "interactive:2,async:4,maintenance:1"}
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(
            process("serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", **env)
        )
        for _ in range(2):
            await stack.enter_async_context(process("worker", ready=b"running slots", **env))
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as client:
            ready = (await client.get("/readyz")).json()
            assert ready["status"] == "ready"
            assert "workers" not in ready["checks"]  # this process runs none

            async def submit(i: int) -> int:
                body = {
                    "input": {"script": [{"call": "echo", "args": {"i": i}}, {"final": i}]},
                    "priority": "interactive" if i % 3 == 0 else "async",
                }
                response = await client.post(
                    "/runs", json=body, headers={"Idempotency-Key": f"run-{i}"}
                )
                return response.status_code

            codes = await asyncio.gather(*(submit(i) for i in range(RUNS)))
            assert set(codes) == {202}

            async def all_done() -> bool:
                async with engine.connect() as conn:
                    done = (
                        await conn.execute(
                            text("SELECT count(*) FROM runs WHERE status = 'succeeded'")
                        )
                    ).scalar_one()
                return bool(done == RUNS)

            await eventually(all_done, within=120, what=f"{RUNS} runs to finish")
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT count(*) AS runs, max(attempts) AS most, "
                    "count(DISTINCT c.data->>'owner') AS owners FROM runs r "
                    "JOIN run_events c ON c.run_id = r.id AND c.type = 'run.claimed'"
                )
            )
        ).one()
        workers = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM workers WHERE role = 'worker' AND stopped_at IS NOT NULL"
                )
            )
        ).scalar_one()
        api = (
            await conn.execute(
                text("SELECT count(*) FROM workers WHERE role = 'api' AND slot_groups = '[]'")
            )
        ).scalar_one()
    assert rows.runs == RUNS  # one claim per run
    assert rows.most == 1
    assert rows.owners == 2  # both workers took part
    assert workers == 2  # both drained and deregistered on SIGTERM
    assert api == 1  # the API replica registers too
    assert await check_all_runs(engine) == RUNS


async def test_a_postgresql_restart_mid_load_loses_nothing(throwaway_cluster: LocalCluster) -> None:
    url = throwaway_cluster.url()
    await asyncio.to_thread(upgrade, url)
    engine = create_engine(Settings(), url)
    try:
        key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
        port = free_port()
        env = {
            "DATABASE_URL": url,
            "TURNSTILE_LEASE_SECONDS": "3",
            "TURNSTILE_HEARTBEAT_SECONDS": "1",
            "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_POLL_INTERVAL_SECONDS": "1",
            "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0.2",
        }
        accepted: list[str] = []
        statuses: list[int] = []
        async with (
            process("serve", "--port", str(port), ready=b"Uvicorn running", **env),
            httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            ) as client,
        ):
            counter = iter(range(10_000))

            async def submit() -> None:
                i = next(counter)
                body = {
                    "input": {
                        "script": [{"call": "sleep", "args": {"seconds": 0.05}}, {"final": i}]
                    }
                }
                try:
                    response = await client.post(
                        "/runs", json=body, headers={"Idempotency-Key": f"k{i}"}
                    )
                except httpx.TransportError:
                    statuses.append(-1)
                    return
                statuses.append(response.status_code)
                if response.status_code == 202:
                    accepted.append(response.json()["id"])

            for _ in range(40):
                await submit()
            await asyncio.to_thread(throwaway_cluster.stop, "fast")
            down = len(statuses)
            for _ in range(5):
                await submit()  # the database is down: these must be refused cleanly
            during = statuses[down:]
            await asyncio.to_thread(throwaway_cluster.start)

            async def recovered() -> bool:
                await submit()
                return statuses[-1] == 202

            await eventually(recovered, within=60, what="the API to accept runs again")
            for _ in range(40):
                await submit()

            async def all_finished() -> bool:
                async with engine.connect() as conn:
                    done = (
                        await conn.execute(
                            text(
                                "SELECT count(*) FROM runs WHERE status = 'succeeded' "
                                "AND id = ANY(CAST(:ids AS uuid[]))"
                            ),
                            {"ids": accepted},
                        )
                    ).scalar_one()
                return bool(done == len(accepted))

            await eventually(all_finished, within=120, what="every accepted run to finish")
        assert during == [503] * 5, during
        assert 500 not in statuses
        assert len(accepted) >= 80
        async with engine.connect() as conn:
            total = (await conn.execute(text("SELECT count(*) FROM runs"))).scalar_one()
        assert total == len(accepted)  # nothing refused was half-written
        assert await check_all_runs(engine) == total
    finally:
        await engine.dispose()


async def test_sigterm_with_an_open_event_stream_exits_promptly(
    database_url: str, engine: AsyncEngine
) -> None:
    port = free_port()
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    async with (
        process(
            "serve", "--port", str(port), ready=b"Uvicorn running", DATABASE_URL=database_url
        ) as serve,
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        ) as client,
    ):
        later = await client.post(
            "/runs", json={"input": 1, "scheduled_for": "2099-01-01T00:00:00Z"}
        )
        run = later.json()["id"]
        lines: list[str] = []
        async with client.stream(
            "GET", f"/runs/{run}/events", headers={"Accept": "text/event-stream"}
        ) as stream:
            async for line in stream.aiter_lines():
                lines.append(line)
                if line.startswith("event: run.created"):
                    serve.send_signal(signal.SIGTERM)
            # The stream ended by itself: the signal reached it before uvicorn's own wait.
        assert await asyncio.wait_for(serve.wait(), 30) == 0
    assert "event: run.created" in lines
    async with engine.connect() as conn:
        roles = (
            await conn.execute(
                text("SELECT role, stopped_at IS NOT NULL FROM workers ORDER BY role")
            )
        ).all()
    assert [tuple(r) for r in roles] == [("serve", True)]
