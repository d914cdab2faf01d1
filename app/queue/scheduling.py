"""Schedules: recurring sessionless runs, exactly one run per tick (`schedules.sql`).

How a schedule fires:
- Its next tick exists ahead as a queued run with `scheduled_for` = `fire_at` = the tick's fire
  time. The claim starts it through the normal path (no scheduler in the hot path), and claim
  loops sleep until the earliest such run is due (`Queue.next_due`), so it starts on time.
- When a tick starts, the following one is created: by the worker pool right after its claim
  (`advance`), and, as a safety net for a process that died in between, by the scheduler
  maintenance service (`ensure_ticks`, app/maintenance/scheduler.py). Both lock the schedule
  row first, compute the same next fire time from the database's state, and insert with
  ON CONFLICT DO NOTHING on UNIQUE (schedule_id, fire_at): the database guarantees one run per
  tick whatever the number of processes.
- The next fire time is the first after everything already covered: the anchor (creation or
  last resume), the latest tick's fire time, and that tick's start. A tick that started late
  covers every tick it was late for. So after downtime (no worker for an hour) the waiting tick
  fires once, late, and its successor is the first fire time after its start: one catch-up run
  for the missed stretch, not one per missed tick. If no tick was waiting (every process was
  down when one started), the first missed tick is created, eligible at once, as the one
  catch-up run; it keeps that first missed fire time in `fire_at`.
- Pause removes the ticks created ahead and not started yet; resume moves the anchor to now
  (ticks skipped while paused never fire) and creates the next tick. Delete removes the
  schedule and its ticks not started yet: it leaves no queued tick behind. Runs that already
  started are real work and go on (a retry after a failure included); they keep the schedule's
  id.
- Holdings: a tenant holds at most its cap of schedules, each firing at most once per its
  minimum interval (app/queue/holdings.py), checked at creation.
- Quotas: a tick is created without any per-tenant queued-run quota check (issue 21 adds
  TURNSTILE_TENANT_MAX_QUEUED): a schedule holds at most one queued tick at a time, and a
  quota that skipped ticks would silently break "exactly one run per tick". Ticks count toward
  the tenant's queued runs like any run; the number of schedules is the operator's lever.
- Time zones and daylight saving: app/queue/cron.py.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from app.queue.core import Queue, dump_json
from app.queue.cron import CronSchedule, InvalidCronError
from app.queue.errors import InvalidScheduleError, ScheduleNotFoundError
from app.queue.holdings import Holdings
from app.queue.pages import RunsPage, decode_cursor, encode_cursor, runs_page
from app.queue.submit import IdempotencyKey, Submissions, Submitter
from app.store import schedule_rows
from app.store.transactions import reading, transaction
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import JSON, Run

log = logging.getLogger("turnstile.schedules")

UPCOMING = 5  # next fire times a schedule's detail shows
RECENT_RUNS = 10  # last runs a schedule's detail shows


@lru_cache(maxsize=1024)
def cron_of(expression: str, timezone: str) -> CronSchedule:
    """The parsed schedule (cached: advancing a busy schedule parses it on every tick)."""
    return CronSchedule.parse(expression, timezone)


def parse_cron(expression: str, timezone: str) -> CronSchedule:
    """Validate a new schedule's expression and time zone (InvalidScheduleError names the
    field)."""
    try:
        return cron_of(expression, timezone)
    except InvalidCronError as exc:
        raise InvalidScheduleError(exc.field, exc.message) from None


@dataclass(frozen=True)
class NewSchedule:
    tenant_id: str
    principal: str
    cron: str
    agent: str
    input: JSON
    priority: int
    timezone: str = "UTC"


@dataclass(frozen=True)
class Schedule:
    id: UUID
    tenant_id: str
    principal: str
    cron: str
    timezone: str
    agent: str
    input: JSON
    priority: int
    anchor_at: datetime
    paused_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: RowMapping) -> Schedule:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})

    @property
    def state(self) -> str:
        return "paused" if self.paused_at is not None else "active"

    @property
    def priority_class(self) -> PriorityClass:
        return PriorityClass.of(self.priority)

    def to_document(self) -> dict[str, JSON]:
        return {
            "id": str(self.id),
            "state": self.state,
            "cron": self.cron,
            "timezone": self.timezone,
            "agent": self.agent,
            "input": self.input,
            "class": self.priority_class.value,
            "priority": self.priority,
            "principal": self.principal,
            "paused_at": self.paused_at.isoformat() if self.paused_at else None,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True)
class ScheduleDetail:
    schedule: Schedule
    next_fire_times: list[datetime]  # none while paused
    runs: list[Run]  # the latest ticks, newest fire time first


@dataclass(frozen=True)
class SchedulePage:
    schedules: list[Schedule]
    next_cursor: str | None


@dataclass(frozen=True)
class ScheduleStats:
    active: int = 0
    paused: int = 0
    without_tick: int = 0  # active schedules with no tick ahead
    most_overdue_seconds: float = 0.0  # how late the most overdue tick ahead is


CREATED = 201


class Schedules:
    """The one way in to schedules for the API, the CLI, the worker pool and the scheduler.
    `keys` (the submissions' idempotency keys) lets `create` honour an `Idempotency-Key`."""

    def __init__(
        self, queue: Queue, keys: Submissions | None = None, holdings: Holdings | None = None
    ) -> None:
        self.queue = queue
        self.keys = keys
        # Without the process defaults, a tenant's own overrides still apply.
        self.holdings = holdings or Holdings()

    def _params(self, **params: Any) -> dict[str, Any]:
        return {"now": self.queue.clock(), **params}

    async def _rows(self, conn: AsyncConnection, name: str, **params: Any) -> list[RowMapping]:
        return await schedule_rows.rows(conn, name, self._params(**params))

    # --- changes ------------------------------------------------------------------------------
    async def create(self, new: NewSchedule) -> Schedule:
        """A new active schedule and its first tick, in one transaction."""
        async with transaction(self.queue.engine) as conn:
            return await self._create(conn, new)

    async def create_once(
        self, new: NewSchedule, idempotency: IdempotencyKey
    ) -> tuple[dict[str, JSON], bool]:
        """`create` under an Idempotency-Key (scoped to the tenant and principal, as on every
        submission): a retry of the same request replays the first answer, never a second
        schedule; the same key with another request is IdempotencyKeyReusedError. Returns the
        schedule's document and whether it was replayed."""
        if self.keys is None:
            raise RuntimeError("Schedules built without idempotency keys")
        who = Submitter(new.tenant_id, new.principal)
        async with transaction(self.queue.engine) as conn:
            replay = await self.keys.take_key(conn, who, idempotency)
            if replay is not None:
                return replay.document, True
            schedule = await self._create(conn, new)
            document = schedule.to_document()
            await self.keys.store_key(conn, who, idempotency, document, None, status=CREATED)
        return document, False

    async def _create(self, conn: AsyncConnection, new: NewSchedule) -> Schedule:
        cron = parse_cron(new.cron, new.timezone)
        # The cap and the minimum interval; it holds the tenant's holdings lock to the commit.
        await self.holdings.admit_schedule(
            conn, new.tenant_id, cron, self.queue.clock() or datetime.now(UTC)
        )
        rows = await self._rows(
            conn,
            "create_schedule",
            id=uuid.uuid4(),
            tenant_id=new.tenant_id,
            principal=new.principal,
            cron=" ".join(new.cron.split()),
            timezone=new.timezone,
            agent=new.agent,
            input=dump_json(new.input),
            priority=new.priority,
        )
        # Not visible to anyone before this commits: no lock needed to create its tick.
        await self._create_next_ticks(conn, rows)
        return Schedule.from_row(rows[0])

    async def pause(self, schedule_id: UUID, *, tenant_id: str | None) -> Schedule:
        """Stop creating ticks and remove the ones created ahead (a no-op when paused)."""
        async with transaction(self.queue.engine) as conn:
            await self._lock(conn, schedule_id, tenant_id)
            rows = await self._rows(conn, "pause_schedule", id=schedule_id)
        return Schedule.from_row(rows[0])

    async def resume(self, schedule_id: UUID, *, tenant_id: str | None) -> Schedule:
        """Fire again from now on (no catch-up for the paused stretch; a no-op when active)."""
        async with transaction(self.queue.engine) as conn:
            current = await self._lock(conn, schedule_id, tenant_id)
            rows = await self._rows(conn, "resume_schedule", id=schedule_id)
            if not rows:
                return current  # it was active
            await self._create_next_ticks(conn, rows)
        return Schedule.from_row(rows[0])

    async def delete(self, schedule_id: UUID, *, tenant_id: str | None) -> int:
        """Delete the schedule and its ticks not started yet; returns how many ticks went."""
        async with transaction(self.queue.engine) as conn:
            await self._lock(conn, schedule_id, tenant_id)
            rows = await self._rows(conn, "delete_schedule", id=schedule_id)
        return int(rows[0]["dropped"])

    async def _lock(
        self, conn: AsyncConnection, schedule_id: UUID, tenant_id: str | None
    ) -> Schedule:
        rows = await self._rows(conn, "lock_schedule", id=schedule_id, tenant_id=tenant_id)
        if not rows:
            raise ScheduleNotFoundError(schedule_id)
        return Schedule.from_row(rows[0])

    # --- ticks --------------------------------------------------------------------------------
    async def advance(self, schedule_ids: set[UUID] | list[UUID]) -> int:
        """Create the next tick of each active schedule among `schedule_ids` that has none
        ahead; returns how many were created. Called when ticks start, and by the scheduler."""
        if not schedule_ids:
            return 0
        async with transaction(self.queue.engine) as conn:
            locked = await self._rows(conn, "lock_schedules", ids=sorted(schedule_ids))
            return await self._create_next_ticks(conn, locked)

    async def ensure_ticks(self, *, batch: int = 200) -> int:
        """The scheduler's round: every active schedule without a tick ahead gets its next one
        (normally none: the pool creates it when the previous tick starts)."""
        created = 0
        after: UUID | None = None
        while True:
            async with reading(self.queue.engine) as conn:
                rows = await self._rows(conn, "schedules_missing_a_tick", after=after, limit=batch)
            ids = [row["id"] for row in rows]
            created += await self.advance(ids)
            if len(ids) < batch:
                return created
            after = ids[-1]

    async def _create_next_ticks(self, conn: AsyncConnection, schedules: list[RowMapping]) -> int:
        """Under the schedules' row locks (or before they are visible): the next tick of each
        whose latest tick is not ahead."""
        if not schedules:
            return 0
        latest = {
            row["schedule_id"]: row
            for row in await self._rows(conn, "latest_ticks", ids=[s["id"] for s in schedules])
        }
        ids: list[UUID] = []
        schedule_ids: list[UUID] = []
        fire_ats: list[datetime] = []
        priorities: Counter[int] = Counter()
        for schedule in schedules:
            tick = latest.get(schedule["id"])
            if tick is not None and tick["status"] == "queued" and tick["started_at"] is None:
                continue  # its next tick is ahead already
            covered: datetime = schedule["anchor_at"]
            if tick is not None:
                for moment in (tick["fire_at"], tick["started_at"]):
                    if moment is not None and moment > covered:
                        covered = moment
            try:
                cron = cron_of(schedule["cron"], schedule["timezone"])
            except InvalidCronError:
                # Valid when created; a time zone can leave the tz database. Say so, skip it.
                log.warning(
                    "schedule no longer parses; no tick created",
                    extra={"schedule_id": str(schedule["id"])},
                )
                continue
            ids.append(uuid.uuid4())
            schedule_ids.append(schedule["id"])
            fire_ats.append(cron.next_after(covered))
            priorities[int(schedule["priority"])] += 1
        if not ids:
            return 0
        rows = await self._rows(
            conn,
            "create_ticks",
            ids=ids,
            schedule_ids=schedule_ids,
            fire_ats=fire_ats,
            max_attempts=self.queue.config.max_attempts,
        )
        created = int(rows[0]["created"]) if rows else 0
        if created == len(ids):
            for priority, count in priorities.items():
                self.queue.observer.transition("enqueued", priority, count)
        return created

    # --- reads --------------------------------------------------------------------------------
    async def get(self, schedule_id: UUID, *, tenant_id: str | None) -> Schedule:
        async with reading(self.queue.engine) as conn:
            rows = await self._rows(conn, "get_schedule", id=schedule_id, tenant_id=tenant_id)
        if not rows:
            raise ScheduleNotFoundError(schedule_id)
        return Schedule.from_row(rows[0])

    async def detail(
        self,
        schedule_id: UUID,
        *,
        tenant_id: str | None,
        upcoming: int = UPCOMING,
        recent: int = RECENT_RUNS,
    ) -> ScheduleDetail:
        """The schedule, its next fire times (the tick ahead first) and its latest runs."""
        schedule = await self.get(schedule_id, tenant_id=tenant_id)
        page = await self.runs_page(schedule_id, tenant_id=tenant_id, cursor=None, limit=recent)
        next_fire_times: list[datetime] = []
        if schedule.paused_at is None:
            cron = cron_of(schedule.cron, schedule.timezone)
            after = schedule.anchor_at
            latest = page.runs[0] if page.runs else None
            if latest is not None and latest.fire_at is not None:
                if latest.status == "queued" and latest.started_at is None:
                    next_fire_times.append(latest.fire_at)
                after = max(m for m in (after, latest.fire_at, latest.started_at) if m is not None)
            next_fire_times.extend(cron.upcoming(after, upcoming - len(next_fire_times)))
        return ScheduleDetail(schedule, next_fire_times, page.runs)

    async def page(self, *, tenant_id: str | None, cursor: str | None, limit: int) -> SchedulePage:
        """Newest first, a keyset page."""
        before = decode_cursor(cursor) if cursor else (None, None)
        async with reading(self.queue.engine) as conn:
            rows = await self._rows(
                conn,
                "list_schedules",
                tenant_id=tenant_id,
                before_created=before[0],
                before_id=before[1],
                limit=limit + 1,
            )
        schedules = [Schedule.from_row(row) for row in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            next_cursor = encode_cursor(schedules[-1].created_at, schedules[-1].id)
        return SchedulePage(schedules, next_cursor)

    async def runs_page(
        self, schedule_id: UUID, *, tenant_id: str | None, cursor: str | None, limit: int
    ) -> RunsPage:
        """A schedule's runs by fire time, newest first, if `tenant_id` (None: any) sees the
        schedule. Once it is deleted its runs keep its id (GET /runs/{id} shows it) but are no
        longer listed here."""
        await self.get(schedule_id, tenant_id=tenant_id)
        return await runs_page(
            self.queue.engine,
            "schedule_runs",
            {"id": schedule_id},
            cursor=cursor,
            limit=limit,
            order_field="fire_at",
        )

    async def stats(self) -> ScheduleStats:
        async with reading(self.queue.engine) as conn:
            rows = await self._rows(conn, "schedule_stats")
        if not rows:
            return ScheduleStats()
        row = rows[0]
        return ScheduleStats(
            active=int(row["active"]),
            paused=int(row["paused"]),
            without_tick=int(row["without_tick"]),
            most_overdue_seconds=float(row["most_overdue_seconds"]),
        )
