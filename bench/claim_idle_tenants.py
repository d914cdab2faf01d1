"""What tenants with no work to claim now cost a claim (issue 32, defect 2; docs/adr/0009).

Two databases, filled alike: one busy tenant with a backlog of async runs (one of them
running, so tenants running none sort before it), and 10,000 runs due tomorrow, which belong to
one other tenant in "one tenant" and to 10,000 tenants (a daily cron each) in "10,000 tenants".
The claim (`claim` of one run and of 8, on the claim engine: generic plans kept per connection,
app/store/engine.py) is timed on both, blocks of 25 claims alternating between the two so a
noisy moment on a shared machine falls on both alike; each claim is rolled back, so every one
sees the same queue. Target: the second within 1.5x of the first.

    .venv/bin/python bench/claim_idle_tenants.py [CLAIMS] [--json FILE]

CLAIMS 400 per case by default. TEST_DATABASE_URL or DATABASE_URL: a server on which it creates
and drops the two databases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from typing import Any

from common import ROOT  # noqa: F401  (puts the checkout on the path)
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.queue.core import Queue
from app.store.engine import create_claim_engine, create_engine
from app.store.migrate import upgrade
from app.store.statements import q
from app.vocabulary.classes import PriorityClass, priorities_of
from app.vocabulary.records import NewRun
from tests.support.databases import admin_execute, with_database

SERVER = os.environ.get("TEST_DATABASE_URL") or os.environ.get(
    "DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
IDLE_RUNS = 10_000
BLOCK = 25
ASYNC = PriorityClass.ASYNC

FUTURE_SQL = """
SELECT count(*) FROM turnstile_create_runs(
    now(), CAST(:ids AS uuid[]), CAST(:tenants AS text[]), CAST(:principals AS text[]),
    CAST(:nulls AS uuid[]), CAST(:priorities AS smallint[]), CAST(:agents AS text[]),
    CAST(:inputs AS jsonb[]), CAST(:attempts AS integer[]), CAST(:scheduled AS timestamptz[]),
    CAST(:nulls AS uuid[]), CAST(:times AS timestamptz[]), CAST(:nulls AS uuid[]),
    CAST(:texts AS text[]), CAST(:jsons AS jsonb[]), false, NULL)
"""


async def fill(engine: AsyncEngine, tenants: int) -> None:
    queue = Queue(engine)
    for n in range(201):
        await queue.enqueue(
            NewRun(
                tenant_id="busy",
                principal="p",
                agent="scripted",
                input={"n": n},
                priority=ASYNC.base,
            )
        )
    assert len(await queue.claim("bench", [ASYNC])) == 1
    tomorrow = datetime.now(UTC) + timedelta(days=1)
    async with engine.begin() as conn:
        await conn.execute(
            text(FUTURE_SQL),
            {
                "ids": [uuid.uuid4() for _ in range(IDLE_RUNS)],
                "tenants": [f"cron-{n % tenants:05d}" for n in range(IDLE_RUNS)],
                "principals": ["p"] * IDLE_RUNS,
                "nulls": [None] * IDLE_RUNS,
                "priorities": [ASYNC.base] * IDLE_RUNS,
                "agents": ["scripted"] * IDLE_RUNS,
                "inputs": ["{}"] * IDLE_RUNS,
                "attempts": [3] * IDLE_RUNS,
                "scheduled": [tomorrow] * IDLE_RUNS,
                "times": [None] * IDLE_RUNS,
                "texts": [None] * IDLE_RUNS,
                "jsons": [None] * IDLE_RUNS,
            },
        )
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE runs, tenant_class_counts"))


async def time_block(engine: AsyncEngine, limit: int, count: int) -> list[float]:
    params: dict[str, Any] = {
        "owner": "bench",
        "priorities": priorities_of([ASYNC]),
        "lease_seconds": 30.0,
        "limit": limit,
        "max_running": [None, None, None],
        "now": None,
        "claim": None,
    }
    times = []
    async with engine.connect() as conn:
        for _ in range(count):
            transaction = await conn.begin()
            started = time.perf_counter()
            rows = (await conn.execute(q("claim"), params)).all()
            times.append((time.perf_counter() - started) * 1000)
            await transaction.rollback()
            assert len(rows) == limit, rows
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "p50_ms": round(statistics.median(ordered), 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
    }


@contextlib.asynccontextmanager
async def migrated(server: str, name: str) -> AsyncIterator[str]:
    """A database of its own on `server`, migrated to head; dropped afterwards."""
    await admin_execute(
        server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"'
    )
    try:
        url = with_database(server, name)
        await asyncio.to_thread(upgrade, url)
        yield url
    finally:
        await admin_execute(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def measure(
    claims: int, fresh: Callable[[str], AbstractAsyncContextManager[str]] | None = None
) -> dict[str, Any]:
    """Both cases' claim times, and the ratios of their medians. `fresh(name)` gives each
    case a migrated database (make bench's `idle_tenants` phase passes clones of its template,
    bench/run.py); by default, databases of their own on SERVER."""
    settings = Settings(database_url=None)
    names = {"one tenant": 1, "10,000 tenants": IDLE_RUNS}
    engines: dict[str, AsyncEngine] = {}
    async with contextlib.AsyncExitStack() as stack:
        for label, tenants in names.items():
            name = f"bench_idle_{tenants}"
            url = await stack.enter_async_context(
                fresh(name) if fresh is not None else migrated(SERVER, name)
            )
            plain = create_engine(settings, url, pool_size=2)
            await fill(plain, tenants)
            await plain.dispose()
            claim_engine = create_claim_engine(settings, url)
            assert claim_engine is not None
            stack.push_async_callback(claim_engine.dispose)
            engines[label] = claim_engine
        results: dict[str, Any] = {}
        for limit in (1, 8):
            times: dict[str, list[float]] = {label: [] for label in names}
            for label in names:  # warm: the kept plans are made now
                await time_block(engines[label], limit, 5)
            while min(len(t) for t in times.values()) < claims:
                for label in names:
                    times[label] += await time_block(engines[label], limit, BLOCK)
            one, many = summary(times["one tenant"]), summary(times["10,000 tenants"])
            results[f"claim of {limit}"] = {
                "one tenant": one,
                "10,000 tenants": many,
                "ratio_p50": round(many["p50_ms"] / one["p50_ms"], 2),
            }
        return results


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    claims = int(args[0]) if args else 400
    results = asyncio.run(measure(claims))
    print(json.dumps(results, indent=1))
    if "--json" in sys.argv:
        path = sys.argv[sys.argv.index("--json") + 1]
        with open(path, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
