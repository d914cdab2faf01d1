"""Smoke test of the zero-setup default: the embedded PostgreSQL starts in a data folder,
migrates, answers a query, stops, and keeps its data across a restart. CI uses the machine's
server for everything else, so this test is what keeps the default from rotting."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import asyncpg

from app.db.embedded import start_embedded
from app.db.engine import plain_url
from app.db.migrate import head_revision, upgrade


async def test_embedded_start_migrate_query_stop_restart() -> None:
    folder = Path(tempfile.mkdtemp(prefix="turnstile-embedded-"))
    try:
        embedded = await asyncio.to_thread(start_embedded, folder)
        assert "host=" in embedded.url  # a Unix socket, no TCP port
        await asyncio.to_thread(upgrade, embedded.url)
        conn = await asyncpg.connect(plain_url(embedded.url))
        try:
            assert await conn.fetchval("SELECT version_num FROM alembic_version") == (
                head_revision()
            )
            await conn.execute("INSERT INTO sessions (tenant_id, principal) VALUES ('t', 'p')")
        finally:
            await conn.close()
        await asyncio.to_thread(embedded.stop)

        again = await asyncio.to_thread(start_embedded, folder)
        conn = await asyncpg.connect(plain_url(again.url))
        try:
            assert await conn.fetchval("SELECT count(*) FROM sessions") == 1
        finally:
            await conn.close()
        await asyncio.to_thread(again.stop)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
