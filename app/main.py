"""The app factory and its lifespan: what `turnstile serve` runs.

Nothing starts at import. `create_app()` returns a FastAPI app whose lifespan resolves the
database (DATABASE_URL or the embedded server), builds the engine and, in reverse order on the
way out, disposes of everything it started.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings, get_settings
from app.db.engine import create_engine
from app.db.state import ResolvedDatabase, resolve_database


@dataclass
class AppState:
    """Everything the lifespan built, reachable from request handlers via `app.state.turnstile`."""

    settings: Settings
    database: ResolvedDatabase
    engine: AsyncEngine


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        database = resolve_database(settings)
        engine = create_engine(settings, database.url, pool_size=settings.db_pool_size or 10)
        app.state.turnstile = AppState(settings=settings, database=database, engine=engine)
        try:
            yield
        finally:
            await engine.dispose()

    app = FastAPI(
        title="Turnstile",
        summary="A durable run queue for AI-agent turns, on PostgreSQL.",
        version="0.1.0",
        lifespan=lifespan,
    )
    from app.api.health import router as health_router

    app.include_router(health_router)
    return app
