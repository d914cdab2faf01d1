"""One tenant's concurrent enqueues: how many runs a second 8 clients submit when they all
belong to one tenant, against 8 clients of 8 tenants, before and after the striped queued
counts (opt-in, about two minutes; not part of `make bench`).

Before migration 0014 every new run added 1 to its tenant's count row and held that row's lock
to its commit, so one tenant's submissions committed one at a time (docs/adr/0006, "Striped
queued counts"). Two paths, each measured on two fresh databases of one server, "before"
(migrated to 0013, with the enqueue statement of the BASELINE commit's app/store/sql/runs.sql,
read with `git show`) and "after" (migrated to head, with this checkout's statement):

* `enqueue`: the statement `Queue.enqueue` runs, through a SQLAlchemy engine of the
  application's (asyncpg), each run a transaction of its own, as back-end callers make them;
* `turnstile_submit`: the PL/pgSQL function `POST /runs` and turns call (app/queue/submit.py),
  through asyncpg with a prepared statement (sessionless runs, no key, no rate limit).

For each path and layout (one tenant for all 8 clients; one tenant each) the 8 clients submit
back to back, before and after alternating in slices of 2 s until each had DURATION seconds,
so a noisy moment on a shared machine falls on both alike; the result is runs/s of each and
their ratio. Nothing claims meanwhile.

    .venv/bin/python bench/enqueue_contention.py [DURATION] [ROUNDS] [BASELINE]

DURATION 6 s, ROUNDS 2 and BASELINE 69c6930 (main before the change) by default.
TEST_DATABASE_URL or DATABASE_URL: a server on which it creates and drops two databases.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from common import ROOT, database_at, statement_at
from sqlalchemy import TextClause
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.store.engine import create_engine
from app.store.statements import q

SERVER = os.environ.get("TEST_DATABASE_URL") or os.environ.get(
    "DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
CLIENTS = 8
SLICE = 2.0
SUBMIT = (
    "SELECT outcome FROM turnstile_submit("
    "p_now => NULL, p_tenant => $1, p_principal => 'p', p_own_sessions_only => false, "
    "p_actor => NULL, p_session => NULL, p_key => NULL, p_request_hash => NULL, "
    "p_ttl_seconds => 86400, p_wait_ms => 5000, p_lock_timeout_ms => 5000, p_run_id => $2, "
    "p_agent => NULL, p_default_agent => 'scripted', p_priority => NULL, "
    "p_default_priority => 10::smallint, p_scheduled_for => NULL, p_input => '{}'::jsonb, "
    "p_max_attempts => 3, p_traceparent => NULL, p_max_queued => NULL)"
)
LAYOUTS = {"one tenant": ["solo"] * CLIENTS, "8 tenants": [f"tenant-{i}" for i in range(CLIENTS)]}

Submit = Callable[[int], Awaitable[None]]  # client number -> one run submitted


def enqueue_client(engine: AsyncEngine, statement: TextClause, tenants: list[str]) -> Submit:
    async def submit(i: int) -> None:
        params: dict[str, Any] = {
            "id": uuid.uuid4(),
            "tenant_id": tenants[i],
            "principal": "p",
            "session_id": None,
            "priority": 10,
            "agent": "scripted",
            "input": json.dumps({}),
            "max_attempts": 3,
            "scheduled_for": None,
            "resubmitted_from": None,
            "actor": None,
            "traceparent": None,
            "max_queued": None,
            "now": None,
        }
        async with engine.begin() as conn:
            await conn.execute(statement, params)

    return submit


def submit_client(
    statements: list[asyncpg.prepared_stmt.PreparedStatement], tenants: list[str]
) -> Submit:
    async def submit(i: int) -> None:
        await statements[i].fetch(tenants[i], uuid.uuid4())

    return submit


async def timed(submit: Submit, seconds: float) -> int:
    """CLIENTS clients call `submit` back to back for `seconds`; how many runs."""
    deadline = time.perf_counter() + seconds
    counts = [0] * CLIENTS

    async def loop(i: int) -> None:
        while time.perf_counter() < deadline:
            await submit(i)
            counts[i] += 1

    await asyncio.gather(*(loop(i) for i in range(CLIENTS)))
    return sum(counts)


async def compare(before: Submit, after: Submit, duration: float) -> tuple[float, float]:
    """Runs/s of each, alternating slices (after first in odd slices, before in even)."""
    done = {"before": 0, "after": 0}
    spent = {"before": 0.0, "after": 0.0}
    await timed(before, 0.5)  # warm up connections and plans
    await timed(after, 0.5)
    slices = max(1, round(duration / SLICE))
    for n in range(slices):
        order = [("before", before), ("after", after)]
        for label, submit in order if n % 2 == 0 else reversed(order):
            started = time.perf_counter()
            done[label] += await timed(submit, SLICE)
            spent[label] += time.perf_counter() - started
    return done["before"] / spent["before"], done["after"] / spent["after"]


async def main() -> None:
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    baseline = sys.argv[3] if len(sys.argv) > 3 else "69c6930"
    names = {"before": f"ts_enq_before_{os.getpid()}", "after": f"ts_enq_after_{os.getpid()}"}
    urls = {
        "before": await database_at(SERVER, names["before"], "0013"),
        "after": await database_at(SERVER, names["after"], "head"),
    }
    statements = {"before": statement_at(baseline, "enqueue"), "after": q("enqueue")}
    settings = Settings()
    engines = {k: create_engine(settings, url, pool_size=CLIENTS) for k, url in urls.items()}
    conns = {k: [await asyncpg.connect(url) for _ in range(CLIENTS)] for k, url in urls.items()}
    prepared = {k: [await c.prepare(SUBMIT) for c in cs] for k, cs in conns.items()}
    print(f"before: {baseline} at migration 0013; after: {ROOT} at head; {CLIENTS} clients")
    try:
        for r in range(rounds):
            for layout, tenants in LAYOUTS.items():
                cases = {
                    "enqueue": {
                        k: enqueue_client(engines[k], statements[k], tenants) for k in urls
                    },
                    "turnstile_submit": {k: submit_client(prepared[k], tenants) for k in urls},
                }
                for path, clients in cases.items():
                    old, new = await compare(clients["before"], clients["after"], duration)
                    print(
                        f"round {r + 1}  {path:17s} {layout:10s} before {old:6.0f} runs/s  "
                        f"after {new:6.0f} runs/s  ({new / old:.2f}x)",
                        flush=True,
                    )
    finally:
        for cs in conns.values():
            for c in cs:
                await c.close()
        for engine in engines.values():
            await engine.dispose()
        admin = await asyncpg.connect(SERVER)
        for name in names.values():
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
