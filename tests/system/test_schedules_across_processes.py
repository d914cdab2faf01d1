"""Schedules across real processes: two `turnstile serve` processes (API, worker pool and
maintenance each) on one PostgreSQL, a long poll interval, and schedules every two seconds.

- One run per tick: every fire time has exactly one run, and the ticks follow each other with
  none skipped, though both processes claim and both create ticks.
- A schedule created while no worker ran, whose ticks were missed for several seconds, fires
  once for the missed stretch, then on every tick again.
- Pause stops it (no queued tick left, no new run while another schedule keeps ticking);
  resume starts it again from now on; delete leaves no queued run.
- Bad input is 422 problem+json naming the field; runs carry their schedule's id; another
  tenant's schedule is 404.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any
from uuid import UUID

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.queue.cron import CronSchedule
from app.queue.scheduling import NewSchedule, Schedules
from app.security.api_keys import create_key
from app.store.embedded import free_port
from app.vocabulary.classes import PriorityClass
from tests.support.invariants import check_all_runs
from tests.support.processes import turnstile
from tests.support.waiting import eventually

EVERY_TWO_SECONDS = "*/2 * * * * *"
TICK = {"script": [{"final": "tick"}]}


async def runs_of(engine: AsyncEngine, schedule_id: UUID) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT r.id, r.status, r.fire_at, r.started_at, "
                "       (SELECT min(e.created_at) FROM run_events e "
                "        WHERE e.run_id = r.id AND e.type = 'run.claimed') AS claimed_at "
                "FROM runs r WHERE r.schedule_id = :id ORDER BY r.fire_at"
            ),
            {"id": schedule_id},
        )
        return [dict(row) for row in rows.mappings()]


async def done(engine: AsyncEngine, schedule_id: UUID) -> list[dict[str, Any]]:
    return [r for r in await runs_of(engine, schedule_id) if r["status"] == "succeeded"]


async def database_now(engine: AsyncEngine) -> datetime:
    async with engine.connect() as conn:
        value: datetime = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
        return value


def assert_one_run_per_tick(runs: list[dict[str, Any]]) -> None:
    """One run per fire time, and each tick the next of the one before: the first fire time
    after both that tick's time and its start (a tick that starts late covers the ticks it was
    late for, as after downtime; on time, that is simply the next two-second boundary)."""
    fire_times = [r["fire_at"] for r in runs]
    assert len(set(fire_times)) == len(fire_times), "two runs for one tick"
    cron = CronSchedule.parse(EVERY_TWO_SECONDS)
    for before, after in pairwise(runs):
        covered = max(before["fire_at"], before["started_at"])
        assert after["fire_at"] == cron.next_after(covered), f"tick skipped or doubled: {runs}"


async def test_two_processes_fire_each_tick_once_catch_up_once_and_pause(
    database_url: str, engine: AsyncEngine
) -> None:
    operator = (
        await create_key(engine, tenant_id="acme", principal="ops", scopes=("operator",))
    ).secret
    other = (
        await create_key(engine, tenant_id="globex", principal="ops", scopes=("operator",))
    ).secret

    # Workers stopped: a schedule created now misses its ticks until the processes start.
    missed = await Schedules(Queue(engine)).create(
        NewSchedule(
            tenant_id="acme",
            principal="ops",
            cron=EVERY_TWO_SECONDS,
            agent="scripted",
            input=TICK,
            priority=PriorityClass.ASYNC.base,
        )
    )
    [waiting] = await runs_of(engine, missed.id)

    async def stretch_missed() -> bool:
        return await database_now(engine) > waiting["fire_at"] + timedelta(seconds=6)

    await eventually(stretch_missed, within=15, what="three ticks missed")

    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_SLOTS": "interactive:1,async:3,maintenance:1",
        # Far longer than a tick: ticks start on time only through the claim loops' wait for
        # the next due run.
        "TURNSTILE_POLL_INTERVAL_SECONDS": "30",
        "TURNSTILE_SCHEDULE_INTERVAL_SECONDS": "1",
        # Ticks two seconds apart, below the default minimum interval of a schedule.
        "TURNSTILE_SCHEDULE_MIN_INTERVAL_SECONDS": "1",
    }
    ports = [free_port(), free_port()]
    async with AsyncExitStack() as stack:
        for port in ports:
            await stack.enter_async_context(
                turnstile("serve", "--port", str(port), ready=b"Uvicorn running", env=env)
            )
        client, stranger = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}",
                    headers={"Authorization": f"Bearer {secret}"},
                    timeout=30,
                )
            )
            for port, secret in zip(ports, (operator, other), strict=True)
        ]

        # --- bad input ------------------------------------------------------------------------
        for body, field in (
            ({"cron": "every day", "input": TICK}, "cron"),
            ({"cron": "0 0 30 2 *", "input": TICK}, "cron"),
            ({"cron": "* * * * *", "timezone": "Mars/Olympus", "input": TICK}, "timezone"),
        ):
            refused = await client.post("/schedules", json=body)
            assert refused.status_code == 422, refused.text
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json()["errors"][0]["loc"] == ["body", field]

        # --- one run per tick, two processes --------------------------------------------------
        created = await client.post(
            "/schedules", json={"cron": EVERY_TWO_SECONDS, "input": TICK, "class": "async"}
        )
        assert created.status_code == 201, created.text
        schedule = created.json()
        assert created.headers["Location"] == f"/schedules/{schedule['id']}"
        ticking = UUID(schedule["id"])

        async def five_done() -> bool:
            return len(await done(engine, ticking)) >= 5

        await eventually(five_done, within=30, what="five ticks run")
        runs = [r for r in await runs_of(engine, ticking) if r["started_at"] is not None]
        assert_one_run_per_tick(runs)
        for run in runs:
            # Claimed at its fire time, not at the next 30 s poll.
            assert run["claimed_at"] - run["fire_at"] < timedelta(seconds=3)

        # --- the missed stretch fired once ----------------------------------------------------
        async def missed_resumed() -> bool:
            return len(await done(engine, missed.id)) >= 3

        await eventually(missed_resumed, within=30, what="the missed schedule ticking again")
        after_downtime = await done(engine, missed.id)
        catch_up = after_downtime[0]
        assert catch_up["fire_at"] == waiting["fire_at"]  # the tick that was waiting
        # Nothing else for the stretch it covered: the next is the first tick after its start.
        assert after_downtime[1]["fire_at"] > catch_up["started_at"]
        assert_one_run_per_tick(
            [r for r in await runs_of(engine, missed.id) if r["started_at"] is not None]
        )

        # --- runs carry the schedule's id; tenancy --------------------------------------------
        shown = (await client.get(f"/runs/{runs[0]['id']}")).json()
        assert shown["schedule_id"] == str(ticking)
        assert shown["fire_at"] is not None
        detail = (await client.get(f"/schedules/{ticking}")).json()
        assert detail["state"] == "active"
        assert len(detail["next_fire_times"]) == 5
        assert {r["schedule_id"] for r in detail["runs"]} == {str(ticking)}
        listed = (await client.get(f"/schedules/{ticking}/runs", params={"limit": 2})).json()
        assert len(listed["runs"]) == 2
        assert listed["next_cursor"]
        assert (await stranger.get(f"/schedules/{ticking}")).status_code == 404
        assert (await stranger.post(f"/schedules/{ticking}/pause")).status_code == 404
        assert (await stranger.delete(f"/schedules/{ticking}")).status_code == 404
        ids = {s["id"] for s in (await client.get("/schedules")).json()["schedules"]}
        assert ids == {str(ticking), str(missed.id)}
        assert (await stranger.get("/schedules")).json()["schedules"] == []

        # --- pause stops it; resume starts it again -------------------------------------------
        paused = await client.post(f"/schedules/{ticking}/pause")
        assert paused.json()["state"] == "paused"
        before = await runs_of(engine, ticking)
        assert "queued" not in {r["status"] for r in before}
        marker = len(await done(engine, missed.id))

        async def two_more_ticks_elsewhere() -> bool:
            return len(await done(engine, missed.id)) >= marker + 2

        await eventually(two_more_ticks_elsewhere, within=30, what="time passing (two ticks)")
        assert [r["id"] for r in await runs_of(engine, ticking)] == [r["id"] for r in before]

        resumed = await client.post(f"/schedules/{ticking}/resume")
        assert resumed.json()["state"] == "active"
        resumed_at = await database_now(engine)

        async def ticking_again() -> bool:
            runs = await done(engine, ticking)
            return len([r for r in runs if r["fire_at"] > resumed_at]) >= 2

        await eventually(ticking_again, within=30, what="ticks after resume")
        after = [
            r for r in await runs_of(engine, ticking) if r["id"] not in {b["id"] for b in before}
        ]
        assert min(r["fire_at"] for r in after) >= resumed_at - timedelta(seconds=1)

        # --- delete leaves no queued run ------------------------------------------------------
        for schedule_id in (ticking, missed.id):
            deleted = await client.delete(f"/schedules/{schedule_id}")
            assert deleted.status_code == 200, deleted.text
            assert (await client.get(f"/schedules/{schedule_id}")).status_code == 404
            assert "queued" not in {r["status"] for r in await runs_of(engine, schedule_id)}

    async with engine.connect() as conn:
        per_tick = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM (SELECT schedule_id, fire_at FROM runs "
                    "WHERE schedule_id IS NOT NULL GROUP BY 1, 2 HAVING count(*) > 1) AS twice"
                )
            )
        ).scalar_one()
        owners = (
            await conn.execute(
                text(
                    "SELECT count(DISTINCT e.data->>'owner') FROM run_events e "
                    "JOIN runs r ON r.id = e.run_id "
                    "WHERE r.schedule_id IS NOT NULL AND e.type = 'run.claimed'"
                )
            )
        ).scalar_one()
    assert per_tick == 0
    assert owners == 2  # both processes started ticks
    assert await check_all_runs(engine) > 0
