"""One tenant's concurrent enqueues: how many runs a second 8 clients submit when they all
belong to one tenant, against 8 clients of 8 tenants (opt-in, about a minute; not part of
`make bench`).

Before migration 0014 every new run added 1 to its tenant's count row and held that row's lock
to its commit, so one tenant's submissions committed one at a time (docs/adr/0006, "Striped
queued counts"). The figures here are the ones that decision is judged by:

* `Queue.enqueue`: the core's enqueue statement through the application's engine (SQLAlchemy,
  asyncpg), each call a transaction of its own, as back-end callers make them;
* `turnstile_submit`: the PL/pgSQL function `POST /runs` and turns call (app/queue/submit.py),
  here through asyncpg directly with a prepared statement (sessionless runs, no key, no rate
  limit), so the figure is the database's side of the API path.

For each path and each layout (one tenant for all 8 clients; one tenant each) the 8 clients
submit back to back for DURATION seconds; the result is runs/s. The database is a fresh one
migrated to the head of the checkout whose `app` package is imported, so the same script
measures another checkout with PYTHONPATH pointing at it (the line "code:" names it):

    .venv/bin/python bench/enqueue_contention.py [DURATION] [ROUNDS]
    PYTHONPATH=/work/wt-before .venv/bin/python bench/enqueue_contention.py

TEST_DATABASE_URL or DATABASE_URL: a server on which it creates and drops one database.
Nothing claims meanwhile, so the queue grows by a few tens of thousands of runs per case.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg

import app
from app.config import Settings
from app.db.engine import create_engine
from app.db.migrate import upgrade
from app.queue.core import Queue
from app.queue.models import NewRun

SERVER = os.environ.get("TEST_DATABASE_URL") or os.environ.get(
    "DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
CLIENTS = 8
SUBMIT = (
    "SELECT outcome FROM turnstile_submit("
    "p_now => NULL, p_tenant => $1, p_principal => 'p', p_own_sessions_only => false, "
    "p_actor => NULL, p_session => NULL, p_key => NULL, p_request_hash => NULL, "
    "p_ttl_seconds => 86400, p_wait_ms => 5000, p_lock_timeout_ms => 5000, p_run_id => $2, "
    "p_agent => NULL, p_default_agent => 'scripted', p_priority => NULL, "
    "p_default_priority => 10::smallint, p_scheduled_for => NULL, p_input => '{}'::jsonb, "
    "p_max_attempts => 3, p_traceparent => NULL, p_max_queued => NULL)"
)


async def fresh_database(name: str) -> str:
    admin = await asyncpg.connect(SERVER)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    url = SERVER.rsplit("/", 1)[0] + "/" + name
    await asyncio.to_thread(upgrade, url, "head")
    return url


async def timed(clients: list[Callable[[], Awaitable[None]]], duration: float) -> float:
    """Each client calls its submit back to back until `duration` ends; runs per second."""
    counts = [0] * len(clients)
    deadline = time.perf_counter() + duration

    async def loop(i: int) -> None:
        while time.perf_counter() < deadline:
            await clients[i]()
            counts[i] += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(len(clients))))
    return sum(counts) / (time.perf_counter() - started)


async def through_enqueue(url: str, tenants: list[str], duration: float) -> float:
    engine = create_engine(Settings(), url, pool_size=CLIENTS)
    queue = Queue(engine)

    def client(tenant: str) -> Callable[[], Awaitable[None]]:
        run = NewRun(tenant_id=tenant, principal="p", agent="scripted", input={}, priority=10)

        async def submit() -> None:
            await queue.enqueue(run)

        return submit

    try:
        await timed([client(t) for t in tenants], 0.5)  # warm up the pool
        return await timed([client(t) for t in tenants], duration)
    finally:
        await engine.dispose()


async def through_submit(url: str, tenants: list[str], duration: float) -> float:
    conns = [await asyncpg.connect(url) for _ in tenants]
    statements = [await c.prepare(SUBMIT) for c in conns]

    def client(i: int) -> Callable[[], Awaitable[None]]:
        async def submit() -> None:
            await statements[i].fetch(tenants[i], uuid.uuid4())

        return submit

    try:
        return await timed([client(i) for i in range(len(tenants))], duration)
    finally:
        for c in conns:
            await c.close()


async def main() -> None:
    duration = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    name = f"ts_enqueue_contention_{os.getpid()}"
    url = await fresh_database(name)
    print(f"code: {os.path.dirname(os.path.dirname(app.__file__))}")
    layouts = {
        "one tenant": ["solo"] * CLIENTS,
        "8 tenants": [f"tenant-{i}" for i in range(CLIENTS)],
    }
    paths = {"Queue.enqueue": through_enqueue, "turnstile_submit": through_submit}
    try:
        for r in range(rounds):
            for path, measure in paths.items():
                for layout, tenants in layouts.items():
                    rate = await measure(url, tenants, duration)
                    print(
                        f"round {r + 1}  {path:17s} {layout:10s} {CLIENTS} clients: "
                        f"{rate:7.0f} runs/s",
                        flush=True,
                    )
    finally:
        admin = await asyncpg.connect(SERVER)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
