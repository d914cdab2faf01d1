"""Schedules in the queue core (app/queue/scheduling.py) against a real PostgreSQL, with the
clock injected: one run per tick whatever the number of concurrent advancers (the database's
UNIQUE (schedule_id, fire_at)), a tick ahead created when the previous one starts, one catch-up
run after downtime, pause, resume and delete, and the claim loop's wait for the next due run."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.maintenance.scheduler import Scheduler
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.errors import InvalidScheduleError, ScheduleNotFoundError
from app.queue.scheduling import NewSchedule, Schedule, Schedules
from app.vocabulary.classes import PriorityClass
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs

START = datetime(2030, 1, 1, tzinfo=UTC)  # the ManualClock's start


def every(cron: str, *, tenant: str = "acme", timezone: str = "UTC") -> NewSchedule:
    return NewSchedule(
        tenant_id=tenant,
        principal="ops",
        cron=cron,
        timezone=timezone,
        agent="scripted",
        input={"script": [{"final": "tick"}]},
        priority=PriorityClass.ASYNC.base,
    )


async def ticks(engine: AsyncEngine, schedule_id: UUID) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT id, status, fire_at, scheduled_for, started_at FROM runs "
                "WHERE schedule_id = :id ORDER BY fire_at"
            ),
            {"id": schedule_id},
        )
        return [dict(row) for row in rows.mappings()]


async def start_due(queue: Queue, schedules: Schedules) -> list[UUID]:
    """What a worker does: claim what is due, then create the claimed ticks' successors."""
    claimed = await queue.claim("w-test", [PriorityClass.ASYNC], limit=10)
    await schedules.advance({c.run.schedule_id for c in claimed if c.run.schedule_id})
    return [c.run.id for c in claimed]


@pytest.fixture
def schedules(queue: Queue) -> Schedules:
    return Schedules(queue)


async def test_creating_a_schedule_queues_its_first_tick_ahead(
    schedules: Schedules, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("*/10 * * * *"))
    assert schedule.state == "active"
    assert schedule.anchor_at == START
    [tick] = await ticks(engine, schedule.id)
    assert tick["status"] == "queued"
    assert tick["fire_at"] == tick["scheduled_for"] == START + timedelta(minutes=10)
    detail = await schedules.detail(schedule.id, tenant_id="acme")
    assert detail.next_fire_times[:3] == [START + timedelta(minutes=m) for m in (10, 20, 30)]
    assert [run.id for run in detail.runs] == [tick["id"]]
    assert detail.runs[0].schedule_id == schedule.id


async def test_each_tick_starts_through_the_claim_and_queues_the_next(
    schedules: Schedules, queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("*/10 * * * *"))
    assert await start_due(queue, schedules) == []  # not due yet
    for minutes in (10, 20, 30):
        clock.now = START + timedelta(minutes=minutes, seconds=1)
        assert len(await start_due(queue, schedules)) == 1
    rows = await ticks(engine, schedule.id)
    assert [r["fire_at"] for r in rows] == [START + timedelta(minutes=m) for m in (10, 20, 30, 40)]
    assert [r["status"] for r in rows] == ["running"] * 3 + ["queued"]


async def test_concurrent_advances_create_one_run_per_tick(
    schedules: Schedules, queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("* * * * *"))
    clock.now = START + timedelta(minutes=1, seconds=1)
    await queue.claim("w-test", [PriorityClass.ASYNC])
    # Twenty processes' worth of advances and scheduler rounds at once, each on its own
    # connection: the row lock and the unique constraint leave exactly one next tick.
    created = await asyncio.gather(
        *(schedules.advance({schedule.id}) for _ in range(10)),
        *(schedules.ensure_ticks() for _ in range(10)),
    )
    assert sum(created) == 1
    rows = await ticks(engine, schedule.id)
    assert [r["fire_at"] for r in rows] == [START + timedelta(minutes=m) for m in (1, 2)]


async def test_the_database_refuses_a_second_run_for_one_tick(
    schedules: Schedules, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("* * * * *"))
    with pytest.raises(IntegrityError, match="uq_runs_schedule_id_fire_at"):
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO runs (tenant_id, principal, agent, input, schedule_id, fire_at) "
                    "VALUES ('acme', 'ops', 'scripted', '{}', :id, :at)"
                ),
                {"id": schedule.id, "at": START + timedelta(minutes=1)},
            )


async def test_after_downtime_the_waiting_tick_is_the_one_catch_up_run(
    schedules: Schedules, queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("* * * * *"))
    # No worker for an hour: 60 ticks missed, one was waiting.
    clock.now = START + timedelta(hours=1, seconds=30)
    assert len(await start_due(queue, schedules)) == 1
    assert await start_due(queue, schedules) == []  # nothing else is due
    rows = await ticks(engine, schedule.id)
    assert [r["fire_at"] for r in rows] == [
        START + timedelta(minutes=1),  # the catch-up: the first missed tick, started late
        START + timedelta(hours=1, minutes=1),  # then the first tick after its start
    ]


async def test_with_no_tick_waiting_the_missed_stretch_fires_once(
    schedules: Schedules, queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("* * * * *"))
    clock.now = START + timedelta(minutes=1, seconds=1)
    # Claimed, then the process died before creating the next tick; everything stays down for
    # an hour.
    await queue.claim("w-test", [PriorityClass.ASYNC])
    clock.now = START + timedelta(hours=1, seconds=30)
    metrics = Metrics()
    scheduler = Scheduler(queue, holder="m-test", interval=1, metrics=metrics)
    stats = await scheduler.run_once()
    assert stats.active == 1
    assert stats.without_tick == 0
    gauge = metrics.registry.get_sample_value
    assert gauge("turnstile_schedules", {"state": "active"}) == 1
    assert gauge("turnstile_schedule_ticks_repaired_total") == 1  # the pool had not
    rows = await ticks(engine, schedule.id)
    assert [r["fire_at"] for r in rows] == [START + timedelta(minutes=m) for m in (1, 2)]
    assert stats.most_overdue_seconds == pytest.approx(3600 - 120 + 30)
    assert gauge("turnstile_schedule_most_overdue_seconds") == pytest.approx(3600 - 120 + 30)
    # The one catch-up run is due at once; once it starts, the next is ahead, not behind.
    assert len(await start_due(queue, schedules)) == 1
    assert await start_due(queue, schedules) == []
    rows = await ticks(engine, schedule.id)
    assert rows[-1]["fire_at"] == START + timedelta(hours=1, minutes=1)
    assert len(rows) == 3


async def test_pause_removes_the_tick_ahead_and_resume_does_not_catch_up(
    schedules: Schedules, queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("* * * * *"))
    paused = await schedules.pause(schedule.id, tenant_id="acme")
    assert paused.state == "paused"
    assert await ticks(engine, schedule.id) == []
    assert await schedules.ensure_ticks() == 0  # the scheduler leaves a paused schedule alone
    assert (await schedules.detail(schedule.id, tenant_id="acme")).next_fire_times == []
    assert (await schedules.pause(schedule.id, tenant_id="acme")).paused_at == paused.paused_at

    clock.now = START + timedelta(minutes=30, seconds=10)
    resumed = await schedules.resume(schedule.id, tenant_id="acme")
    assert resumed.state == "active"
    [tick] = await ticks(engine, schedule.id)
    assert tick["fire_at"] == START + timedelta(minutes=31)  # the next one from now on
    assert (await schedules.resume(schedule.id, tenant_id="acme")).anchor_at == resumed.anchor_at
    assert len(await ticks(engine, schedule.id)) == 1


async def test_a_tick_claimed_before_the_pause_runs_and_gets_no_successor(
    schedules: Schedules, queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("* * * * *"))
    clock.now = START + timedelta(minutes=1, seconds=1)
    claimed = await queue.claim("w-test", [PriorityClass.ASYNC])
    await schedules.pause(schedule.id, tenant_id="acme")
    await schedules.advance({schedule.id})  # the pool's advance, after the pause
    rows = await ticks(engine, schedule.id)
    assert [(r["id"], r["status"]) for r in rows] == [(claimed[0].run.id, "running")]


async def test_delete_leaves_no_queued_run_and_keeps_started_ones(
    schedules: Schedules, queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    schedule = await schedules.create(every("* * * * *"))
    clock.now = START + timedelta(minutes=1, seconds=1)
    started = await start_due(queue, schedules)
    assert await schedules.delete(schedule.id, tenant_id="acme") == 1
    rows = await ticks(engine, schedule.id)
    assert [(r["id"], r["status"]) for r in rows] == [(started[0], "running")]
    with pytest.raises(ScheduleNotFoundError):
        await schedules.get(schedule.id, tenant_id="acme")
    with pytest.raises(ScheduleNotFoundError):
        await schedules.delete(schedule.id, tenant_id="acme")
    assert await schedules.advance({schedule.id}) == 0
    run = await queue.get_run(started[0])
    assert run is not None
    assert run.schedule_id == schedule.id  # still findable
    assert await check_all_runs(engine) >= 1


async def test_another_tenants_schedule_is_not_found(schedules: Schedules) -> None:
    schedule = await schedules.create(every("* * * * *", tenant="acme"))
    for action in (schedules.get, schedules.pause, schedules.resume, schedules.delete):
        with pytest.raises(ScheduleNotFoundError):
            await action(schedule.id, tenant_id="globex")
    page = await schedules.page(tenant_id="globex", cursor=None, limit=10)
    assert page.schedules == []
    assert [s.id for s in (await schedules.page(tenant_id=None, cursor=None, limit=10)).schedules]


async def test_schedule_pages_follow_their_cursor(schedules: Schedules) -> None:
    made: list[Schedule] = [await schedules.create(every("0 * * * *")) for _ in range(5)]
    seen: list[UUID] = []
    cursor = None
    while True:
        page = await schedules.page(tenant_id="acme", cursor=cursor, limit=2)
        seen.extend(s.id for s in page.schedules)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(seen) == sorted(s.id for s in made)


async def test_bad_cron_or_timezone_is_refused_naming_the_field(schedules: Schedules) -> None:
    with pytest.raises(InvalidScheduleError) as bad_cron:
        await schedules.create(every("every day"))
    assert bad_cron.value.field == "cron"
    with pytest.raises(InvalidScheduleError) as bad_zone:
        await schedules.create(every("* * * * *", timezone="Nowhere/Special"))
    assert bad_zone.value.field == "timezone"


async def test_next_due_tells_the_claim_loop_how_long_to_sleep(
    queue: Queue, schedules: Schedules, clock: ManualClock
) -> None:
    assert await queue.next_due([PriorityClass.ASYNC]) is None
    await schedules.create(every("*/10 * * * *"))
    assert await queue.next_due([PriorityClass.ASYNC]) == pytest.approx(600)
    assert await queue.next_due([PriorityClass.INTERACTIVE]) is None  # not its classes
    clock.now = START + timedelta(minutes=10)
    assert await queue.next_due([PriorityClass.ASYNC]) is None  # eligible now: claim it
