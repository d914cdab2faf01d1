"""The churn benchmark, `make bench-churn` (opt-in, long): what a long life of runs being
enqueued, claimed, completed and deleted by retention does to the claim and to the tables.

Usage: .venv/bin/python bench/churn.py [--runs 2000000] [--backlog 10000] [--retention 60]
       [--reset-storage] [--out bench/results] [--stem churn-latest]

One database (cloned from a freshly migrated template, dropped afterwards) takes `--runs` runs.
This process drives the Queue API directly rather than `turnstile worker` processes: the
statements are the production ones (enqueue_many, claim_many, heartbeat_many, append_event,
complete_many, and the production pruner RunRetention deleting finished runs past
`--retention` seconds with their events and inputs), without a worker's scheduling and a
scripted agent's execution around them, so the table sees millions of runs in minutes instead
of hours. Producers keep `--backlog` runs queued; lanes claim batches of 32, beat their leases
once (heartbeats change lease_expires_at), append one event to a few of them (an update of
last_event_seq alone, as a tool call or a checkpoint makes) and complete them in one statement.

At 0 %, 25 %, 50 %, 75 % and 100 % of the runs, everything pauses and the claim is timed the
same way each time: `claim_one` of the async class, with the queue holding exactly `--backlog`
runs, timed from this process around the whole claim transaction (each probe run is completed
and replaced, untimed), in rounds of 25 interleaved with the same probe on a second, fresh
database holding the same backlog: the ratio of the two is what churn did, whatever the
machine was doing meanwhile. Beside it: sizes of runs, run_events and run_inputs (heap and indexes,
and each index of runs), dead tuples, autovacuum and autoanalyze counts, and the share of HOT
updates on runs. A sampler also records the most dead tuples seen on runs every 5 s.

`--reset-storage` RESETs the storage parameters migration 0008 sets (fillfactor, per-table
autovacuum) before the first run, so one build can measure the tables with and without them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, Databases, log, retrying, server_url, summary

from app.config import Settings
from app.maintenance.pruners import RunRetention
from app.queue.core import Queue
from app.store.engine import create_claim_engine, create_engine
from app.vocabulary.classes import PriorityClass

ASYNC = PriorityClass.ASYNC
TABLES = ("runs", "run_events", "run_inputs")
WORK = {"script": [{"final": "ok"}]}
BATCH = 32  # a lane's claim_many and complete_many, as a worker's completion batch groups them
STEPS_PER_BATCH = 16  # runs of each batch given one append_event (last_event_seq only)
LANES = 3
PROBES = 200

STATS_SQL = """
SELECT s.relname, pg_relation_size(s.relid) AS heap_bytes,
       pg_indexes_size(s.relid) AS index_bytes, s.n_live_tup, s.n_dead_tup, s.n_tup_ins,
       s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_del, s.autovacuum_count, s.autoanalyze_count,
       s.vacuum_count, s.last_autovacuum, c.reloptions
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.relname = ANY($1::text[])
"""
SERVER_SQL = """
SELECT name, setting FROM pg_settings
WHERE name IN ('autovacuum', 'autovacuum_naptime', 'autovacuum_max_workers',
               'autovacuum_vacuum_cost_delay', 'autovacuum_vacuum_cost_limit',
               'vacuum_cost_limit', 'shared_buffers', 'server_version')
ORDER BY name
"""
INDEX_SQL = """
SELECT indexrelname, pg_relation_size(indexrelid) AS bytes
FROM pg_stat_user_indexes WHERE relname = 'runs' ORDER BY indexrelname
"""


class Churn:
    """One database under churn: producers, lanes, the pruner, and the pause for a probe."""

    def __init__(self, url: str, settings: Settings, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.engine = create_engine(settings, url, pool_size=LANES + 4)
        # Claims on their own connections, as the service makes them (app/main.py).
        self.claim_engine = create_claim_engine(settings, url)
        self.queue = Queue(self.engine, claim_engine=self.claim_engine)
        self.pruner = RunRetention(
            self.queue, holder="bench-churn", interval=1.0, retention_seconds=args.retention
        )
        self.enqueued = 0
        self.claimed = 0
        self.completed = 0
        self.pruned = 0
        self.go = asyncio.Event()  # cleared: every loop parks at its next turn
        self.busy = 0  # loops between two parks
        self.idle = asyncio.Event()  # set while no loop is between two parks
        self.done = False
        self.dead_peak = 0

    async def _turn(self) -> None:
        self._leave()
        await self.go.wait()
        self.busy += 1
        self.idle.clear()

    def _leave(self) -> None:
        self.busy -= 1
        if self.busy == 0:
            self.idle.set()

    async def pause(self) -> None:
        self.go.clear()
        if self.busy > 0:
            self.idle.clear()
            await self.idle.wait()

    def resume(self) -> None:
        self.go.set()

    async def producer(self) -> None:
        self.busy += 1
        while not self.done:
            await self._turn()
            queued = self.enqueued - self.claimed
            room = min(2000, self.args.backlog - queued, self.args.runs - self.enqueued)
            if room <= 0:
                await asyncio.sleep(0.005)
                continue
            await self.queue.enqueue_many(
                tenant_id="bench",
                principal="bench",
                runs=[("scripted", WORK, ASYNC.base, None)] * room,
            )
            self.enqueued += room
        self._leave()

    async def lane(self, index: int) -> None:
        self.busy += 1
        owner = f"bench-churn-{index}"
        while not self.done:
            await self._turn()
            claimed = await self.queue.claim(owner, [ASYNC], limit=BATCH)
            if not claimed:
                await asyncio.sleep(0.005)
                continue
            self.claimed += len(claimed)
            leases = [c.lease for c in claimed]
            await self.queue.heartbeat_many(leases)
            for lease in leases[:STEPS_PER_BATCH]:
                await self.queue.append_event(lease, "bench.step", {})
            await self.queue.complete_many([(lease, {"ok": True}) for lease in leases])
            self.completed += len(claimed)
        self._leave()

    async def prune(self) -> None:
        self.busy += 1
        while not self.done:
            await self._turn()
            self.pruned += (await self.pruner.run_once()).deleted
            await asyncio.sleep(self.pruner.interval)
        self._leave()

    async def sample(self, conn: asyncpg.Connection) -> None:
        while not self.done:
            dead = await conn.fetchval(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'runs'"
            )
            self.dead_peak = max(self.dead_peak, int(dead or 0))
            await asyncio.sleep(5)

    async def probe(self, conn: asyncpg.Connection, fresh: Queue) -> dict[str, Any]:
        """Time `claim_one` on this queue holding exactly the backlog (everything else paused)
        and on `fresh`, a never-churned database holding the same backlog, in interleaved
        rounds, so that a noisy moment of a shared machine falls on both alike and their
        ratio says what churn did."""
        queued = await conn.fetchval("SELECT count(*) FROM runs WHERE status = 'queued'")
        if queued < self.args.backlog:
            await self.queue.enqueue_many(
                tenant_id="bench",
                principal="bench",
                runs=[("scripted", WORK, ASYNC.base, None)] * (self.args.backlog - queued),
            )
        times: dict[str, list[float]] = {"churned": [], "fresh": []}
        queues = {"churned": self.queue, "fresh": fresh}
        for queue in queues.values():
            for _ in range(10):  # warm the pool and the plan cache
                await timed_claim(queue)
        while len(times["churned"]) < PROBES:
            for label, queue in queues.items():
                for _ in range(25):
                    times[label].append(await timed_claim(queue))
        churned, reference = summary(times["churned"]), summary(times["fresh"])
        return {
            "churned": churned,
            "fresh": reference,
            "p50_ratio": _ratio(churned["p50_ms"], reference["p50_ms"]),
            "p99_ratio": _ratio(churned["p99_ms"], reference["p99_ms"]),
        }

    async def close(self) -> None:
        await self.engine.dispose()
        if self.claim_engine is not None:
            await self.claim_engine.dispose()


async def timed_claim(queue: Queue) -> float:
    """Milliseconds of one `claim_one`; the run is then completed and replaced, untimed, so
    the queue keeps its depth."""
    started = time.perf_counter()
    claimed = await queue.claim("bench-probe", [ASYNC], limit=1)
    elapsed = (time.perf_counter() - started) * 1000
    if len(claimed) != 1:
        raise RuntimeError("the probe claimed nothing")
    await queue.complete(claimed[0].lease, {"ok": True})
    await queue.enqueue_many(
        tenant_id="bench", principal="bench", runs=[("scripted", WORK, ASYNC.base, None)]
    )
    return elapsed


async def reset_storage(conn: asyncpg.Connection) -> None:
    """Every storage parameter of the churned tables back to the server's defaults."""
    for row in await conn.fetch(
        "SELECT relname, reloptions FROM pg_class WHERE relname = ANY($1::text[]) "
        "AND reloptions IS NOT NULL",
        list(TABLES),
    ):
        names = ", ".join(option.split("=", 1)[0] for option in row["reloptions"])
        await conn.execute(f"ALTER TABLE {row['relname']} RESET ({names})")


async def table_stats(conn: asyncpg.Connection) -> dict[str, Any]:
    await asyncio.sleep(1.5)  # backends flush their table counters at most once a second
    tables: dict[str, Any] = {}
    for row in await conn.fetch(STATS_SQL, list(TABLES)):
        upd = int(row["n_tup_upd"])
        tables[row["relname"]] = {
            "heap_mb": round(row["heap_bytes"] / 2**20, 1),
            "indexes_mb": round(row["index_bytes"] / 2**20, 1),
            "live_tuples": int(row["n_live_tup"]),
            "dead_tuples": int(row["n_dead_tup"]),
            "inserted": int(row["n_tup_ins"]),
            "updated": upd,
            "hot_updated": int(row["n_tup_hot_upd"]),
            "hot_share": round(int(row["n_tup_hot_upd"]) / upd, 3) if upd else None,
            "deleted": int(row["n_tup_del"]),
            "autovacuums": int(row["autovacuum_count"]),
            "autoanalyzes": int(row["autoanalyze_count"]),
            "last_autovacuum": row["last_autovacuum"].isoformat()
            if row["last_autovacuum"]
            else None,
            "reloptions": list(row["reloptions"] or []),
        }
    tables["runs"]["index_kb"] = {
        row["indexrelname"]: round(row["bytes"] / 1024) for row in await conn.fetch(INDEX_SQL)
    }
    return tables


async def measure(dbs: Databases, settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    async with dbs.fresh() as url, dbs.fresh() as fresh_url:
        conn = await asyncpg.connect(url)
        churn = Churn(url, settings, args)
        # The reference: a database holding the same backlog that never churns (its only
        # traffic is the probes' own claims, completions and replacements).
        fresh_engine = create_engine(settings, fresh_url, pool_size=2)
        fresh_claims = create_claim_engine(settings, fresh_url)
        fresh = Queue(fresh_engine, claim_engine=fresh_claims)
        for start in range(0, args.backlog, 2000):
            await fresh.enqueue_many(
                tenant_id="bench",
                principal="bench",
                runs=[("scripted", WORK, ASYNC.base, None)] * min(2000, args.backlog - start),
            )
        tasks: list[asyncio.Task[None]] = []
        checkpoints: list[dict[str, Any]] = []
        try:
            server = {r["name"]: r["setting"] for r in await conn.fetch(SERVER_SQL)}
            if server["autovacuum"] != "on":
                log("autovacuum is off on this server: dead tuples will only grow")
            if args.reset_storage:
                await reset_storage(conn)
            began = time.monotonic()
            for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
                target = round(args.runs * fraction)
                if fraction > 0:
                    churn.resume()
                    while churn.completed < target:
                        finished, _ = await asyncio.wait(tasks, timeout=0.2)
                        if finished:
                            break
                    for task in tasks:
                        if task.done():
                            task.result()  # a loop that failed ends the benchmark with its error
                    await churn.pause()
                claim = await churn.probe(conn, fresh)
                point = {
                    "fraction": fraction,
                    "completed": churn.completed,
                    "pruned": churn.pruned,
                    "seconds": round(time.monotonic() - began, 1),
                    "claim_one": claim,
                    "dead_tuples_peak_runs": churn.dead_peak,
                    "tables": await table_stats(conn),
                }
                log(
                    f"churn {fraction:.0%}: {churn.completed:,} runs, {churn.pruned:,} pruned, "
                    f"claim_one p50 {claim['churned']['p50_ms']} ms "
                    f"(fresh {claim['fresh']['p50_ms']} ms) p99 {claim['churned']['p99_ms']} ms "
                    f"(fresh {claim['fresh']['p99_ms']} ms), "
                    f"runs {point['tables']['runs']}"
                )
                checkpoints.append(point)
                if fraction == 0.0:
                    tasks = [asyncio.create_task(churn.producer())]
                    tasks += [asyncio.create_task(churn.lane(i)) for i in range(LANES)]
                    tasks.append(asyncio.create_task(churn.prune()))
                    sampler = await asyncpg.connect(url)
                    tasks.append(asyncio.create_task(churn.sample(sampler)))
            wall = time.monotonic() - began
        finally:
            churn.done = True
            churn.resume()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await churn.close()
            await fresh_engine.dispose()
            if fresh_claims is not None:
                await fresh_claims.dispose()
            await conn.close()
            if tasks:
                await sampler.close()
    first, last = checkpoints[0]["claim_one"]["churned"], checkpoints[-1]["claim_one"]
    return {
        "runs": churn.completed,
        "wall_seconds": round(wall, 1),
        "runs_per_second": round(churn.completed / wall, 1),
        "pruned": churn.pruned,
        "storage_parameters": "reset" if args.reset_storage else "migrations",
        "server": server,
        # The end's claim against the fresh table's, timed in the same interleaved rounds (the
        # figure the 1.5x is about), and against the start's (other moments: noisier).
        "claim_p50_ratio_end_to_fresh": last["p50_ratio"],
        "claim_p99_ratio_end_to_fresh": last["p99_ratio"],
        "claim_p50_ratio_end_to_start": _ratio(last["churned"]["p50_ms"], first["p50_ms"]),
        "claim_p99_ratio_end_to_start": _ratio(last["churned"]["p99_ms"], first["p99_ms"]),
        "dead_tuples_peak_runs": churn.dead_peak,
        "checkpoints": checkpoints,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def markdown(results: dict[str, Any]) -> str:
    churn = results["churn"]
    lines = [
        f"# Churn ({results['date']}, {churn['runs']:,} runs)",
        "",
        f"Machine: {results['machine']}; load average at start {results['load_average']['start']}, "
        f"at end {results['load_average']['end']}. Storage parameters: "
        f"{churn['storage_parameters']}. Server: "
        + ", ".join(f"{k} {v}" for k, v in churn["server"].items())
        + f". Retention {results['settings']['retention_seconds']} s, "
        f"backlog {results['settings']['backlog']:,} queued, "
        f"{churn['runs_per_second']} runs/s over {churn['wall_seconds']} s; "
        f"{churn['pruned']:,} runs pruned; at most {churn['dead_tuples_peak_runs']:,} dead "
        "tuples seen on runs (5 s samples).",
        "",
        "| Point | Runs | claim_one p50 ms (fresh; ratio) | p99 ms (fresh; ratio) "
        "| runs heap/idx MB | run_events heap/idx MB | run_inputs heap/idx MB | runs dead "
        "| runs HOT share | autovacuums runs/events/inputs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in churn["checkpoints"]:
        t, c = point["tables"], point["claim_one"]
        lines.append(
            f"| {point['fraction']:.0%} | {point['completed']:,} "
            f"| {c['churned']['p50_ms']} ({c['fresh']['p50_ms']}; x{c['p50_ratio']}) "
            f"| {c['churned']['p99_ms']} ({c['fresh']['p99_ms']}; x{c['p99_ratio']}) "
            + " ".join(f"| {t[n]['heap_mb']}/{t[n]['indexes_mb']}" for n in TABLES)
            + f" | {t['runs']['dead_tuples']:,} | {t['runs']['hot_share']} | "
            + "/".join(str(t[n]["autovacuums"]) for n in TABLES)
            + " |"
        )
    end = churn["checkpoints"][-1]["tables"]["runs"]["index_kb"]
    lines += [
        "",
        f"Claim at the end over the fresh table's in the same rounds: p50 "
        f"x{churn['claim_p50_ratio_end_to_fresh']}, p99 x{churn['claim_p99_ratio_end_to_fresh']}"
        f"; over the start's: p50 x{churn['claim_p50_ratio_end_to_start']}, "
        f"p99 x{churn['claim_p99_ratio_end_to_start']}.",
        "",
        "Indexes of runs at the end (kB): " + ", ".join(f"{k} {v}" for k, v in end.items()) + ".",
        "",
    ]
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2_000_000)
    parser.add_argument("--backlog", type=int, default=10_000, help="runs kept queued")
    parser.add_argument("--retention", type=float, default=60.0, help="seconds")
    parser.add_argument("--reset-storage", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--stem", default="churn-latest")
    args = parser.parse_args()
    dbs = Databases(await server_url())
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {
            "runs": args.runs,
            "backlog": args.backlog,
            "retention_seconds": args.retention,
            "batch": BATCH,
            "lanes": LANES,
            "probes": PROBES,
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "load_average": {"start": [round(x, 2) for x in os.getloadavg()]},
    }
    await dbs.create_template()
    try:
        results["churn"] = await retrying("churn", lambda: measure(dbs, Settings(), args))
    finally:
        await dbs.drop_template()
    results["load_average"]["end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(results, indent=2, default=str))
    table = markdown(results)
    (args.out / f"{args.stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    asyncio.run(main())
