"""The rows behind the queue's read models (app/queue/reads.py): the runbook's depth, live
slots and stuck runs, sessions, the dashboard's overview and its charts, a run's inputs and its
workers' hosts, webhook endpoints' deliveries, and the keyset pages of runs and of a
transcript. Statements: app/store/sql/reads.sql, dashboard.sql, submission.sql (session_runs)
and schedules.sql (schedule_runs). Each call is one connection of the engine's; the rows are
decoded by the read models, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.statements import q

PAGE_STATEMENTS = frozenset(
    {"failed_runs", "session_runs", "ui_runs", "schedule_runs", "session_transcript"}
)
"""The keyset statements `page_rows` runs (each ordered, each bounded by its `limit`)."""


async def _all(engine: AsyncEngine, name: str, params: dict[str, Any]) -> list[RowMapping]:
    async with engine.connect() as conn:
        return list((await conn.execute(q(name), params)).mappings().all())


async def depth_rows(
    engine: AsyncEngine, *, now: datetime | None, tenant_id: str | None, max_counted: int
) -> list[RowMapping]:
    return await _all(
        engine, "queue_depth", {"now": now, "tenant_id": tenant_id, "max_counted": max_counted}
    )


async def live_slot_rows(
    engine: AsyncEngine, *, now: datetime | None, stale_seconds: float
) -> list[RowMapping]:
    return await _all(engine, "live_slots_per_class", {"now": now, "stale_seconds": stale_seconds})


async def stuck_rows(
    engine: AsyncEngine,
    *,
    now: datetime | None,
    tenant_id: str | None,
    queued_seconds: float,
    waiting_seconds: float,
    limit: int,
) -> list[RowMapping]:
    return await _all(
        engine,
        "stuck_runs",
        {
            "now": now,
            "tenant_id": tenant_id,
            "queued_seconds": queued_seconds,
            "waiting_seconds": waiting_seconds,
            "limit": limit,
        },
    )


async def discard_empty_session(engine: AsyncEngine, *, session_id: UUID, tenant_id: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            q("discard_empty_session"), {"session_id": session_id, "tenant_id": tenant_id}
        )


async def insert_session(
    engine: AsyncEngine,
    *,
    now: datetime | None,
    tenant_id: str,
    principal: str,
    metadata: str,
    multitask: str = "reject",
    approval: str | None = None,
) -> RowMapping:
    """A new session; `metadata` is its JSON text (`{}` for none), `approval` its approval
    policy's (None: the process default)."""
    async with engine.begin() as conn:
        result = await conn.execute(
            q("create_session"),
            {
                "now": now,
                "tenant_id": tenant_id,
                "principal": principal,
                "metadata": metadata,
                "multitask": multitask,
                "approval": approval,
            },
        )
        return result.mappings().one()


async def update_session_metadata(
    engine: AsyncEngine,
    session_id: UUID,
    *,
    tenant_id: str,
    principal: str | None,
    metadata: str,
    max_pairs: int,
) -> RowMapping | None:
    """Merge `metadata` (JSON text) into the session's, unless that makes more than
    `max_pairs` pairs: the row says whether it was written and how many pairs the merge has;
    None when the caller sees no such session."""
    async with engine.begin() as conn:
        result = await conn.execute(
            q("update_session_metadata"),
            {
                "session_id": session_id,
                "tenant_id": tenant_id,
                "principal": principal,
                "metadata": metadata,
                "max_pairs": max_pairs,
            },
        )
        return result.mappings().first()


async def session_row(
    engine: AsyncEngine, session_id: UUID, *, tenant_id: str | None, principal: str | None
) -> RowMapping | None:
    rows = await _all(
        engine,
        "get_session",
        {"session_id": session_id, "tenant_id": tenant_id, "principal": principal},
    )
    return rows[0] if rows else None


async def page_rows(
    engine: AsyncEngine, statement: str, params: dict[str, Any]
) -> list[RowMapping]:
    """The rows of one keyset page (`statement` one of PAGE_STATEMENTS)."""
    if statement not in PAGE_STATEMENTS:
        raise ValueError(f"{statement} is not a keyset page statement")
    return await _all(engine, statement, params)


@dataclass(frozen=True)
class OverviewRows:
    """The dashboard overview's rows, read on one connection."""

    depth: Sequence[RowMapping]
    throughput: Sequence[RowMapping]
    recoveries: Sequence[RowMapping]
    dead_letter: int
    slot_groups: Sequence[RowMapping]
    live_slots: Sequence[RowMapping]


async def overview_rows(
    engine: AsyncEngine,
    *,
    now: datetime | None,
    tenant_id: str | None,
    max_counted: int,
    window_minutes: int,
    stale_seconds: float,
) -> OverviewRows:
    scoped = {"now": now, "tenant_id": tenant_id, "max_counted": max_counted}
    windowed = {**scoped, "minutes": window_minutes}
    # A process not seen for a lease period has stopped beating: not live.
    stale = {"now": now, "stale_seconds": stale_seconds}
    async with engine.connect() as conn:
        depth = (await conn.execute(q("queue_depth"), scoped)).mappings().all()
        throughput = (await conn.execute(q("ui_throughput"), windowed)).mappings().all()
        recoveries = (await conn.execute(q("ui_recoveries"), windowed)).mappings().all()
        dead_letter = (
            await conn.execute(q("ui_dead_letter_count"), {"tenant_id": tenant_id})
        ).scalar_one()
        slots = (await conn.execute(q("ui_slot_groups"), stale)).mappings().all()
        live = (await conn.execute(q("live_slots_per_class"), stale)).mappings().all()
    return OverviewRows(
        depth=depth,
        throughput=throughput,
        recoveries=recoveries,
        dead_letter=int(dead_letter),
        slot_groups=slots,
        live_slots=live,
    )


async def input_rows(engine: AsyncEngine, run_id: UUID) -> list[RowMapping]:
    return await _all(engine, "run_inputs", {"run_id": run_id})


async def worker_host_rows(engine: AsyncEngine, worker_ids: list[str]) -> list[RowMapping]:
    return await _all(engine, "ui_worker_hosts", {"ids": worker_ids})


async def session_pending_turn_rows(
    engine: AsyncEngine, session_id: UUID, *, tenant_id: str | None, limit: int
) -> list[RowMapping]:
    return await _all(
        engine,
        "ui_session_pending_turns",
        {"session_id": session_id, "tenant_id": tenant_id, "limit": limit},
    )


async def cancel_reason_rows(engine: AsyncEngine, run_ids: list[UUID]) -> list[RowMapping]:
    return await _all(engine, "ui_cancel_reasons", {"ids": run_ids})


async def webhook_delivery_rows(
    engine: AsyncEngine, endpoint_ids: list[UUID], *, per_endpoint: int
) -> list[RowMapping]:
    return await _all(
        engine, "ui_webhook_deliveries", {"ids": endpoint_ids, "per_endpoint": per_endpoint}
    )


async def webhook_delivery_count_rows(
    engine: AsyncEngine, endpoint_ids: list[UUID], *, now: datetime | None, hours: int
) -> list[RowMapping]:
    return await _all(
        engine, "ui_webhook_delivery_counts", {"ids": endpoint_ids, "now": now, "hours": hours}
    )


async def chart_rows(
    engine: AsyncEngine, *, now: datetime | None, tenant_id: str | None, minutes: int
) -> list[RowMapping]:
    return await _all(engine, "ui_charts", {"now": now, "tenant_id": tenant_id, "minutes": minutes})
