"""A saturated worker pool keeps its leases and stops claiming (issue 41 item 1), against a real
PostgreSQL: an agent that keeps the event loop busy for longer than its lease (CPU-bound, as a
loop with thousands of model calls is) neither loses its own run nor any other, the pool says
it held back while its loop lagged, and a claim never takes more than the batch cap."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.observability.metrics import Metrics
from app.queue.core import Queue, QueueConfig
from app.vocabulary.classes import PriorityClass
from app.vocabulary.layout import parse_slots
from app.vocabulary.records import ClaimedRun, NewRun
from app.worker.execution import ExecutionContext
from app.worker.pool import WorkerPool
from tests.support.invariants import check_all_runs
from tests.support.waiting import eventually

ASYNC = PriorityClass.ASYNC
LEASE = 2.0
BURN = 1.5 * LEASE  # the loop is busy for longer than the lease


@dataclass
class BurningExecutor:
    """Keeps the event loop busy (CPU, no await) for `burn` seconds of a run that asks for it,
    then checks its lease as every real executor does before a write, and completes."""

    started: list[UUID] = field(default_factory=list)

    async def execute(self, ctx: ExecutionContext) -> None:
        self.started.append(ctx.lease.run_id)
        burn = float((ctx.claimed.run.input or {}).get("burn", 0))
        deadline = time.monotonic() + burn
        while time.monotonic() < deadline:
            sum(range(1000))
        ctx.ensure_may_continue()
        await ctx.checked(await ctx.queue.complete(ctx.lease, {}), "complete")


class RecordingQueue(Queue):
    """The real queue; it notes the limit of every claim."""

    limits: list[int]

    async def claim(self, *args: Any, **kwargs: Any) -> list[ClaimedRun]:
        self.limits.append(int(kwargs["limit"]))
        return await super().claim(*args, **kwargs)


@pytest.fixture
def queue(engine: AsyncEngine) -> RecordingQueue:
    q = RecordingQueue(engine, QueueConfig(lease_seconds=LEASE, backoff_base_seconds=1))
    q.limits = []
    return q


@pytest.fixture
async def pools() -> AsyncIterator[list[WorkerPool]]:
    started: list[WorkerPool] = []
    yield started
    for pool in started:
        await pool.stop(grace_seconds=0)


def new_run(**input_: Any) -> NewRun:
    return NewRun(tenant_id="t", principal="p", agent="scripted", input=input_, priority=ASYNC.base)


async def test_a_pool_whose_loop_is_saturated_keeps_its_leases_and_holds_back(
    queue: RecordingQueue, engine: AsyncEngine, pools: list[WorkerPool]
) -> None:
    metrics = Metrics()
    executor = BurningExecutor()
    pool = WorkerPool(
        queue,
        executor,
        parse_slots("interactive:1,async:1,maintenance:1"),
        lease_seconds=LEASE,
        heartbeat_seconds=0.2,
        poll_interval_seconds=0.1,
        metrics=metrics,
    )
    burner = await queue.enqueue(new_run(burn=BURN))
    quick = [await queue.enqueue(new_run()) for _ in range(3)]
    await pool.start()
    pools.append(pool)

    async def all_succeeded() -> bool:
        runs = [await queue.get_run(r.id) for r in (burner, *quick)]
        return all(r is not None and r.status == "succeeded" for r in runs)

    await eventually(all_succeeded, within=30, what="every run to succeed")
    for run in (burner, *quick):
        state = await queue.get_run(run.id)
        assert state is not None
        assert state.attempts == 1, state
        types = [e.type for e in await queue.events(run.id)]
        assert "run.fenced" not in types, types
        assert "run.requeued" not in types, types
    assert executor.started[0] == burner.id
    # Its loop lagged by the burn after it: the pool held back rather than claim.
    assert pool.held_back_ever
    assert pool.held_back_rounds >= 1
    rounds = metrics.registry.get_sample_value("turnstile_worker_held_back_rounds_total")
    assert rounds is not None
    assert rounds >= 1
    assert metrics.registry.get_sample_value("turnstile_worker_holding_back") == 0
    assert await check_all_runs(engine) == 4


async def test_a_claim_takes_at_most_the_batch_cap(
    queue: RecordingQueue, engine: AsyncEngine, pools: list[WorkerPool]
) -> None:
    executor = BurningExecutor()
    pool = WorkerPool(
        queue,
        executor,
        parse_slots("interactive:1,async:20,maintenance:1"),
        lease_seconds=LEASE,
        heartbeat_seconds=0.5,
        poll_interval_seconds=0.1,
        claim_batch_max=3,
    )
    runs = [await queue.enqueue(new_run()) for _ in range(10)]
    await pool.start()
    pools.append(pool)

    async def done() -> bool:
        states = [await queue.get_run(r.id) for r in runs]
        return all(s is not None and s.status == "succeeded" for s in states)

    await eventually(done, within=30, what="every run to succeed")
    assert queue.limits
    assert max(queue.limits) <= 3
    assert await check_all_runs(engine) == 10
