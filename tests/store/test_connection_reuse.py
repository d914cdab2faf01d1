"""A process keeps the connections it opened: demand that rises and falls reuses them.

An API process's demand for connections swings between none and every request in flight
(a turn holds one for a millisecond or two). SQLAlchemy's pool closes a connection of its
overflow whenever it is returned to a full pool, so each swing above the pool's size opened
connections and the next lull closed them again: a profile of one API process under 32
connections of load (issue 41) spent 13 % of its time in asyncpg's connect, and PostgreSQL
started a backend for each. The pool now keeps every connection it is allowed, up to the same
limit as before."""

from __future__ import annotations

import asyncio

from sqlalchemy import text

from app.config import Settings
from app.store.engine import create_engine, pool_limit


async def test_bursts_of_demand_reuse_the_pools_connections(
    settings: Settings, database_url: str
) -> None:
    engine = create_engine(settings, database_url, pool_size=2)
    backends: set[int] = set()

    async def one_statement() -> None:
        async with engine.connect() as conn:
            backends.add((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
            # Held a moment, as a request's statement is, so that the burst needs them all.
            await conn.execute(text("SELECT pg_sleep(0.002)"))

    try:
        for _ in range(10):
            # A burst of twelve at once (more than the pool allows: the rest wait their
            # turn), then a lull in which every connection is returned.
            await asyncio.gather(*(one_statement() for _ in range(12)))
        limit = pool_limit(2)
        assert limit == 4
        # Before, each burst opened the overflow again: 2 + 2 x 10 backends.
        assert len(backends) <= limit
        assert engine.pool.checkedin() == len(backends)  # type: ignore[attr-defined]
    finally:
        await engine.dispose()
