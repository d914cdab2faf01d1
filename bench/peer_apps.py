"""The peers' worker applications for the peers phase (bench/peers.py), each as its own
documentation sets one up, started through its own CLI:

    python bench/peer_apps.py pgqueuer
        = pgqueuer.run(pgqueuer_factory, batch_size=5, max_concurrent_tasks=10), which is
          `pgq run peer_apps:pgqueuer_factory --batch-size 5 --max-concurrent-tasks 10` without
          the CLI: pgqueuer 1.6.0's `pgq run` fails before it starts with the typer release
          installed here (`--log-level`'s parser hands setup_fancy_logger a str: AttributeError
          'str' object has no attribute 'name')
    procrastinate --app=peer_apps.procrastinate_app worker --concurrency 10

(with bench/ as the working directory, BENCH_PEER_DSN naming the database).

Three jobs in each: `noop` returns at once; `sleep` sleeps 50 ms; `probe` prints the wall-clock
time on its first line, `PROBE <n> <unix time>`, which the bench reads from the worker's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator

import asyncpg
import pgqueuer
import procrastinate
from pgqueuer import AsyncpgDriver, Job, PgQueuer

SLEEP_SECONDS = 0.05


@contextlib.asynccontextmanager
async def pgqueuer_factory() -> AsyncIterator[PgQueuer]:
    connection = await asyncpg.connect(os.environ["BENCH_PEER_DSN"])
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        return None

    @pgq.entrypoint("sleep")
    async def sleep(job: Job) -> None:
        await asyncio.sleep(SLEEP_SECONDS)

    @pgq.entrypoint("probe")
    async def probe(job: Job) -> None:
        at = time.time()
        print(f"PROBE {(job.payload or b'').decode()} {at!r}", flush=True)

    try:
        yield pgq
    finally:
        await connection.close()


def make_procrastinate_app(dsn: str, **pool: int) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, **pool))

    @app.task(name="noop")
    async def noop() -> None:
        return None

    @app.task(name="sleep")
    async def sleep() -> None:
        await asyncio.sleep(SLEEP_SECONDS)

    @app.task(name="probe")
    async def probe(n: int) -> None:
        at = time.time()
        print(f"PROBE {n} {at!r}", flush=True)

    return app


procrastinate_app = make_procrastinate_app(os.environ.get("BENCH_PEER_DSN", ""))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["pgqueuer"]:
        raise SystemExit("usage: python bench/peer_apps.py pgqueuer")
    asyncio.run(pgqueuer.run(pgqueuer_factory, batch_size=5, max_concurrent_tasks=10))
