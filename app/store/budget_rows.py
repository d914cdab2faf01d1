"""The model budgets' rows (app/store/sql/budgets.sql): an admin's overrides, a model call's
reservation (one short transaction: the endpoint's row made sure of, then locked and taken
from), its settlement, a provider's pause, and the figures. What a budget may be, and what a
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
        result = await conn.execute(q("model_budget_reserve"), params)
        return result.mappings().one_or_none()


async def settle(engine: AsyncEngine, params: dict[str, Any]) -> None:
    async with engine.begin() as conn:
        await conn.execute(q("model_budget_settle"), params)


async def pause(engine: AsyncEngine, params: dict[str, Any]) -> RowMapping:
    async with engine.begin() as conn:
        return (await conn.execute(q("model_budget_pause"), params)).mappings().one()


async def figures(engine: AsyncEngine, endpoint: str | None) -> list[RowMapping]:
    async with engine.connect() as conn:
        result = await conn.execute(q("model_budget_figures"), {"endpoint": endpoint})
        return list(result.mappings().all())
