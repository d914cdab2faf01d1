"""The peers phase of `make bench`: Turnstile, PGQueuer and Procrastinate run the same workloads
in the same run, each on a fresh database of its own on the same server, each worker a process
of its own started the way its documentation says (bench/peer_apps.py):

- drain: N no-op jobs bulk-enqueued, then drained by 1 and 2 worker processes with 10 jobs in
  flight per process. Jobs/s over the window from the first claim to the last completion, by
  the database clock (Turnstile: the runs' started_at/finished_at; PGQueuer: its log table's
  `picked` and `successful` rows; Procrastinate: its `started` and `succeeded` events);
- single enqueues: N jobs enqueued one at a time by one client on one connection, no worker;
- backlog: N jobs of 50 ms queued for one worker process, then high-priority probes at 20/s;
  a probe's latency runs from just before its enqueue call to the first line of its job (the
  job prints the time; Turnstile's is the worker's `executing run` log line, at debug, written
  when the run starts executing), both on this machine's clock;
- commits and WAL bytes per job of the drain (bulk enqueue included) and of the single
  enqueues: deltas of pg_stat_database.xact_commit for the database (less this process's own
  polling statements) and of pg_current_wal_lsn() (the whole server's WAL: on a shared server
  other databases' writes are in it).

Turnstile gets 10 usable slots per process: `interactive:1,async:10,maintenance:1` for the
drain; `interactive:1,async:9,maintenance:1` for the backlog (its probes are interactive runs,
which the reserved slot takes at once: the layout is Turnstile's answer to this workload).
A peer that cannot be imported or run is reported as such, with the error, and not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
from common import ROOT, TURNSTILE, Databases, log, service_env, summary

from app.config import Settings
from app.queue.core import Queue
from app.store.engine import create_engine
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun

BIN = Path(sys.executable).parent
BENCH = ROOT / "bench"
INTERACTIVE, ASYNC = PriorityClass.INTERACTIVE, PriorityClass.ASYNC
NOOP = {"script": [{"final": "ok"}]}
SLOW = {"script": [{"call": "sleep", "args": {"seconds": 0.05}}, {"final": "ok"}]}
IN_FLIGHT = 10
CHUNK = 2000
PROBE_RATE = 20.0


# --- the systems ------------------------------------------------------------------------------
class System:
    name = ""
    package = ""
    config = ""

    def version(self) -> str:
        return importlib.metadata.version(self.package)

    async def install(self, dbs: Databases, url: str) -> None:
        raise NotImplementedError

    def worker(self, url: str, log_path: Path, purpose: str) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    async def enqueue_bulk(self, url: str, count: int, job: str) -> None:
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def client(self, url: str) -> AsyncIterator[Any]:
        """One client on one connection, for single enqueues."""
        yield None
        raise NotImplementedError

    async def enqueue_one(self, client: Any, job: str, probe: int | None = None) -> Any:
        raise NotImplementedError

    remaining_sql = ""
    window_sql = ""

    def probe_times(self, log_path: Path, sent: dict[Any, float]) -> list[float]:
        """Latency (ms) of every probe whose first line is in the worker's output."""
        latencies = []
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("PROBE "):
                _, n, at = line.split()
                if int(n) in sent:
                    latencies.append((float(at) - sent[int(n)]) * 1000)
        return latencies


class Turnstile(System):
    name = "Turnstile"
    package = "turnstile"
    config = (
        "`turnstile worker` with `TURNSTILE_SLOTS=interactive:1,async:10,maintenance:1` "
        "(backlog: `async:9`, probes as interactive runs); `Queue.enqueue_many` in chunks of "
        f"{CHUNK:,} (sessionless runs), `Queue.enqueue` for single enqueues; no-op = a "
        "scripted run with one final step, 50 ms job = one `sleep` tool call"
    )
    remaining_sql = "SELECT count(*) FROM runs WHERE status IN ('queued', 'running')"
    window_sql = (
        "SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM runs "
        "WHERE status = 'succeeded'"
    )

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def version(self) -> str:
        return importlib.metadata.version("turnstile")

    async def install(self, dbs: Databases, url: str) -> None:
        pass  # a clone of the migrated template

    def worker(self, url: str, log_path: Path, purpose: str) -> subprocess.Popen[bytes]:
        async_slots = IN_FLIGHT - 1 if purpose == "backlog" else IN_FLIGHT
        layout = f"interactive:1,async:{async_slots},maintenance:1"
        # The probe's first line is the worker's `executing run` line, logged at debug: the
        # backlog's worker logs at debug (a line for every run, probes and backlog alike).
        level = "debug" if purpose == "backlog" else "info"
        with log_path.open("wb") as out:
            return subprocess.Popen(
                [TURNSTILE, "worker"],
                env=service_env(url, slots=layout, log_level=level),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )

    async def enqueue_bulk(self, url: str, count: int, job: str) -> None:
        engine = create_engine(self.settings, url)
        try:
            queue = Queue(engine)
            input_ = NOOP if job == "noop" else SLOW
            for start in range(0, count, CHUNK):
                await queue.enqueue_many(
                    tenant_id="bench",
                    principal="bench",
                    runs=[("scripted", input_, ASYNC.base, None)] * min(CHUNK, count - start),
                )
        finally:
            await engine.dispose()

    @contextlib.asynccontextmanager
    async def client(self, url: str) -> AsyncIterator[Any]:
        engine = create_engine(self.settings, url, pool_size=1)
        try:
            yield Queue(engine)
        finally:
            await engine.dispose()

    async def enqueue_one(self, client: Any, job: str, probe: int | None = None) -> Any:
        run = await client.enqueue(
            NewRun(
                tenant_id="bench",
                principal="bench",
                agent="scripted",
                input=NOOP,
                priority=INTERACTIVE.base if probe is not None else ASYNC.base,
            )
        )
        return run.id

    def probe_times(self, log_path: Path, sent: dict[Any, float]) -> list[float]:
        latencies = []
        for line in log_path.read_text(errors="replace").splitlines():
            if '"executing run"' not in line:
                continue
            record = json.loads(line)
            run_id = uuid.UUID(record["run_id"])
            if run_id in sent:
                at = dt.datetime.fromisoformat(record["time"]).timestamp()
                latencies.append((at - sent[run_id]) * 1000)
        return latencies


class PGQueuer(System):
    name = "PGQueuer"
    package = "pgqueuer"
    config = (
        "schema by `pgq install` (default durability: every table logged); worker "
        "`pgqueuer.run(factory, batch_size=5, max_concurrent_tasks=10)`, what `pgq run` does "
        "(whose CLI fails here: see bench/peer_apps.py); `max_concurrent_tasks` is the "
        "documented per-process cap and must be at least twice the batch size; one asyncpg "
        "connection (`AsyncpgDriver`); `Queries.enqueue` with lists in chunks of "
        f"{CHUNK:,} for bulk, one call per job for single enqueues; probes at priority 100"
    )
    remaining_sql = "SELECT count(*) FROM pgqueuer"
    window_sql = (
        "SELECT extract(epoch FROM max(created) FILTER (WHERE status = 'successful') "
        "- min(created) FILTER (WHERE status = 'picked')) FROM pgqueuer_log"
    )

    def env(self, url: str) -> dict[str, str]:
        return {**os.environ, "BENCH_PEER_DSN": url, "PGDSN": url, "PYTHONPATH": str(BENCH)}

    async def install(self, dbs: Databases, url: str) -> None:
        await asyncio.to_thread(
            subprocess.run,
            [str(BIN / "pgq"), "--pg-dsn", url, "install"],
            env=self.env(url),
            check=True,
            capture_output=True,
            cwd=BENCH,
        )

    def worker(self, url: str, log_path: Path, purpose: str) -> subprocess.Popen[bytes]:
        with log_path.open("wb") as out:
            return subprocess.Popen(
                [sys.executable, str(BENCH / "peer_apps.py"), "pgqueuer"],
                env={**self.env(url), "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=BENCH,
            )

    async def enqueue_bulk(self, url: str, count: int, job: str) -> None:
        from pgqueuer import AsyncpgDriver, Queries

        conn = await asyncpg.connect(url)
        try:
            queries = Queries(AsyncpgDriver(conn))
            for start in range(0, count, CHUNK):
                n = min(CHUNK, count - start)
                await queries.enqueue([job] * n, [None] * n, [0] * n)
        finally:
            await conn.close()

    @contextlib.asynccontextmanager
    async def client(self, url: str) -> AsyncIterator[Any]:
        from pgqueuer import AsyncpgDriver, Queries

        conn = await asyncpg.connect(url)
        try:
            yield Queries(AsyncpgDriver(conn))
        finally:
            await conn.close()

    async def enqueue_one(self, client: Any, job: str, probe: int | None = None) -> Any:
        if probe is not None:
            await client.enqueue("probe", str(probe).encode(), 100)
            return probe
        return await client.enqueue(job, None, 0)


class Procrastinate(System):
    name = "Procrastinate"
    package = "procrastinate"
    config = (
        "schema by `procrastinate schema --apply`; worker `procrastinate "
        "--app=peer_apps.procrastinate_app worker --concurrency 10` (defaults otherwise: "
        "LISTEN/NOTIFY on, jobs kept after they finish), `PsycopgConnector` (psycopg 3 pool); "
        f"`batch_defer_async` in chunks of {CHUNK:,} for bulk, `defer_async` on a pool of one "
        "connection for single enqueues; probes at priority 100"
    )
    remaining_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    window_sql = (
        "SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded') "
        "- min(at) FILTER (WHERE type = 'started')) FROM procrastinate_events"
    )

    def env(self, url: str) -> dict[str, str]:
        return {**os.environ, "BENCH_PEER_DSN": url, "PYTHONPATH": str(BENCH)}

    async def install(self, dbs: Databases, url: str) -> None:
        await asyncio.to_thread(
            subprocess.run,
            [
                str(BIN / "procrastinate"),
                "--app=peer_apps.procrastinate_app",
                "schema",
                "--apply",
            ],
            env=self.env(url),
            check=True,
            capture_output=True,
            cwd=BENCH,
        )

    def worker(self, url: str, log_path: Path, purpose: str) -> subprocess.Popen[bytes]:
        with log_path.open("wb") as out:
            return subprocess.Popen(
                [
                    str(BIN / "procrastinate"),
                    "--app=peer_apps.procrastinate_app",
                    "--log-level",
                    "warning",
                    "worker",
                    "--concurrency",
                    str(IN_FLIGHT),
                ],
                env={**self.env(url), "PYTHONUNBUFFERED": "1"},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=BENCH,
            )

    @contextlib.asynccontextmanager
    async def client(self, url: str) -> AsyncIterator[Any]:
        import peer_apps

        app = peer_apps.make_procrastinate_app(url, min_size=1, max_size=1)
        async with app.open_async():
            yield app

    async def enqueue_bulk(self, url: str, count: int, job: str) -> None:
        async with self.client(url) as app:
            task = app.tasks[job]
            for start in range(0, count, CHUNK):
                await task.batch_defer_async(*([{}] * min(CHUNK, count - start)))

    async def enqueue_one(self, client: Any, job: str, probe: int | None = None) -> Any:
        if probe is not None:
            await client.tasks["probe"].configure(priority=100).defer_async(n=probe)
            return probe
        return await client.tasks[job].defer_async()


# --- measuring --------------------------------------------------------------------------------
class Counters:
    """xact_commit of one database and the server's WAL position, read on a connection of
    their own that is closed at once (its statement is one commit, subtracted)."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def read(self) -> tuple[int, int]:
        conn = await asyncpg.connect(self.url)
        try:
            row = await conn.fetchrow(
                "SELECT xact_commit, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal "
                "FROM pg_stat_database WHERE datname = current_database()"
            )
        finally:
            await conn.close()
        return int(row["xact_commit"]), int(row["wal"])


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.asynccontextmanager
async def database(dbs: Databases, system: System) -> AsyncIterator[str]:
    if isinstance(system, Turnstile):
        async with dbs.fresh() as url:
            yield url
    else:
        async with dbs.empty() as url:
            await system.install(dbs, url)
            yield url


async def drain(
    dbs: Databases, system: System, jobs: int, processes: int, logs: Path
) -> dict[str, Any]:
    async with database(dbs, system) as url:
        counters = Counters(url)
        await asyncio.sleep(1.0)  # the install's backends have exited and reported
        before = await counters.read()
        started = time.monotonic()
        await system.enqueue_bulk(url, jobs, "noop")
        enqueue_seconds = time.monotonic() - started
        conn = await asyncpg.connect(url)
        polls = 0
        workers: list[subprocess.Popen[bytes]] = []
        try:
            workers = [
                system.worker(
                    url, logs / f"peers-{system.package}-drain{processes}-{i}.log", "drain"
                )
                for i in range(processes)
            ]
            deadline = time.monotonic() + 60 + jobs / 20
            while True:
                remaining = await conn.fetchval(system.remaining_sql)
                polls += 1
                if remaining == 0:
                    break
                if any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"a {system.name} worker exited")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{system.name}: {remaining} of {jobs} jobs left")
                await asyncio.sleep(0.1)
        finally:
            stop(workers)
            await conn.close()
        await asyncio.sleep(1.0)
        after = await counters.read()
        conn = await asyncpg.connect(url)
        try:
            window = float(await conn.fetchval(system.window_sql))
        finally:
            await conn.close()
    commits = after[0] - before[0] - polls - 1
    return {
        "processes": processes,
        "in_flight_per_process": IN_FLIGHT,
        "jobs": jobs,
        "enqueue_seconds": round(enqueue_seconds, 3),
        "window_seconds": round(window, 3),
        "jobs_per_second": round(jobs / window, 1),
        "commits_per_job": round(commits / jobs, 3),
        "wal_bytes_per_job": round((after[1] - before[1]) / jobs),
    }


async def single_enqueues(dbs: Databases, system: System, count: int) -> dict[str, Any]:
    async with database(dbs, system) as url:
        counters = Counters(url)
        await asyncio.sleep(1.0)
        before = await counters.read()
        times = []
        async with system.client(url) as client:
            for _ in range(5):  # connect and warm the client's statement caches
                await system.enqueue_one(client, "noop")
            began = time.perf_counter()
            for _ in range(count):
                started = time.perf_counter()
                await system.enqueue_one(client, "noop")
                times.append((time.perf_counter() - started) * 1000)
            elapsed = time.perf_counter() - began
        await asyncio.sleep(1.0)
        after = await counters.read()
    total = count + 5
    return {
        "enqueues": count,
        "per_second": round(count / elapsed, 1),
        **summary(times),
        "commits_per_enqueue": round((after[0] - before[0] - 1) / total, 3),
        "wal_bytes_per_enqueue": round((after[1] - before[1]) / total),
    }


async def backlog(
    dbs: Databases, system: System, jobs: int, probes: int, logs: Path
) -> dict[str, Any]:
    log_path = logs / f"peers-{system.package}-backlog.log"
    log_path.unlink(missing_ok=True)
    async with database(dbs, system) as url:
        await system.enqueue_bulk(url, jobs, "sleep")
        conn = await asyncpg.connect(url)
        worker: subprocess.Popen[bytes] | None = None
        sent: dict[Any, float] = {}
        try:
            worker = system.worker(url, log_path, "backlog")
            # Every slot busy with the backlog before the first probe.
            deadline = time.monotonic() + 60
            while await conn.fetchval(system.remaining_sql) > jobs - 2 * IN_FLIGHT:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{system.name}: the backlog did not start ({log_path})")
                await asyncio.sleep(0.05)
            async with system.client(url) as client:
                began = time.monotonic()
                for n in range(probes):
                    at = time.time()
                    key = await system.enqueue_one(client, "noop", probe=n)
                    sent[key] = at
                    await asyncio.sleep(max(0.0, began + (n + 1) / PROBE_RATE - time.monotonic()))
            left = await conn.fetchval(system.remaining_sql)
            deadline = time.monotonic() + 30
            latencies: list[float] = []
            while time.monotonic() < deadline:
                latencies = system.probe_times(log_path, sent)
                if len(latencies) >= probes:
                    break
                await asyncio.sleep(0.2)
        finally:
            if worker is not None:
                stop([worker])
            await conn.close()
    latencies = system.probe_times(log_path, sent)
    return {
        "backlog_jobs": jobs,
        "job": "50 ms sleep",
        "probes": probes,
        "probe_rate_per_second": PROBE_RATE,
        "backlog_left_when_probes_done": left,
        "latency_ms": summary(latencies),
    }


async def measure(
    dbs: Databases,
    settings: Settings,
    *,
    jobs: int,
    processes: tuple[int, ...],
    singles: int,
    backlog_jobs: int,
    probes: int,
    logs: Path,
) -> dict[str, Any]:
    systems: list[System] = [Turnstile(settings), PGQueuer(), Procrastinate()]
    results: dict[str, Any] = {"systems": {}, "unavailable": {}}
    for system in systems:
        try:
            version = system.version()
            if not isinstance(system, Turnstile):
                __import__(system.package)
        except Exception as exc:  # not installed: said so, not measured
            results["unavailable"][system.name] = f"{type(exc).__name__}: {exc}"
            log(f"peers: {system.name} unavailable: {exc}")
            continue
        row: dict[str, Any] = {"version": version, "config": system.config, "drain": []}
        try:
            for n in processes:
                log(f"peers: {system.name}, drain of {jobs:,} no-op jobs, {n} process(es)")
                row["drain"].append(await drain(dbs, system, jobs, n, logs))
                log(f"  {row['drain'][-1]}")
            log(f"peers: {system.name}, {singles:,} single enqueues")
            row["single_enqueue"] = await single_enqueues(dbs, system, singles)
            log(f"  {row['single_enqueue']}")
            log(f"peers: {system.name}, {probes} probes behind {backlog_jobs:,} jobs of 50 ms")
            row["backlog"] = await backlog(dbs, system, backlog_jobs, probes, logs)
            log(f"  {row['backlog']}")
        except Exception as exc:
            if isinstance(system, Turnstile) or "too many clients" in str(exc):
                raise
            results["unavailable"][system.name] = f"failed here: {type(exc).__name__}: {exc}"
            log(f"peers: {system.name} failed: {exc}")
            continue
        results["systems"][system.name] = row
    return results


# --- report -----------------------------------------------------------------------------------
def markdown(peers: dict[str, Any], pgbench: float) -> str:
    systems = peers["systems"]
    names = list(systems)
    if not names:
        return ""
    base = systems.get("Turnstile")

    def cell(name: str, value: float | None, reference: float | None, unit: str = "") -> str:
        if value is None:
            return "-"
        text = f"{value:,.0f}{unit}" if value >= 100 else f"{value:,.3g}{unit}"
        if reference and name != "Turnstile":
            text += f" ({value / reference:.2f}x Turnstile)"
        return text

    lines = [
        "| Workload (same run, same server) | "
        + " | ".join(f"{n} {systems[n]['version']}" for n in names)
        + " |",
        "|---|" + "---:|" * len(names),
    ]
    for i, drained in enumerate(base["drain"] if base else []):
        values = [
            next((d for d in systems[n]["drain"] if d["processes"] == drained["processes"]), None)
            for n in names
        ]
        lines.append(
            f"| Drain {drained['jobs']:,} no-op jobs, {drained['processes']} process"
            f"{'es' if drained['processes'] > 1 else ''} x {IN_FLIGHT} in flight: jobs/s "
            f"(% of pgbench {pgbench:,.0f} tps) | "
            + " | ".join(
                "-"
                if v is None
                else cell(n, v["jobs_per_second"], drained["jobs_per_second"])
                + f", {v['jobs_per_second'] / pgbench:.0%}"
                for n, v in zip(names, values, strict=True)
            )
            + " |"
        )
        if i == 0:
            lines.append(
                "| commits per job; WAL bytes per job (bulk enqueue + drain) | "
                + " | ".join(
                    "-" if v is None else f"{v['commits_per_job']}; {v['wal_bytes_per_job']:,}"
                    for v in values
                )
                + " |"
            )
    ref = base["single_enqueue"] if base else None
    lines.append(
        "| Single enqueues, one client, one connection: per s; p50 / p99 ms | "
        + " | ".join(
            cell(n, systems[n]["single_enqueue"]["per_second"], ref and ref["per_second"])
            + f"; {systems[n]['single_enqueue']['p50_ms']} / "
            f"{systems[n]['single_enqueue']['p99_ms']}"
            for n in names
        )
        + " |"
    )
    lines.append(
        "| commits per enqueue; WAL bytes per enqueue | "
        + " | ".join(
            f"{systems[n]['single_enqueue']['commits_per_enqueue']}; "
            f"{systems[n]['single_enqueue']['wal_bytes_per_enqueue']:,}"
            for n in names
        )
        + " |"
    )
    sample = next(iter(systems.values()))["backlog"]
    lines.append(
        f"| High-priority probe behind {sample['backlog_jobs']:,} jobs of 50 ms, "
        f"{sample['probe_rate_per_second']:g}/s: enqueue call to the job's first line, "
        "p50 / p99 ms (n) | "
        + " | ".join(
            f"{systems[n]['backlog']['latency_ms']['p50_ms']} / "
            f"{systems[n]['backlog']['latency_ms']['p99_ms']} "
            f"(n={systems[n]['backlog']['latency_ms']['n']})"
            for n in names
        )
        + " |"
    )
    for name, reason in peers["unavailable"].items():
        lines.append(f"| {name}: not measured | {reason} |" + " |" * (len(names) - 1))
    return "\n".join(lines) + "\n"
