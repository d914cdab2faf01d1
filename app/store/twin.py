"""A twin of an engine for another thread's event loop: the same URL and connection arguments
(timeouts, application name, PgBouncer options), its own connections.

An asyncpg connection belongs to the event loop that opened it, so a thread with a loop of its
own (the worker's heartbeats, app/worker/heartbeat.py) cannot borrow the process's pool. Its
twin is built from that pool's own creation arguments (`Pool.recreate`), so whatever the
engine's connections are given, the twin's are too; it opens connections only as it uses them.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def twin_engine(engine: AsyncEngine) -> AsyncEngine:
    """A new engine on `engine`'s URL and connection arguments, with a pool of its own."""
    pool = engine.sync_engine.pool.recreate()
    return create_async_engine(engine.url, pool=pool)
