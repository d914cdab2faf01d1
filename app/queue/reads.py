"""The queue's read models for the edges: the runbook (depth per class, stuck runs, the dead
letter), sessions, and the operator dashboard (its overview lists the busiest tenants from
app/queue/tenant_limits.py). The API, the dashboard and the CLI call these;
they never run a statement themselves, and each result is decoded here, once (the rows are
the store's, app/store/read_rows.py).

Tenant scoping: `tenant_id=None` is the whole queue (admin keys, the CLI); `principal=None`
every principal of the tenant (scoped keys). Time is the database's unless the queue's clock
says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from app.queue.core import Queue
from app.queue.pages import RunsPage, TranscriptPage, runs_page, transcript_page
from app.queue.tenant_limits import MAX_COUNTED, TenantDepth, Tenants
from app.store import read_rows
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import JSON, Run

BUSIEST_TENANTS = 10
"""How many tenants the dashboard's overview lists one by one."""

STUCK_REASONS = ("lease_expired", "queued_too_long", "waiting_too_long")


@dataclass
class ClassDepth:
    """Non-terminal runs of one class by status, and how long its longest-eligible queued run
    has waited (None when nothing is eligible)."""

    queued: int = 0
    running: int = 0
    waiting_for_user: int = 0
    oldest_eligible_age_seconds: float | None = None


@dataclass(frozen=True)
class ClassCoverage:
    """Whether a class is served: the slots of live worker processes that can claim it, beside
    its queued runs. A class with queued runs and no live slot anywhere is `unserved`, which
    only a fleet of partial layouts can cause (docs/adr/0005), or a fleet with no worker."""

    live_slots: int
    queued: int

    @property
    def unserved(self) -> bool:
        return self.queued > 0 and self.live_slots == 0


@dataclass(frozen=True)
class StuckRun:
    reason: str  # one of STUCK_REASONS
    run: Run


@dataclass(frozen=True)
class SessionView:
    id: UUID
    tenant_id: str
    principal: str
    created_at: datetime
    active_run_id: UUID | None
    active_status: str | None
    active_question: JSON
    # The multitask policy (docs/turn-control.md) and the turns waiting for the active run.
    multitask: str = "reject"
    pending_turns: int = 0

    @property
    def state(self) -> str:
        """idle, busy (a queued or running run), or waiting_for_user."""
        if self.active_status is None:
            return "idle"
        return "waiting_for_user" if self.active_status == "waiting_for_user" else "busy"


@dataclass(frozen=True)
class Overview:
    """The dashboard's overview: depth and throughput per class, recoveries, the dead letter,
    and the live slot groups (rows as the statements return them, for the templates)."""

    depth: dict[PriorityClass, ClassDepth]
    throughput: list[dict[str, Any]]
    recoveries: dict[str, int]
    dead_letter: int
    slot_groups: list[dict[str, Any]] = field(default_factory=list)
    coverage: dict[PriorityClass, ClassCoverage] = field(default_factory=dict)
    # The busiest tenants by queued runs (the rest summed, tenant None), or the one tenant.
    tenants: list[TenantDepth] = field(default_factory=list)

    @property
    def unserved(self) -> list[PriorityClass]:
        return [klass for klass, seen in self.coverage.items() if seen.unserved]


class Reads:
    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    # --- the runbook --------------------------------------------------------------------------
    async def depth(self, *, tenant_id: str | None) -> dict[PriorityClass, ClassDepth]:
        """Every class, with zeros where nothing is queued, running or waiting."""
        rows = await read_rows.depth_rows(
            self.queue.engine, now=self.queue.clock(), tenant_id=tenant_id, max_counted=MAX_COUNTED
        )
        return _depth(rows)

    async def live_slots(self, *, stale_seconds: float) -> dict[PriorityClass, int]:
        """Every class, with the slots of the live worker processes that can claim it (zero
        where none can); a process not seen for `stale_seconds` is not live."""
        rows = await read_rows.live_slot_rows(
            self.queue.engine, now=self.queue.clock(), stale_seconds=stale_seconds
        )
        slots = {str(row["class"]): int(row["slots"]) for row in rows}
        return {klass: slots.get(klass.value, 0) for klass in PriorityClass}

    async def stuck(
        self,
        *,
        tenant_id: str | None,
        queued_seconds: float,
        waiting_seconds: float,
        limit: int,
    ) -> list[StuckRun]:
        rows = await read_rows.stuck_rows(
            self.queue.engine,
            now=self.queue.clock(),
            tenant_id=tenant_id,
            queued_seconds=queued_seconds,
            waiting_seconds=waiting_seconds,
            limit=limit,
        )
        return [StuckRun(reason=str(row["reason"]), run=Run.from_row(row)) for row in rows]

    async def failed_page(
        self, *, tenant_id: str | None, cursor: str | None, limit: int
    ) -> RunsPage:
        """The dead letter: failed runs not dismissed yet, newest first."""
        return await runs_page(
            self.queue.engine,
            "failed_runs",
            {"tenant_id": tenant_id},
            cursor=cursor,
            limit=limit,
            order_field="finished_at",
        )

    # --- sessions -----------------------------------------------------------------------------
    async def create_session(
        self, *, tenant_id: str, principal: str, multitask: str = "reject"
    ) -> SessionView:
        row = await read_rows.insert_session(
            self.queue.engine,
            now=self.queue.clock(),
            tenant_id=tenant_id,
            principal=principal,
            multitask=multitask,
        )
        return SessionView(
            id=row["id"],
            tenant_id=row["tenant_id"],
            principal=row["principal"],
            created_at=row["created_at"],
            active_run_id=None,
            active_status=None,
            active_question=None,
            multitask=row["multitask"],
        )

    async def session(
        self, session_id: UUID, *, tenant_id: str | None, principal: str | None
    ) -> SessionView | None:
        row = await read_rows.session_row(
            self.queue.engine, session_id, tenant_id=tenant_id, principal=principal
        )
        if row is None:
            return None
        return SessionView(
            id=row["id"],
            tenant_id=row["tenant_id"],
            principal=row["principal"],
            created_at=row["created_at"],
            active_run_id=row["active_run_id"],
            active_status=row["active_status"],
            active_question=row["active_question"],
            multitask=row["multitask"],
            pending_turns=int(row["pending_turns"]),
        )

    async def session_runs_page(
        self, session_id: UUID, *, cursor: str | None, limit: int
    ) -> RunsPage:
        """A session's runs, newest first (the caller checked the session is visible)."""
        return await runs_page(
            self.queue.engine,
            "session_runs",
            {"session_id": session_id},
            cursor=cursor,
            limit=limit,
            order_field="created_at",
        )

    async def session_transcript_page(
        self, session_id: UUID, *, cursor: str | None, limit: int
    ) -> TranscriptPage:
        """A session's conversation, oldest first (the caller checked the session is visible)."""
        return await transcript_page(self.queue.engine, session_id, cursor=cursor, limit=limit)

    # --- the dashboard ------------------------------------------------------------------------
    async def runs_page(
        self,
        *,
        tenant_id: str | None,
        principal: str | None,
        filters: dict[str, Any],
        cursor: str | None,
        limit: int,
    ) -> RunsPage:
        """The dashboard's runs list: `filters` are ui_runs's status, class band, session and
        creation-time parameters."""
        return await runs_page(
            self.queue.engine,
            "ui_runs",
            {"tenant_id": tenant_id, "principal": principal, **filters},
            cursor=cursor,
            limit=limit,
            order_field="created_at",
        )

    async def overview(
        self, *, tenant_id: str | None, window_minutes: int, stale_seconds: float
    ) -> Overview:
        rows = await read_rows.overview_rows(
            self.queue.engine,
            now=self.queue.clock(),
            tenant_id=tenant_id,
            max_counted=MAX_COUNTED,
            window_minutes=window_minutes,
            stale_seconds=stale_seconds,
        )
        live = {str(row["class"]): int(row["slots"]) for row in rows.live_slots}
        classes = _depth(rows.depth)
        busiest = await Tenants(self.queue).depth(tenant_id=tenant_id, top=BUSIEST_TENANTS)
        return Overview(
            depth=classes,
            coverage={
                klass: coverage_of(classes[klass], live.get(klass.value, 0))
                for klass in PriorityClass
            },
            throughput=[dict(row) for row in rows.throughput],
            recoveries={str(row["type"]): int(row["events"]) for row in rows.recoveries},
            dead_letter=rows.dead_letter,
            slot_groups=[dict(row) for row in rows.slot_groups],
            tenants=busiest,
        )

    async def inputs_by_event(self, run_id: UUID) -> dict[int, dict[str, Any]]:
        """A run's delivered inputs by the sequence number of the event that delivered each."""
        rows = await read_rows.input_rows(self.queue.engine, run_id)
        return {int(row["event_seq"]): dict(row) for row in rows}

    async def worker_hosts(self, worker_ids: set[str]) -> dict[str, str]:
        """Where the named workers run ("host, pid N"): for operator and admin views only."""
        if not worker_ids:
            return {}
        rows = await read_rows.worker_host_rows(self.queue.engine, sorted(worker_ids))
        return {row["id"]: f"{row['host']}, pid {row['pid']}" for row in rows}


def coverage_of(depth: ClassDepth, live_slots: int) -> ClassCoverage:
    return ClassCoverage(live_slots=live_slots, queued=depth.queued)


def _depth(rows: Any) -> dict[PriorityClass, ClassDepth]:
    classes = list(PriorityClass)
    depth = {klass: ClassDepth() for klass in classes}
    for row in rows:
        entry = depth[classes[int(row["class_index"])]]
        setattr(entry, str(row["status"]), int(row["runs"]))
        if row["oldest_eligible_age"] is not None:
            entry.oldest_eligible_age_seconds = round(float(row["oldest_eligible_age"]), 3)
    return depth
