"""Backups that restore (issue 36; docs/operations.md, "Backups and restores").

A throwaway cluster of the test's own takes a load (runs that sleep, call a counting server,
finish) from `turnstile serve` and a worker; mid-load a backup is taken: a base backup
(`pg_basebackup -X stream`, the WAL it needs included) or a logical dump (`pg_dump -Fc`, for a
small installation). The backup is restored (a new cluster started on the base backup's files,
or `pg_restore` into a new database) and Turnstile started on it: the runs that were running
when the backup was taken hold leases of a past the restored database has left behind, so its
sweeper requeues them, every run of the backup ends terminal, and the shared invariants hold.
What the backup did not hold (submissions after it) is gone: a restore returns to the backup's
moment, which is why the docs pair base backups with a WAL archive.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from uuid import UUID

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.security.api_keys import create_key
from app.store.embedded import LocalCluster, free_port
from app.store.engine import create_engine
from app.store.migrate import upgrade
from tests.support.chaos import TERMINAL, Client, Fleet, Ledger, counting_server, sessionless_script
from tests.support.invariants import check_all_runs
from tests.support.processes import turnstile
from tests.support.waiting import eventually

ENV = {
    "TURNSTILE_LEASE_SECONDS": "3",
    "TURNSTILE_HEARTBEAT_SECONDS": "0.5",
    "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.25",
    "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
    "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0.1",
    "TURNSTILE_RETRY_BACKOFF_MAX_SECONDS": "1",
    "TURNSTILE_HTTP_ALLOWED_HOSTS": "127.0.0.1",
    "TURNSTILE_HTTP_TIMEOUT_SECONDS": "5",
    "TURNSTILE_SLOTS": "interactive:2,async:4,maintenance:1",
    "TURNSTILE_DB_POOL_SIZE": "5",
}
RUNS = 40

Backup = Callable[[], Awaitable[str]]  # takes the backup, returns the restored database's URL


def script(i: int, counter: str, tag: str) -> list[dict[str, object]]:
    """The chaos suite's mix, each run held a while so some are running at the backup."""
    hold = {"call": "sleep", "args": {"seconds": 0.3 + 0.1 * (i % 5)}}
    return [hold, *sessionless_script(i, counter, tag)]


async def counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT status, count(*) FROM runs GROUP BY 1"))).all()
    return {str(status): int(n) for status, n in rows}


async def backup_mid_load(url: str, engine: AsyncEngine, take: Backup) -> tuple[str, Ledger]:
    """Turnstile on `url` under load; `take` runs while runs are running and others queued."""
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    ledger = Ledger()
    env = {"DATABASE_URL": url, **ENV}
    async with AsyncExitStack() as stack:
        counter = await stack.enter_async_context(counting_server())
        port = free_port()
        await stack.enter_async_context(
            turnstile(
                "serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", env=env
            )
        )
        await Fleet(env, stack).start_worker()
        client = Client(f"http://127.0.0.1:{port}", key, ledger)
        stack.push_async_callback(client.aclose)

        async def submit(i: int) -> None:
            tag = f"r{i}"
            body = {"input": {"tag": tag, "script": script(i, counter.base, tag)}}
            response = await client.post("/runs", body, tag)
            assert response.status_code == 202, response.text
            ledger.accept(tag, UUID(response.json()["id"]))

        for i in range(RUNS):
            await submit(i)

        async def midway() -> bool:
            now = await counts(engine)
            return now.get("running", 0) >= 2 and now.get("succeeded", 0) >= 5

        await eventually(midway, within=60, what="runs running and runs finished")
        restored = await take()
        # The service goes on after the backup: what it does now the backup does not hold.
        for i in range(RUNS, RUNS + 10):
            await submit(i)
    return restored, ledger


async def restored_service_finishes(restored: str, ledger: Ledger) -> dict[str, object]:
    """Turnstile on the restored database: every run it holds ends terminal, the running ones
    requeued by the sweeper; the invariants hold."""
    engine = create_engine(Settings(), restored)
    try:
        before = await counts(engine)
        assert before.get("running", 0) >= 1, before  # the backup caught runs mid-flight
        async with engine.connect() as conn:
            ids = [str(i) for i in (await conn.execute(text("SELECT id FROM runs"))).scalars()]
        assert set(ids) <= {str(run_id) for run_id in ledger.accepted.values()}
        assert len(ids) < len(ledger.accepted)  # the later submissions are not in the backup
        key = (await create_key(engine, tenant_id="acme", principal="svc2")).secret
        env = {"DATABASE_URL": restored, **ENV}
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(counting_server())
            port = free_port()
            await stack.enter_async_context(
                turnstile("serve", "--port", str(port), ready=b"Uvicorn running", env=env)
            )

            async def all_terminal() -> bool:
                now = await counts(engine)
                return sum(now.get(s, 0) for s in TERMINAL) == len(ids)

            await eventually(all_terminal, within=120, what="every restored run to finish")
            ready = Client(f"http://127.0.0.1:{port}", key, Ledger())
            stack.push_async_callback(ready.aclose)
            assert (await ready.get("/readyz")).status_code == 200
        async with engine.connect() as conn:
            requeued = (
                await conn.execute(
                    text("SELECT count(*) FROM run_events WHERE type = 'run.requeued'")
                )
            ).scalar_one()
        assert requeued >= before["running"]
        checked = await check_all_runs(engine)
        assert checked == len(ids)
        return {"restored runs": len(ids), "running at the backup": before["running"]}
    finally:
        await engine.dispose()


def owned_folder(cluster: LocalCluster) -> Path:
    """A folder the cluster's server user can write (pg_basebackup runs as that user)."""
    folder = Path(tempfile.mkdtemp(prefix="turnstile-backup-"))
    folder.chmod(0o755)
    if cluster.run_as is not None:
        entry = pwd.getpwnam(cluster.run_as)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    return folder


@pytest.mark.timeout(300)
async def test_a_base_backup_taken_mid_load_restores_and_requeues_its_running_runs(
    throwaway_cluster: LocalCluster,
) -> None:
    url = throwaway_cluster.url()
    await asyncio.to_thread(upgrade, url)
    folder = owned_folder(throwaway_cluster)
    restored_cluster = LocalCluster(
        bin_dir=throwaway_cluster.bin_dir, data_dir=folder / "restored", port=free_port()
    )

    async def base_backup() -> str:
        # -X stream: the WAL written during the copy comes with it, so the copy is consistent
        # on its own; -c fast: a checkpoint now rather than at the next scheduled one.
        done = await asyncio.to_thread(
            throwaway_cluster._run,
            str(throwaway_cluster.bin_dir / "pg_basebackup"),
            *("-h", "127.0.0.1", "-p", str(throwaway_cluster.port), "-U", "postgres"),
            *("-D", str(restored_cluster.data_dir), "-X", "stream", "-c", "fast", "--no-sync"),
        )
        assert done.returncode == 0, done.stderr
        return restored_cluster.url()

    engine = create_engine(Settings(), url)
    try:
        restored, ledger = await backup_mid_load(url, engine, base_backup)
    finally:
        await engine.dispose()
    # The original is gone (a lost machine); the copy starts where the backup ended.
    await asyncio.to_thread(throwaway_cluster.stop, "immediate")
    try:
        await asyncio.to_thread(restored_cluster.start)
        await restored_service_finishes(restored, ledger)
    finally:
        await asyncio.to_thread(restored_cluster.stop, "immediate")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(300)
async def test_a_logical_dump_taken_mid_load_restores_into_a_new_database(
    throwaway_cluster: LocalCluster,
) -> None:
    url = throwaway_cluster.url()
    await asyncio.to_thread(upgrade, url)
    folder = owned_folder(throwaway_cluster)
    dump = folder / "turnstile.dump"
    bin_dir = throwaway_cluster.bin_dir
    connect = ("-h", "127.0.0.1", "-p", str(throwaway_cluster.port), "-U", "postgres")

    async def logical_dump() -> str:
        # One snapshot of the whole database (pg_dump's own repeatable-read transaction).
        steps = [
            (str(bin_dir / "pg_dump"), *connect, "-Fc", "-f", str(dump), "postgres"),
            (str(bin_dir / "createdb"), *connect, "restored"),
            (str(bin_dir / "pg_restore"), *connect, "-d", "restored", "--exit-on-error", str(dump)),
        ]
        for step in steps:
            done = await asyncio.to_thread(throwaway_cluster._run, *step)
            assert done.returncode == 0, (step[0], done.stderr)
        return throwaway_cluster.url("restored")

    engine = create_engine(Settings(), url)
    try:
        restored, ledger = await backup_mid_load(url, engine, logical_dump)
    finally:
        await engine.dispose()
    try:
        await restored_service_finishes(restored, ledger)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
