"""The fair-share bookkeeping under interleavings a review found (issue 32, defect 1).

A claim has locked run X and moved its tenant's running count, but not committed; a cancel of
X (or an endpoint delete cancelling X, a webhook delivery) starts meanwhile, reads its snapshot
of the counts, and waits on X's row. When the claim commits, the cancel must move the counts
from what the claim left, not from its snapshot: it used to apply -1 to the snapshot's 0 and
fail `CHECK (running >= 0)`, answering 500. Each interleaving is held open on real connections
and waits on pg_stat_activity's wait events, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.queue.core import Queue
from app.store.statements import q
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.invariants import check_all_runs
from tests.support.waiting import eventually

ASYNC = PriorityClass.ASYNC


def new_run(tenant: str) -> NewRun:
    return NewRun(
        tenant_id=tenant,
        principal="p",
        agent="scripted",
        input={"script": [{"final": 1}]},
        priority=ASYNC.base,
    )


async def pid_of(conn: AsyncConnection) -> int:
    return int(await conn.scalar(text("SELECT pg_backend_pid()")))


async def waiting_on_a_lock(engine: AsyncEngine, pid: int) -> bool:
    async with engine.connect() as conn:
        waits = await conn.scalar(
            text("SELECT a.wait_event_type = 'Lock' FROM pg_stat_activity a WHERE a.pid = :pid"),
            {"pid": pid},
        )
    return bool(waits)


async def claim_on(conn: AsyncConnection, queue: Queue, name: str, limit: int = 1) -> list[Any]:
    """A claim statement on the caller's transaction, left open by the caller."""
    params: dict[str, Any] = {
        "owner": "holder",
        "priorities": [ASYNC.base + i for i in range(10)],
        "lease_seconds": 30.0,
        "limit": limit,
        "max_running": [None, None, None],
        "now": queue.clock(),
        "claim": None,
    }
    rows = await conn.execute(q(name), params)
    return [row["id"] for row in rows.mappings().all() if row["id"] is not None]


async def running_count(engine: AsyncEngine, tenant: str) -> int:
    async with engine.connect() as conn:
        found = await conn.scalar(
            text("SELECT running FROM tenant_class_counts WHERE tenant_id = :t AND band = 1"),
            {"t": tenant},
        )
    return int(found or 0)


async def _cancel_while_claim_in_flight(
    queue: Queue, claim: str, limited: bool, limit: int = 1
) -> None:
    engine = queue.engine
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    if limited:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO tenant_limits (tenant_id, max_running) "
                    "VALUES (:t, CAST('{\"async\": 5}' AS jsonb))"
                ),
                {"t": tenant},
            )
    run = await queue.enqueue(new_run(tenant))
    async with contextlib.AsyncExitStack() as stack:
        holder = await stack.enter_async_context(engine.connect())
        await holder.begin()
        assert await claim_on(holder, queue, claim, limit) == [run.id]
        canceller = await stack.enter_async_context(engine.connect())
        pid = await pid_of(canceller)
        await canceller.commit()
        cancel = asyncio.create_task(
            queue.cancel(run.id, actor="op", reason="race", conn=canceller)
        )
        await eventually(lambda: waiting_on_a_lock(engine, pid), what="the cancel waits on X")
        await holder.commit()
        outcome = await cancel
        await canceller.commit()
    assert outcome.changed
    assert outcome.run.status == "cancelled"
    assert await running_count(engine, tenant) == 0
    await check_all_runs(engine)


async def test_a_cancel_racing_a_claim_moves_the_counts_the_claim_left(queue: Queue) -> None:
    await _cancel_while_claim_in_flight(queue, "claim", limited=False)


async def test_a_cancel_racing_a_limited_claim(queue: Queue) -> None:
    await _cancel_while_claim_in_flight(queue, "claim", limited=True)


async def test_a_cancel_racing_a_batch_claim_moves_the_counts_the_claim_left(queue: Queue) -> None:
    await _cancel_while_claim_in_flight(queue, "claim", limited=False, limit=8)


async def test_a_cancel_racing_claim_fifo_moves_the_counts_the_claim_left(queue: Queue) -> None:
    await _cancel_while_claim_in_flight(queue, "claim_fifo", limited=False)
