"""What the striped queued counts cost a claim (opt-in, a minute or two; not part of
`make bench`): `claim_one` before and after migration 0014 on the same layouts, interleaved.

After 0014 a claim reads its tenant's 8 stripes to see whether it took the tenant's last queued
run, and when it did (its snapshot's total is 0) it calls turnstile_clear_work, which locks the
8 stripes and clears the tenant's flag (docs/adr/0006, "Striped queued counts"). So the layouts
are the two extremes: every claim drains a tenant (1,000 tenants with one queued run each, as
many chat tenants with a turn each), and no claim does (one tenant with a backlog); and one in
between (1,000 tenants with 5 runs each).

"before" is the BASELINE commit's `claim_one` (read with `git show`) on a database at migration
0013, "after" this checkout's on a database at head; both filled with the same async runs
inserted directly with their counts, as the migrations would leave them; claims on the claim
engine (generic plans, app/store/engine.py), each its own transaction. Blocks of 25 claims
alternate between the two, so a noisy moment on a shared machine falls on both alike.

    .venv/bin/python bench/claim_drain_cost.py [CLAIMS] [BASELINE] [BATCH]

CLAIMS 300 per layout, BASELINE 69c6930 and BATCH 1 (`claim_one`; more: `claim_many` of that
many runs, CLAIMS then counting batches) by default. TEST_DATABASE_URL or DATABASE_URL: a
server on which it creates and drops two databases per layout.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from typing import Any

import asyncpg
from common import ROOT, database_at, statement_at
from sqlalchemy import TextClause
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.store.engine import create_claim_engine, create_engine
from app.store.statements import q

SERVER = os.environ.get("TEST_DATABASE_URL") or os.environ.get(
    "DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
BLOCK = 25
LAYOUTS = {  # name: (tenants, queued runs each)
    "1,000 tenants x 1 run (every claim drains)": (1_000, 1),
    "1,000 tenants x 5 runs": (1_000, 5),
    "1 tenant x 2,000 runs (none drains)": (1, 2_000),
}
RUNS_SQL = """
INSERT INTO runs (tenant_id, principal, status, priority, agent, input, max_attempts,
                  last_event_seq, inputs_count, created_at, updated_at)
SELECT 'tenant-' || t, 'bench', 'queued', 10, 'scripted', '{}'::jsonb, 3, 1, 1,
       now() - interval '1 hour' + (t * $2 + n) * interval '1 millisecond', now()
FROM generate_series(1, $1) AS t, generate_series(1, $2) AS n
"""
COUNTS_BEFORE = """
INSERT INTO tenant_class_counts (tenant_id, band, running, queued)
SELECT 'tenant-' || t, 1, 0, $2 FROM generate_series(1, $1) AS t
"""
COUNTS_AFTER = """
WITH counted AS (
    INSERT INTO tenant_class_counts (tenant_id, band, running, queued, has_work)
    SELECT 'tenant-' || t, 1, 0, 0, true FROM generate_series(1, $1) AS t
    RETURNING tenant_id, band
)
INSERT INTO tenant_queued_stripes (tenant_id, band, stripe, queued)
SELECT tenant_id, band, s, CASE WHEN s = 0 THEN $2 ELSE 0 END
FROM counted, generate_series(0, 7) AS s
"""


async def fresh_database(name: str, revision: str, counts: str, layout: tuple[int, int]) -> str:
    url = await database_at(SERVER, name, revision)
    conn = await asyncpg.connect(url)
    await conn.execute(RUNS_SQL, *layout)
    await conn.execute(counts, *layout)
    await conn.execute("VACUUM ANALYZE")
    await conn.close()
    return url


async def claims(engine: AsyncEngine, statement: TextClause, n: int, batch: int) -> list[float]:
    params: dict[str, Any] = {
        "owner": "bench",
        "priorities": list(range(10, 20)),
        "lease_seconds": 300.0,
        "limit": batch,
        "max_running": [None, None, None],
        "now": None,
    }
    times = []
    for _ in range(n):
        started = time.perf_counter()
        async with engine.begin() as conn:
            rows = (await conn.execute(statement, params)).mappings().all()
        times.append(time.perf_counter() - started)
        assert rows[0]["id"] is not None, "the queue ran dry: fewer claims per layout"
    return times


async def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    baseline = sys.argv[2] if len(sys.argv) > 2 else "69c6930"
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    name = "claim_one" if batch == 1 else "claim_many"
    settings = Settings()
    statements = {"before": statement_at(baseline, name), "after": q(name)}
    print(
        f"before: {baseline} at migration 0013; after: {ROOT} at head; {name} of {batch}, p50 / p95"
    )
    for label, layout in LAYOUTS.items():
        names = {k: f"ts_claimcost_{k}_{os.getpid()}" for k in statements}
        urls = {
            "before": await fresh_database(names["before"], "0013", COUNTS_BEFORE, layout),
            "after": await fresh_database(names["after"], "head", COUNTS_AFTER, layout),
        }
        engines: dict[str, AsyncEngine] = {}
        for k, url in urls.items():
            engines[k] = create_claim_engine(settings, url) or create_engine(settings, url)
        times: dict[str, list[float]] = {k: [] for k in statements}
        try:
            for k in statements:  # warm up: connections and generic plans
                await claims(engines[k], statements[k], 5, batch)
            for block in range(total // BLOCK):
                order = list(statements) if block % 2 == 0 else list(reversed(statements))
                for k in order:
                    times[k] += await claims(engines[k], statements[k], BLOCK, batch)
        finally:
            for engine in engines.values():
                await engine.dispose()
            admin = await asyncpg.connect(SERVER)
            for name in names.values():
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.close()
        figures = {}
        for k, xs in times.items():
            xs = sorted(xs)
            figures[k] = (statistics.median(xs) * 1e3, xs[int(len(xs) * 0.95)] * 1e3)
        ratio = figures["after"][0] / figures["before"][0]
        print(
            f"{label:45s} before {figures['before'][0]:.2f} / {figures['before'][1]:.2f} ms  "
            f"after {figures['after'][0]:.2f} / {figures['after'][1]:.2f} ms  "
            f"(p50 {ratio:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    asyncio.run(main())
