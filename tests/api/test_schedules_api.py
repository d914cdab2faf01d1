"""The schedules API in a real server: operator scope, problem+json for bad input naming the
field, Idempotency-Key on create (a retry never makes a second schedule), the schedule's
document and its runs."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import running_api

NIGHTLY = {"cron": "0 3 * * *", "timezone": "Europe/Paris", "input": {"report": "nightly"}}


async def count(engine: AsyncEngine, sql: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql))).scalar_one())


async def test_create_needs_the_operator_scope(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine) as api:
        user = await api.client("acme", "alice")
        refused = await user.post("/schedules", json=NIGHTLY)
        assert refused.status_code == 403
        assert refused.headers["content-type"] == "application/problem+json"
        assert (await user.get("/schedules")).status_code == 403
    assert await count(engine, "SELECT count(*) FROM schedules") == 0


async def test_bad_input_is_422_naming_the_field(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine) as api:
        ops = await api.client("acme", "ops", "operator")
        for body, loc in (
            ({**NIGHTLY, "cron": "0 3 * *"}, ["body", "cron"]),
            ({**NIGHTLY, "cron": "0 0 31 2 *"}, ["body", "cron"]),
            ({**NIGHTLY, "timezone": "Europe/Atlantis"}, ["body", "timezone"]),
            ({**NIGHTLY, "agent": "nobody"}, ["body", "agent"]),
            ({**NIGHTLY, "class": "urgent"}, ["body", "class"]),
            ({**NIGHTLY, "every": "day"}, ["body", "every"]),
            ({"cron": "0 3 * * *"}, ["body", "input"]),
        ):
            refused = await ops.post("/schedules", json=body)
            assert refused.status_code == 422, (body, refused.text)
            problem = refused.json()
            assert problem["type"] == "/problems/invalid-request"
            assert problem["errors"][0]["loc"] == loc, problem
    assert await count(engine, "SELECT count(*) FROM schedules") == 0
    assert await count(engine, "SELECT count(*) FROM runs") == 0


async def test_an_idempotent_create_replays_instead_of_making_a_second_schedule(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        ops = await api.client("acme", "ops", "operator")
        headers = {"Idempotency-Key": "nightly-report"}
        first = await ops.post("/schedules", json=NIGHTLY, headers=headers)
        again = await ops.post("/schedules", json=NIGHTLY, headers=headers)
        assert first.status_code == again.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == first.json()
        assert again.headers["Location"] == first.headers["Location"]
        other = await ops.post("/schedules", json={**NIGHTLY, "cron": "0 4 * * *"}, headers=headers)
        assert other.status_code == 422
        assert other.json()["type"] == "/problems/idempotency-key-reused"

        schedule = first.json()
        assert schedule["state"] == "active"
        assert schedule["class"] == "async"
        assert schedule["agent"] == "scripted"
        detail = (await ops.get(f"/schedules/{schedule['id']}")).json()
        # Every next fire time is 03:00 on Paris's wall clock.
        paris = ZoneInfo("Europe/Paris")
        fires = [datetime.fromisoformat(t).astimezone(paris) for t in detail["next_fire_times"]]
        assert len(fires) == 5
        assert {(f.hour, f.minute) for f in fires} == {(3, 0)}
        [tick] = detail["runs"]
        assert tick["status"] == "queued"
        assert tick["scheduled_for"] == tick["fire_at"] == detail["next_fire_times"][0]
        run = (await ops.get(f"/runs/{tick['id']}")).json()
        assert run["schedule_id"] == schedule["id"]
    assert await count(engine, "SELECT count(*) FROM schedules") == 1
    assert await count(engine, "SELECT count(*) FROM runs") == 1
