"""Alembic environment: async migrations under a transaction-scoped advisory lock.

The URL comes from the caller (`app.store.migrate` passes it in the config's attributes) or from
Turnstile's settings. All migrations of one `upgrade` run in a single transaction that first
takes `pg_advisory_xact_lock`, so two processes starting at once cannot both migrate: the
second waits, then finds the schema already at head. A transaction-scoped lock (not a session
lock) also works through PgBouncer in transaction mode.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import context
from app.store.migrate import MIGRATION_LOCK_KEY, database_url_for_alembic
from app.store.tables import metadata

config = context.config
target_metadata = metadata


def _url() -> str:
    url = config.attributes.get("database_url")
    return str(url) if url else database_url_for_alembic()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def _run_online() -> None:
    from app.store.engine import async_url, connect_timeout, pgbouncer_options

    url, connect_args = async_url(_url()), {"timeout": connect_timeout(_url())}
    if config.attributes.get("pgbouncer"):
        url, options = pgbouncer_options(url)
        connect_args.update(options)
    engine = create_async_engine(url, poolclass=pool.NullPool, connect_args=connect_args)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(_run_online())
