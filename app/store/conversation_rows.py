"""The deletions of the OpenAI Responses API's objects (app/store/sql/conversations.sql): a
conversation is a session deleted with its runs when none is active; a response, a finished
sessionless run. What the outcomes mean is app/queue/reads.py's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal
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
    only_run: UUID | None = None,
) -> Literal["deleted", "active", "dead_letter", "in_session", "missing"]:
    """Deleted; or kept because a run of it is active, or failed and not dismissed; or not
    visible to the caller. With `only_run`, only while that run is its only one (kept:
    `in_session`)."""
    params = {
        "session_id": session_id,
        "tenant_id": tenant_id,
        "principal": principal,
        "only_run": only_run,
    }
    async with engine.begin() as conn:
        # The lock every submission to the session takes first: a turn in flight commits
        # before the delete looks at the session's runs, or finds no session after it.
        await conn.execute(q("lock_session"), {**params, "now": now})
        row = (await conn.execute(q("delete_idle_session"), params)).mappings().one()
        if not row["found"]:
            return "missing"
        if row["deleted"]:
            return "deleted"
        if only_run is not None and row["others"]:
            return "in_session"
        return "active" if row["active"] else "dead_letter"


async def delete_finished_run(
    engine: AsyncEngine, run_id: UUID, *, tenant_id: str, principal: str | None
) -> Literal["deleted", "active", "dead_letter", "in_session", "missing"]:
    """As `delete_idle_session`, for one sessionless run; a run of a session is kept
    (`in_session`: it goes with its session)."""
    async with engine.begin() as conn:
        params = {"run_id": run_id, "tenant_id": tenant_id, "principal": principal}
        row = (await conn.execute(q("delete_finished_run"), params)).mappings().first()
        if row is None:
            return "missing"
        if row["deleted"]:
            return "deleted"
        if row["in_session"]:
            return "in_session"
        return "dead_letter" if row["dead_letter"] else "active"
