"""The model-budgets benchmark (issue 39 item 5; docs/model-budgets.md), `make bench-budgets` and
the `budgets` phase of `make bench`: a burst of `openai` runs against a provider-like endpoint
that enforces its own limits, with Turnstile's model budgets and without them.

Usage: .venv/bin/python bench/model_budgets.py [--runs 2000] [--rpm 1200] [--tpm 120000]
       [--workers 2] [--slots LAYOUT] [--modes budgets,none] [--quick] [--trace]
       [--out bench/results]
       [--stem budgets-latest]

The endpoint (bench/limited_model.py, a process of its own) holds a token bucket of requests
and one of tokens, each a minute's worth refilling continuously, and answers 429 with
Retry-After and the x-ratelimit-* headers over them; each answer reports its `usage`. The burst
is `--runs` runs enqueued at once: half interactive, half async, half of each for tenant `a`
and half for tenant `b`, served by `--workers` real `turnstile worker` processes (streaming off,
`max_tokens` OUTPUT_TOKENS). Mode `budgets`: TURNSTILE_MODEL_RPM and _TPM set to the endpoint's
limits, one budget key for every process. Mode `none`: TURNSTILE_MODEL_BUDGETS=false, each run
retrying alone (the agent's own backoff, honouring Retry-After) as before.

Reported per mode: the endpoint's 429s, the runs' early releases and failures (transient
retries that ran out), the finishing time (enqueue to the last run's end, database clock), the
throughput as a share of the endpoint's limit, and, from the runs' events, each run's wait for
capacity (the time between each `run.released` with `waited_for: capacity` and its next
`run.claimed`, summed), p50 and p99 per class and tenant, with the enqueue-to-end latency
beside it (comparable in both modes).

The share: a burst starts against full buckets (a minute's worth goes at once), then the limit
is a rate. The fastest the endpoint could have served the burst is the time the larger of its
two demands beyond the first minute's worth takes at the limit's rate (the tokens it served
and the requests); the share is that over the measured finishing time. 1.0: the burst
finished as fast as the endpoint allows.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    ROOT,
    Databases,
    Worker,
    endpoint_stats,
    log,
    percentile,
    retrying,
    server_url,
    wait_workers,
)

from app.config import Settings
from app.queue.core import Queue
from app.store.embedded import free_port
from app.store.engine import create_engine
from app.vocabulary.classes import PriorityClass

INTERACTIVE = PriorityClass.INTERACTIVE
ASYNC = PriorityClass.ASYNC
OUTPUT_TOKENS = 200  # the request's max_tokens, and what each reservation holds beyond its prompt
ANSWER_TOKENS = 150  # what each answer reports using: settlement gives the rest back
SLOTS = "interactive:4,async:12,maintenance:1"
TENANTS = ("a", "b")
MODES = ("budgets", "none")
ENDPOINT = "bench-model"


class LimitedModel:
    def __init__(self, rpm: int, tpm: int, logs: Path) -> None:
        self.port = free_port()
        self.log_file = logs.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "limited_model.py"),
                *(str(self.port), str(rpm), str(tpm), str(ANSWER_TOKENS)),
            ],
            stdout=subprocess.PIPE,
            stderr=self.log_file,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the limited model endpoint did not start (see {logs})")

    async def stats(self) -> dict[str, Any]:
        return await endpoint_stats(self.port)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log_file.close()


# Each run's wait for capacity: every give-back for capacity to the run's next claim, summed.
WAITS = """
WITH gave_back AS (
    SELECT e.run_id, e.seq, e.created_at
    FROM run_events e
    WHERE e.type = 'run.released' AND e.data ->> 'waited_for' = 'capacity'
),
waited AS (
    SELECT g.run_id, count(*) AS waits,
           sum(extract(epoch FROM coalesce(
               (SELECT min(c.created_at) FROM run_events c
                WHERE c.run_id = g.run_id AND c.seq > g.seq AND c.type = 'run.claimed'),
               g.created_at) - g.created_at)) AS seconds
    FROM gave_back g GROUP BY g.run_id
)
SELECT r.tenant_id, r.priority / 10 AS band, r.status,
       coalesce(w.waits, 0) AS waits, coalesce(w.seconds, 0) AS wait_seconds,
       extract(epoch FROM r.finished_at - r.created_at) AS latency_seconds
FROM runs r LEFT JOIN waited w ON w.run_id = r.id
"""


# What --trace samples every half second: the budget's buckets, its bookings and calls in flight.
TRACE = """
SELECT round(b.token_level) AS tokens, round(b.request_level::numeric, 1) AS requests,
       round(b.token_advance::numeric, 1) AS advance, round(b.used_share::numeric, 2) AS share,
       (SELECT count(*) FROM model_reservations WHERE wake_at IS NOT NULL) AS booked,
       (SELECT count(*) FROM model_reservations WHERE wake_at IS NULL) AS in_flight,
       (SELECT count(*) FROM model_reservations WHERE wake_at <= now()) AS due,
       (SELECT count(*) FROM runs WHERE status = 'running') AS running,
       (SELECT count(*) FROM runs WHERE status = 'queued' AND scheduled_for <= now()) AS eligible
FROM model_budgets b WHERE b.endpoint = $1
"""


def _figures(values: list[float]) -> dict[str, Any]:
    def ms(pct: float) -> float | None:
        value = percentile(values, pct)
        return None if value is None else round(value * 1000, 1)

    return {"n": len(values), "p50_ms": ms(50), "p99_ms": ms(99), "max_ms": ms(100)}


async def one_mode(
    dbs: Databases, mode: str, args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    async with dbs.fresh() as url:
        conn = await asyncpg.connect(url)
        model = LimitedModel(args.rpm, args.tpm, logs / f"budgets-{mode}-model.log")
        engine = create_engine(Settings(), url)
        workers: list[Worker] = []
        try:
            settings = {
                "openai_base_url": f"http://127.0.0.1:{model.port}/v1",
                "openai_stream": "false",
                "openai_max_output_tokens": str(OUTPUT_TOKENS),
                "openai_budget_endpoint": ENDPOINT,
                "model_budgets": "true" if mode == "budgets" else "false",
                "model_rpm": str(args.rpm),
                "model_tpm": str(args.tpm),
            }
            for i in range(args.workers):
                workers.append(
                    Worker(url, args.slots, logs / f"budgets-{mode}-{i}.log", **settings)
                )
            await wait_workers(conn, args.workers, workers)
            queue = Queue(engine)
            started = await conn.fetchval("SELECT now()")
            per_tenant = args.runs // len(TENANTS)
            for tenant in TENANTS:
                runs = [
                    (
                        "openai",
                        {"text": f"hello {tenant} {i}"},
                        (INTERACTIVE if i % 2 == 0 else ASYNC).base,
                        None,
                    )
                    for i in range(per_tenant)
                ]
                for start in range(0, len(runs), 1000):
                    await queue.enqueue_many(
                        tenant_id=tenant, principal="bench", runs=runs[start : start + 1000]
                    )
            total = per_tenant * len(TENANTS)
            deadline = time.monotonic() + args.timeout
            while True:
                finished = await conn.fetchval(
                    "SELECT count(*) FROM runs WHERE status IN ('succeeded', 'failed', 'cancelled')"
                )
                if args.trace:
                    log(
                        f"  {round(time.monotonic() - deadline + args.timeout, 1)} s: "
                        + str(dict(await conn.fetchrow(TRACE, ENDPOINT) or {}))
                        + f" finished {finished}"
                    )
                if finished >= total:
                    break
                if time.monotonic() > deadline:
                    log(f"budgets {mode}: {total - finished} runs unfinished at the deadline")
                    break
                await asyncio.sleep(0.5)
            stats = await model.stats()
            window = await conn.fetchval(
                "SELECT extract(epoch FROM max(finished_at) - $1) FROM runs", started
            )
            rows = await conn.fetch(WAITS)
            early = await conn.fetchval(
                "SELECT count(*) FROM run_events WHERE type = 'run.released' "
                "AND (data ->> 'graceful')::boolean IS FALSE"
            )
            budget = await conn.fetchrow(
                "SELECT requests_used, tokens_used, waits, pauses FROM model_budgets "
                "WHERE endpoint = $1",
                ENDPOINT,
            )
        finally:
            for worker in workers:
                worker.stop()
            model.stop()
            await engine.dispose()
            await conn.close()
    window = float(window or 0)
    burst_tokens = max(0, stats["tokens_served"] - args.tpm) * 60 / args.tpm
    burst_requests = max(0, stats["served"] - args.rpm) * 60 / args.rpm
    fastest = max(burst_tokens, burst_requests)
    classes: dict[str, Any] = {}
    for band, name in ((0, "interactive"), (1, "async")):
        for tenant in (*TENANTS, "all"):
            chosen = [
                r
                for r in rows
                if int(r["band"]) == band and (tenant == "all" or r["tenant_id"] == tenant)
            ]
            classes[f"{name}/{tenant}"] = {
                "capacity_wait": _figures([float(r["wait_seconds"]) for r in chosen]),
                "gave_back_per_run": round(sum(int(r["waits"]) for r in chosen) / len(chosen), 2)
                if chosen
                else None,
                "latency": _figures(
                    [float(r["latency_seconds"]) for r in chosen if r["latency_seconds"]]
                ),
            }
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {
        "mode": mode,
        "runs": len(rows),
        "statuses": statuses,
        "endpoint_rpm": args.rpm,
        "endpoint_tpm": args.tpm,
        "calls_served": stats["served"],
        "endpoint_429s": stats["refused"],
        "tokens_served": stats["tokens_served"],
        "early_releases": int(early),
        "finishing_seconds": round(window, 2),
        "fastest_possible_seconds": round(fastest, 2),
        "throughput_share_of_limit": round(fastest / window, 3) if window else None,
        "budget": dict(budget) if budget else None,
        "per_class_and_tenant": classes,
    }


async def measure(dbs: Databases, args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    rows = []
    for mode in args.modes.split(","):
        log(f"budgets: {args.runs} openai runs, endpoint {args.rpm} rpm / {args.tpm} tpm, {mode}")
        row = await retrying(f"budgets-{mode}", lambda mode=mode: one_mode(dbs, mode, args, logs))
        log(f"  {json.dumps({k: v for k, v in row.items() if k != 'per_class_and_tenant'})}")
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| Mode | Runs (succeeded) | 429s | Early releases | Finishing time | Fastest possible "
        "| Share of the limit | Capacity wait p50 / p99, interactive | async "
        "| Latency p50 / p99, interactive | async |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]

    def pair(figures: dict[str, Any]) -> str:
        return f"{figures['p50_ms']} / {figures['p99_ms']} ms"

    for row in rows:
        c = row["per_class_and_tenant"]
        lines.append(
            f"| {row['mode']} | {row['runs']:,} ({row['statuses'].get('succeeded', 0):,}) "
            f"| {row['endpoint_429s']:,} | {row['early_releases']:,} "
            f"| {row['finishing_seconds']} s | {row['fastest_possible_seconds']} s "
            f"| {row['throughput_share_of_limit']} "
            f"| {pair(c['interactive/all']['capacity_wait'])} "
            f"| {pair(c['async/all']['capacity_wait'])} "
            f"| {pair(c['interactive/all']['latency'])} | {pair(c['async/all']['latency'])} |"
        )
    lines += ["", "Per tenant (capacity wait p50 / p99):", ""]
    lines += ["| Mode | Class | Tenant a | Tenant b |", "|---|---|---|---|"]
    for row in rows:
        c = row["per_class_and_tenant"]
        for name in ("interactive", "async"):
            lines.append(
                f"| {row['mode']} | {name} | {pair(c[f'{name}/a']['capacity_wait'])} "
                f"| {pair(c[f'{name}/b']['capacity_wait'])} |"
            )
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="2,000 (the quick mode: 400)")
    p.add_argument("--rpm", type=int, default=None, help="the endpoint's requests a minute")
    p.add_argument("--tpm", type=int, default=None, help="the endpoint's tokens a minute")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slots", default=SLOTS, help="each worker's slot layout")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mode at most")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trace", action="store_true", help="log the budget every half second")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--stem", default=None)
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults: 2,000 runs (400 quick), limits that make the burst last about two minutes
    past its first minute's worth (about 40 s quick)."""
    args.runs = args.runs or (400 if args.quick else 2000)
    args.tpm = args.tpm or (40_000 if args.quick else 120_000)
    args.rpm = args.rpm or (args.runs if args.quick else 1200)
    args.stem = args.stem or ("budgets-quick" if args.quick else "budgets-latest")
    return args


async def run(args: argparse.Namespace, dbs: Databases | None = None) -> list[dict[str, Any]]:
    own = dbs is None
    if dbs is None:
        dbs = Databases(await server_url())
        await dbs.create_template()
    logs = ROOT / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        return await measure(dbs, args, logs)
    finally:
        if own:
            await dbs.drop_template()


async def main() -> None:
    args = resolve(parser().parse_args())
    rows = await run(args)
    results = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "settings": {
            "runs": args.runs,
            "rpm": args.rpm,
            "tpm": args.tpm,
            "workers": args.workers,
            "slots": args.slots,
            "max_tokens": OUTPUT_TOKENS,
            "answer_tokens": ANSWER_TOKENS,
        },
        "budgets": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(results, indent=2, default=str))
    table = markdown(rows)
    (args.out / f"{args.stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    asyncio.run(main())
