"""The batched paths the benchmark asked for: group-committed completions (`complete_many`, the
slot group's `CompletionBatcher`) and the one-statement resume read. A batch shares its
statement and nothing else: every run in it is fenced on its own lease."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import asyncpg
import pytest

from app.queue.core import Queue
from app.store.engine import plain_url
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Fenced, Lease, NewRun, ToolCall, Written
from app.worker.completions import CompletionBatcher
from app.worker.execution import ExecutionContext, StopExecution
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs

ASYNC = PriorityClass.ASYNC


def new_run(**kwargs: Any) -> NewRun:
    kwargs.setdefault("input", {"n": 1})
    return NewRun(tenant_id="t", principal="p", agent="scripted", priority=ASYNC.base, **kwargs)


async def claim(queue: Queue, count: int, owner: str = "w") -> list[Lease]:
    claimed = await queue.claim(owner, [ASYNC], limit=count)
    assert len(claimed) == count
    return [c.lease for c in claimed]


async def event_types(queue: Queue, run_id: Any) -> list[str]:
    return [e.type for e in await queue.events(run_id)]


async def test_complete_many_fences_each_run_on_its_own(queue: Queue, clock: ManualClock) -> None:
    for _ in range(4):
        await queue.enqueue(new_run())
    held, cancelled, reclaimed, finished = await claim(queue, 4, owner="slow")
    await queue.cancel(cancelled.run_id, actor="op")
    assert isinstance(await queue.complete(finished, {"first": True}), Written)
    # `reclaimed` loses its lease to the sweeper and another worker claims the run again;
    # `held` keeps its lease throughout with heartbeats.
    clock.advance(20)
    assert await queue.heartbeat(held)
    clock.advance(11)
    assert (await queue.sweep()).requeued == 1
    clock.advance(10)  # past the backoff
    (new,) = await claim(queue, 1, owner="fast")
    assert new.run_id == reclaimed.run_id
    assert new.epoch == reclaimed.epoch + 1
    before = {lease.run_id: await queue.get_run(lease.run_id) for lease in (cancelled, reclaimed)}

    outcomes = await queue.complete_many(
        [(held, {"n": 1}), (cancelled, {"n": 2}), (reclaimed, {"n": 3}), (finished, {"n": 4})]
    )

    assert isinstance(outcomes[0], Written)
    assert [type(o) for o in outcomes[1:]] == [Fenced, Fenced, Fenced]
    assert [o.lease for o in outcomes[1:] if isinstance(o, Fenced)] == [
        cancelled,
        reclaimed,
        finished,
    ]
    done = await queue.get_run(held.run_id)
    assert done is not None
    assert (done.status, done.result) == ("succeeded", {"n": 1})
    last = (await queue.events(held.run_id))[-1]
    assert (last.type, last.epoch, last.seq) == ("run.succeeded", held.epoch, outcomes[0].seq)
    # The runs whose fence failed are exactly as they were: not even their event counter moved.
    for run_id, run in before.items():
        assert await queue.get_run(run_id) == run
        assert "run.succeeded" not in await event_types(queue, run_id)
    first = await queue.get_run(finished.run_id)
    assert first is not None
    assert first.result == {"first": True}
    assert (await event_types(queue, finished.run_id)).count("run.succeeded") == 1
    # The new holder of the reclaimed run still completes it.
    assert isinstance((await queue.complete_many([(new, {"n": 5})]))[0], Written)
    assert await check_all_runs(queue.engine) == 4


async def test_complete_many_writes_nothing_and_notifies_nobody_when_all_are_fenced(
    queue: Queue, database_url: str
) -> None:
    await queue.enqueue(new_run())
    (lease,) = await claim(queue, 1)
    await queue.cancel(lease.run_id, actor="op")
    listener = await asyncpg.connect(plain_url(database_url))
    heard: list[str] = []
    await listener.add_listener("turnstile", lambda *args: heard.append(args[3]))
    try:
        assert [type(o) for o in await queue.complete_many([(lease, {})])] == [Fenced]
        assert await queue.complete_many([]) == []
        await listener.execute("SELECT 1")  # a round trip, so a notification would be in
    finally:
        await listener.close()
    assert heard == []


async def test_complete_many_commits_once_with_one_notification(
    queue: Queue, database_url: str
) -> None:
    for _ in range(3):
        await queue.enqueue(new_run())
    leases = await claim(queue, 3)
    listener = await asyncpg.connect(plain_url(database_url))
    heard: list[str] = []
    await listener.add_listener("turnstile", lambda *args: heard.append(args[3]))
    try:
        outcomes = await queue.complete_many([(lease, {"i": i}) for i, lease in enumerate(leases)])
        for _ in range(50):
            if heard:
                break
            await asyncio.sleep(0.02)
        await listener.execute("SELECT 1")
    finally:
        await listener.close()
    assert all(isinstance(o, Written) for o in outcomes)
    assert len(heard) == 1
    payload = json.loads(heard[0])  # the runs by id prefix (payloads are bounded)
    assert payload["more"] is False
    assert sorted(payload["runs"]) == sorted(str(lease.run_id)[:8] for lease in leases)
    for i, lease in enumerate(leases):
        run = await queue.get_run(lease.run_id)
        assert run is not None
        assert run.result == {"i": i}
    assert await check_all_runs(queue.engine) == 3


async def test_batcher_groups_completions_and_fences_each(queue: Queue) -> None:
    for _ in range(12):
        await queue.enqueue(new_run())
    leases = await claim(queue, 12)
    lost = leases[5]
    await queue.cancel(lost.run_id, actor="op")
    batcher = CompletionBatcher(queue)

    outcomes = await asyncio.gather(*(batcher.complete(lease, {"ok": 1}) for lease in leases))

    # All twelve were waiting before the flusher ran: one statement, one commit.
    assert batcher.statements == 1
    assert [isinstance(o, Fenced) for o in outcomes] == [lease == lost for lease in leases]
    lost_run = await queue.get_run(lost.run_id)
    assert lost_run is not None
    assert lost_run.status == "cancelled"
    for lease in leases:
        if lease != lost:
            run = await queue.get_run(lease.run_id)
            assert run is not None
            assert run.status == "succeeded"
    assert await check_all_runs(queue.engine) == 12


async def test_a_caller_cancelled_before_its_batch_writes_nothing(queue: Queue) -> None:
    for _ in range(3):
        await queue.enqueue(new_run())
    first, second, third = await claim(queue, 3)
    batcher = CompletionBatcher(queue)
    flying = asyncio.create_task(batcher.complete(first, {}))
    await asyncio.sleep(0)  # the first batch is on its way
    gone = asyncio.create_task(batcher.complete(second, {}))
    kept = asyncio.create_task(batcher.complete(third, {}))
    await asyncio.sleep(0)
    gone.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    assert isinstance(await flying, Written)
    assert isinstance(await kept, Written)
    run = await queue.get_run(second.run_id)
    assert run is not None
    assert run.status == "running"
    assert await event_types(queue, second.run_id) == ["run.created", "run.claimed"]


async def test_a_fenced_batched_completion_records_run_fenced(queue: Queue) -> None:
    await queue.enqueue(new_run())
    claimed = (await queue.claim("w", [ASYNC]))[0]
    ctx = ExecutionContext(
        queue=queue,
        claimed=claimed,
        slot_group="async",
        lease_seconds=30,
        completions=CompletionBatcher(queue),
    )
    await queue.cancel(claimed.lease.run_id, actor="op")
    with pytest.raises(StopExecution):
        await ctx.complete({"late": True})
    assert await event_types(queue, claimed.lease.run_id) == [
        "run.created",
        "run.claimed",
        "run.cancelled",
        "run.fenced",
    ]
    assert await check_all_runs(queue.engine) == 1


async def test_resume_state_reads_what_the_three_reads_read(
    queue: Queue, clock: ManualClock
) -> None:
    run = await queue.enqueue(new_run(input={"script": []}))
    claimed = (await queue.claim("w", [ASYNC]))[0]
    # A first claim has nothing to read: its only input is its own.
    fresh = await queue.resume_state(claimed.run)
    assert (fresh.checkpoint, fresh.inputs, fresh.journal) == (None, [{"script": []}], [])
    lease = claimed.lease
    call = ToolCall(step=1, tool="echo", idempotency_class="safe", args={"a": 1})
    await queue.tool_started(lease, call)
    await queue.tool_finished(lease, call, "succeeded", {"echo": 1}, {"step": 1})
    second = ToolCall(step=2, tool="echo", idempotency_class="unsafe", args={"b": 2})
    await queue.tool_started(lease, second)
    await queue.wait_for_user(lease, "which?", step=2, state={"step": 2})
    await queue.deliver_input(run.id, "this one", principal="p")
    clock.advance(1)
    again = (await queue.claim("w", [ASYNC]))[0]
    state = await queue.resume_state(again.run)
    assert state.checkpoint == await queue.latest_checkpoint(run.id)
    assert state.checkpoint is not None
    assert state.checkpoint.state == {"step": 2}
    assert state.inputs == await queue.inputs(run.id) == [{"script": []}, "this one"]
    assert state.journal == await queue.journal(run.id)
    assert [(e.step, e.entry) for e in state.journal] == [
        (1, "started"),
        (1, "finished"),
        (2, "started"),
    ]
