"""The whole API and worker flow through PgBouncer in transaction pooling mode: migrations,
submissions (idempotent ones racing), a scripted run that calls a tool, asks and is answered,
with LISTEN on a direct connection."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.engine import plain_url
from app.store.migrate import upgrade
from tests.support.api import running_api
from tests.support.invariants import check_all_runs
from tests.support.pgbouncer import pgbouncer_in_front_of
from tests.support.waiting import eventually


async def test_api_and_workers_through_pgbouncer(
    server_url: str, database_url: str, engine: AsyncEngine
) -> None:
    async with pgbouncer_in_front_of(server_url) as port:
        through = plain_url(make_url(database_url).set(host="127.0.0.1", port=port))
        # Migrating through the bouncer works: the advisory lock is transaction-scoped.
        await asyncio.to_thread(upgrade, through, pgbouncer=True)
        async with running_api(
            through,
            engine,
            workers=True,
            pgbouncer=True,
            listen_database_url=database_url,
            db_pool_size=4,
        ) as api:
            client = await api.client()
            session = (await client.post("/sessions")).json()["id"]
            script = {
                "script": [{"call": "echo", "args": {"a": 1}}, {"ask": "Sure?"}, {"final": "done"}]
            }
            answers = await asyncio.gather(
                *(
                    client.post(
                        f"/sessions/{session}/turns",
                        json={"input": script},
                        headers={"Idempotency-Key": "once"},
                    )
                    for _ in range(20)
                )
            )
            assert {r.status_code for r in answers} == {202}
            run_id = answers[0].json()["id"]
            assert {r.json()["id"] for r in answers} == {run_id}

            async def status(wanted: str) -> dict[str, Any] | None:
                run: dict[str, Any] = (
                    await client.get(f"/runs/{run_id}", params={"wait": 5, "status": "queued"})
                ).json()
                return run if run["status"] == wanted else None

            await eventually(lambda: status("waiting_for_user"), within=30)
            await client.post(f"/sessions/{session}/turns", json={"input": "yes"})
            done = await eventually(lambda: status("succeeded"), within=30)
            assert done["result"]["answers"] == ["yes"]
            many = await asyncio.gather(
                *(client.post("/runs", json={"input": {"n": i}}) for i in range(30))
            )
            assert {r.status_code for r in many} == {202}
    await check_all_runs(engine)


async def test_timeouts_apply_to_every_transaction_through_pgbouncer(
    server_url: str, database_url: str
) -> None:
    """Startup parameters do not pass PgBouncer: each transaction sets its own timeouts."""
    from sqlalchemy import text

    from app.config import Settings
    from app.store.engine import create_engine

    async with pgbouncer_in_front_of(server_url) as port:
        through = plain_url(make_url(database_url).set(host="127.0.0.1", port=port))
        settings = Settings(
            pgbouncer=True,
            listen_database_url=database_url,
            statement_timeout_ms=7_000,
            lock_timeout_ms=3_000,
        )
        bounced = create_engine(settings, through, pool_size=2)
        try:
            for _ in range(3):
                async with bounced.begin() as conn:
                    assert await conn.scalar(text("SHOW statement_timeout")) == "7s"
                    assert await conn.scalar(text("SHOW lock_timeout")) == "3s"
        finally:
            await bounced.dispose()
