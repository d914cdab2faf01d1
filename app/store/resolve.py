"""Database state shared by the app and the CLI: which URL to use and whether it is migrated."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.store.embedded import EmbeddedDatabase, start_embedded
from app.store.migrate import head_revision, known_revisions


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
    return (await schema_state(engine)).revision


@dataclass(frozen=True)
class SchemaState:
    """Where the database's schema stands: its revision (None: never migrated), and the
    oldest release whose code its migrations keep working (`schema_compatibility`, from
    migration 0016 on; None before it)."""

    revision: str | None
    oldest_release: str | None = None

    def problem(self) -> str | None:
        """Why this code cannot run on the schema (None: it can). It can at its own head,
        and on a newer schema whose migrations say this release still works on it (every
        migration is safe for the release before it: docs/deployment.md)."""
        head = head_revision()
        if self.revision == head:
            return None
        if self.revision is None or self.revision in known_revisions():
            return (
                f"the database schema is at {self.revision or 'nothing'}, this code needs "
                f"{head}: run 'turnstile migrate' first"
            )
        if self.oldest_release is not None and self.oldest_release <= head:
            return None
        return (
            f"the database schema is at {self.revision}, newer than this code ({head}), and "
            f"its migrations need code of release {self.oldest_release or 'unknown'} or later"
        )


async def schema_state(engine: AsyncEngine) -> SchemaState:
    async with engine.connect() as conn:
        exists = await conn.scalar(text("SELECT to_regclass('alembic_version') IS NOT NULL"))
        if not exists:
            return SchemaState(None)
        revision = await conn.scalar(text("SELECT version_num FROM alembic_version"))
        oldest = None
        if await conn.scalar(text("SELECT to_regclass('schema_compatibility') IS NOT NULL")):
            oldest = await conn.scalar(text("SELECT oldest_release FROM schema_compatibility"))
        return SchemaState(
            str(revision) if revision is not None else None,
            str(oldest) if oldest is not None else None,
        )
