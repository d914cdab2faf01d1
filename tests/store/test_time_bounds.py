"""Times at the edge of PostgreSQL's range, and runs the code cannot decode (issue 40, item 1).

PostgreSQL stores 0001-01-01T00:00:00Z as a time before the Christian era once converted, and
the driver brings `infinity` and `-infinity` back as Python's naive `datetime.max` and
`datetime.min`. A run with such a `scheduled_for` made the claim's bookkeeping raise after the
claim committed, stranding every run of its batch under a lease nobody served. Now:

- the API refuses times outside 1970-01-01 .. 9999-01-01 (UTC) before anything is written;
- the database refuses infinite `scheduled_for` values (migration 0015), and normalises any
  that a queued or held run already carried;
- a claimed run the code cannot decode is failed on its own, and the rest of its batch runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.queue.core import Queue
from app.store.engine import create_engine
from app.store.migrate import upgrade
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.api import running_api

EDGES = [
    "0001-01-01T00:00:00Z",
    "0001-01-01T00:00:00+14:00",
    "9999-12-31T23:59:59.999999Z",
    "9999-12-31T23:59:59-12:00",
    "1969-12-31T23:59:59Z",
]


async def _count(engine: AsyncEngine, sql: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql))).scalar_one())


def _refused(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert "scheduled_for" in response.text
    return body


@pytest.mark.parametrize("when", EDGES)
async def test_the_api_refuses_times_at_the_edge_of_the_range(
    database_url: str, engine: AsyncEngine, when: str
) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client()
        _refused(await client.post("/runs", json={"input": {}, "scheduled_for": when}))
        session = (await client.post("/sessions")).json()["id"]
        _refused(
            await client.post(
                f"/sessions/{session}/turns", json={"input": {}, "scheduled_for": when}
            )
        )
        assert await _count(engine, "SELECT count(*) FROM runs") == 0
        # The bounds themselves are accepted, and render.
        for fine in ("1970-01-01T00:00:00Z", "9998-12-31T23:59:59Z"):
            created = await client.post("/runs", json={"input": {}, "scheduled_for": fine})
            assert created.status_code == 202, created.text
            assert (await client.get(created.headers["location"])).status_code == 200


async def _poison(engine: AsyncEngine, run_id: object, value: str) -> None:
    """Store an infinite time on a run as a database that predates migration 0015 could hold
    it (the constraint is dropped in this test's own database)."""
    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE runs DROP CONSTRAINT IF EXISTS ck_runs_finite_times"))
        await conn.execute(
            text(
                "UPDATE runs SET scheduled_for = CAST(CAST(:value AS text) AS timestamptz)"
                " WHERE id = :id"
            ),
            {"value": value, "id": run_id},
        )


@pytest.mark.parametrize("value", ["-infinity", "infinity"])
async def test_a_claimed_run_that_cannot_be_decoded_fails_alone_and_its_batch_runs(
    queue: Queue, engine: AsyncEngine, value: str
) -> None:
    runs = [
        await queue.enqueue(
            NewRun(tenant_id="acme", principal="p", agent="scripted", input={"n": n}, priority=10)
        )
        for n in range(3)
    ]
    poisoned = runs[1]
    await _poison(engine, poisoned.id, value)
    if value == "infinity":
        # Never eligible by its time: the claim can only meet it once it is made eligible.
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE runs SET created_at = '-infinity' WHERE id = :id"),
                {"id": poisoned.id},
            )
            await conn.execute(
                text("UPDATE runs SET scheduled_for = NULL WHERE id = :id"),
                {"id": poisoned.id},
            )
    claimed = await queue.claim("w", [PriorityClass.ASYNC], limit=3)
    assert sorted(c.run.id for c in claimed) == sorted(r.id for r in runs if r is not poisoned)
    # The others are held and can finish.
    for item in claimed:
        assert await queue.heartbeat(item.lease)
    async with engine.connect() as conn:
        status, kind = (
            await conn.execute(
                text("SELECT status, failure ->> 'kind' FROM runs WHERE id = :id"),
                {"id": poisoned.id},
            )
        ).one()
    assert (status, kind) == ("failed", "undecodable")
    # Nothing is left running without a holder.
    assert await _count(engine, "SELECT count(*) FROM runs WHERE status = 'running'") == len(
        claimed
    )


async def test_migration_0015_normalises_infinite_times_of_live_runs(
    empty_database: str,
) -> None:
    """A database at 0014 holding live runs with infinite times: after the upgrade they are
    finite (eligible now, or far in the future as they asked), the stats render, and the
    database refuses new ones."""
    await asyncio.to_thread(upgrade, empty_database, "0014")
    engine = create_engine(Settings(database_url=None), empty_database, pool_size=2)
    try:
        async with engine.begin() as conn:
            for status, value in (
                ("queued", "-infinity"),
                ("queued", "infinity"),
                ("waiting_for_user", "infinity"),
            ):
                await conn.execute(
                    text(
                        "INSERT INTO runs (id, tenant_id, principal, status, priority, agent,"
                        " input, max_attempts, scheduled_for, last_event_seq, inputs_count,"
                        " created_at, updated_at) VALUES (gen_random_uuid(), 'a', 'p',"
                        " :status, 10, 'scripted', '{}', 3,"
                        " CAST(CAST(:value AS text) AS timestamptz), 1, 1,"
                        " now(), now())"
                    ),
                    {"status": status, "value": value},
                )
        await engine.dispose()
        await asyncio.to_thread(upgrade, empty_database)
        times = "SELECT count(*) FROM runs WHERE NOT isfinite(scheduled_for)"
        assert await _count(engine, times) == 0
        assert await _count(engine, "SELECT count(*) FROM runs WHERE scheduled_for IS NULL") == 1
        far = "SELECT count(*) FROM runs WHERE extract(year FROM scheduled_for) = 9999"
        assert await _count(engine, far) == 2
        async with running_api(empty_database, engine) as api:
            admin = await api.client("a", "root", "admin")
            stats = await admin.get("/queue/stats")
            assert stats.status_code == 200, stats.text
        with pytest.raises(DBAPIError, match="ck_runs_finite_times"):
            async with engine.begin() as conn:
                await conn.execute(text("UPDATE runs SET scheduled_for = 'infinity'"))
    finally:
        await engine.dispose()
