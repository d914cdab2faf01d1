"""The streaming phase of `make bench` (issue 23, docs/adr/0007-live-output-deltas.md): what 50
runs writing their answers live cost the queue beside them.

Twice on a fresh database, without and then with 50 streaming runs: one `turnstile worker`
(the streaming host: 50 async slots) runs 50 scripted `say` runs that each write text for the
whole measurement (a piece every 20 ms, about 50 pieces a second each: 2,500 deltas a second
for the process, coalesced by its publisher into at most 10 notifications a second), while a
second `turnstile worker` drains no-op runs and then serves interactive no-op runs arriving at
a steady rate. Without streaming the host worker runs the same 50 runs with sleep steps instead
(same slots, same claims, no text), so the difference is the live output alone.

Reported per condition: no-op runs/s (drain window by the database clock), interactive
enqueue-to-claim p50/p99 (database clock), the host worker's CPU share (what the 50 runs cost
the machine), the notifications and bytes heard on
`turnstile_deltas` by this process's LISTEN (standing in for an API process's one listener),
the largest payload, and the highest `pg_notification_queue_usage()` sampled during it.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path
from typing import Any

import asyncpg
from common import (
    NOOP,
    Databases,
    Worker,
    enqueue_bulk,
    log,
    summary,
    wait_count,
    wait_workers,
)

from app.config import Settings
from app.queue.core import Queue
from app.store.engine import create_engine
from app.vocabulary.classes import PriorityClass
from app.vocabulary.live_deltas import CHANNEL
from app.vocabulary.records import NewRun

INTERACTIVE, ASYNC, _ = PriorityClass
STREAMS = 50
PIECE_SECONDS = 0.02
SLEEP_MAX_SECONDS = 60  # the scripted agent's sleep tool's bound (app/runtime/tools.py)

LATENCY_SQL = """
SELECT extract(epoch FROM c.created_at - r.created_at) * 1000 AS ms
FROM runs r
JOIN run_events c ON c.run_id = r.id AND c.type = 'run.claimed' AND c.seq = 2
WHERE r.priority = $1 AND r.created_at >= $2
"""


def host_script(streaming: bool, seconds: float) -> dict[str, Any]:
    """A run that stays busy `seconds`: writing text live, or sleeping for as long."""
    pieces = max(1, int(seconds / PIECE_SECONDS))
    if streaming:
        text = "".join(f"word{i} " for i in range(pieces))
        return {"script": [{"say": text, "delay": PIECE_SECONDS}]}
    # The sleep tool takes at most 60 s a call (a longer one fails the run at once, and the
    # "without" side would then measure no busy runs at all): as many calls as it takes.
    sleeps = [
        {"call": "sleep", "args": {"seconds": min(SLEEP_MAX_SECONDS, seconds - start)}}
        for start in range(0, math.ceil(seconds), SLEEP_MAX_SECONDS)
    ]
    return {"script": [*sleeps, {"final": "ok"}]}


async def one(
    dbs: Databases,
    settings: Settings,
    *,
    streaming: bool,
    noop_runs: int,
    latency_seconds: float,
    rate: float,
    logs: Path,
) -> dict[str, Any]:
    async with dbs.fresh() as url:
        conn = await asyncpg.connect(url)
        listener = await asyncpg.connect(url)
        heard: list[int] = []
        await listener.add_listener(CHANNEL, lambda *a: heard.append(len(a[3].encode())))
        engine = create_engine(settings, url)
        queue = Queue(engine)
        label = "streaming" if streaming else "quiet"
        workers: list[Worker] = []
        usage_max = 0.0
        sampling = True

        async def sample() -> None:
            nonlocal usage_max
            while sampling:
                usage_max = max(
                    usage_max, await listener.fetchval("SELECT pg_notification_queue_usage()")
                )
                await asyncio.sleep(0.2)

        try:
            # Partial layouts keep the two apart: the host serves only async runs (the 50), the
            # other only interactive ones (the measured no-ops).
            host = Worker(
                url,
                f"async:{STREAMS}",
                logs / f"stream-host-{label}.log",
                partial_layout="true",
                drain_grace_seconds="0",
            )
            drain = Worker(
                url, "interactive:4", logs / f"stream-drain-{label}.log", partial_layout="true"
            )
            workers = [host, drain]
            await wait_workers(conn, 2, workers)
            busy_for = 180.0  # longer than the measurement; the host is stopped at its end
            await enqueue_bulk(queue, STREAMS, host_script(streaming, busy_for), ASYNC.base)
            await wait_count(
                conn,
                f"SELECT count(*) FROM runs WHERE status = 'running' AND priority = {ASYNC.base}",
                STREAMS,
                within=60,
            )
            sampler = asyncio.create_task(sample())
            heard.clear()
            listened_from = time.monotonic()
            host_cpu = host.cpu_seconds()
            # No-op throughput: interactive class, so only the drain worker's 4 slots take
            # them (the async slots are busy with the host's runs).
            began = await conn.fetchval("SELECT now()")
            await enqueue_bulk(queue, noop_runs, NOOP, INTERACTIVE.base)
            await wait_count(
                conn,
                "SELECT count(*) FROM runs WHERE status = 'succeeded' "
                f"AND priority = {INTERACTIVE.base}",
                noop_runs,
                within=300,
            )
            window = await conn.fetchval(
                "SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM runs "
                "WHERE priority = $1 AND created_at >= $2",
                INTERACTIVE.base,
                began,
            )
            # Interactive latency: arrivals at a steady rate.
            since = await conn.fetchval("SELECT now()")
            sent = 0
            start = time.monotonic()
            while time.monotonic() - start < latency_seconds:
                await queue.enqueue(
                    NewRun(
                        tenant_id="bench",
                        principal="bench",
                        agent="scripted",
                        input=NOOP,
                        priority=INTERACTIVE.base,
                    )
                )
                sent += 1
                await asyncio.sleep(max(0.0, start + sent / rate - time.monotonic()))
            await wait_count(
                conn,
                "SELECT count(*) FROM runs WHERE status = 'succeeded' "
                f"AND priority = {INTERACTIVE.base}",
                noop_runs + sent,
                within=60,
            )
            listened = time.monotonic() - listened_from
            heard_now = list(heard)  # what came during the window, not while stopping
            host_cpu = host.cpu_seconds() - host_cpu
            sampling = False
            await sampler
            rows = await conn.fetch(LATENCY_SQL, INTERACTIVE.base, since)
        finally:
            for worker in workers:
                worker.stop()
            await engine.dispose()
            await listener.close()
            await conn.close()
    return {
        "condition": label,
        "streaming_runs": STREAMS if streaming else 0,
        "noop_runs": noop_runs,
        "noop_runs_per_second": round(noop_runs / float(window), 1),
        "interactive_claim_ms": summary([float(r["ms"]) for r in rows]),
        "delta_notifications": len(heard_now),
        "delta_notifications_per_second": round(len(heard_now) / listened, 2),
        "delta_bytes_per_second": round(sum(heard_now) / listened, 1),
        "largest_delta_payload_bytes": max(heard_now, default=0),
        "notification_queue_usage_max": usage_max,
        # The host worker's CPU share over the window: what its 50 runs cost the machine
        # (streaming: the say loops and the publisher; quiet: sleeping runs).
        "host_worker_cpu_share": round(host_cpu / listened, 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


async def measure(
    dbs: Databases,
    settings: Settings,
    *,
    noop_runs: int,
    latency_seconds: float,
    rate: float,
    logs: Path,
) -> list[dict[str, Any]]:
    rows = []
    for streaming in (False, True):
        log(f"streaming: {'with' if streaming else 'without'} {STREAMS} streaming runs")
        row = await one(
            dbs,
            settings,
            streaming=streaming,
            noop_runs=noop_runs,
            latency_seconds=latency_seconds,
            rate=rate,
            logs=logs,
        )
        log(f"  {row}")
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| Condition | No-op runs/s | Interactive claim p50 / p99 (ms) | Delta notifications/s "
        "| Delta kB/s | Largest payload (B) | Max queue usage | Host worker CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        claim = row["interactive_claim_ms"]
        lines.append(
            f"| {row['condition']} ({row['streaming_runs']} streaming) "
            f"| {row['noop_runs_per_second']} | {claim.get('p50_ms')} / {claim.get('p99_ms')} "
            f"| {row['delta_notifications_per_second']} "
            f"| {row['delta_bytes_per_second'] / 1000:.1f} "
            f"| {row['largest_delta_payload_bytes']} | {row['notification_queue_usage_max']:.2g} "
            f"| {row['host_worker_cpu_share']:.0%} |"
        )
    return "\n".join(lines) + "\n"
