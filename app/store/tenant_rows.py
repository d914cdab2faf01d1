"""The tenants' rows (app/store/sql/tenants.sql): their limit overrides, read and upserted, and
the per-tenant running and queued figures. What a limit may be is app/queue/tenant_limits.py's.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.store.statements import q


async def limits_row(engine: AsyncEngine, tenant_id: str) -> RowMapping | None:
    async with engine.connect() as conn:
        result = await conn.execute(q("tenant_limits_get"), {"tenant_id": tenant_id})
        return result.mappings().one_or_none()


async def upsert_limits(engine: AsyncEngine, params: dict[str, Any]) -> RowMapping:
    """tenant_limits_set with its parameters (the overrides and which of them to keep)."""
    async with engine.begin() as conn:
        return (await conn.execute(q("tenant_limits_set"), params)).mappings().one()


async def depth_rows(
    engine: AsyncEngine, *, tenant_id: str | None, top: int, max_counted: int
) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(
            q("tenant_depth"), {"tenant_id": tenant_id, "top": top, "max_counted": max_counted}
        )
        return list(result.mappings().all())


async def holdings_row(
    conn: AsyncConnection,
    tenant_id: str,
    *,
    default_max_schedules: int | None,
    default_max_webhook_endpoints: int | None,
) -> RowMapping:
    """What the tenant holds (its schedules, its webhook endpoints) and its own caps, after
    taking its holdings lock on `conn`'s transaction, held to the commit: concurrent creations
    of one tenant count one after the other."""
    await conn.execute(q("lock_tenant_holdings"), {"tenant_id": tenant_id})
    params = {
        "tenant_id": tenant_id,
        "default_max_schedules": default_max_schedules,
        "default_max_webhook_endpoints": default_max_webhook_endpoints,
    }
    return (await conn.execute(q("tenant_holdings"), params)).mappings().one()
