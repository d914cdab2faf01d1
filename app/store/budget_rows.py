"""The model budgets' rows (app/store/sql/budgets.sql): an admin's overrides and a tenant's
limits, a model call's reservation (one short transaction: the endpoint's and its tenant's
rows made sure of, then locked and taken from), its settlement, a provider's pause, and the
figures. What a budget may be, and what a
reservation's answer means, is app/queue/model_budgets.py's."""

from __future__ import annotations

from typing import Any

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.statements import q


async def budget_row(engine: AsyncEngine, endpoint: str) -> RowMapping | None:
    async with engine.connect() as conn:
        result = await conn.execute(q("model_budget_get"), {"endpoint": endpoint})
        return result.mappings().one_or_none()


async def upsert_budget(engine: AsyncEngine, params: dict[str, Any]) -> RowMapping:
    """model_budget_set with its parameters (the overrides and which of them to keep)."""
    async with engine.begin() as conn:
        return (await conn.execute(q("model_budget_set"), params)).mappings().one()


async def reserve(engine: AsyncEngine, params: dict[str, Any]) -> RowMapping | None:
    """One reservation, fenced on the run's lease: its answer, or None when the run no longer
    holds its lease (nothing was taken). The row lock model_budget_reserve takes is held only
    to this transaction's commit, two statements later."""
    async with engine.begin() as conn:
        await conn.execute(q("model_budget_ensure"), params)
        await conn.execute(q("model_tenant_ensure"), params)
        result = await conn.execute(q("model_budget_reserve"), params)
        return result.mappings().one_or_none()


async def free(engine: AsyncEngine, params: dict[str, Any]) -> bool:
    """model_budget_free: whether the endpoint has no limit for the tenant; first, when there
    are some, the calls and tokens the asking process settled there since it last asked are
    added to the figures (the endpoint's row, then the tenant's: the order of every lock on
    them), in the same transaction."""
    async with engine.begin() as conn:
        if params["requests"] > 0:
            await conn.execute(q("model_budget_count"), params)
            await conn.execute(q("model_tenant_count"), params)
        row = (await conn.execute(q("model_budget_free"), params)).mappings().one()
        return bool(row["free"])


async def settle(engine: AsyncEngine, params: dict[str, Any]) -> None:
    """The settlement on the endpoint's row, then on its tenant's (the order a reservation
    locks them in), in one transaction; what the reservation held of its tenant's tokens
    passes from the first to the second."""
    async with engine.begin() as conn:
        row = (await conn.execute(q("model_budget_settle"), params)).mappings().one_or_none()
        if params.get("tenant_id") is None:
            return
        held = None if row is None else row["tenant_tokens"]
        await conn.execute(q("model_tenant_settle"), {**params, "tenant_tokens": held})


async def upsert_tenant_budget(engine: AsyncEngine, params: dict[str, Any]) -> RowMapping:
    """model_tenant_budget_set with its parameters (the limits and which of them to keep); an
    endpoint given a tenant's limit gets its budget's row (listed, as one given an override),
    in the same transaction."""
    async with engine.begin() as conn:
        if params["endpoint"]:
            await conn.execute(q("model_budget_ensure"), params)
        return (await conn.execute(q("model_tenant_budget_set"), params)).mappings().one()


async def tenant_limits(engine: AsyncEngine, tenant_id: str) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(q("model_tenant_limits"), {"tenant_id": tenant_id})
        return list(result.mappings().all())


async def wake(engine: AsyncEngine, params: dict[str, Any]) -> int:
    """model_budget_wake: the runs of bookings come due early made eligible now (how many)."""
    async with engine.begin() as conn:
        row = (await conn.execute(q("model_budget_wake"), params)).mappings().one()
        return int(row["woken"])


async def observe(engine: AsyncEngine, params: dict[str, Any]) -> None:
    async with engine.begin() as conn:
        await conn.execute(q("model_budget_observe"), params)


async def pause(engine: AsyncEngine, params: dict[str, Any]) -> RowMapping:
    async with engine.begin() as conn:
        return (await conn.execute(q("model_budget_pause"), params)).mappings().one()


async def figures(engine: AsyncEngine, endpoint: str | None) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(q("model_budget_figures"), {"endpoint": endpoint})
        return list(result.mappings().all())


async def tenant_figures(engine: AsyncEngine) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(q("model_budget_tenant_figures"))
        return list(result.mappings().all())
