"""Maintenance across real processes: of two workers, exactly one runs each maintenance
service, and when that one is killed (SIGKILL, no goodbye) the survivor takes over."""

from __future__ import annotations

import signal
from contextlib import AbstractAsyncContextManager

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.embedded import free_port
from tests.support.processes import Child, turnstile
from tests.support.waiting import eventually

SERVICES = (
    "sweeper",
    "idempotency-pruner",
    "run-retention",
    "session-retention",
    "queue-metrics",
    "scheduler",
    # Stale has_work flags of tenants' count rows (docs/adr/0006, "Striped queued counts").
    "work-settler",
    # Runs past their deadline to start (docs/start-deadlines.md).
    "expirer",
)


async def maintained(port: int) -> set[str]:
    """The maintenance services this process has run (from its own metrics)."""
    async with httpx.AsyncClient() as client:
        body = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    return {
        sample.labels["service"]
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == "turnstile_maintenance_last_success_timestamp_seconds"
    }


def worker(database_url: str, port: int) -> AbstractAsyncContextManager[Child]:
    return turnstile(
        "worker",
        "--metrics-port",
        str(port),
        ready=b"running slots",
        env={
            "DATABASE_URL": database_url,
            # Short intervals: leases of max(3 x interval, 5 s) = 5 s.
            "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_PRUNE_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_RETENTION_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_QUEUE_METRICS_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_SCHEDULE_INTERVAL_SECONDS": "0.5",
        },
    )


async def test_maintenance_runs_once_and_moves_to_the_survivor(
    database_url: str, engine: AsyncEngine
) -> None:
    ports = [free_port(), free_port()]
    async with worker(database_url, ports[0]) as one, worker(database_url, ports[1]) as two:
        processes = [one.process, two.process]

        async def split() -> tuple[set[str], set[str]] | None:
            first, second = await maintained(ports[0]), await maintained(ports[1])
            return (first, second) if (first | second) >= set(SERVICES) else None

        first, second = await eventually(split, within=30, what="every service to run")
        # Each service ran in one process only.
        assert not first & second, (first, second)
        async with engine.connect() as conn:
            holders = dict(
                (await conn.execute(text("SELECT name, holder FROM maintenance_leases"))).all()
            )
        assert set(holders) == set(SERVICES)

        victim = 0 if first else 1
        survivor = 1 - victim
        before = await maintained(ports[survivor])
        processes[victim].send_signal(signal.SIGKILL)
        await processes[victim].wait()

        async def taken_over() -> set[str] | None:
            now = await maintained(ports[survivor])
            return now if now >= set(SERVICES) else None

        after = await eventually(taken_over, within=30, what="the survivor to take over")
        assert after - before == (first if victim == 0 else second)
        async with engine.connect() as conn:
            survivors = set(
                (
                    await conn.execute(text("SELECT DISTINCT holder FROM maintenance_leases"))
                ).scalars()
            )
        assert len(survivors) == 1
        assert survivors != {holders[next(iter(first if victim == 0 else second))]}
