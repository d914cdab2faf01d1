"""The submissions' statements that run on a caller's transaction (app/store/sql/submission.sql
and runs.sql): a resubmission's locks and reads, a dismissal, the operator's event, the
submission allowance, and the idempotency keys (claimed under their own lock timeout, read,
stored). The turn itself is one `Database.call("submit", ...)`; what these rows mean is
app/queue/submit.py's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.store.statements import q

_SET_LOCK_TIMEOUT = text("SELECT set_config('lock_timeout', :ms, true)")


async def lock_session(
    conn: AsyncConnection,
    *,
    session_id: UUID,
    tenant_id: str,
    principal: str | None,
    now: datetime | None,
) -> None:
    await conn.execute(
        q("lock_session"),
        {"session_id": session_id, "tenant_id": tenant_id, "principal": principal, "now": now},
    )


async def lock_failed_run(conn: AsyncConnection, run_id: UUID, tenant_id: str | None) -> RowMapping:
    result = await conn.execute(q("lock_failed_run"), {"run_id": run_id, "tenant_id": tenant_id})
    return result.mappings().one()


async def resubmission_of(conn: AsyncConnection, run_id: UUID) -> RowMapping | None:
    return (await conn.execute(q("resubmission_of"), {"run_id": run_id})).mappings().one_or_none()


async def active_run_of_session(conn: AsyncConnection, session_id: UUID) -> RowMapping | None:
    result = await conn.execute(q("active_run_of_session"), {"session_id": session_id})
    return result.mappings().one_or_none()


async def operator_event(
    conn: AsyncConnection, *, run_id: UUID, type: str, data: str, now: datetime | None
) -> None:
    await conn.execute(
        q("operator_event"), {"run_id": run_id, "type": type, "data": data, "now": now}
    )


async def dismiss(
    conn: AsyncConnection, *, run_id: UUID, tenant_id: str | None, actor: str, now: datetime | None
) -> RowMapping | None:
    result = await conn.execute(
        q("dismiss"), {"run_id": run_id, "tenant_id": tenant_id, "actor": actor, "now": now}
    )
    return result.mappings().one_or_none()


async def allowance_row(
    engine: AsyncEngine,
    *,
    tenant_id: str,
    now: datetime | None,
    default_rate: float | None,
    default_burst: int | None,
) -> RowMapping:
    async with engine.connect() as conn:
        result = await conn.execute(
            q("submit_allowance"),
            {
                "tenant_id": tenant_id,
                "now": now,
                "default_rate": default_rate,
                "default_burst": default_burst,
            },
        )
        return result.mappings().one()


async def set_lock_timeout(conn: AsyncConnection, milliseconds: int | str) -> None:
    """The lock timeout of the rest of `conn`'s transaction."""
    await conn.execute(_SET_LOCK_TIMEOUT, {"ms": str(milliseconds)})


async def claim_key(conn: AsyncConnection, params: dict[str, Any]) -> bool:
    """Own the idempotency key (True), or find it taken (False)."""
    return bool((await conn.execute(q("idempotency_claim"), params)).scalar_one())


async def stored_key(conn: AsyncConnection, params: dict[str, Any]) -> RowMapping:
    return (await conn.execute(q("idempotency_stored"), params)).mappings().one()


async def peek_key(engine: AsyncEngine, params: dict[str, Any]) -> RowMapping | None:
    """The key's stored outcome while it lasts, without taking the key (None: none)."""
    async with engine.connect() as conn:
        return (await conn.execute(q("idempotency_peek"), params)).mappings().one_or_none()


async def store_key(conn: AsyncConnection, params: dict[str, Any]) -> None:
    await conn.execute(q("idempotency_store"), params)
