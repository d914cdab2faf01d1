"""Turnstile's benchmark, `make bench`: every figure beside the PostgreSQL commit ceiling measured
in the same run. A script, not a test: it reports, it asserts nothing.

Usage: .venv/bin/python bench/run.py [--quick] [--out bench/results] [--png docs/bench-latest.png]
       [--phases ceiling,api] (`BENCH_QUICK=1` is the same as `--quick`)

The server is DATABASE_URL, else TURNSTILE_DATABASE_URL, else TEST_DATABASE_URL, else the
embedded PostgreSQL. Every phase runs on a fresh database cloned from a freshly migrated
template, dropped afterwards (also when a phase fails). This process is the load generator:
it enqueues, it times claims and it reads the results; the service runs in `turnstile worker`
and `turnstile serve --no-workers` processes it starts, and the HTTP clients are processes of
their own (bench/http_load.py). Some phases only (`--phases ceiling,api`): results in files of
their own (`latest-ceiling-api.json` and `.md`), the table whenever the ceiling ran.

1. Ceiling: pgbench (one single-row UPDATE per transaction, 8 clients) and asyncpg (8
   connections committing single-row UPDATEs), at the server's own durability settings, which
   are Turnstile's; (7) the asyncpg figure again with one pg_notify per transaction.
2. Throughput: no-op scripted runs, bulk-enqueued sessionless, drained by 1, 2 and 4 worker
   processes at several async slot counts (the quick profile: fewer runs and slot counts).
   Runs/s over the drain window by the database clock (first claim to last completion), and
   the ratio to the pgbench ceiling; the CPU per run of the workers and of PostgreSQL's
   backends.
3. Latency under backlog: 10,000 async runs (each a 50 ms sleep tool call: claim, journal,
   checkpoint, complete) keep every async slot of one worker busy, while interactive no-op
   runs arrive at a steady rate. Enqueue-to-claim by the database clock, per class.
4. Claim latency with 1k, 100k and 1M queued runs (claim_one and claim_many of 8), timed from
   this process around the whole claim transaction.
4b. Idle tenants (bench/claim_idle_tenants.py): the claim beside 10,000 tenants whose only
   work is due tomorrow (a daily cron each), against the same with one such tenant, in
   alternating blocks; target within 1.5x.
5. POST /sessions/{id}/turns against 1 and 2 API processes (each a `turnstile serve
   --no-workers`, its own uvicorn on its own port, as docs/deployment.md runs API replicas),
   from two bench/http_load.py processes spreading their connections over the ports. With the
   throughput phase's 1, 2 and 4 worker processes: the scale curve, each role's figures as
   shares of pgbench, with CPU per operation of the role and of PostgreSQL's backends.
6. Peak RSS (VmHWM) of every worker process.
7. In flight (bench/inflight.py): one worker with 100, 500, 2,000 and 5,000 async slots serving
   three times as many `openai` runs against a loopback endpoint answering after 1 s
   (bench/fake_model.py), lease 6 s and heartbeat 2 s: runs/s, worker CPU per run, connections
   the endpoint accepted, the heartbeat's lag, runs past their lease, leases lost.
7b. Model budgets (bench/model_budgets.py): a burst of 2,000 `openai` runs (half interactive,
   half async, two tenants) against an endpoint enforcing its own requests and tokens a
   minute (bench/limited_model.py), with budgets set to its limits and without: 429s, early
   releases, finishing time, throughput as a share of the limit, waits for capacity by class
   and tenant.
8. Streaming (bench/streaming.py): no-op throughput and interactive latency with 50 runs
   writing text live beside them, against the same without; the delta notifications and the
   notification queue usage.
9. Peers (bench/peers.py): Turnstile, PGQueuer and Procrastinate on the same workloads (drain,
   single enqueues, probes behind a backlog, commits and WAL per job), each on its own database.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ceiling
import claim_idle_tenants
import inflight
import model_budgets
import peers
import streaming
from common import (
    NOOP,
    ROOT,
    TURNSTILE,
    Databases,
    Worker,
    _round,
    cpu_seconds,
    enqueue_bulk,
    log,
    peak_rss_mb,
    percentile,
    retrying,
    server_url,
    service_env,
    summary,
    wait_count,
    wait_workers,
)

from app.config import Settings
from app.queue.core import Queue
from app.store.embedded import free_port
from app.store.engine import create_claim_engine, create_engine
from app.vocabulary.classes import PriorityClass
from app.vocabulary.layout import parse_slots
from app.vocabulary.records import NewRun

INTERACTIVE, ASYNC, MAINTENANCE = PriorityClass


@dataclass(frozen=True)
class Profile:
    name: str
    ceiling_seconds: float
    throughput_runs: int
    throughput_slots: tuple[int, ...]
    throughput_processes: tuple[int, ...]
    backlog_runs: int
    backlog_sleep_seconds: float
    latency_seconds: float
    interactive_rate: float
    depths: tuple[int, ...]
    # Tenants holding the queued runs at each depth (fair shares, docs/adr/0006): the claim
    # walks tenants, so its cost is measured with one and with many.
    depth_tenants: tuple[int, ...]
    claims_per_depth: int
    api_seconds: float
    api_connections: int
    api_processes: tuple[int, ...]
    api_clients: int
    inflight_sizes: tuple[int, ...]
    # The model-budgets burst (bench/model_budgets.py): runs, and the endpoint's tokens and
    # requests a minute.
    budget_runs: tuple[int, int, int]
    peer_jobs: int
    peer_processes: tuple[int, ...]
    peer_singles: int
    peer_backlog: int
    peer_probes: int


FULL = Profile(
    name="full",
    ceiling_seconds=10,
    throughput_runs=20_000,
    throughput_slots=(4, 16, 64),
    throughput_processes=(1, 2, 4),
    backlog_runs=10_000,
    backlog_sleep_seconds=0.05,
    latency_seconds=30,
    interactive_rate=40,
    depths=(1_000, 100_000, 1_000_000),
    depth_tenants=(1, 1_000),
    claims_per_depth=300,
    api_seconds=15,
    api_connections=32,
    api_processes=(1, 2),
    api_clients=2,
    inflight_sizes=(100, 500, 2_000, 5_000),
    budget_runs=(2_000, 120_000, 1_200),
    peer_jobs=20_000,
    peer_processes=(1, 2),
    peer_singles=5_000,
    peer_backlog=5_000,
    peer_probes=200,
)
QUICK = Profile(
    name="quick",
    ceiling_seconds=3,
    throughput_runs=2_000,
    throughput_slots=(4, 32),
    throughput_processes=(1, 2, 4),  # the scale curve's worker rows
    backlog_runs=10_000,
    backlog_sleep_seconds=0.05,
    latency_seconds=6,
    interactive_rate=40,
    depths=(1_000, 100_000),
    depth_tenants=(1, 1_000),
    claims_per_depth=100,
    api_seconds=4,
    api_connections=32,
    api_processes=(1, 2),
    api_clients=2,
    inflight_sizes=(100, 500),
    budget_runs=(400, 40_000, 400),
    peer_jobs=2_000,
    peer_processes=(1, 2),
    peer_singles=500,
    peer_backlog=1_000,
    peer_probes=40,
)
TINY = Profile(  # the smoke test's: every phase runs, the figures mean nothing
    name="tiny",
    ceiling_seconds=1,
    throughput_runs=200,
    throughput_slots=(4,),
    throughput_processes=(1,),
    backlog_runs=300,
    backlog_sleep_seconds=0.05,
    latency_seconds=1.5,
    interactive_rate=20,
    depths=(1_000,),
    depth_tenants=(1, 1_000),
    claims_per_depth=20,
    api_seconds=1,
    api_connections=4,
    api_processes=(1, 2),
    api_clients=2,
    inflight_sizes=(20,),
    budget_runs=(20, 3_000, 100),
    peer_jobs=100,
    peer_processes=(1,),
    peer_singles=20,
    peer_backlog=40,
    peer_probes=4,
)
PROFILES = {p.name: p for p in (FULL, QUICK, TINY)}
PHASES = (
    "ceiling",
    "throughput",
    "latency",
    "depth",
    "idle_tenants",
    "api",
    "inflight",
    "budgets",
    "streaming",
    "peers",
)


# --- 2. throughput ----------------------------------------------------------------------------
async def throughput(
    dbs: Databases,
    settings: Settings,
    profile: Profile,
    processes: int,
    slots: int,
    logs: Path,
    layout: str | None = None,
) -> dict[str, Any]:
    """The drain of no-op async runs by `processes` workers of `slots` async slots each, in a
    layout of one interactive slot unless `layout` is given (the default one's row)."""
    tag = "default" if layout else f"{processes}x{slots}"
    layout = layout or f"interactive:1,async:{slots},maintenance:1"
    async with dbs.fresh() as url:
        conn = await asyncpg.connect(url)
        engine = create_engine(settings, url)
        workers: list[Worker] = []
        try:
            workers = [
                Worker(url, layout, logs / f"throughput-{tag}-{i}.log") for i in range(processes)
            ]
            await wait_workers(conn, processes, workers)
            pg_cpu = inflight.BackendCpu()
            await pg_cpu.sample(conn)
            cpu_before = sum(w.cpu_seconds() for w in workers)
            began = time.monotonic()
            await enqueue_bulk(Queue(engine), profile.throughput_runs, NOOP, ASYNC.base)
            enqueued = time.monotonic() - began
            # Drained? Meanwhile, the most connections the workers held open (every backend
            # on this database but this process's two: this connection and the engine's).
            connections = 0
            deadline = time.monotonic() + 600
            while True:
                done, backends = await conn.fetchrow(
                    "SELECT (SELECT count(*) FROM runs WHERE status = 'succeeded'), "
                    "(SELECT count(*) FROM pg_stat_activity WHERE datname = current_database())"
                )
                connections = max(connections, backends - 2)
                await pg_cpu.sample(conn)
                if done >= profile.throughput_runs:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the backlog was not drained within 600 s")
                await asyncio.sleep(0.05)
            wall = time.monotonic() - began
            rss = [w.peak_rss_mb() for w in workers]
            cpu = sum(w.cpu_seconds() for w in workers) - cpu_before
            postgres_cpu = pg_cpu.seconds()
        finally:
            for worker in workers:
                worker.stop()
            await engine.dispose()
        row = await conn.fetchrow(
            "SELECT count(*) AS runs, "
            "extract(epoch FROM max(finished_at) - min(started_at)) AS window, "
            "(SELECT count(*) FROM run_events) AS events "
            "FROM runs WHERE status = 'succeeded'"
        )
        await conn.close()
    window = float(row["window"])
    return {
        "processes": processes,
        "slots_per_process": slots,
        "layout": layout,
        "runs": int(row["runs"]),
        "events": int(row["events"]),
        "enqueue_seconds": round(enqueued, 3),
        "drain_seconds": round(window, 3),
        "wall_seconds": round(wall, 3),
        "runs_per_second": round(int(row["runs"]) / window, 1),
        "worker_peak_rss_mb": rss,
        "worker_connections_peak": connections,
        # The workers' CPU time (user + system) per run while they drained: what a run costs
        # a worker process, whatever else competed for the cores.
        "worker_cpu_ms_per_run": round(cpu * 1000 / int(row["runs"]), 3),
        # PostgreSQL's backends of this database (the bench's bulk enqueue included; the
        # server's background processes, such as the WAL writer, not), per run.
        "postgres_cpu_ms_per_run": (
            None if postgres_cpu is None else round(postgres_cpu * 1000 / int(row["runs"]), 3)
        ),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# --- 3. latency under backlog -----------------------------------------------------------------
LATENCY_SQL = """
SELECT r.priority,
       extract(epoch FROM c.created_at - coalesce(r.scheduled_for, r.created_at)) * 1000 AS ms
FROM runs r
JOIN run_events c ON c.run_id = r.id AND c.type = 'run.claimed' AND c.seq = 2
WHERE c.created_at >= $1 AND c.created_at < $2
"""


async def latency(
    dbs: Databases, settings: Settings, profile: Profile, logs: Path
) -> dict[str, Any]:
    layout = settings.slots  # the default layout
    slow = {
        "script": [
            {"call": "sleep", "args": {"seconds": profile.backlog_sleep_seconds}},
            {"final": "ok"},
        ]
    }
    async with dbs.fresh() as url:
        conn = await asyncpg.connect(url)
        engine = create_engine(settings, url)
        queue = Queue(engine)
        worker: Worker | None = None
        try:
            await enqueue_bulk(queue, profile.backlog_runs, slow, ASYNC.base)
            worker = Worker(url, layout, logs / "latency.log")
            await wait_workers(conn, 1, [worker])
            # Let the async slots fill before the first interactive arrival.
            await wait_count(
                conn,
                f"SELECT count(*) FROM runs WHERE status = 'running' AND priority = {ASYNC.base}",
                sum(g.size for g in settings.slot_groups if g.top_class is ASYNC),
                within=30,
            )
            since = await conn.fetchval("SELECT now()")
            interval = 1.0 / profile.interactive_rate
            sent = 0
            # Per interactive run: how long its enqueue transaction took as this client saw it
            # (its BEGIN is the run's created_at, so it is part of enqueue-to-claim), and the
            # wall-clock time the enqueue returned (same machine, same clock as the server's).
            enqueue_ms: list[float] = []
            returned_at: dict[uuid.UUID, float] = {}
            began = time.monotonic()
            while time.monotonic() - began < profile.latency_seconds:
                started = time.perf_counter()
                run = await queue.enqueue(
                    NewRun(
                        tenant_id="bench",
                        principal="bench",
                        agent="scripted",
                        input=NOOP,
                        priority=INTERACTIVE.base,
                    )
                )
                enqueue_ms.append((time.perf_counter() - started) * 1000)
                returned_at[run.id] = time.time()
                sent += 1
                await asyncio.sleep(max(0.0, began + sent * interval - time.monotonic()))
            await wait_count(
                conn,
                f"SELECT count(*) FROM runs WHERE priority = {INTERACTIVE.base} "
                "AND status <> 'queued'",
                sent,
                within=30,
            )
            until = await conn.fetchval("SELECT now()")
            backlog = await conn.fetchval(
                f"SELECT count(*) FROM runs WHERE status = 'queued' AND priority = {ASYNC.base}"
            )
            async_busy = await conn.fetchval(
                f"SELECT count(*) FROM runs WHERE status = 'running' AND priority = {ASYNC.base}"
            )
            rss = worker.peak_rss_mb()
        finally:
            if worker is not None:
                worker.stop()
            await engine.dispose()
        rows = await conn.fetch(LATENCY_SQL, since, until)
        claims = await conn.fetch(
            "SELECT run_id, extract(epoch FROM created_at) AS at FROM run_events "
            "WHERE type = 'run.claimed' AND seq = 2 AND run_id = ANY($1::uuid[])",
            list(returned_at),
        )
        await conn.close()
    after_return = [
        (float(row["at"]) - returned_at[row["run_id"]]) * 1000
        for row in claims
        if row["run_id"] in returned_at
    ]
    by_class: dict[str, list[float]] = {}
    for row in rows:
        by_class.setdefault(PriorityClass.of(row["priority"]).value, []).append(float(row["ms"]))
    return {
        "layout": layout,
        "backlog_runs": profile.backlog_runs,
        "async_run": f"one sleep tool call of {profile.backlog_sleep_seconds * 1000:g} ms",
        "interactive_rate_per_second": profile.interactive_rate,
        "seconds": profile.latency_seconds,
        "interactive_sent": sent,
        "async_still_queued_at_end": backlog,
        "async_running_at_end": async_busy,
        "worker_peak_rss_mb": rss,
        "classes": {klass: summary(values) for klass, values in sorted(by_class.items())},
        "interactive_enqueue_transaction": summary(enqueue_ms),
        # Negative when the claim began before the client had read its COMMIT's answer.
        "interactive_claim_after_enqueue_returned": summary(after_return),
        "samples_ms": {klass: values for klass, values in by_class.items()},
    }


# --- 4. claim latency against queue depth -----------------------------------------------------
FILL_SQL = """
WITH run AS (
    INSERT INTO runs (tenant_id, principal, status, priority, agent, input, max_attempts,
                      last_event_seq, inputs_count, created_at, updated_at)
    SELECT 'bench-' || (g % $3), 'bench', 'queued', $1, 'scripted', '{}'::jsonb, 3, 1, 1,
           now() - interval '1 hour' + g * interval '1 millisecond', now()
    FROM generate_series(1, $2) g
    RETURNING tenant_id, priority
)
-- The tenants' counts, as the queue's own statements keep them (docs/adr/0006): new runs on
-- the stripes (stripe 0 here), has_work set, every count row with its 8 stripes.
, per_band AS MATERIALIZED (
    SELECT tenant_id, CAST(priority / 10 AS smallint) AS band, count(*) AS n FROM run
    GROUP BY tenant_id, priority / 10
),
count_row AS (
    INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued, has_work)
    SELECT tenant_id, band, 0, 0, true FROM per_band
    ON CONFLICT (tenant_id, band) DO UPDATE SET has_work = true
)
INSERT INTO tenant_queued_stripes AS s (tenant_id, band, stripe, queued)
SELECT tenant_id, band, g, CASE WHEN g = 0 THEN n ELSE 0 END
FROM per_band CROSS JOIN generate_series(0, 7) AS g
ON CONFLICT (tenant_id, band, stripe) DO UPDATE SET queued = s.queued + excluded.queued
"""


class _Depth:
    """One database holding a queue of `target` claimable async runs of `tenants` tenants."""

    def __init__(self, url: str, settings: Settings, target: int, tenants: int) -> None:
        self.url = url
        self.target = target
        self.tenants = tenants
        self.engine = create_engine(settings, url)
        # Claims on their own connections, as the service makes them (app/main.py).
        self.claim_engine = create_claim_engine(settings, url)
        self.queue = Queue(self.engine, claim_engine=self.claim_engine)
        self.conn: asyncpg.Connection | None = None

    async def fill(self) -> None:
        """Top the queue back up to its depth (untimed)."""
        if self.conn is None:
            self.conn = await asyncpg.connect(self.url)
        queued = await self.conn.fetchval("SELECT count(*) FROM runs WHERE status = 'queued'")
        while queued < self.target:
            n = min(200_000, self.target - queued)
            await self.conn.execute(FILL_SQL, ASYNC.base, n, self.tenants)
            queued += n

    async def close(self) -> None:
        await self.engine.dispose()
        if self.claim_engine is not None:
            await self.claim_engine.dispose()
        if self.conn is not None:
            await self.conn.close()


async def depth(dbs: Databases, settings: Settings, profile: Profile) -> list[dict[str, Any]]:
    """One database per depth and number of tenants holding the runs, all built first; then
    the claims are timed in interleaved rounds (a round at each database in turn), so a noisy
    moment on a shared machine falls on every depth alike instead of on whichever was being
    measured. A round takes at most a quarter of its queue, and the queue is filled back to its
    depth before the next one."""
    async with contextlib.AsyncExitStack() as stack:
        queues: list[_Depth] = []
        for target in profile.depths:
            for tenants in profile.depth_tenants:
                url = await stack.enter_async_context(dbs.fresh())
                queues.append(_Depth(url, settings, target, tenants))
                stack.push_async_callback(queues[-1].close)
                await queues[-1].fill()
                assert queues[-1].conn is not None
                await queues[-1].conn.execute("VACUUM ANALYZE runs")
                await queues[-1].conn.execute("ANALYZE tenant_class_counts")
                await queues[-1].conn.execute("ANALYZE tenant_queued_stripes")
        times: dict[tuple[int, int, str], list[float]] = {}
        for label, limit in (("claim_one", 1), ("claim_many_8", 8)):
            for q in queues:
                for _ in range(10):  # warm the connection pool and the plan caches
                    await q.queue.claim("bench", [ASYNC], limit=limit)
            per_round = min(25, max(1, min(profile.depths) // (limit * 4)))
            while any(
                len(times.get((q.target, q.tenants, label), [])) < profile.claims_per_depth
                for q in queues
            ):
                for q in queues:
                    series = times.setdefault((q.target, q.tenants, label), [])
                    await q.fill()
                    for _ in range(min(per_round, profile.claims_per_depth - len(series))):
                        started = time.perf_counter()
                        claimed = await q.queue.claim("bench", [ASYNC], limit=limit)
                        series.append((time.perf_counter() - started) * 1000)
                        if len(claimed) != limit:
                            raise RuntimeError(f"claimed {len(claimed)} of {limit}")
        results = [
            {
                "queued": q.target,
                "tenants": q.tenants,
                "claim_one": summary(times[(q.target, q.tenants, "claim_one")]),
                "claim_many_8": summary(times[(q.target, q.tenants, "claim_many_8")]),
            }
            for q in queues
        ]
        for row in results:
            log(f"claim latency at {row['queued']:,} queued, {row['tenants']} tenant(s): {row}")
        return results


# --- 5. the API -------------------------------------------------------------------------------
def create_key(env: dict[str, str]) -> str:
    return subprocess.run(
        [TURNSTILE, "keys", "create", "--tenant", "bench", "--principal", "bench"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()


def start_server(env: dict[str, str], log_file: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [TURNSTILE, "serve", "--no-workers"],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


WAL_SQL = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"
# This database's committed transactions, as far as its backends have reported them.
COMMITS_SQL = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
# Backends of this database waiting for the lock PostgreSQL takes to commit a transaction that
# notified (PreCommit_Notify: AccessExclusiveLock on object 0 of pg_database, one for the whole
# server, held until the commit's WAL flush is done), and those active at all.
NOTIFY_WAIT_SQL = """
SELECT count(*) FILTER (WHERE l.pid IS NOT NULL) AS waiting,
       count(*) FILTER (WHERE a.state = 'active') AS active
FROM pg_stat_activity a
LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'object'
     AND l.classid = 'pg_database'::regclass AND l.objid = 0 AND NOT l.granted
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
"""


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


async def wait_listening(server: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            raise RuntimeError(tail(log_path))
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def backends_gone(conn: asyncpg.Connection) -> None:
    """Until no other client backend is connected to this database (they have exited, and
    flushed their statistics), for at most ten seconds."""
    for _ in range(200):
        others = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        if not others:
            return
        await asyncio.sleep(0.05)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def merge_clients(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the load generator processes' reports: counts summed, latency
    percentiles over every client's latencies together, the window the longest of theirs (they
    share one start, so their windows coincide)."""
    latencies = [ms for report in reports for ms in report.pop("latencies_ms")]
    window = max(report["seconds"] for report in reports)
    statuses: dict[str, int] = {}
    for report in reports:
        for status, count in report["statuses"].items():
            statuses[status] = statuses.get(status, 0) + count
    return {
        "connections": sum(report["connections"] for report in reports),
        "clients": len(reports),
        "seconds": window,
        "requests": len(latencies),
        "requests_total": sum(report["requests_total"] for report in reports),
        "statuses": dict(sorted(statuses.items())),
        "sessions_exhausted": any(report["sessions_exhausted"] for report in reports),
        "requests_per_second": round(len(latencies) / window, 1) if window > 0 else None,
        "p50_ms": _round(percentile(latencies, 50)),
        "p95_ms": _round(percentile(latencies, 95)),
        "p99_ms": _round(percentile(latencies, 99)),
        "max_ms": _round(max(latencies) if latencies else None),
        "client_cpu_seconds": round(sum(r["client_cpu_seconds"] for r in reports), 3),
        "client_cpu_share_max": max((r["client_cpu_share"] or 0.0) for r in reports),
    }


async def api(dbs: Databases, profile: Profile, logs: Path, processes: int = 1) -> dict[str, Any]:
    """`POST /sessions/{id}/turns` against `processes` API processes, each a `turnstile serve
    --no-workers` (its own uvicorn) on its own port, as docs/deployment.md runs API replicas;
    the load comes from `profile.api_clients` bench/http_load.py processes, whose connections
    take the ports in turn (a round-robin balancer's spread, without a balancer's cost)."""
    async with dbs.fresh() as url:
        ports: list[int] = []
        while len(ports) < processes:
            if (port := free_port()) not in ports:
                ports.append(port)
        env = service_env(url, port=str(ports[0]), host="127.0.0.1")
        key = await asyncio.to_thread(create_key, env)
        conn = await asyncpg.connect(url)
        sessions = await conn.fetch(
            "INSERT INTO sessions (tenant_id, principal, created_at) "
            "SELECT 'bench', 'bench', now() FROM generate_series(1, $1) RETURNING id",
            int(max(20_000, 4_000 * processes * (profile.api_seconds + 3))),
        )
        servers: list[subprocess.Popen[bytes]] = []
        log_files: list[IO[bytes]] = []
        listings: list[str] = []
        try:
            for i, port in enumerate(ports):
                log_path = logs / f"api-{processes}x-{i}.log"
                log_files.append(log_path.open("wb"))
                # BENCH_SUBMIT_GROUP_COMMIT=false: the API without group-committed submissions,
                # for a before/after in one session (docs/adr/0012).
                group_commit = os.environ.get("BENCH_SUBMIT_GROUP_COMMIT", "true")
                server_env = service_env(
                    url, port=str(port), host="127.0.0.1", submit_group_commit=group_commit
                )
                servers.append(start_server(server_env, log_files[-1]))
            for i, (server, port) in enumerate(zip(servers, ports, strict=True)):
                await wait_listening(server, port, logs / f"api-{processes}x-{i}.log")
            pg_cpu = inflight.BackendCpu()
            await pg_cpu.sample(conn)
            wal_before = await conn.fetchval(WAL_SQL)
            commits_before = await conn.fetchval(COMMITS_SQL)
            # Notifications sent on the queue's channel while the load runs, as a listener
            # receives them (each turn's, or each batch's: docs/adr/0012).
            notified = [0]
            listener = await asyncpg.connect(url)
            await listener.add_listener(
                "turnstile", lambda *_: notified.__setitem__(0, notified[0] + 1)
            )
            cpu_before = [cpu_seconds(server.pid) or 0.0 for server in servers]
            # BENCH_PROFILE_API=FILE.svg samples the API process with py-spy while it serves
            # the load (where the time goes, for docs/performance.md); its CPU figure then
            # includes the sampler's cost, so profile in a run whose figures are not published.
            # One API process only: the profile of the one-process row.
            sampler = None
            if (profile_to := os.environ.get("BENCH_PROFILE_API")) and processes == 1:
                sampler = await asyncio.create_subprocess_exec(
                    str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    *("--format", "raw" if profile_to.endswith(".txt") else "flamegraph"),
                    *("-o", profile_to, "--pid", str(servers[0].pid), "-r", "250"),
                    *("-d", str(int(profile.api_seconds))),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            # Disjoint sessions per load generator process (a session takes one turn).
            clients = max(1, min(profile.api_clients, profile.api_connections))
            for i in range(clients):
                with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listing:
                    listing.write("\n".join(str(row["id"]) for row in sessions[i::clients]))
                listings.append(listing.name)
            # One start for every client, late enough for their interpreters to be up.
            begin_at = time.time() + 1.5
            load = [
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(ROOT / "bench" / "http_load.py"),
                    *("--port", ",".join(map(str, ports)), "--key", key),
                    *("--sessions", listing),
                    "--connections",
                    # The connections split between the clients, the remainder to the first.
                    str(
                        profile.api_connections // clients + (i < profile.api_connections % clients)
                    ),
                    *("--seconds", str(profile.api_seconds), "--begin-at", str(begin_at)),
                    "--latencies",
                    stdout=asyncio.subprocess.PIPE,
                )
                for i, listing in enumerate(listings)
            ]
            outputs = asyncio.gather(*(client.communicate() for client in load))
            # PostgreSQL's backends sampled while the load runs (a backend that closes in
            # between keeps its last sample).
            waits: list[tuple[int, int]] = []
            while not outputs.done():
                await asyncio.wait([outputs], timeout=0.5)
                await pg_cpu.sample(conn)
                waiting, active = await conn.fetchrow(NOTIFY_WAIT_SQL)
                waits.append((int(waiting), int(active)))
            for client in load:
                if client.returncode != 0:
                    raise RuntimeError(f"the load generator exited {client.returncode}")
            result = merge_clients([json.loads(out) for out, _ in outputs.result()])
            cpu = [
                (cpu_seconds(server.pid) or 0.0) - before
                for server, before in zip(servers, cpu_before, strict=True)
            ]
            postgres_cpu = pg_cpu.seconds()
            wal = await conn.fetchval(WAL_SQL) - wal_before
            if sampler is not None:
                await sampler.wait()
            requests = result["requests_total"]

            def per_request(seconds: float | None) -> float | None:
                return (
                    None if seconds is None or not requests else round(seconds * 1000 / requests, 3)
                )

            result = {"processes": processes, **result}
            # CPU time per request, warm-up requests included: of the API processes together,
            # of the PostgreSQL backends of this database (not its background processes, such
            # as the WAL writer), and of the load generator processes together.
            result["server_cpu_ms_per_request"] = per_request(sum(cpu))
            result["server_cpu_seconds_each"] = [round(seconds, 3) for seconds in cpu]
            result["postgres_cpu_ms_per_request"] = per_request(postgres_cpu)
            result["client_cpu_ms_per_request"] = per_request(result["client_cpu_seconds"])
            # The whole server's WAL (pg_current_wal_lsn): on a shared server, other databases'
            # writes are in it too, so it is an upper bound.
            result["wal_bytes_per_request"] = round(wal / requests) if requests else None
            # Sampled every 0.5 s under load: how many of the API's backends were queued on the
            # notifying-commit lock, of how many active (the next bottleneck, when it is that).
            result["notify_lock_waiters_mean"] = (
                round(sum(w for w, _ in waits) / len(waits), 1) if waits else None
            )
            result["active_backends_mean"] = (
                round(sum(a for _, a in waits) / len(waits), 1) if waits else None
            )
            result["server_peak_rss_mb"] = max(
                (peak_rss_mb(server.pid) or 0.0) for server in servers
            )
            result["runs_created"] = await conn.fetchval("SELECT count(*) FROM runs")
            # Commits per request (a group commit carries several): the API processes are
            # stopped first, because a backend's statistics reach pg_stat_database only when it
            # flushes them (at the latest when it exits).
            await listener.close()
            for server in servers:
                stop_server(server)
            await backends_gone(conn)
            commits = await conn.fetchval(COMMITS_SQL) - commits_before
            result["commits_per_request"] = round(commits / requests, 3) if requests else None
            result["notifications_per_request"] = (
                round(notified[0] / requests, 3) if requests else None
            )
            result["load_average"] = [round(x, 2) for x in os.getloadavg()]
        finally:
            for server in servers:
                stop_server(server)
            for log_file in log_files:
                log_file.close()
            for name in listings:
                os.unlink(name)
            await conn.close()
    return result


# --- report -----------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def api_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The API phase's rows, one per count of API processes (a results file written before the
    scale curve holds one row, `api`)."""
    if results.get("api_scale"):
        return list(results["api_scale"])
    return [results["api"]] if results.get("api") else []


def latency_rows(latency: dict[str, Any], pgbench: float) -> list[str]:
    lines = []
    lat = latency["classes"]
    for klass in ("interactive", "async"):
        if klass in lat:
            row = lat[klass]
            target = "p99 <= 20 ms" if klass == "interactive" else "-"
            met = "-"
            if klass == "interactive" and row["p99_ms"] is not None:
                met = "yes" if row["p99_ms"] <= 20 else "no"
            lines.append(
                f"| Enqueue-to-claim, {klass}, behind {latency['backlog_runs']:,} "
                f"async runs (p50 / p95 / p99 ms, n={row['n']}) | {row['p50_ms']} / "
                f"{row['p95_ms']} / {row['p99_ms']} | {pgbench:,.0f} tps | {target} | {met} |"
            )
    enq = latency.get("interactive_enqueue_transaction")
    after = latency.get("interactive_claim_after_enqueue_returned")
    if enq and after:
        lines.append(
            f"| of which the enqueue's own transaction, as its client saw it (p50 / p99 ms); "
            f"claim start after the enqueue returned (p50 / p99 ms) | {enq['p50_ms']} / "
            f"{enq['p99_ms']}; {after['p50_ms']} / {after['p99_ms']} | {pgbench:,.0f} tps | - | - |"
        )
    return lines


def scale_curve(results: dict[str, Any], pgbench: float) -> list[str]:
    """The scale curve: 1, 2 and 4 worker processes (at the largest slot count measured) and 1
    and 2 API processes against one PostgreSQL, each as a share of the run's pgbench and of the
    role's one-process figure, with what an operation cost the role's processes and PostgreSQL's
    backends, and how many of the machine's cores those backends kept busy (rate x their CPU per
    operation): where that nears the cores PostgreSQL can have, PostgreSQL is the limit."""
    throughput = results.get("throughput") or []
    slots = max((row["slots_per_process"] for row in throughput), default=0)
    workers = sorted(
        (row for row in throughput if row["slots_per_process"] == slots),
        key=lambda row: row["processes"],
    )
    apis = sorted(api_rows(results), key=lambda row: row.get("processes", 1))
    if not workers and not apis:
        return []

    def fmt(value: float | None, spec: str = "") -> str:
        return "?" if value is None else format(value, spec)

    def row_line(
        label: str,
        rate: float,
        base: float | None,
        latency: str,
        role_ms: float | None,
        postgres_ms: float | None,
        load: list[float] | None,
    ) -> str:
        cores = None if postgres_ms is None else rate * postgres_ms / 1000
        return (
            f"| {label} | {rate:,.0f} | {rate / pgbench:.1%} | "
            f"{f'{rate / base:.2f}x' if base else '-'} | {latency} | "
            f"{fmt(role_ms)} / {fmt(postgres_ms)} | {fmt(cores, '.2f')} | "
            f"{load[0] if load else '?'} |"
        )

    lines = [
        "",
        "The scale curve: processes of each role against one PostgreSQL, as shares of this "
        f"run's pgbench ({pgbench:,.0f} tps) and of the role's one-process figure. CPU per "
        "operation is user + system time from /proc: the role's processes together, and "
        "PostgreSQL's backends of the phase's database (not its background processes, such as "
        "the WAL writer); PostgreSQL cores busy is the rate times its CPU per operation. The "
        "load average (1 minute) is read at the end of each row.",
        "",
        "| Role x processes, workload | Per second | Share of pgbench | vs 1 process "
        "| p50 / p99 ms | CPU ms per operation: role / PostgreSQL | PostgreSQL cores busy "
        "| Load average |",
        "|---|---:|---:|---:|---|---|---:|---:|",
    ]
    base = next((r["runs_per_second"] for r in workers if r["processes"] == 1), None)
    for row in workers:
        lines.append(
            row_line(
                f"`turnstile worker` x {row['processes']} ({slots} async slots each), no-op runs",
                row["runs_per_second"],
                base,
                "-",
                row.get("worker_cpu_ms_per_run"),
                row.get("postgres_cpu_ms_per_run"),
                row.get("load_average"),
            )
        )
    base = next(
        (
            r["requests_per_second"]
            for r in apis
            if r.get("processes", 1) == 1 and r.get("requests_per_second")
        ),
        None,
    )
    for row in apis:
        lines.append(
            row_line(
                f"`turnstile serve --no-workers` x {row.get('processes', 1)}, "
                "`POST /sessions/{id}/turns`",
                row.get("requests_per_second") or 0.0,
                base,
                f"{_round(row['p50_ms'])} / {_round(row['p99_ms'])}",
                row.get("server_cpu_ms_per_request"),
                row.get("postgres_cpu_ms_per_request"),
                row.get("load_average"),
            )
        )
    counted = [row for row in apis if row.get("commits_per_request") is not None]
    if counted:
        lines += [
            "",
            "Commits and notifications per turn (group-committed submissions, "
            "docs/adr/0012-group-committed-submissions.md): "
            + "; ".join(
                f"with {row['processes']} API process{'es' if row['processes'] > 1 else ''}, "
                f"{row['commits_per_request']} commits and "
                f"{row['notifications_per_request']} notifications"
                for row in counted
            )
            + ".",
        ]
    waited = [row for row in apis if row.get("notify_lock_waiters_mean") is not None]
    if waited:
        lines += [
            "",
            "PostgreSQL's notifying-commit lock under the API's load (one lock for the whole "
            "server, held through each notifying commit's WAL flush; each commit of turns "
            "notifies once): "
            + "; ".join(
                f"with {row['processes']} API process{'es' if row['processes'] > 1 else ''}, "
                f"{row['notify_lock_waiters_mean']} of {row['active_backends_mean']} active "
                "backends waiting for it on average"
                for row in waited
            )
            + ".",
        ]
    loaded = [row for row in apis if row.get("client_cpu_ms_per_request") is not None]
    if loaded:
        lines += [
            "",
            "The API's load generator: "
            + "; ".join(
                f"with {row['processes']} API process{'es' if row['processes'] > 1 else ''}, "
                f"{row['connections']} connections from {row['clients']} bench/http_load.py "
                f"process{'es' if row['clients'] > 1 else ''} (each spreading its connections "
                f"over the API ports in turn), {row['client_cpu_ms_per_request']} ms of their "
                f"CPU per request, the busiest at {row['client_cpu_share_max']:.0%} of a core"
                for row in loaded
            )
            + ". Well under a core each, the clients waited on the servers: they were not the "
            "limit.",
        ]
    return lines


def markdown(results: dict[str, Any]) -> str:
    ceil = results["ceiling"]
    # The ratio's reference is the higher of the two pgbench figures of this run (start and
    # end), so a ceiling depressed by a noisy moment never flatters a ratio.
    pgbench = max(ceil["pgbench_tps"], (results.get("ceiling_end") or {}).get("pgbench_tps", 0))
    cores = results["machine"]["cores"] or 1
    busy = max(results["load_average"]["start"][0], results["load_average"]["end"][0]) > cores
    lines = [
        f"Measured {results['date']} on {results['machine']['cores']} cores "
        f"({results['machine']['cpu'] or results['machine']['platform']}), PostgreSQL "
        f"{ceil['server_version']} (synchronous_commit={ceil['durability']['synchronous_commit']}, "
        f"fsync={ceil['durability']['fsync']}), profile `{results['profile']}`; load average "
        f"{results['load_average']['start']} at the start, {results['load_average']['end']} at "
        "the end."
        + (
            " The load average was above the core count: other processes competed for the CPU"
            " during this run, so every figure is lower than on an idle machine."
            if busy
            else ""
        ),
        "",
        "| Figure | Measured | Ceiling in the same run | Target | Met |",
        "|---|---:|---:|---|---|",
        f"| Commit ceiling, pgbench (1 UPDATE/txn, {ceil['clients']} clients) | "
        f"{ceil['pgbench_tps']:,.0f} tps at the start, "
        f"{(results.get('ceiling_end') or {}).get('pgbench_tps', 0):,.0f} at the end | "
        f"reference: {pgbench:,.0f} tps | - | - |",
        f"| Commit ceiling, asyncpg ({ceil['clients']} connections) | "
        f"{ceil['asyncpg_tps']:,.0f} tps | - | - | - |",
        f"| Same with one pg_notify per txn | {ceil['asyncpg_notify_tps']:,.0f} tps | "
        f"{ceil['asyncpg_tps']:,.0f} tps (asyncpg) | - | - |",
    ]
    throughput = results.get("throughput") or []
    best = max(throughput, key=lambda r: r["runs_per_second"], default=None)
    for row in throughput:
        ratio = row["runs_per_second"] / pgbench
        lines.append(
            f"| No-op runs/s, {row['processes']} worker process"
            f"{'es' if row['processes'] > 1 else ''} x {row['slots_per_process']} async slots "
            f"(worker CPU per run) | {row['runs_per_second']:,.0f} ({ratio:.1%}; "
            f"{row.get('worker_cpu_ms_per_run', '?')} ms) | {pgbench:,.0f} tps | "
            f">= 25 % of pgbench | {'yes' if ratio >= 0.25 else 'no'}"
            f"{' (best)' if row is best else ''} |"
        )
    default = results.get("default_layout")
    if default:
        ratio = default["runs_per_second"] / pgbench
        lines.append(
            f"| No-op runs/s, 1 worker process in the default layout `{default['layout']}` "
            f"(worker CPU per run) | {default['runs_per_second']:,.0f} ({ratio:.1%}; "
            f"{default.get('worker_cpu_ms_per_run', '?')} ms) | {pgbench:,.0f} tps | "
            f">= 25 % of pgbench | {'yes' if ratio >= 0.25 else 'no'} |"
        )
    if results.get("latency"):
        lines += latency_rows(results["latency"], pgbench)
    depths = results.get("depth") or []
    if depths:
        base = depths[0]["claim_one"]["p50_ms"]
        for row in depths:
            one, many = row["claim_one"], row["claim_many_8"]
            ratio = one["p50_ms"] / base if base else float("nan")
            # Results from before fair shares have no "tenants": one tenant held the runs.
            tenants = row.get("tenants", 1)
            held = "1 tenant" if tenants == 1 else f"{tenants:,} tenants"
            lines.append(
                f"| Claim latency at {row['queued']:,} queued ({held}), claim_one p50 / p99 ms "
                f"(claim_many of 8) | {one['p50_ms']} / {one['p99_ms']} ({many['p50_ms']} / "
                f"{many['p99_ms']}) | {pgbench:,.0f} tps | p50 <= 1.5x of 1k, 1 tenant | "
                f"{ratio:.2f}x{' yes' if ratio <= 1.5 else ' no'} |"
            )
    for limit, idle in (results.get("idle_tenants") or {}).items():
        one, many = idle["one tenant"], idle["10,000 tenants"]
        ratio = idle["ratio_p50"]
        lines.append(
            f"| Claim ({limit}) beside 10,000 tenants whose only work is due tomorrow, p50 / p99 "
            f"ms (the same beside 1 such tenant) | {many['p50_ms']} / {many['p99_ms']} "
            f"({one['p50_ms']} / {one['p99_ms']}) | {pgbench:,.0f} tps | p50 <= 1.5x of 1 "
            f"tenant | {ratio:.2f}x{' yes' if ratio <= 1.5 else ' no'} |"
        )
    for api_row in api_rows(results):
        processes = api_row.get("processes", 1)
        rps = api_row.get("requests_per_second") or 0.0
        met = rps >= 1000 and (api_row["p99_ms"] or 1e9) <= 50
        clients = api_row.get("clients", 1)
        postgres = api_row.get("postgres_cpu_ms_per_request")
        lines.append(
            f"| POST /sessions/{{id}}/turns, {api_row['connections']} connections from "
            f"{clients} client process{'es' if clients > 1 else ''}, {processes} uvicorn "
            f"process{'es' if processes > 1 else ''} (req/s; p50 / p99 ms; CPU per request: "
            f"{'the API processes' if processes > 1 else 'the server'}"
            f"{' / PostgreSQL' if postgres is not None else ''}) | "
            f"{rps:,.0f} ({rps / pgbench:.1%}); {_round(api_row['p50_ms'])} / "
            f"{_round(api_row['p99_ms'])}; {api_row.get('server_cpu_ms_per_request', '?')}"
            f"{f' / {postgres}' if postgres is not None else ''} ms | "
            f"{pgbench:,.0f} tps | "
            f">= 1,000 req/s at p99 <= 50 ms | {'yes' if met else 'no'} |"
        )
    if throughput or results.get("latency"):
        rss = results.get("worker_peak_rss_mb")
        lines.append(
            f"| Peak RSS of a worker process | {rss} MB | - | <= 150 MB | "
            f"{'yes' if rss is not None and rss <= 150 else 'no'} |"
        )
    lines += scale_curve(results, pgbench)
    if results.get("inflight"):
        delay = results["inflight"][0]["model_delay_seconds"]
        lines += [
            "",
            f"Runs of the `openai` agent in flight in one `turnstile worker` process (a loopback "
            f"endpoint answers each model call after {delay:g} s; targets from the issue, at "
            "2,000 in flight: every call in flight at once, >= 500 runs/s, <= 30 connections, "
            "peak RSS <= 300 MB, no lease lost, every run succeeded):",
            "",
            inflight.markdown(results["inflight"]).rstrip("\n"),
        ]
    if results.get("budgets"):
        first = results["budgets"][0]
        lines += [
            "",
            f"Model budgets (bench/model_budgets.py): a burst of {first['runs']:,} `openai` runs "
            "(half interactive, half async, two tenants) against an endpoint enforcing "
            f"{first['endpoint_rpm']:,} requests and {first['endpoint_tpm']:,} tokens a minute, "
            "with budgets set to its limits and without (TURNSTILE_MODEL_BUDGETS=false):",
            "",
            model_budgets.markdown(results["budgets"]).rstrip("\n"),
        ]
    if results.get("streaming"):
        lines += [
            "",
            "Live output (docs/adr/0007): no-op runs and interactive arrivals on one worker "
            f"while another runs {streaming.STREAMS} runs writing text live, against the same "
            "runs sleeping instead:",
            "",
            streaming.markdown(results["streaming"]).rstrip("\n"),
        ]
    if results.get("peers"):
        lines += [
            "",
            "The peers in the same run, each on a fresh database of the same server, "
            f"{peers.IN_FLIGHT} jobs in flight per worker process (how each is configured: "
            "docs/performance.md):",
            "",
            peers.markdown(results["peers"], pgbench).rstrip("\n"),
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no PNG")
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    samples = results["latency"]["samples_ms"]
    for klass, colour in (("interactive", "tab:blue"), ("async", "tab:orange")):
        values = sorted(samples.get(klass, []))
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            left.plot(values, fractions, label=f"{klass} (n={len(values)})", color=colour)
    left.set_xscale("log")
    left.set_xlabel("enqueue-to-claim latency (ms, log scale)")
    left.set_ylabel("fraction of runs claimed within")
    left.set_title(
        f"Behind {results['latency']['backlog_runs']:,} queued async runs (every async slot busy)"
    )
    left.axvline(20, color="grey", linestyle=":", label="interactive p99 target (20 ms)")
    left.legend(loc="center", bbox_to_anchor=(0.6, 0.5), fontsize="small")
    left.grid(True, which="both", alpha=0.3)
    pgbench = max(
        results["ceiling"]["pgbench_tps"],
        (results.get("ceiling_end") or {}).get("pgbench_tps", 0),
    )
    for processes, marker in ((1, "o"), (2, "s"), (4, "^")):
        rows = [r for r in results["throughput"] if r["processes"] == processes]
        if rows:
            right.plot(
                [r["slots_per_process"] for r in rows],
                [r["runs_per_second"] for r in rows],
                marker=marker,
                label=f"{processes} worker process{'es' if processes > 1 else ''}",
            )
    right.axhline(pgbench * 0.25, color="tab:red", linestyle="--", label="25 % of pgbench")
    right.set_xscale("log", base=2)
    right.set_xlabel("async slots per worker process")
    right.set_ylabel("no-op runs/s")
    right.set_title(f"Throughput (pgbench ceiling {pgbench:,.0f} tps)")
    right.legend()
    right.grid(True, alpha=0.3)
    fig.suptitle(f"Turnstile benchmark, {results['date']}, {results['machine']['cores']} cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("BENCH_QUICK", "") not in ("", "0"),
        help="the quick mode (also BENCH_QUICK=1)",
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="comma-separated, of: " + ", ".join(PHASES),
    )
    parser.add_argument(
        "--report-only",
        type=Path,
        default=None,
        help="measure nothing: write the Markdown (and PNG) again from this results JSON",
    )
    args = parser.parse_args()
    if args.report_only is not None:
        results = json.loads(args.report_only.read_text())
        table = markdown(results)
        args.report_only.with_suffix(".md").write_text(table)
        print(table)
        if args.png is not None:
            plot(results, args.png)
        return
    profile = PROFILES[args.profile or ("quick" if args.quick else "full")]
    phases = set(args.phases.split(","))
    if unknown := phases - set(PHASES):
        parser.error(f"unknown phase(s): {', '.join(sorted(unknown))}")
    settings = Settings()
    dbs = Databases(await server_url())
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "profile": profile.name,
        "settings": asdict(profile),
        "machine": machine(),
        "load_average": {"start": [round(x, 2) for x in os.getloadavg()]},
        "throughput": [],
        "depth": [],
        "api_scale": [],
    }
    await dbs.create_template()
    try:
        if "ceiling" in phases:
            async with dbs.fresh() as url:
                log("commit ceiling")
                results["ceiling"] = await ceiling.measure(url, 8, profile.ceiling_seconds)
                log(f"ceiling: {results['ceiling']}")
        if "throughput" in phases:
            for processes in profile.throughput_processes:
                for slots in profile.throughput_slots:
                    log(f"throughput: {processes} process(es) x {slots} async slots")
                    row = await retrying(
                        "throughput",
                        lambda p=processes, n=slots: throughput(dbs, settings, profile, p, n, logs),
                    )
                    log(f"  {row['runs_per_second']} runs/s")
                    results["throughput"].append(row)
            # What a user runs first: one process with the default layout, as `turnstile serve`
            # starts it (issue 41 item 5 asks it to drain at least 25 % of pgbench).
            default = Settings.model_fields["slots"].default
            default_async = sum(
                g.size for g in parse_slots(default) if PriorityClass.ASYNC in g.classes
            )
            log(f"throughput: the default layout {default}")
            results["default_layout"] = await retrying(
                "throughput",
                lambda: throughput(dbs, settings, profile, 1, default_async, logs, default),
            )
            log(f"  {results['default_layout']['runs_per_second']} runs/s")
        if "latency" in phases:
            log("latency under backlog")
            results["latency"] = await retrying(
                "latency", lambda: latency(dbs, settings, profile, logs)
            )
            log(f"  {results['latency']['classes']}")
        if "depth" in phases:
            results["depth"] = await retrying("depth", lambda: depth(dbs, settings, profile))
        if "idle_tenants" in phases:
            log("claims beside 10,000 tenants with work due tomorrow")
            results["idle_tenants"] = await retrying(
                "idle_tenants",
                lambda: claim_idle_tenants.measure(
                    profile.claims_per_depth, lambda _name: dbs.fresh()
                ),
            )
            log(f"  {results['idle_tenants']}")
        if "api" in phases:
            for processes in profile.api_processes:
                log(f"POST /sessions/{{id}}/turns, {processes} API process(es)")
                row = await retrying(
                    "api", lambda n=processes: api(dbs, profile, logs, processes=n)
                )
                log(f"  {row}")
                results["api_scale"].append(row)
            # The one-process row under its earlier name, for readers of earlier results.
            results["api"] = next(
                (row for row in results["api_scale"] if row["processes"] == 1),
                results["api_scale"][0],
            )
        if "inflight" in phases:
            results["inflight"] = await retrying(
                "inflight",
                lambda: inflight.measure(dbs, settings, profile.inflight_sizes, 1.0, logs),
            )
        if "budgets" in phases:
            runs, tpm, rpm = profile.budget_runs
            results["budgets"] = await model_budgets.measure(
                dbs,
                model_budgets.resolve(
                    model_budgets.parser().parse_args(
                        ["--runs", str(runs), "--tpm", str(tpm), "--rpm", str(rpm)]
                    )
                ),
                logs,
            )
        if "streaming" in phases:
            results["streaming"] = await retrying(
                "streaming",
                lambda: streaming.measure(
                    dbs,
                    settings,
                    noop_runs=min(profile.throughput_runs, 5_000),
                    latency_seconds=profile.latency_seconds,
                    rate=profile.interactive_rate,
                    logs=logs,
                ),
            )
        if "peers" in phases:
            results["peers"] = await retrying(
                "peers",
                lambda: peers.measure(
                    dbs,
                    settings,
                    jobs=profile.peer_jobs,
                    processes=profile.peer_processes,
                    singles=profile.peer_singles,
                    backlog_jobs=profile.peer_backlog,
                    probes=profile.peer_probes,
                    logs=logs,
                ),
            )
        if "ceiling" in phases:
            async with dbs.fresh() as url:
                await ceiling.prepare(url)
                tps = await asyncio.to_thread(ceiling.run_pgbench, url, 8, profile.ceiling_seconds)
                results["ceiling_end"] = {"pgbench_tps": round(tps, 1)}
    finally:
        await dbs.drop_template()
    results["load_average"]["end"] = [round(x, 2) for x in os.getloadavg()]
    rss = [r for row in results["throughput"] for r in row["worker_peak_rss_mb"] if r]
    if "latency" in results and results["latency"]["worker_peak_rss_mb"]:
        rss.append(results["latency"]["worker_peak_rss_mb"])
    results["worker_peak_rss_mb"] = max(rss) if rss else None
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "latest" if profile is FULL else profile.name
    complete = phases >= {"ceiling", "throughput", "latency", "depth", "api"}
    if not complete:
        # Some phases only (`--phases ceiling,api`): files of their own, so a partial run never
        # replaces the results of a whole one.
        stem += "-" + "-".join(phase for phase in PHASES if phase in phases)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2, default=str))
    if "ceiling" in phases:
        # Every figure is given beside the ceiling, so the table needs it; it shows the
        # phases that ran.
        table = markdown(results)
        (args.out / f"{stem}.md").write_text(table)
        print(table)
        png = args.png or (ROOT / "docs" / "bench-latest.png" if profile is FULL else None)
        if png is not None and complete:
            plot(results, png)
    else:
        summary_only = {k: v for k, v in results.items() if k != "latency"}
        print(json.dumps(summary_only, indent=2, default=str))


if __name__ == "__main__":
    asyncio.run(main())
