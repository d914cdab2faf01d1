"""The webhook endpoints' rows (app/store/sql/webhooks.sql): created, listed, rotated, enabled,
disabled, deleted, read for a delivery, and their delivery counts. Deliveries themselves are
inserted by the transitions that report them (runs.sql); what an endpoint is, and when one is
disabled, is app/queue/webhook_endpoints.py's.
"""

from __future__ import annotations

from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.store.statements import q


async def insert_endpoint(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    principal: str,
    url: str,
    events: list[str],
    secret: bytes,
) -> RowMapping:
    """The new endpoint's row, on the caller's transaction (after its holdings check)."""
    result = await conn.execute(
        q("webhook_create"),
        {
            "tenant_id": tenant_id,
            "principal": principal,
            "url": url,
            "events": events,
            "secret": secret,
        },
    )
    return result.mappings().one()


async def endpoint_rows(engine: AsyncEngine, tenant_id: str | None) -> list[RowMapping]:
    """A tenant's live endpoints, or every tenant's (None)."""
    async with engine.connect() as conn:
        result = await conn.execute(q("webhook_list"), {"tenant_id": tenant_id})
        return list(result.mappings().all())


async def rotate_secret(
    engine: AsyncEngine, *, tenant_id: str, endpoint_id: UUID, secret: bytes
) -> bool:
    """False when the tenant has no such endpoint."""
    async with engine.begin() as conn:
        result = await conn.execute(
            q("webhook_rotate"),
            {"id": endpoint_id, "tenant_id": tenant_id, "secret": secret, "now": None},
        )
        return result.first() is not None


async def enable_endpoint(
    engine: AsyncEngine, *, tenant_id: str, endpoint_id: UUID
) -> RowMapping | None:
    async with engine.begin() as conn:
        result = await conn.execute(
            q("webhook_enable"), {"id": endpoint_id, "tenant_id": tenant_id, "now": None}
        )
        return result.mappings().first()


async def disable_endpoint(
    engine: AsyncEngine, *, tenant_id: str, endpoint_id: UUID
) -> RowMapping | None:
    async with engine.begin() as conn:
        result = await conn.execute(
            q("webhook_disable"), {"id": endpoint_id, "tenant_id": tenant_id, "now": None}
        )
        return result.mappings().first()


async def delete_endpoint(engine: AsyncEngine, *, tenant_id: str, endpoint_id: UUID) -> bool:
    """False when the tenant has no such endpoint."""
    async with engine.begin() as conn:
        result = await conn.execute(
            q("webhook_delete"), {"id": endpoint_id, "tenant_id": tenant_id, "now": None}
        )
        return result.first() is not None


async def pending_delivery_ids(engine: AsyncEngine, endpoint_id: UUID, *, limit: int) -> list[UUID]:
    async with engine.connect() as conn:
        result = await conn.execute(
            q("webhook_pending_deliveries"), {"id": endpoint_id, "limit": limit}
        )
        return list(result.scalars().all())


async def endpoint_for_delivery(
    engine: AsyncEngine, *, run_id: UUID, endpoint_id: UUID
) -> RowMapping | None:
    async with engine.connect() as conn:
        result = await conn.execute(
            q("webhook_for_delivery"), {"run_id": run_id, "endpoint_id": endpoint_id}
        )
        return result.mappings().first()


async def delivery_succeeded(engine: AsyncEngine, endpoint_id: UUID) -> None:
    async with engine.begin() as conn:
        await conn.execute(q("webhook_delivery_succeeded"), {"id": endpoint_id})


async def delivery_failed(
    engine: AsyncEngine, endpoint_id: UUID, *, disable_after: int
) -> RowMapping | None:
    async with engine.begin() as conn:
        result = await conn.execute(
            q("webhook_delivery_failed"),
            {"id": endpoint_id, "disable_after": disable_after, "now": None},
        )
        return result.mappings().first()


async def task_push_count(conn: AsyncConnection, *, tenant_id: str, run_id: UUID) -> int:
    """A task's live push configurations, on the caller's transaction (its cap check)."""
    result = await conn.execute(q("task_push_count"), {"tenant_id": tenant_id, "run_id": run_id})
    return int(result.scalar_one())


async def insert_task_push(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    principal: str,
    run_id: UUID,
    url: str,
    secret: bytes,
) -> RowMapping:
    """The new push configuration's row, on the caller's transaction (after its cap check)."""
    result = await conn.execute(
        q("task_push_create"),
        {
            "tenant_id": tenant_id,
            "principal": principal,
            "run_id": run_id,
            "url": url,
            "secret": secret,
        },
    )
    return result.mappings().one()


async def task_push_rows(
    engine: AsyncEngine, *, tenant_id: str, run_id: UUID, after: UUID | None, limit: int
) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(
            q("task_push_list"),
            {"tenant_id": tenant_id, "run_id": run_id, "after": after, "limit": limit},
        )
        return list(result.mappings().all())


async def task_push_row(
    engine: AsyncEngine, *, tenant_id: str, run_id: UUID, config_id: UUID
) -> RowMapping | None:
    async with engine.connect() as conn:
        result = await conn.execute(
            q("task_push_get"), {"tenant_id": tenant_id, "run_id": run_id, "id": config_id}
        )
        return result.mappings().first()


async def task_push_catch_up(
    engine: AsyncEngine, *, run_id: UUID, endpoint_id: UUID, hook_attempts: int
) -> int:
    """The delivery a configuration stored after its task's transition missed (0 or 1)."""
    async with engine.begin() as conn:
        await conn.execute(q("task_push_lock_run"), {"run_id": run_id})
        result = await conn.execute(
            q("task_push_catch_up"),
            {"id": endpoint_id, "hook_attempts": hook_attempts, "now": None},
        )
        return int(result.mappings().one()["made"])
