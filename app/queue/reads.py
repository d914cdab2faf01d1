"""The queue's read models for the edges: the runbook (depth per class, stuck runs, the dead
letter), sessions, and the operator dashboard (its overview lists the busiest tenants from
app/queue/tenant_limits.py, its charts read the last hour minute by minute, its webhooks
page an endpoint's latest deliveries). The API, the dashboard and the CLI call these;
they never run a statement themselves, and each result is decoded here, once (the rows are
the store's, app/store/read_rows.py).

Tenant scoping: `tenant_id=None` is the whole queue (admin keys, the CLI); `principal=None`
every principal of the tenant (scoped keys). Time is the database's unless the queue's clock
says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from app.queue.core import Queue, dump_json
from app.queue.pages import RunsPage, TranscriptPage, runs_page, transcript_page
from app.queue.tenant_limits import MAX_COUNTED, TenantDepth, Tenants
from app.queue.turns import PendingTurn
from app.store import conversation_rows, read_rows
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import JSON, Run

BUSIEST_TENANTS = 10
"""How many tenants the dashboard's overview lists one by one."""

STUCK_REASONS = ("lease_expired", "queued_too_long", "waiting_too_long")

Deletion = Literal["deleted", "active", "dead_letter", "in_session", "missing"]
"""What a delete of a conversation (a session) or a response (a run) did: deleted; kept because
a run is still going, or failed and not dismissed (the dead letter is the operator's), or is
part of a session; or the caller sees no such thing."""


@dataclass
class ClassDepth:
    """Non-terminal runs of one class by status, and how long its longest-eligible queued run
    has waited (None when nothing is eligible)."""

    queued: int = 0
    running: int = 0
    waiting_for_user: int = 0
    oldest_eligible_age_seconds: float | None = None


@dataclass(frozen=True)
class WebhookDelivery:
    """One delivery (a run of the `webhook` agent) as the dashboard lists it."""

    run_id: UUID
    source_run_id: UUID
    event: str
    status: str
    attempts: int
    max_attempts: int
    failure: JSON
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class DeliveryCounts:
    delivered: int = 0
    failed: int = 0  # after all their attempts (or cancelled with a deleted endpoint)
    pending: int = 0


@dataclass(frozen=True)
class MinuteStats:
    """One minute of the overview's charts."""

    start: datetime
    finished: int
    claimed: int
    depth: int  # at the minute's end: eligible and not yet claimed a first time
    latency_median: float | None  # seconds from eligible to first claim, of the claims in it
    latency_max: float | None


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
    # A conversation's metadata (the OpenAI Conversations API); {} for every other session.
    metadata: dict[str, str] = field(default_factory=dict)
    # The multitask policy (docs/turn-control.md) and the turns waiting for the active run.
    multitask: str = "reject"
    pending_turns: int = 0
    # The session's approval policy (docs/approvals.md; None: the process default).
    approval: JSON = None

    @property
    def approval_request(self) -> JSON:
        """The tool call the active run waits to have approved, or None."""
        question = self.active_question
        if self.active_status == "waiting_for_user" and isinstance(question, dict):
            return question.get("approval_request")
        return None

    @property
    def state(self) -> str:
        """idle, busy (a queued or running run), or waiting_for_user."""
        if self.active_status is None:
            return "idle"
        return "waiting_for_user" if self.active_status == "waiting_for_user" else "busy"


@dataclass(frozen=True)
class CancelReason:
    """Why a run was cancelled: `interrupted` (a turn under the interrupt policy), `expired`
    (its deadline to start), or the words of whoever cancelled it; `by` who or what did."""

    reason: str
    by: str


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
        self,
        *,
        tenant_id: str,
        principal: str,
        metadata: dict[str, str] | None = None,
        multitask: str = "reject",
        approval: JSON = None,
    ) -> SessionView:
        row = await read_rows.insert_session(
            self.queue.engine,
            now=self.queue.clock(),
            tenant_id=tenant_id,
            principal=principal,
            metadata=dump_json(metadata or {}),
            multitask=multitask,
            approval=None if approval is None else dump_json(approval),
        )
        return SessionView(
            id=row["id"],
            tenant_id=row["tenant_id"],
            principal=row["principal"],
            created_at=row["created_at"],
            active_run_id=None,
            active_status=None,
            active_question=None,
            metadata=_pairs(row["metadata"]),
            multitask=row["multitask"],
            approval=row["approval"],
        )

    async def update_session_metadata(
        self,
        session_id: UUID,
        *,
        tenant_id: str,
        principal: str | None,
        metadata: dict[str, str],
        max_pairs: int,
    ) -> int | None:
        """Set the keys of `metadata` on the session's (the others kept). The number of pairs
        the merge has; it is written only when that is at most `max_pairs`. None: no such
        session for this caller."""
        row = await read_rows.update_session_metadata(
            self.queue.engine,
            session_id,
            tenant_id=tenant_id,
            principal=principal,
            metadata=dump_json(metadata),
            max_pairs=max_pairs,
        )
        return None if row is None else int(row["pairs"])

    async def discard_empty_session(self, session_id: UUID, *, tenant_id: str) -> None:
        """Remove a session no run names (one made for a turn that was then refused)."""
        await read_rows.discard_empty_session(
            self.queue.engine, session_id=session_id, tenant_id=tenant_id
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
            metadata=_pairs(row["metadata"]),
            multitask=row["multitask"],
            pending_turns=int(row["pending_turns"]),
            approval=row.get("approval"),
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

    async def delete_idle_session(
        self,
        session_id: UUID,
        *,
        tenant_id: str,
        principal: str | None,
        only_run: UUID | None = None,
    ) -> Deletion:
        """Delete a session with its runs (the Responses API's conversation delete), unless a
        run of it is active or failed and not dismissed (nothing written then). With
        `only_run` (a response's delete, in a chain of responses), only while that run is the
        session's only one (`in_session` otherwise)."""
        return await conversation_rows.delete_idle_session(
            self.queue.engine,
            session_id,
            tenant_id=tenant_id,
            principal=principal,
            now=self.queue.clock(),
            only_run=only_run,
        )

    async def delete_finished_run(
        self, run_id: UUID, *, tenant_id: str, principal: str | None
    ) -> Deletion:
        """Delete a finished sessionless run (the Responses API's response delete), unless it
        failed and is not dismissed."""
        return await conversation_rows.delete_finished_run(
            self.queue.engine, run_id, tenant_id=tenant_id, principal=principal
        )

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

    async def session_pending_turns(
        self, session_id: UUID, *, tenant_id: str | None, limit: int
    ) -> list[PendingTurn]:
        """A session's turns waiting for its active run, in the order they will start (the
        caller checked the session is visible)."""
        rows = await read_rows.session_pending_turn_rows(
            self.queue.engine, session_id, tenant_id=tenant_id, limit=limit
        )
        return [PendingTurn.from_row(row) for row in rows]

    async def cancel_reasons(self, runs: list[Run]) -> dict[UUID, CancelReason]:
        """Why each cancelled run of `runs` ended (its run.cancelled event's reason and who
        cancelled it); runs not cancelled are left out, and cost no read."""
        cancelled = [run.id for run in runs if run.status == "cancelled"]
        if not cancelled:
            return {}
        rows = await read_rows.cancel_reason_rows(self.queue.engine, cancelled)
        return {
            row["run_id"]: CancelReason(reason=row["reason"] or "", by=row["by"] or "")
            for row in rows
        }

    async def worker_hosts(self, worker_ids: set[str]) -> dict[str, str]:
        """Where the named workers run ("host, pid N"): for operator and admin views only."""
        if not worker_ids:
            return {}
        rows = await read_rows.worker_host_rows(self.queue.engine, sorted(worker_ids))
        return {row["id"]: f"{row['host']}, pid {row['pid']}" for row in rows}

    async def webhook_deliveries(
        self, endpoint_ids: list[UUID], *, per_endpoint: int
    ) -> dict[UUID, list[WebhookDelivery]]:
        """The latest deliveries of each endpoint, newest first (the caller checked the
        endpoints are visible)."""
        found: dict[UUID, list[WebhookDelivery]] = {id_: [] for id_ in endpoint_ids}
        if not endpoint_ids:
            return found
        rows = await read_rows.webhook_delivery_rows(
            self.queue.engine, endpoint_ids, per_endpoint=per_endpoint
        )
        for row in rows:
            found[row["endpoint_id"]].append(
                WebhookDelivery(
                    run_id=row["run_id"],
                    source_run_id=row["source_run_id"],
                    event=str(row["event"]),
                    status=str(row["status"]),
                    attempts=int(row["attempts"]),
                    max_attempts=int(row["max_attempts"]),
                    failure=row["failure"],
                    created_at=row["created_at"],
                    finished_at=row["finished_at"],
                )
            )
        return found

    async def webhook_delivery_counts(
        self, endpoint_ids: list[UUID], *, hours: int
    ) -> dict[UUID, DeliveryCounts]:
        """Each endpoint's deliveries over the last `hours`, by outcome."""
        counts = {id_: DeliveryCounts() for id_ in endpoint_ids}
        if not endpoint_ids:
            return counts
        rows = await read_rows.webhook_delivery_count_rows(
            self.queue.engine, endpoint_ids, now=self.queue.clock(), hours=hours
        )
        for row in rows:
            counts[row["endpoint_id"]] = DeliveryCounts(
                delivered=int(row["delivered"]),
                failed=int(row["failed"]),
                pending=int(row["pending"]),
            )
        return counts

    async def minutes(self, *, tenant_id: str | None, minutes: int) -> list[MinuteStats]:
        """The last `minutes` one-minute buckets, oldest first, ending with the current one:
        throughput, claims and their latency, and the queue's depth (dashboard.sql: ui_charts
        says how each is counted)."""
        rows = await read_rows.chart_rows(
            self.queue.engine, now=self.queue.clock(), tenant_id=tenant_id, minutes=minutes
        )
        return [
            MinuteStats(
                start=row["from_at"],
                finished=int(row["finished"]),
                claimed=int(row["claimed"]),
                depth=int(row["depth"]),
                latency_median=_seconds(row["latency_median"]),
                latency_max=_seconds(row["latency_max"]),
            )
            for row in rows
        ]


def _seconds(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


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


def _pairs(value: Any) -> dict[str, str]:
    """A session's metadata column as the string pairs it holds."""
    if not isinstance(value, dict):
        return {}
    return {str(k): str(v) for k, v in value.items()}
