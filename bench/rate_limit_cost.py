"""What the submission rate limit costs a submission (opt-in, about a minute; not part of
`make bench`): `turnstile_submit` as migration 0010 left it (0005's text, no bucket step), as
0012 has it for a tenant with no limit (one `tenant_limits` read, no bucket), and for tenants
with a limit high enough never to refuse (the bucket upsert, its row held to the commit).

Usage: .venv/bin/python bench/rate_limit_cost.py [ROUNDS]  (TEST_DATABASE_URL or DATABASE_URL:
a server on which it creates and drops two databases)

Each round, in turn for each case: 1,000 sequential calls on one connection (latency), then
2,000 calls over 8 connections (throughput), one tenant for all 8 or one tenant each. The calls
are the function itself through asyncpg (sessionless runs, no key), not HTTP.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
import uuid

import asyncpg

from app.store.migrate import upgrade

SERVER = os.environ.get("TEST_DATABASE_URL") or os.environ.get(
    "DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
BASE_ARGS = (
    "p_now => NULL, p_tenant => $1, p_principal => 'p', p_own_sessions_only => false, "
    "p_actor => NULL, p_session => NULL, p_key => NULL, p_request_hash => NULL, "
    "p_ttl_seconds => 86400, p_wait_ms => 5000, p_lock_timeout_ms => 5000, p_run_id => $2, "
    "p_agent => NULL, p_default_agent => 'scripted', p_priority => NULL, "
    "p_default_priority => 10::smallint, p_scheduled_for => NULL, p_input => '{}'::jsonb, "
    "p_max_attempts => 3, p_traceparent => NULL"
)
OLD = f"SELECT outcome FROM turnstile_submit({BASE_ARGS})"
NEW = (
    f"SELECT outcome, rate_tokens FROM turnstile_submit({BASE_ARGS}, "
    "p_submit_rate => NULL, p_submit_burst => NULL)"
)


async def make(name: str, revision: str) -> str:
    admin = await asyncpg.connect(SERVER)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    url = SERVER.rsplit("/", 1)[0] + "/" + name
    await asyncio.to_thread(upgrade, url, revision)
    return url


async def sequential(url: str, sql: str, tenant: str, n: int) -> list[float]:
    conn = await asyncpg.connect(url)
    stmt = await conn.prepare(sql)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await stmt.fetch(tenant, uuid.uuid4())
        times.append(time.perf_counter() - t)
    await conn.close()
    return times


async def concurrent(url: str, sql: str, tenant: str, n: int, workers: int = 8) -> float:
    """`tenant` ending in '*': each connection submits for its own tenant (tenant1, ...)."""
    conns = [await asyncpg.connect(url) for _ in range(workers)]
    stmts = [await c.prepare(sql) for c in conns]

    async def run(stmt: asyncpg.prepared_stmt.PreparedStatement, own: str) -> None:
        for _ in range(n // workers):
            await stmt.fetch(own, uuid.uuid4())

    t = time.perf_counter()
    await asyncio.gather(*(run(s, tenant.replace("*", str(i))) for i, s in enumerate(stmts)))
    elapsed = time.perf_counter() - t
    for c in conns:
        await c.close()
    return n / elapsed


async def main() -> None:
    old = await make("ts_ratebench_old", "0010")
    new = await make("ts_ratebench_new", "head")
    c = await asyncpg.connect(new)
    await c.execute(
        "INSERT INTO tenant_limits (tenant_id, submit_rate_per_second, submit_burst) "
        "VALUES ('limited', 1000000, 1000000000)"
    )
    for i in range(8):
        await c.execute(
            "INSERT INTO tenant_limits (tenant_id, submit_rate_per_second, submit_burst) "
            f"VALUES ('lim{i}', 1000000, 1000000000)"
        )
    await c.close()
    cases = [
        ("0010 (no bucket step)", old, OLD, "free"),
        ("0012, no limit", new, NEW, "free"),
        ("0012, limited", new, NEW, "limited"),
        ("0012, limited, 8 tenants", new, NEW, "lim*"),
        ("0012, no limit, 8 tenants", new, NEW, "free*"),
    ]
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    lat: dict[str, list[float]] = {c[0]: [] for c in cases}
    thr: dict[str, list[float]] = {c[0]: [] for c in cases}
    for _ in range(rounds):
        for name, url, sql, tenant in cases:
            lat[name] += await sequential(url, sql, tenant.replace("*", "0"), 1000)
            thr[name].append(await concurrent(url, sql, tenant, 2000))
    for name, *_ in cases:
        xs = sorted(lat[name])
        per_round = ", ".join(f"{x:.0f}" for x in thr[name])
        print(
            f"{name:24s} sequential p50 {statistics.median(xs) * 1e6:7.0f} us  "
            f"p99 {xs[int(len(xs) * 0.99)] * 1e6:7.0f} us   8 conns: "
            f"{statistics.median(thr[name]):6.0f}/s (rounds {per_round})"
        )
    admin = await asyncpg.connect(SERVER)
    for db in ("ts_ratebench_old", "ts_ratebench_new"):
        await admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    await admin.close()


asyncio.run(main())
