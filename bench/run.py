"""Turnstile's benchmark, `make bench`: every figure beside the PostgreSQL commit ceiling measured
in the same run. A script, not a test: it reports, it asserts nothing.

Usage: .venv/bin/python bench/run.py [--quick] [--out bench/results] [--png docs/bench-latest.png]
       (`BENCH_QUICK=1` is the same as `--quick`)

The server is DATABASE_URL, else TURNSTILE_DATABASE_URL, else TEST_DATABASE_URL, else the
embedded PostgreSQL. Every phase runs on a fresh database cloned from a freshly migrated
template, dropped afterwards (also when a phase fails). This process is the load generator:
it enqueues, it times claims and it reads the results; the service runs in `turnstile worker`
and `turnstile serve --no-workers` processes it starts, and the HTTP client is a process of its
own (bench/http_load.py).

1. Ceiling: pgbench (one single-row UPDATE per transaction, 8 clients) and asyncpg (8
   connections committing single-row UPDATEs), at the server's own durability settings, which
   are Turnstile's; (7) the asyncpg figure again with one pg_notify per transaction.
2. Throughput: no-op scripted runs, bulk-enqueued sessionless, drained by 1, 2 and 4 worker
   processes at several async slot counts (the quick profile: 1 and 2). Runs/s over the drain
   window by the database clock (first claim to last completion), and the ratio to the pgbench
   ceiling.
3. Latency under backlog: 10,000 async runs (each a 50 ms sleep tool call: claim, journal,
   checkpoint, complete) keep every async slot of one worker busy, while interactive no-op
   runs arrive at a steady rate. Enqueue-to-claim by the database clock, per class.
4. Claim latency with 1k, 100k and 1M queued runs (claim_one and claim_many of 8), timed from
   this process around the whole claim transaction.
5. POST /sessions/{id}/turns from bench/http_load.py against one `turnstile serve --no-workers`.
6. Peak RSS (VmHWM) of every worker process.
7. In flight (bench/inflight.py): one worker with 100, 500, 2,000 and 5,000 async slots serving
   as many `openai` runs against a loopback endpoint answering after 1 s (bench/fake_model.py).
8. Peers (bench/peers.py): Turnstile, PGQueuer and Procrastinate on the same workloads (drain,
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
import inflight
import peers
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
    retrying,
    server_url,
    service_env,
    summary,
    wait_count,
    wait_workers,
)

from app.config import Settings
from app.db.embedded import free_port
from app.db.engine import create_engine
from app.queue.classes import PriorityClass
from app.queue.core import Queue
from app.queue.models import NewRun

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
    inflight_sizes: tuple[int, ...]
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
    inflight_sizes=(100, 500, 2_000, 5_000),
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
    throughput_processes=(1, 2),
    backlog_runs=10_000,
    backlog_sleep_seconds=0.05,
    latency_seconds=6,
    interactive_rate=40,
    depths=(1_000, 100_000),
    depth_tenants=(1, 1_000),
    claims_per_depth=100,
    api_seconds=4,
    api_connections=32,
    inflight_sizes=(100, 500),
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
    inflight_sizes=(20,),
    peer_jobs=100,
    peer_processes=(1,),
    peer_singles=20,
    peer_backlog=40,
    peer_probes=4,
)
PROFILES = {p.name: p for p in (FULL, QUICK, TINY)}


# --- 2. throughput ----------------------------------------------------------------------------
async def throughput(
    dbs: Databases, settings: Settings, profile: Profile, processes: int, slots: int, logs: Path
) -> dict[str, Any]:
    layout = f"interactive:1,async:{slots},maintenance:1"
    async with dbs.fresh() as url:
        conn = await asyncpg.connect(url)
        engine = create_engine(settings, url)
        workers: list[Worker] = []
        try:
            workers = [
                Worker(url, layout, logs / f"throughput-{processes}x{slots}-{i}.log")
                for i in range(processes)
            ]
            await wait_workers(conn, processes, workers)
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
                if done >= profile.throughput_runs:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the backlog was not drained within 600 s")
                await asyncio.sleep(0.05)
            wall = time.monotonic() - began
            rss = [w.peak_rss_mb() for w in workers]
            cpu = sum(w.cpu_seconds() for w in workers) - cpu_before
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
-- The tenants' counts, as the queue's own statements keep them (docs/adr/0006).
INSERT INTO tenant_class_counts AS c (tenant_id, band, running, queued)
SELECT tenant_id, priority / 10, 0, count(*) FROM run GROUP BY tenant_id, priority / 10
ON CONFLICT (tenant_id, band) DO UPDATE SET queued = c.queued + excluded.queued
"""


class _Depth:
    """One database holding a queue of `target` claimable async runs of `tenants` tenants."""

    def __init__(self, url: str, settings: Settings, target: int, tenants: int) -> None:
        self.url = url
        self.target = target
        self.tenants = tenants
        self.engine = create_engine(settings, url)
        self.queue = Queue(self.engine)
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


async def api(dbs: Databases, profile: Profile, logs: Path) -> dict[str, Any]:
    async with dbs.fresh() as url:
        port = free_port()
        env = service_env(url, port=str(port), host="127.0.0.1")
        key = await asyncio.to_thread(create_key, env)
        conn = await asyncpg.connect(url)
        sessions = await conn.fetch(
            "INSERT INTO sessions (tenant_id, principal, created_at) "
            "SELECT 'bench', 'bench', now() FROM generate_series(1, $1) RETURNING id",
            int(max(20_000, 4_000 * (profile.api_seconds + 3))),
        )
        log_file = (logs / "api.log").open("wb")
        server = start_server(env, log_file)
        try:
            deadline = time.monotonic() + 60
            while True:
                if server.poll() is not None:
                    raise RuntimeError((logs / "api.log").read_text(errors="replace")[-2000:])
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
            cpu_before = cpu_seconds(server.pid) or 0.0
            # BENCH_PROFILE_API=FILE.svg samples the API process with py-spy while it serves
            # the load (where the time goes, for docs/performance.md); its CPU figure then
            # includes the sampler's cost, so profile in a run whose figures are not published.
            sampler = None
            if profile_to := os.environ.get("BENCH_PROFILE_API"):
                sampler = await asyncio.create_subprocess_exec(
                    str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    *("--format", "raw" if profile_to.endswith(".txt") else "flamegraph"),
                    *("-o", profile_to, "--pid", str(server.pid), "-r", "250"),
                    *("-d", str(int(profile.api_seconds))),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listing:
                listing.write("\n".join(str(row["id"]) for row in sessions))
            try:
                client = await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(ROOT / "bench" / "http_load.py"),
                    "--port",
                    str(port),
                    "--key",
                    key,
                    "--sessions",
                    listing.name,
                    "--connections",
                    str(profile.api_connections),
                    "--seconds",
                    str(profile.api_seconds),
                    stdout=asyncio.subprocess.PIPE,
                )
                out, _ = await client.communicate()
            finally:
                os.unlink(listing.name)
            result: dict[str, Any] = json.loads(out)
            cpu = (cpu_seconds(server.pid) or 0.0) - cpu_before
            if sampler is not None:
                await sampler.wait()
            # The server's CPU time per request, warm-up requests included.
            result["server_cpu_ms_per_request"] = round(cpu * 1000 / result["requests_total"], 3)
            result["server_peak_rss_mb"] = peak_rss_mb(server.pid)
            result["runs_created"] = await conn.fetchval("SELECT count(*) FROM runs")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            log_file.close()
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
    best = max(results["throughput"], key=lambda r: r["runs_per_second"])
    for row in results["throughput"]:
        ratio = row["runs_per_second"] / pgbench
        lines.append(
            f"| No-op runs/s, {row['processes']} worker process"
            f"{'es' if row['processes'] > 1 else ''} x {row['slots_per_process']} async slots "
            f"(worker CPU per run) | {row['runs_per_second']:,.0f} ({ratio:.1%}; "
            f"{row.get('worker_cpu_ms_per_run', '?')} ms) | {pgbench:,.0f} tps | "
            f">= 25 % of pgbench | {'yes' if ratio >= 0.25 else 'no'}"
            f"{' (best)' if row is best else ''} |"
        )
    lat = results["latency"]["classes"]
    for klass in ("interactive", "async"):
        if klass in lat:
            row = lat[klass]
            target = "p99 <= 20 ms" if klass == "interactive" else "-"
            met = "-"
            if klass == "interactive" and row["p99_ms"] is not None:
                met = "yes" if row["p99_ms"] <= 20 else "no"
            lines.append(
                f"| Enqueue-to-claim, {klass}, behind {results['latency']['backlog_runs']:,} "
                f"async runs (p50 / p95 / p99 ms, n={row['n']}) | {row['p50_ms']} / "
                f"{row['p95_ms']} / {row['p99_ms']} | {pgbench:,.0f} tps | {target} | {met} |"
            )
    enq = results["latency"].get("interactive_enqueue_transaction")
    after = results["latency"].get("interactive_claim_after_enqueue_returned")
    if enq and after:
        lines.append(
            f"| of which the enqueue's own transaction, as its client saw it (p50 / p99 ms); "
            f"claim start after the enqueue returned (p50 / p99 ms) | {enq['p50_ms']} / "
            f"{enq['p99_ms']}; {after['p50_ms']} / {after['p99_ms']} | {pgbench:,.0f} tps | - | - |"
        )
    depths = results["depth"]
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
    api_row = results["api"]
    met = (
        api_row["requests_per_second"] >= 1000 and (api_row["p99_ms"] or 1e9) <= 50
        if api_row.get("requests_per_second")
        else False
    )
    lines.append(
        f"| POST /sessions/{{id}}/turns, {api_row['connections']} connections, one uvicorn "
        f"process (req/s; p50 / p99 ms; server CPU per request) | "
        f"{api_row['requests_per_second']:,.0f}; {_round(api_row['p50_ms'])} / "
        f"{_round(api_row['p99_ms'])}; {api_row.get('server_cpu_ms_per_request', '?')} ms | "
        f"{pgbench:,.0f} tps | "
        f">= 1,000 req/s at p99 <= 50 ms | {'yes' if met else 'no'} |"
    )
    rss = results["worker_peak_rss_mb"]
    lines.append(
        f"| Peak RSS of a worker process | {rss} MB | - | <= 150 MB | "
        f"{'yes' if rss is not None and rss <= 150 else 'no'} |"
    )
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
        default="ceiling,throughput,latency,depth,api,inflight,peers",
        help="comma-separated",
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
        if "latency" in phases:
            log("latency under backlog")
            results["latency"] = await retrying(
                "latency", lambda: latency(dbs, settings, profile, logs)
            )
            log(f"  {results['latency']['classes']}")
        if "depth" in phases:
            results["depth"] = await retrying("depth", lambda: depth(dbs, settings, profile))
        if "api" in phases:
            log("POST /sessions/{id}/turns")
            results["api"] = await retrying("api", lambda: api(dbs, profile, logs))
            log(f"  {results['api']}")
        if "inflight" in phases:
            results["inflight"] = await retrying(
                "inflight",
                lambda: inflight.measure(dbs, settings, profile.inflight_sizes, 1.0, logs),
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
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2, default=str))
    if phases >= {"ceiling", "throughput", "latency", "depth", "api"}:
        table = markdown(results)
        (args.out / f"{stem}.md").write_text(table)
        print(table)
        png = args.png or (ROOT / "docs" / "bench-latest.png" if profile is FULL else None)
        if png is not None:
            plot(results, png)
    else:
        summary_only = {k: v for k, v in results.items() if k != "latency"}
        print(json.dumps(summary_only, indent=2, default=str))


if __name__ == "__main__":
    asyncio.run(main())
