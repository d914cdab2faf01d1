"""A transaction the domain opens through the store, for the few operations whose statements
must commit together (a schedule and its first tick, a holdings check and the insert it
admits): the domain decides what is atomic, the store's typed calls run the statements on the
connection it is handed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """BEGIN ... COMMIT on one of the engine's connections (ROLLBACK when the block raises)."""
    async with engine.begin() as conn:
        yield conn


@asynccontextmanager
async def reading(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One of the engine's connections for reads (its implicit transaction rolled back after)."""
    async with engine.connect() as conn:
        yield conn
