"""The in-flight phase of `make bench`: one `turnstile worker` process with N async slots serves
3 x N runs of the `openai` agent (lease 6 s, heartbeat 2 s: the conditions of issue 41) against
bench/fake_model.py, a loopback chat-completions endpoint
(its own process) that answers every call after a fixed delay. What it shows is whether one
process holds thousands of model calls open at once, and what that costs the worker, the
endpoint and PostgreSQL.

Per size: runs/s over the window from the first claim to the last completion (database clock);
the most model calls open at once (the endpoint's own count); the most connections the worker
held (pg_stat_activity by application_name); its peak RSS; the heartbeat statement's time (a
`heartbeat_many` of N leases timed from this process: pg_stat_statements is not loaded on every
server); CPU seconds per run of the worker, of the endpoint and of PostgreSQL's backends of the
phase's database (user + system time from /proc, before and after); whether any run.requeued
or run.fenced event appeared; whether every run succeeded. And what the issue asked of it: the
connections the endpoint accepted (a client that reuses its connections opens about one per
slot), the most runs seen running past their lease at once, and the heartbeat's lag: the
longest a held lease went unrenewed (now minus its last renewal, sampled from `runs` every
0.2 s) less the heartbeat interval; and, from the worker's own metrics (`--metrics-port`,
scraped at each sample), whether it held back (`turnstile_worker_holding_back` seen at 1, the
claim rounds it skipped) and the most its heartbeat thread measured of its own lag.

Standalone (long runs, not in `make test`): `python bench/inflight.py 500 2000 5000`; settings
of the worker for an experiment as JSON in BENCH_WORKER_SETTINGS (e.g.
`{"backpressure_max_cpu": "1"}`).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
from common import ROOT, Databases, Worker, cpu_seconds, endpoint_stats, log, wait_workers

from app.config import Settings
from app.queue.core import Queue
from app.store.embedded import free_port
from app.store.engine import create_engine
from app.vocabulary.classes import PriorityClass

ASYNC = PriorityClass.ASYNC
NOOP = {"script": [{"final": "ok"}]}

# The targets at 2,000 runs in flight in one process.
TARGET_SIZE = 2000
TARGET_RUNS_PER_SECOND = 500
TARGET_CONNECTIONS = 30
TARGET_RSS_MB = 300
TARGET_RUNS_PER_SECOND_41 = 1000  # issue 41 item 3

RUNS_PER_SLOT = 3
LEASE_SECONDS = 6
HEARTBEAT_SECONDS = 2


class BackendCpu:
    """CPU time (user + system) of PostgreSQL's backends serving one database, from /proc: each
    backend's time when first seen (zero for one that connected after the baseline) to its last
    sample. Backends of other databases on a shared server are not counted; neither are the
    server's own background processes (WAL writer, checkpointer). None when the server's
    processes are not visible here (another host or container)."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.visible = True
        self.baselined = False

    async def sample(self, conn: asyncpg.Connection) -> None:
        pids = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        for row in pids:
            pid = int(row["pid"])
            seconds = cpu_seconds(pid)
            if seconds is None:
                self.visible = False
                continue
            if pid not in self.first:
                self.first[pid] = seconds if not self.baselined else 0.0
            self.last[pid] = seconds
        self.baselined = True

    def seconds(self) -> float | None:
        if not self.visible:
            return None
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


class FakeModel:
    def __init__(self, delay: float, logs: Path) -> None:
        self.port = free_port()
        self.log_file = logs.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "fake_model.py"), str(self.port), str(delay)],
            stdout=subprocess.PIPE,
            stderr=self.log_file,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the fake model endpoint did not start (see {logs})")

    async def stats(self) -> dict[str, int]:
        return await endpoint_stats(self.port)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid) or 0.0

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log_file.close()


WORKER_METRICS = (
    "turnstile_worker_holding_back",
    "turnstile_worker_held_back_rounds_total",
    "turnstile_worker_heartbeat_lag_seconds",
    "turnstile_worker_loop_lag_seconds",
)


async def worker_metrics(port: int) -> dict[str, float]:
    """The worker's own load figures from its metrics port (empty while it is unreachable)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, TimeoutError):
        return {}
    try:
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
        await writer.drain()
        body = (await asyncio.wait_for(reader.read(), 5)).decode(errors="replace")
    except (OSError, TimeoutError):
        return {}
    finally:
        writer.close()
    found = {}
    for line in body.splitlines():
        name, _, value = line.partition(" ")
        if name in WORKER_METRICS:
            found[name] = float(value)
    return found


async def heartbeat_ms(queue: Queue, count: int) -> dict[str, Any]:
    """Claim `count` runs from this process and time `heartbeat_many` of all their leases:
    the one statement a worker with that many runs in flight sends every heartbeat."""
    await queue.enqueue_many(
        tenant_id="bench", principal="bench", runs=[("scripted", NOOP, ASYNC.base, None)] * count
    )
    claimed = await queue.claim("bench-heartbeat", [ASYNC], limit=count)
    leases = [c.lease for c in claimed]
    times = []
    for _ in range(7):
        started = time.perf_counter()
        held = await queue.heartbeat_many(leases)
        times.append((time.perf_counter() - started) * 1000)
        if len(held) != len(leases):
            raise RuntimeError(f"heartbeat renewed {len(held)} of {len(leases)} leases")
    return {"leases": len(leases), "median_ms": round(statistics.median(times[1:]), 2)}


async def one_size(
    dbs: Databases,
    settings: Settings,
    slots: int,
    delay: float,
    logs: Path,
    runs_per_slot: int = RUNS_PER_SLOT,
) -> dict[str, Any]:
    total = slots * runs_per_slot
    layout = f"interactive:1,async:{slots},maintenance:1"
    async with dbs.fresh() as url:
        conn = await asyncpg.connect(url)
        model = FakeModel(delay, logs / f"inflight-{slots}-model.log")
        worker: Worker | None = None
        engine = create_engine(settings, url)
        metrics_port = free_port()
        try:
            worker = Worker(
                url,
                layout,
                logs / f"inflight-{slots}.log",
                args=("--metrics-port", str(metrics_port)),
                openai_base_url=f"http://127.0.0.1:{model.port}/v1",
                lease_seconds=str(LEASE_SECONDS),
                heartbeat_seconds=str(HEARTBEAT_SECONDS),
                **json.loads(os.environ.get("BENCH_WORKER_SETTINGS") or "{}"),
            )
            await wait_workers(conn, 1, [worker])
            pg_cpu = BackendCpu()
            await pg_cpu.sample(conn)
            worker_cpu, model_cpu = worker.cpu_seconds(), model.cpu_seconds()
            queue = Queue(engine)
            for start in range(0, total, 2000):
                await queue.enqueue_many(
                    tenant_id="bench",
                    principal="bench",
                    runs=[
                        ("openai", {"text": f"hello {i}"}, ASYNC.base, None)
                        for i in range(start, min(total, start + 2000))
                    ],
                )
            connections = 0
            past_lease = 0
            lease_age = 0.0
            seen: dict[str, float] = {}
            deadline = time.monotonic() + 120 + total / 20
            while True:
                await pg_cpu.sample(conn)
                finished, held, lapsed, age = await conn.fetchrow(
                    "SELECT (SELECT count(*) FROM runs WHERE status IN "
                    "('succeeded', 'failed', 'cancelled')), "
                    "(SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name LIKE 'turnstile worker%'), "
                    "(SELECT count(*) FROM runs WHERE status = 'running' "
                    " AND lease_expires_at < now()), "
                    "(SELECT $1 - extract(epoch FROM min(lease_expires_at) - now()) "
                    " FROM runs WHERE status = 'running')",
                    float(LEASE_SECONDS),
                )
                connections = max(connections, held)
                past_lease = max(past_lease, lapsed)
                lease_age = max(lease_age, float(age or 0))
                for name, value in (await worker_metrics(metrics_port)).items():
                    seen[name] = max(seen.get(name, 0.0), value)
                if finished >= total:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{total} openai runs not finished in time")
                await asyncio.sleep(0.2)
            stats = await model.stats()
            worker_cpu = worker.cpu_seconds() - worker_cpu
            model_cpu = model.cpu_seconds() - model_cpu
            rss = worker.peak_rss_mb()
            postgres_cpu = pg_cpu.seconds()
            worker.stop()
            worker = None
            row = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE status = 'succeeded') AS succeeded, "
                "count(*) AS runs, "
                "extract(epoch FROM max(finished_at) - min(started_at)) AS window "
                "FROM runs"
            )
            events = dict(
                await conn.fetch(
                    "SELECT type, count(*) FROM run_events "
                    "WHERE type IN ('run.requeued', 'run.fenced') GROUP BY type"
                )
            )
            heartbeat = await heartbeat_ms(queue, slots)
        finally:
            if worker is not None:
                worker.stop()
            model.stop()
            await engine.dispose()
            await conn.close()
    runs = int(row["runs"])
    window = float(row["window"])

    def per_run(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000 / runs, 3)

    return {
        "slots": slots,
        "layout": layout,
        "model_delay_seconds": delay,
        "runs": runs,
        "succeeded": int(row["succeeded"]),
        "window_seconds": round(window, 3),
        "runs_per_second": round(runs / window, 1),
        "lease_seconds": LEASE_SECONDS,
        "heartbeat_seconds": HEARTBEAT_SECONDS,
        "model_connections_opened": stats.get("connections"),
        "runs_past_their_lease_peak": past_lease,
        "longest_unrenewed_lease_seconds": round(lease_age, 2),
        "heartbeat_lag_seconds": round(max(lease_age - HEARTBEAT_SECONDS, 0.0), 2),
        "held_back": seen.get("turnstile_worker_holding_back", 0.0) >= 1,
        "held_back_rounds": int(seen.get("turnstile_worker_held_back_rounds_total", 0)),
        "heartbeat_lag_seen_by_worker_seconds": round(
            seen.get("turnstile_worker_heartbeat_lag_seconds", 0.0), 3
        ),
        "loop_lag_max_seconds": round(seen.get("turnstile_worker_loop_lag_seconds", 0.0), 3),
        "worker_cpu_ms_per_model_call": (
            round(worker_cpu * 1000 / stats["served"], 3) if stats.get("served") else None
        ),
        "model_calls_in_flight_peak": stats["peak"],
        "model_calls_served": stats["served"],
        "worker_connections_peak": connections,
        "worker_peak_rss_mb": rss,
        "heartbeat_many": heartbeat,
        "cpu_ms_per_run": {
            "worker": per_run(worker_cpu),
            "model_endpoint": per_run(model_cpu),
            "postgres_backends": per_run(postgres_cpu),
        },
        "requeued_events": int(events.get("run.requeued", 0)),
        "fenced_events": int(events.get("run.fenced", 0)),
    }


async def measure(
    dbs: Databases, settings: Settings, sizes: tuple[int, ...], delay: float, logs: Path
) -> list[dict[str, Any]]:
    rows = []
    for slots in sizes:
        log(f"in flight: one worker x {slots} async slots, openai runs, model answers in {delay} s")
        row = await one_size(dbs, settings, slots, delay, logs)
        log(f"  {row}")
        rows.append(row)
    return rows


def targets(row: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets, checked on a row. Every size must have each call in flight at once,
    lose no lease and succeed every run; the rate, connection and memory targets are the
    2,000-run figures."""
    met = {
        "all_in_flight": row["model_calls_in_flight_peak"] >= row["slots"],
        "no_lease_lost": row["requeued_events"] == 0 and row["fenced_events"] == 0,
        "all_succeeded": row["succeeded"] == row["runs"],
    }
    if row["slots"] == TARGET_SIZE:
        met["runs_per_second"] = row["runs_per_second"] >= TARGET_RUNS_PER_SECOND_41
        met["connections"] = row["worker_connections_peak"] <= TARGET_CONNECTIONS
        met["rss"] = (row["worker_peak_rss_mb"] or 1e9) <= TARGET_RSS_MB
    return met


def markdown(rows: list[dict[str, Any]]) -> str:
    def yn(flag: bool | None) -> str:
        return "-" if flag is None else ("met" if flag else "**missed**")

    lines = [
        "| Async slots = runs | Runs/s | Model calls in flight (peak) | DB connections (peak) "
        "| Peak RSS | heartbeat_many of N leases | CPU ms per run: worker / endpoint / "
        "PostgreSQL | Connections opened | Heartbeat lag | Past their lease (peak) "
        "| Held back (rounds) "
        "| Leases lost | All succeeded |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        met = targets(row)
        cpu = row["cpu_ms_per_run"]
        target = row["slots"] == TARGET_SIZE
        lines.append(
            f"| {row['slots']:,} | {row['runs_per_second']:,.0f}"
            + (f" ({yn(met['runs_per_second'])} >= {TARGET_RUNS_PER_SECOND_41})" if target else "")
            + f" | {row['model_calls_in_flight_peak']:,} ({yn(met['all_in_flight'])}) "
            f"| {row['worker_connections_peak']}"
            + (f" ({yn(met['connections'])} <= {TARGET_CONNECTIONS})" if target else "")
            + f" | {row['worker_peak_rss_mb']} MB"
            + (f" ({yn(met['rss'])} <= {TARGET_RSS_MB} MB)" if target else "")
            + f" | {row['heartbeat_many']['median_ms']} ms "
            f"| {cpu['worker']} / {cpu['model_endpoint']} / {cpu['postgres_backends']} "
            f"| {row.get('model_connections_opened')} | {row.get('heartbeat_lag_seconds')} s "
            f"| {row.get('runs_past_their_lease_peak')} "
            f"| {'yes' if row.get('held_back') else 'no'} ({row.get('held_back_rounds')}) "
            f"| {row['requeued_events'] + row['fenced_events']} ({yn(met['no_lease_lost'])}) "
            f"| {row['succeeded']:,} of {row['runs']:,} ({yn(met['all_succeeded'])}) |"
        )
    return "\n".join(lines) + "\n"


async def standalone(sizes: tuple[int, ...]) -> None:
    """The phase on its own: `python bench/inflight.py 500 2000 5000` (long; opt-in)."""
    from common import server_url

    dbs = Databases(await server_url())
    await dbs.create_template()
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        rows = await measure(dbs, Settings(), sizes, 1.0, logs)
    finally:
        await dbs.drop_template()
    print(json.dumps(rows, indent=2))
    print(markdown(rows))


if __name__ == "__main__":
    asyncio.run(standalone(tuple(int(a) for a in sys.argv[1:]) or (500, 2000, 5000)))
