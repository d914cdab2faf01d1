"""Approval before a tool call (app/store/sql/submission.sql and runs.sql): a session's and a
run's approval policy, and a run's record of a rejected call. What these rows mean is
app/queue/approvals.py's and the runtime's (docs/approvals.md)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.store.statements import q


async def set_session_approval(
    engine: AsyncEngine,
    *,
    session_id: UUID,
    tenant_id: str,
    principal: str | None,
    approval: str | None,
) -> bool:
    """Set (JSON text) or clear (None) a session's policy; False: no such session."""
    async with engine.begin() as conn:
        result = await conn.execute(
            q("set_session_approval"),
            {
                "session_id": session_id,
                "tenant_id": tenant_id,
                "principal": principal,
                "approval": approval,
            },
        )
        return result.first() is not None


async def session_approval(engine: AsyncEngine, session_id: UUID) -> Any:
    """The session's policy as stored (None: none)."""
    async with engine.connect() as conn:
        result = await conn.execute(q("session_approval"), {"session_id": session_id})
        row = result.first()
        return None if row is None else row[0]


async def set_run_approval(conn: AsyncConnection, *, run_id: UUID, approval: str) -> RowMapping:
    """A turn's policy (JSON text) on the run it made or answered, in the caller's transaction."""
    result = await conn.execute(q("set_run_approval"), {"run_id": run_id, "approval": approval})
    return result.mappings().one()


async def lock_run(conn: AsyncConnection, *, run_id: UUID) -> RowMapping | None:
    """The run's row, locked, for an approval naming it (None: no such run)."""
    result = await conn.execute(q("lock_run_for_approval"), {"run_id": run_id})
    return result.mappings().one_or_none()
