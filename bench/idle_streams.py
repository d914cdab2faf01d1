"""What idle event streams cost the database: N Server-Sent Event streams held open on runs
that wait for the user, against a local `turnstile serve`, counted in PostgreSQL transactions.

Usage: python bench/idle_streams.py [--streams 1000] [--seconds 60]
       [--server postgresql://postgres@127.0.0.1:5432/postgres]

A measurement, not a test (docs/performance.md quotes it). It creates a throwaway database on
`--server`, migrates it, puts `--streams` runs in `waiting_for_user` through the queue core,
starts `turnstile serve --no-workers` on it in its own process (with the stream caps raised to
fit), opens one stream per run on plain asyncio connections (a client library would cost more
CPU than the server on a 2-core machine) and waits until every stream has delivered its
`run.waiting` event. It then reads `xact_commit + xact_rollback` of that database from
`pg_stat_database` before and after `--seconds`: with the service idle before any stream
opened, with the streams open, and after closing them; the smaller idle figure is the
baseline. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from app.config import Settings
from app.queue.core import Queue
from app.security.api_keys import create_key
from app.store.embedded import free_port
from app.store.engine import create_engine, plain_url
from app.store.migrate import upgrade
from app.vocabulary.classes import PriorityClass
from tests.support.databases import admin_execute, new_database_name, with_database

ROOT = Path(__file__).resolve().parent.parent


async def transactions(url: str) -> int:
    conn = await asyncpg.connect(plain_url(url))
    try:
        # Each backend flushes its counters at most once a second (and an idle one after up to
        # 10 s): the windows below are long enough for that to be noise.
        value = await conn.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()"
        )
        return int(value)
    finally:
        await conn.close()


async def waiting_runs(url: str, count: int) -> tuple[str, list[str]]:
    """A key and `count` runs of its principal, each waiting for the user."""
    engine = create_engine(Settings(database_url=url), url, pool_size=4)
    try:
        queue = Queue(engine)
        key = await create_key(engine, tenant_id="bench", principal="alice")
        ids = await queue.enqueue_many(
            tenant_id="bench",
            principal="alice",
            runs=[
                ("scripted", {"n": i}, PriorityClass.INTERACTIVE.base, None) for i in range(count)
            ],
        )
        claimed = []
        while len(claimed) < count:
            claimed += await queue.claim("bench", list(PriorityClass), limit=100)
        for run in claimed:
            await queue.wait_for_user(run.lease, "Which day?", step=1, state={})
        return key.secret, [str(run_id) for run_id in ids]
    finally:
        await engine.dispose()


async def follow(port: int, key: str, run_id: str, opened: asyncio.Event) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            (
                f"GET /runs/{run_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {key}\r\nAccept: text/event-stream\r\n\r\n"
            ).encode()
        )
        buffered = b""
        while not opened.is_set():
            chunk = await reader.read(65536)
            if not chunk:
                raise RuntimeError(f"stream of {run_id} closed: {buffered[:300]!r}")
            buffered += chunk
            if b"event: run.waiting" in buffered:
                opened.set()
        while await reader.read(65536):
            pass  # keep-alives only, until we close it
    finally:
        writer.close()


async def wait_for_server(port: int, process: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError("turnstile serve exited")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("turnstile serve did not start")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--server",
        default=os.environ.get(
            "TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    args = parser.parse_args()
    name = new_database_name("ts_idle_streams")
    await admin_execute(args.server, f'CREATE DATABASE "{name}"')
    url = with_database(args.server, name)
    process: asyncio.subprocess.Process | None = None
    try:
        await asyncio.to_thread(upgrade, url)
        key, runs = await waiting_runs(url, args.streams)
        port = free_port()
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "TURNSTILE_MAX_STREAMS_PER_KEY": str(args.streams),
            "TURNSTILE_MAX_STREAMS_PER_PROCESS": str(args.streams),
            "TURNSTILE_LOG_LEVEL": "warning",
        }
        process = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--no-workers"],
            cwd=ROOT,
            env=env,
        )
        await wait_for_server(port, process)
        before = await transactions(url)
        await asyncio.sleep(args.seconds)  # the idle service, before any stream
        idle_before = await transactions(url) - before

        opened = [asyncio.Event() for _ in runs]
        followers = [
            asyncio.create_task(follow(port, key, run_id, seen))
            for run_id, seen in zip(runs, opened, strict=True)
        ]
        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(seen.wait() for seen in opened)), 300)
        open_seconds = time.monotonic() - started

        before = await transactions(url)
        await asyncio.sleep(args.seconds)  # the measurement window
        with_streams = await transactions(url) - before

        for follower in followers:
            follower.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        before = await transactions(url)
        await asyncio.sleep(args.seconds)
        idle_after = await transactions(url) - before
        baseline = min(idle_before, idle_after)
        print(
            json.dumps(
                {
                    "streams": args.streams,
                    "seconds": args.seconds,
                    "seconds_to_open_all": round(open_seconds, 1),
                    "transactions_with_streams": with_streams,
                    "transactions_per_second_with_streams": round(with_streams / args.seconds, 1),
                    "transactions_idle_before": idle_before,
                    "transactions_idle_after": idle_after,
                    "transactions_per_second_baseline": round(baseline / args.seconds, 1),
                    "per_stream_per_second": round(
                        (with_streams - baseline) / args.seconds / args.streams, 4
                    ),
                }
            )
        )
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 60)
        await admin_execute(args.server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    asyncio.run(main())
