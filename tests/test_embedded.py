"""Smoke test of the zero-setup default: the embedded PostgreSQL starts in a data folder,
migrates, answers a query, stops, and keeps its data across a restart. CI uses the machine's
server for everything else, so this test is what keeps the default from rotting."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import asyncpg
import pytest

from app.db.embedded import LocalCluster, free_port, pgserver_bin_dir, start_embedded
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


def test_a_cluster_starts_from_binaries_under_a_private_folder(tmp_path: Path) -> None:
    """A checkout under a folder only root may enter (mktemp -d makes it 0700) must not keep
    the server's own user from running initdb and postgres out of it."""
    installed = pgserver_bin_dir()
    if installed is None:
        pytest.skip("pgserver's binaries are not installed (no wheel for this Python)")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    # The package and the shared libraries its binaries find through their rpath, as pip laid
    # them out in site-packages.
    site = installed.parents[2]
    for folder in ("pgserver", "pgserver.libs"):
        shutil.copytree(site / folder, private / folder, symlinks=True)
    cluster = LocalCluster(
        bin_dir=private / installed.relative_to(site),
        data_dir=tmp_path / "data",
        port=free_port(),
    )
    try:
        cluster.init()
        cluster.start()
        assert cluster.running()
    finally:
        cluster.stop("immediate")
