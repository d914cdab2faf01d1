"""`turnstile worker` as a real OS process: it runs runs, and SIGTERM drains it (the running
run is released with its attempt given back and finishes elsewhere), exiting 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import AbstractAsyncContextManager
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.store.embedded import LocalCluster, free_port
from app.store.migrate import upgrade
from app.vocabulary.records import NewRun, Run
from tests.support.processes import Child, run_cli, turnstile
from tests.support.waiting import eventually


def worker_process(database_url: str, **env: str) -> AbstractAsyncContextManager[Child]:
    return turnstile(
        "worker",
        ready=b"running slots",
        env={"DATABASE_URL": database_url, "TURNSTILE_POLL_INTERVAL_SECONDS": "60", **env},
    )


async def run_state(queue: Queue, run_id: Any) -> Run:
    run = await queue.get_run(run_id)
    assert run is not None
    return run


def scripted(*steps: dict[str, Any]) -> NewRun:
    return NewRun(tenant_id="t", principal="p", agent="scripted", input={"script": list(steps)})


async def test_a_worker_process_runs_runs_and_drains_on_sigterm(
    database_url: str, engine: AsyncEngine
) -> None:
    queue = Queue(engine)
    async with worker_process(database_url, TURNSTILE_DRAIN_GRACE_SECONDS="0") as worker:
        quick = await queue.enqueue(scripted({"call": "echo", "args": {}}, {"final": "ok"}))

        async def finished(run_id: Any) -> bool:
            return (await run_state(queue, run_id)).status == "succeeded"

        await eventually(lambda: finished(quick.id), within=20, what="the quick run")
        slow = await queue.enqueue(scripted({"call": "sleep", "args": {"seconds": 5}}))

        async def sleeping() -> bool:
            types = [e.type for e in await queue.events(slow.id)]
            return "tool.started" in types

        await eventually(sleeping, within=20, what="the slow run's tool call")
        worker.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(worker.process.wait(), 30) == 0
    # An operator's supervisor sees the drain and the stop in the worker's output.
    assert b"turnstile: draining" in worker.log
    assert worker.log.rstrip().endswith(b"turnstile: worker stopped")
    released = await run_state(queue, slow.id)
    assert (released.status, released.attempts, released.lease_owner) == ("queued", 0, None)
    last = (await queue.events(slow.id))[-1]
    assert (last.type, last.data["graceful"]) == ("run.released", True)
    async with engine.connect() as conn:
        stopped = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM workers WHERE role = 'worker' AND stopped_at IS NOT NULL"
                )
            )
        ).scalar_one()
    assert stopped == 1

    # Another worker finishes it, from its journal: the sleep started but has no outcome, and
    # being safe it runs again. Its attempt was given back, so it shows 1.
    async with worker_process(database_url):
        await eventually(lambda: finished(slow.id), within=60, what="the released run")
    assert (await run_state(queue, slow.id)).attempts == 1


async def test_a_worker_refuses_an_unmigrated_database(empty_database: str) -> None:
    code, _, err = await run_cli("worker", env={"DATABASE_URL": empty_database})
    assert code == 2
    assert err.strip().startswith("turnstile: the database schema is at nothing")
    assert err.strip().count("\n") == 0


async def test_a_worker_started_before_its_database_waits_for_it(
    throwaway_cluster: LocalCluster,
) -> None:
    """A fleet may start before its database: the worker retries with backoff, a line per
    failure, and runs once the database is up (it used to exit at the first refusal)."""
    url = throwaway_cluster.url()
    await asyncio.to_thread(upgrade, url)
    await asyncio.to_thread(throwaway_cluster.stop, "fast")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "DATABASE_URL": url, "TURNSTILE_POLL_INTERVAL_SECONDS": "60"},
    )
    assert process.stderr is not None
    try:
        first = await asyncio.wait_for(process.stderr.readline(), 60)
        assert b"database unreachable" in first
        assert b"retrying in" in first
        await asyncio.to_thread(throwaway_cluster.start)
        lines = [first]
        while b"running slots" not in lines[-1]:
            line = await asyncio.wait_for(process.stderr.readline(), 60)
            assert line, b"".join(lines).decode(errors="replace")
            lines.append(line)
        log = b"".join(lines).decode(errors="replace")
        assert "Traceback" not in log, log
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 60) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_worker_gives_up_on_an_unreachable_database_after_its_timeout() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"  # nothing listens there
    code, _, err = await run_cli(
        "worker", env={"DATABASE_URL": url, "TURNSTILE_WORKER_START_TIMEOUT_SECONDS": "1"}
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("turnstile: database unreachable")
    assert all("database unreachable" in line for line in lines)
