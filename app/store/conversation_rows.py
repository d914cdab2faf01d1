"""The deletions of the OpenAI Responses API's objects (app/store/sql/conversations.sql): a
conversation is a session deleted with its runs when none is active; a response, a finished
sessionless run. What the outcomes mean is app/queue/reads.py's.
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.statements import q


async def delete_idle_session(
    engine: AsyncEngine,
    session_id: UUID,
    *,
    tenant_id: str,
    principal: str | None,
    now: datetime | None,
) -> tuple[bool, bool]:
    """(found, deleted): the session was visible, and it was deleted (no run of it active)."""
    params = {"session_id": session_id, "tenant_id": tenant_id, "principal": principal}
    async with engine.begin() as conn:
        # The lock every submission to the session takes first: a turn in flight commits
        # before the delete looks at the session's runs, or finds no session after it.
        await conn.execute(q("lock_session"), {**params, "now": now})
        row = (await conn.execute(q("delete_idle_session"), params)).mappings().one()
        return bool(row["found"]), bool(row["deleted"])


async def delete_finished_run(
    engine: AsyncEngine, run_id: UUID, *, tenant_id: str, principal: str | None
) -> bool:
    async with engine.begin() as conn:
        params = {"run_id": run_id, "tenant_id": tenant_id, "principal": principal}
        return (await conn.execute(q("delete_finished_run"), params)).first() is not None
