"""Database state shared by the app and the CLI: which URL to use and whether it is migrated."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.store.embedded import EmbeddedDatabase, start_embedded


@dataclass
class ResolvedDatabase:
    url: str
    embedded: EmbeddedDatabase | None


def resolve_database(settings: Settings) -> ResolvedDatabase:
    """DATABASE_URL as given, or the embedded server (started if it is not running)."""
    if settings.database_url:
        return ResolvedDatabase(url=settings.database_url, embedded=None)
    embedded = start_embedded(settings.data_dir)
    return ResolvedDatabase(url=embedded.url, embedded=embedded)


async def schema_revision(engine: AsyncEngine) -> str | None:
    """The Alembic revision the database is at, or None when it was never migrated."""
    async with engine.connect() as conn:
        exists = await conn.scalar(text("SELECT to_regclass('alembic_version') IS NOT NULL"))
        if not exists:
            return None
        revision = await conn.scalar(text("SELECT version_num FROM alembic_version"))
        return str(revision) if revision is not None else None
