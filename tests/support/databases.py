"""Real PostgreSQL databases for tests: a migrated template, cloned per test.

The server is `TEST_DATABASE_URL` when set, else an embedded one started for the test session.
The template is migrated through Alembic (whose engine is disposed before cloning, since a
lingering connection blocks `CREATE DATABASE ... TEMPLATE`); each clone is dropped `WITH (FORCE)`
so a connection a test leaked cannot keep it alive.
"""

from __future__ import annotations

import os
import uuid

import asyncpg
from sqlalchemy.engine import make_url

from app.store.engine import plain_url


def server_url() -> str:
    return os.environ["TURNSTILE_TEST_SERVER_URL"]


def with_database(url: str, database: str) -> str:
    return plain_url(make_url(url).set(database=database))


async def admin_execute(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(plain_url(url))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def new_database_name(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:10]}"


async def clone_database(server: str, template: str) -> str:
    """A new database cloned from `template`; returns its URL."""
    name = new_database_name("ts_test")
    await admin_execute(server, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return with_database(server, name)


async def drop_database(server: str, url: str) -> None:
    name = make_url(url).database
    await admin_execute(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
