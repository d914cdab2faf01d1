"""Worker ids are opaque (`w-` and random hex): what a tenant sees of the worker that holds or
held its run (run.claimed and run.fenced events, the sweeper's failure, the dashboard's run page)
names no host and no process id. The workers table keeps host and pid per id, and operator and
admin keys are shown them on the dashboard's run page."""

from __future__ import annotations

import os
import re
import socket
from typing import Any
from uuid import UUID

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue, QueueConfig
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from app.worker.pool import new_worker_id
from tests.support.api import Api, running_api
from tests.support.clock import ManualClock
from tests.support.waiting import eventually

OPAQUE = re.compile(r"^w-[0-9a-f]{16}$")
HOST_AND_PID = f"{socket.gethostname()}:{os.getpid()}"
PID = str(os.getpid())


async def signed_in(api: Api, key: str) -> httpx.AsyncClient:
    client = httpx.AsyncClient(base_url=api.base, timeout=30)
    api.clients.append(client)
    assert (await client.post("/ui/sign-in", data={"key": key})).status_code == 303
    return client


def test_new_worker_ids_are_opaque() -> None:
    ids = {new_worker_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(OPAQUE.match(worker_id) for worker_id in ids)


async def test_tenants_see_opaque_worker_ids_and_operators_the_host(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url, engine, workers=True, lease_seconds=3, heartbeat_seconds=0.5
    ) as api:
        tenant = await api.client("acme", "alice")
        submitted = await tenant.post(
            "/runs", json={"input": {"script": [{"call": "sleep", "args": {"seconds": 60}}]}}
        )
        run_id = submitted.json()["id"]

        async def running() -> bool:
            return bool((await tenant.get(f"/runs/{run_id}")).json()["status"] == "running")

        await eventually(running, what="the run to be claimed")
        owner = (await api.queue.get_run(UUID(run_id))).lease_owner  # type: ignore[union-attr]
        assert owner is not None
        assert OPAQUE.match(owner), owner
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    text("SELECT host, pid FROM workers WHERE id = :id"), {"id": owner}
                )
            ).one()
        assert (row.host, row.pid) == (socket.gethostname(), os.getpid())

        tenant_page = (
            await (await signed_in(api, await api.key("acme", "alice"))).get(f"/ui/runs/{run_id}")
        ).text
        assert owner in tenant_page
        assert HOST_AND_PID not in tenant_page
        assert f"pid {PID}" not in tenant_page
        operator_page = (
            await (await signed_in(api, await api.key("acme", "ops", "operator"))).get(
                f"/ui/runs/{run_id}"
            )
        ).text
        assert f"{socket.gethostname()}, pid {PID}" in operator_page

        # Cancelled under the worker: its next heartbeat finds the run gone and it writes its
        # one run.fenced event.
        assert (await tenant.post(f"/runs/{run_id}/cancel")).status_code == 200

        async def fenced() -> list[dict[str, Any]] | None:
            events = (await tenant.get(f"/runs/{run_id}/events")).json()["events"]
            return events if any(e["type"] == "run.fenced" for e in events) else None

        events = await eventually(fenced, what="the run.fenced event")
    owners = [e["data"]["owner"] for e in events if e["type"] in ("run.claimed", "run.fenced")]
    assert owners == [owner, owner]
    assert HOST_AND_PID not in str(events)


async def test_the_sweepers_failure_names_no_host(engine: AsyncEngine) -> None:
    clock = ManualClock()
    queue = Queue(engine, QueueConfig(lease_seconds=30, max_attempts=1), clock=clock)
    run = await queue.enqueue(
        NewRun(tenant_id="t", principal="p", agent="scripted", input={}, priority=0)
    )
    worker_id = new_worker_id()
    await queue.claim(worker_id, list(PriorityClass))
    clock.advance(31)
    await queue.sweep()
    failed = await queue.get_run(run.id)
    assert failed is not None
    assert failed.status == "failed"
    assert worker_id in failed.failure["message"]
    assert socket.gethostname() + ":" not in failed.failure["message"]
