"""First benchmark of the worker pool: claim throughput, and enqueue-to-claim latency per class
behind an async backlog. A script, not a test: it reports figures and asserts nothing.

Usage: .venv/bin/python bench/claim_bench.py [--runs 5000] [--seconds 5] [--json PATH]

It creates a scratch database on DATABASE_URL (else TEST_DATABASE_URL, else the embedded
PostgreSQL), migrates it, measures, and drops it. Latencies come from the database's own clock:
the time of each run's `run.claimed` event minus the time it became eligible.

Phase 1 (throughput): a bulk-enqueued backlog of no-op async runs drained by a pool whose
executor completes each run at once (claim, complete, events: every write fenced).
Phase 2 (latency under backlog): 10,000 async runs keep every async slot busy (each takes
20 ms), while interactive runs arrive at a steady rate; reported per class, p50/p95/p99.

The pool runs in this process for now; the benchmarks issue moves load generation out of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from app.config import Settings
from app.db.embedded import start_embedded
from app.db.engine import create_engine, plain_url
from app.db.migrate import upgrade
from app.queue.classes import PriorityClass
from app.queue.core import Queue, QueueConfig
from app.queue.models import NewRun
from app.worker.executor import ExecutionContext
from app.worker.layout import parse_slots
from app.worker.notifier import Notifier
from app.worker.pool import WorkerPool

INTERACTIVE, ASYNC, MAINTENANCE = PriorityClass
LATENCY_SQL = """
SELECT r.priority,
       extract(epoch FROM c.created_at - coalesce(r.scheduled_for, r.created_at)) * 1000 AS ms
FROM runs r JOIN run_events c ON c.run_id = r.id AND c.type = 'run.claimed' AND c.seq = 2
WHERE r.created_at >= $1
"""


class WorkingExecutor:
    """Completes each run after `pause[class]` seconds of pretend work."""

    def __init__(self, pause: dict[PriorityClass, float]) -> None:
        self.pause = pause

    async def execute(self, ctx: ExecutionContext) -> None:
        pause = self.pause.get(ctx.claimed.run.priority_class, 0.0)
        if pause:
            await asyncio.sleep(pause)
        await ctx.checked(await ctx.queue.complete(ctx.lease, {}), "complete")


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


async def server_url() -> str:
    url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    if url:
        return url
    return (await asyncio.to_thread(start_embedded, Path(".turnstile"))).url


async def scratch_database(server: str) -> tuple[str, str]:
    name = f"turnstile_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    conn = await asyncpg.connect(plain_url(server))
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    from sqlalchemy.engine import make_url

    url = plain_url(make_url(server).set(database=name))
    await asyncio.to_thread(upgrade, url)
    return name, url


async def drop_database(server: str, name: str) -> None:
    conn = await asyncpg.connect(plain_url(server))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def wait_drained(url: str, total: int, within: float) -> float:
    conn = await asyncpg.connect(plain_url(url))
    try:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            done = await conn.fetchval("SELECT count(*) FROM runs WHERE status = 'succeeded'")
            if done >= total:
                return time.monotonic()
            await asyncio.sleep(0.05)
        raise TimeoutError(f"backlog not drained within {within}s")
    finally:
        await conn.close()


async def start_pool(
    url: str, settings: Settings, slots: str, executor: Any
) -> tuple[WorkerPool, Notifier, Queue]:
    engine = create_engine(settings, url, pool_size=40)
    queue = Queue(engine, QueueConfig(lease_seconds=30))
    notifier = Notifier(url)
    await notifier.start()
    await asyncio.wait_for(notifier.connected.wait(), 10)
    pool = WorkerPool(
        queue,
        executor,
        parse_slots(slots),
        lease_seconds=30,
        heartbeat_seconds=10,
        poll_interval_seconds=1.0,
        notifier=notifier,
        role="bench",
    )
    await pool.start()
    return pool, notifier, queue


async def stop_pool(pool: WorkerPool, notifier: Notifier, queue: Queue) -> None:
    await pool.stop(grace_seconds=5)
    await notifier.stop()
    await queue.engine.dispose()


async def throughput(url: str, settings: Settings, runs: int, slots: str) -> dict[str, Any]:
    engine = create_engine(settings, url)
    queue = Queue(engine)
    for start in range(0, runs, 1000):
        count = min(1000, runs - start)
        await queue.enqueue_many(
            tenant_id="bench", principal="bench", runs=[("noop", {}, ASYNC.base, None)] * count
        )
    await engine.dispose()
    pool, notifier, pool_queue = await start_pool(url, settings, slots, WorkingExecutor({}))
    began = time.monotonic()
    finished = await wait_drained(url, runs, within=600)
    await stop_pool(pool, notifier, pool_queue)
    seconds = finished - began
    return {
        "slots": slots,
        "runs": runs,
        "seconds": round(seconds, 3),
        "runs_per_second": round(runs / seconds, 1),
    }


async def latency(url: str, settings: Settings, seconds: float, rate: float) -> dict[str, Any]:
    engine = create_engine(settings, url)
    queue = Queue(engine)
    conn = await asyncpg.connect(plain_url(url))
    since = await conn.fetchval("SELECT now()")
    for _ in range(10):
        await queue.enqueue_many(
            tenant_id="bench", principal="bench", runs=[("noop", {}, ASYNC.base, None)] * 1000
        )
    executor = WorkingExecutor({ASYNC: 0.02})
    pool, notifier, pool_queue = await start_pool(
        url, settings, "interactive:2,async:4,maintenance:1", executor
    )
    interval = 1.0 / rate
    sent = 0
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        await queue.enqueue(
            NewRun(
                tenant_id="bench",
                principal="bench",
                agent="noop",
                input={},
                priority=INTERACTIVE.base,
            )
        )
        sent += 1
        await asyncio.sleep(max(0.0, began + sent * interval - time.monotonic()))
    await asyncio.sleep(0.5)  # let the last arrivals be claimed before stopping
    backlog = await conn.fetchval("SELECT count(*) FROM runs WHERE status = 'queued'")
    await stop_pool(pool, notifier, pool_queue)
    rows = await conn.fetch(LATENCY_SQL, since)
    await conn.close()
    await engine.dispose()
    by_class: dict[str, list[float]] = {}
    for row in rows:
        by_class.setdefault(PriorityClass.of(row["priority"]).value, []).append(float(row["ms"]))
    report: dict[str, Any] = {"interactive_sent": sent, "async_backlog_left": backlog}
    for klass, values in sorted(by_class.items()):
        report[klass] = {
            "claimed": len(values),
            "p50_ms": round(percentile(values, 50), 2),
            "p95_ms": round(percentile(values, 95), 2),
            "p99_ms": round(percentile(values, 99), 2),
            "mean_ms": round(statistics.fmean(values), 2),
        }
    return report


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=20.0, help="interactive arrivals per s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    settings = Settings()
    server = await server_url()
    results: dict[str, Any] = {"cores": os.cpu_count(), "throughput": []}
    for slots in ("interactive:1,async:4,maintenance:1", "interactive:1,async:16,maintenance:1"):
        name, url = await scratch_database(server)
        try:
            results["throughput"].append(await throughput(url, settings, args.runs, slots))
        finally:
            await drop_database(server, name)
    name, url = await scratch_database(server)
    try:
        results["latency"] = await latency(url, settings, args.seconds, args.rate)
    finally:
        await drop_database(server, name)

    print("| slots | runs | seconds | runs/s |\n|---|---|---|---|")
    for row in results["throughput"]:
        print(f"| {row['slots']} | {row['runs']} | {row['seconds']} | {row['runs_per_second']} |")
    lat = results["latency"]
    print(
        f"\nEnqueue-to-claim behind a 10,000-run async backlog ({lat['interactive_sent']} "
        f"interactive arrivals; {lat['async_backlog_left']} runs still queued at the end):\n"
    )
    print("| class | claimed | p50 ms | p95 ms | p99 ms |\n|---|---|---|---|---|")
    for klass in ("interactive", "async"):
        if klass in lat:
            row = lat[klass]
            print(
                f"| {klass} | {row['claimed']} | {row['p50_ms']} | {row['p95_ms']} | "
                f"{row['p99_ms']} |"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    asyncio.run(main())
