"""Per-tenant limits for tests: a plain upsert of the tenant's `tenant_limits` row, exactly what
an admin's `PUT /tenants/{tenant}/limits` writes (docs/adr/0006). NULL, or a class left out of
`max_running`, means the process default."""

from __future__ import annotations

import json

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine


async def set_limits(
    engine: AsyncEngine,
    tenant_id: str,
    *,
    max_running: dict[str, int] | None = None,
    max_queued: int | None = None,
) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO tenant_limits (tenant_id, max_running, max_queued, updated_at) "
                "VALUES (:tenant, CAST(:running AS jsonb), :queued, now()) "
                "ON CONFLICT (tenant_id) DO UPDATE SET max_running = excluded.max_running, "
                "max_queued = excluded.max_queued, updated_at = excluded.updated_at"
            ),
            {"tenant": tenant_id, "running": json.dumps(max_running or {}), "queued": max_queued},
        )


async def counts(engine: AsyncEngine, tenant_id: str, band: int) -> tuple[int, int]:
    """(running, queued) of the tenant for the band: its count row's running (0 without a
    row), and its queued runs, counted."""
    async with engine.connect() as conn:
        running = await conn.scalar(
            text(
                "SELECT running FROM tenant_class_counts WHERE tenant_id = :tenant AND band = :band"
            ),
            {"tenant": tenant_id, "band": band},
        )
        queued = await conn.scalar(
            text(
                "SELECT count(*) FROM runs WHERE tenant_id = :tenant AND priority / 10 = :band "
                "AND status = 'queued'"
            ),
            {"tenant": tenant_id, "band": band},
        )
    return int(running or 0), int(queued or 0)
