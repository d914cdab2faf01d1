"""A PgBouncer in transaction pooling mode in front of the test server, started by the test.

Debian's package refuses to run as root, so it runs as the `postgres` system user from a
folder of its own. Trust authentication, like the server behind it.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from app.store.embedded import free_port
from app.store.engine import plain_url
from tests.support.system_tools import require_tool


def _prepare(folder: Path, port: int, host: str, server_port: int, user: str) -> None:
    folder.chmod(0o755)
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={server_port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        f"unix_socket_dir = {folder}\n"
        "auth_type = trust\n"
        f"auth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\n"
        "max_client_conn = 500\ndefault_pool_size = 20\n"
        f"logfile = {folder / 'pgbouncer.log'}\n"
    )
    entry = pwd.getpwnam("postgres")
    for path in [folder, *folder.iterdir()]:
        os.chown(path, entry.pw_uid, entry.pw_gid)


@asynccontextmanager
async def pgbouncer_in_front_of(server_url: str) -> AsyncIterator[int]:
    """Start PgBouncer for the server of `server_url`; yields its port."""
    binary = require_tool("pgbouncer", "/usr/sbin/pgbouncer")
    server = make_url(server_url)
    if not server.host or server.host.startswith("/"):
        pytest.skip("PgBouncer test needs a TCP server (set TEST_DATABASE_URL)")
    folder = Path(tempfile.mkdtemp(prefix="turnstile-pgbouncer-"))
    port = free_port()
    await asyncio.to_thread(
        _prepare, folder, port, server.host, server.port or 5432, server.username or "postgres"
    )
    entry = pwd.getpwnam("postgres")
    process = await asyncio.create_subprocess_exec(
        str(binary),
        str(folder / "pgbouncer.ini"),
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=[],
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        url = plain_url(server.set(port=port, host="127.0.0.1", database="postgres"))
        for _ in range(200):
            try:
                conn = await asyncpg.connect(url, statement_cache_size=0)
                await conn.close()
                break
            except (OSError, asyncpg.PostgresError):
                if process.returncode is not None:
                    raise RuntimeError("pgbouncer exited; see its log") from None
                await asyncio.sleep(0.05)
        yield port
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
        await asyncio.to_thread(shutil.rmtree, folder, True)
