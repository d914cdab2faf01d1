"""The PostgreSQL commit ceiling on this machine, the reference every Turnstile throughput figure
is reported against. A script, not a test.

Usage: .venv/bin/python bench/ceiling.py [--seconds 10] [--clients 8] [--json PATH]

Measured on a scratch database of DATABASE_URL (else TEST_DATABASE_URL, else the embedded
PostgreSQL), with the server's own durability settings (whatever synchronous_commit and fsync
say there, which are also what Turnstile runs with):
1. pgbench, one single-row UPDATE per transaction, N clients;
2. asyncpg, N connections each committing single-row UPDATEs in a loop;
3. the same as 2 with one pg_notify per transaction, which is what a NOTIFY costs (PostgreSQL
   serializes the commits of notifying transactions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from app.store.embedded import pgserver_bin_dir, start_embedded, system_bin_dir
from app.store.engine import plain_url

ROWS = 100


async def server_url() -> str:
    url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    if url:
        return url
    return (await asyncio.to_thread(start_embedded, Path(".turnstile"))).url


def pgbench_binary() -> str:
    for folder in (system_bin_dir(), pgserver_bin_dir()):
        if folder is not None and (folder / "pgbench").exists():
            return str(folder / "pgbench")
    found = shutil.which("pgbench")
    if found is None:
        raise SystemExit("bench: pgbench not found (it ships with the PostgreSQL server packages)")
    return found


async def prepare(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS ceiling_rows (id int PRIMARY KEY, n bigint NOT NULL)"
        )
        await conn.execute(
            "INSERT INTO ceiling_rows SELECT g, 0 FROM generate_series(1, $1) g "
            "ON CONFLICT DO NOTHING",
            ROWS,
        )
    finally:
        await conn.close()


def run_pgbench(url: str, clients: int, seconds: float) -> float:
    script = tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False)  # noqa: SIM115
    script.write(f"\\set id random(1, {ROWS})\nUPDATE ceiling_rows SET n = n + 1 WHERE id = :id;\n")
    script.close()
    try:
        done = subprocess.run(
            [
                pgbench_binary(),
                "-n",
                "-c",
                str(clients),
                "-j",
                str(min(clients, 4)),
                "-T",
                str(int(seconds)),
                "-f",
                script.name,
                url,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        os.unlink(script.name)
    match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"bench: pgbench failed: {done.stderr.strip()[-400:]}")
    return float(match.group(1))


async def run_asyncpg(url: str, clients: int, seconds: float, notify: bool) -> float:
    statement = "UPDATE ceiling_rows SET n = n + 1 WHERE id = $1"
    if notify:
        statement = (
            "WITH u AS (UPDATE ceiling_rows SET n = n + 1 WHERE id = $1 RETURNING id) "
            "SELECT pg_notify('ceiling', id::text) FROM u"
        )
    deadline = time.monotonic() + seconds
    counts = [0] * clients

    async def client(index: int) -> None:
        conn = await asyncpg.connect(url)
        try:
            while time.monotonic() < deadline:
                await conn.execute(statement, 1 + (index * 7 + counts[index]) % ROWS)
                counts[index] += 1
        finally:
            await conn.close()

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return sum(counts) / (time.monotonic() - started)


async def measure(url: str, clients: int, seconds: float) -> dict[str, Any]:
    await prepare(url)
    conn = await asyncpg.connect(url)
    try:
        durability = {
            name: await conn.fetchval(f"SHOW {name}")
            for name in ("synchronous_commit", "fsync", "wal_sync_method")
        }
        version = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    return {
        "server_version": version,
        "durability": durability,
        "clients": clients,
        "pgbench_tps": round(await asyncio.to_thread(run_pgbench, url, clients, seconds), 1),
        "asyncpg_tps": round(await run_asyncpg(url, clients, seconds, notify=False), 1),
        "asyncpg_notify_tps": round(await run_asyncpg(url, clients, seconds, notify=True), 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    server = await server_url()
    name = f"turnstile_ceiling_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(plain_url(server))
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = plain_url(make_url(server).set(database=name))
        result = await measure(url, args.clients, args.seconds)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
