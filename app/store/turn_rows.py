"""The multitask policies' statements (app/store/sql/submission.sql): a session's policy, the
lock of its active run, pending turns (added, read, listed, withdrawn), the events about them,
and the sweep's backstop. What these rows mean is app/queue/turns.py's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.store.statements import q


async def set_session_multitask(
    engine: AsyncEngine,
    *,
    session_id: UUID,
    tenant_id: str,
    principal: str | None,
    multitask: str,
) -> bool:
    async with engine.begin() as conn:
        result = await conn.execute(
            q("set_session_multitask"),
            {
                "session_id": session_id,
                "tenant_id": tenant_id,
                "principal": principal,
                "multitask": multitask,
            },
        )
        return result.first() is not None


async def session_multitask(
    engine: AsyncEngine, *, session_id: UUID, tenant_id: str, principal: str | None
) -> str | None:
    async with engine.connect() as conn:
        result = await conn.execute(
            q("session_multitask"),
            {"session_id": session_id, "tenant_id": tenant_id, "principal": principal},
        )
        row = result.first()
        return None if row is None else str(row[0])


async def lock_session(
    conn: AsyncConnection,
    *,
    session_id: UUID,
    tenant_id: str,
    principal: str | None,
    now: datetime | None,
) -> RowMapping | None:
    """The session's row, locked, with its owner; None when not found (or not visible)."""
    result = await conn.execute(
        q("lock_session"),
        {"session_id": session_id, "tenant_id": tenant_id, "principal": principal, "now": now},
    )
    return result.mappings().one_or_none()


async def lock_active_run(conn: AsyncConnection, session_id: UUID) -> RowMapping | None:
    result = await conn.execute(q("lock_active_run"), {"session_id": session_id})
    return result.mappings().one_or_none()


async def active_run(conn: AsyncConnection, session_id: UUID) -> RowMapping | None:
    result = await conn.execute(q("active_run_of_session"), {"session_id": session_id})
    return result.mappings().one_or_none()


async def add_pending_turn(conn: AsyncConnection, params: dict[str, Any]) -> RowMapping | None:
    """The new pending turn with its position; None when the session's bound is reached."""
    result = await conn.execute(q("add_pending_turn"), params)
    return result.mappings().one_or_none()


async def turn_event(
    conn: AsyncConnection, *, run_id: UUID, type: str, data: str, now: datetime | None
) -> int | None:
    """An event of an active run about a turn; None when the run is no longer active."""
    result = await conn.execute(
        q("turn_event"), {"run_id": run_id, "type": type, "data": data, "now": now}
    )
    row = result.first()
    return None if row is None else int(row[0])


async def pending_turn(
    conn: AsyncConnection | AsyncEngine, *, session_id: UUID, turn_id: UUID
) -> RowMapping | None:
    params = {"session_id": session_id, "turn_id": turn_id}
    if isinstance(conn, AsyncEngine):
        async with conn.connect() as read:
            return (await read.execute(q("pending_turn"), params)).mappings().one_or_none()
    return (await conn.execute(q("pending_turn"), params)).mappings().one_or_none()


async def visible_pending_turn(
    engine: AsyncEngine, *, turn_id: UUID, tenant_id: str | None, principal: str | None
) -> RowMapping | None:
    params = {"turn_id": turn_id, "tenant_id": tenant_id, "principal": principal}
    async with engine.connect() as conn:
        return (await conn.execute(q("visible_pending_turn"), params)).mappings().one_or_none()


async def waiting_turns_of_session(
    engine: AsyncEngine,
    *,
    session_id: UUID,
    tenant_id: str | None,
    principal: str | None,
    limit: int,
) -> list[RowMapping]:
    params = {
        "session_id": session_id,
        "tenant_id": tenant_id,
        "principal": principal,
        "limit": limit,
    }
    async with engine.connect() as conn:
        result = await conn.execute(q("waiting_turns_of_session"), params)
        return list(result.mappings().all())


async def pending_turns_of_session(engine: AsyncEngine, session_id: UUID) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(q("pending_turns_of_session"), {"session_id": session_id})
        return list(result.mappings().all())


async def cancel_pending_turn(
    conn: AsyncConnection, *, session_id: UUID, turn_id: UUID, now: datetime | None
) -> RowMapping | None:
    result = await conn.execute(
        q("cancel_pending_turn"), {"session_id": session_id, "turn_id": turn_id, "now": now}
    )
    return result.mappings().one_or_none()


async def promote_stranded_turns(engine: AsyncEngine, *, limit: int, now: datetime | None) -> int:
    async with engine.begin() as conn:
        result = await conn.execute(q("promote_stranded_turns"), {"limit": limit, "now": now})
        return len(result.all())


async def overdue_interrupts(
    engine: AsyncEngine, *, limit: int, now: datetime | None
) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(q("overdue_interrupts"), {"limit": limit, "now": now})
        return list(result.mappings().all())
