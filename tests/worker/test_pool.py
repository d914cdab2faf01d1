"""The worker pool against a real PostgreSQL: reserved capacity per class, NOTIFY wakeups and
LISTEN reconnection, fencing by heartbeat, self-fencing, graceful drain, executor errors, and
the lifespan starting and stopping the pool inside a real uvicorn server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.main import create_app
from app.queue.core import Queue, QueueConfig
from app.store.engine import create_engine
from app.vocabulary.classes import PriorityClass
from app.vocabulary.layout import parse_slots
from app.vocabulary.records import NewRun, Run
from app.worker.execution import ExecutionContext, Executor
from app.worker.notifier import Notifier
from app.worker.pool import WorkerPool
from tests.support.executors import CompletingExecutor
from tests.support.invariants import check_all_runs
from tests.support.servers import running_server
from tests.support.waiting import eventually

INTERACTIVE, ASYNC, MAINTENANCE = PriorityClass
SLOW_POLL = 60.0  # far longer than any wait below: a prompt claim can only come from NOTIFY


@dataclass
class BlockingExecutor:
    """Holds every run it gets until the test lets it go; records what it saw."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    started: list[UUID] = field(default_factory=list)
    interrupted: list[tuple[UUID, bool, bool]] = field(default_factory=list)

    async def execute(self, ctx: ExecutionContext) -> None:
        self.started.append(ctx.lease.run_id)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.interrupted.append((ctx.lease.run_id, ctx.fenced, ctx.self_fenced))
            raise
        ctx.ensure_may_continue()
        await ctx.checked(await ctx.queue.complete(ctx.lease, {}), "complete")


@pytest.fixture
def fast_queue(engine: AsyncEngine) -> Queue:
    return Queue(engine, QueueConfig(lease_seconds=5, backoff_base_seconds=1))


@pytest.fixture
async def make_pool(fast_queue: Queue, database_url: str) -> AsyncIterator[Callable[..., Any]]:
    started: list[tuple[WorkerPool, Notifier]] = []

    async def factory(
        executor: Executor,
        slots: str = "interactive:1,async:2,maintenance:1",
        *,
        heartbeat: float = 0.5,
        lease: float = 5.0,
        poll: float = SLOW_POLL,
        queue: Queue | None = None,
    ) -> WorkerPool:
        notifier = Notifier(database_url)
        await notifier.start()
        await asyncio.wait_for(notifier.connected.wait(), 10)
        pool = WorkerPool(
            queue or fast_queue,
            executor,
            parse_slots(slots),
            lease_seconds=lease,
            heartbeat_seconds=heartbeat,
            poll_interval_seconds=poll,
            notifier=notifier,
        )
        await pool.start()
        started.append((pool, notifier))
        return pool

    yield factory
    for pool, notifier in started:
        await pool.stop(grace_seconds=0)
        await notifier.stop()


def new_run(klass: PriorityClass, **kwargs: Any) -> NewRun:
    return NewRun(
        tenant_id="t", principal="p", agent="scripted", input={}, priority=klass.base, **kwargs
    )


async def status_of(queue: Queue, run_id: UUID) -> Run:
    run = await queue.get_run(run_id)
    assert run is not None
    return run


async def count(engine: AsyncEngine, sql: str, **params: Any) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql), params)).scalar_one())


async def test_interactive_run_is_claimed_at_once_behind_a_full_async_backlog(
    make_pool: Callable[..., Any], fast_queue: Queue, engine: AsyncEngine
) -> None:
    executor = BlockingExecutor()
    pool: WorkerPool = await make_pool(executor)
    await fast_queue.enqueue_many(
        tenant_id="t", principal="p", runs=[("scripted", {}, ASYNC.base, None)] * 500
    )

    async def async_slots_full() -> bool:
        return pool.occupancy()["async"]["busy"] == 2

    await eventually(async_slots_full, what="both async slots busy")
    interactive = await fast_queue.enqueue(new_run(INTERACTIVE))

    async def claimed() -> Run | None:
        run = await status_of(fast_queue, interactive.id)
        return run if run.status == "running" else None

    run = await eventually(claimed, within=10, what="the interactive run claimed")
    assert run.lease_owner == pool.worker_id
    assert pool.occupancy()["interactive"] == {"busy": 1, "size": 1}
    # The backlog did not move: no async slot was freed, none was borrowed.
    queued = await count(engine, "SELECT count(*) FROM runs WHERE status = 'queued'")
    assert queued == 498
    executor.release.set()


async def test_sustained_interactive_load_does_not_starve_maintenance(
    make_pool: Callable[..., Any], fast_queue: Queue, engine: AsyncEngine
) -> None:
    await make_pool(CompletingExecutor(pause_seconds=0.01), "interactive:2,async:1,maintenance:1")
    stop = asyncio.Event()

    async def keep_interactive_busy() -> None:
        while not stop.is_set():
            backlog = await count(
                engine, "SELECT count(*) FROM runs WHERE status = 'queued' AND priority = 0"
            )
            if backlog < 30:
                await fast_queue.enqueue_many(
                    tenant_id="t",
                    principal="p",
                    runs=[("scripted", {}, INTERACTIVE.base, None)] * 30,
                )
            await asyncio.sleep(0.01)

    load = asyncio.create_task(keep_interactive_busy())
    try:
        maintenance = await fast_queue.enqueue(new_run(MAINTENANCE))

        async def done() -> bool:
            return (await status_of(fast_queue, maintenance.id)).status == "succeeded"

        await eventually(done, within=10, what="the maintenance run to finish")
        still_queued = await count(
            engine, "SELECT count(*) FROM runs WHERE status = 'queued' AND priority = 0"
        )
        assert still_queued > 0, "the interactive load was not sustained"
    finally:
        stop.set()
        await load


async def test_notify_wakes_an_idle_slot_and_listen_reconnects(
    make_pool: Callable[..., Any], fast_queue: Queue, engine: AsyncEngine
) -> None:
    pool: WorkerPool = await make_pool(CompletingExecutor())
    notifier = pool.notifier
    assert notifier is not None

    async def finished(run_id: UUID) -> bool:
        return (await status_of(fast_queue, run_id)).status == "succeeded"

    first = await fast_queue.enqueue(new_run(ASYNC))
    await eventually(lambda: finished(first.id), within=10, what="claim after NOTIFY")

    old_pid = notifier.backend_pid
    async with engine.connect() as conn:
        killed = await conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": old_pid})
    assert killed is True

    async def reconnected() -> bool:
        return notifier.connections >= 2 and notifier.connected.is_set()

    await eventually(reconnected, within=10, what="LISTEN re-established")
    assert notifier.backend_pid != old_pid
    second = await fast_queue.enqueue(new_run(INTERACTIVE))
    await eventually(lambda: finished(second.id), within=10, what="claim after reconnect")


async def test_fenced_heartbeat_cancels_the_execution_before_its_next_write(
    make_pool: Callable[..., Any], fast_queue: Queue
) -> None:
    wrote_after = asyncio.Event()
    in_tool = asyncio.Event()
    cancelled: list[bool] = []

    class LongToolExecutor:
        async def execute(self, ctx: ExecutionContext) -> None:
            await ctx.checked(await ctx.queue.append_event(ctx.lease, "agent.note", {}), "note")
            in_tool.set()
            try:
                await asyncio.sleep(60)  # a long tool call, interrupted by the pool
            except asyncio.CancelledError:
                cancelled.append(ctx.fenced)
                raise
            await ctx.queue.append_event(ctx.lease, "agent.after", {})
            wrote_after.set()

    await make_pool(LongToolExecutor(), heartbeat=0.05)
    run = await fast_queue.enqueue(new_run(INTERACTIVE))
    await asyncio.wait_for(in_tool.wait(), 10)
    await fast_queue.cancel(run.id, actor="test")

    async def fenced_recorded() -> list[Any] | None:
        events = await fast_queue.events(run.id)
        return events if events[-1].type == "run.fenced" else None

    events = await eventually(fenced_recorded, within=10, what="run.fenced after the heartbeat")
    assert cancelled == [True]
    assert not wrote_after.is_set()
    assert [e.type for e in events][-3:] == ["agent.note", "run.cancelled", "run.fenced"]
    assert events[-1].data["during"] == "heartbeat"


async def test_self_fencing_stops_a_run_whose_heartbeats_fail(
    database_url: str, make_pool: Callable[..., Any]
) -> None:
    # Heartbeats fail with errors (a lock held elsewhere makes them time out), not with fencing.
    quick = create_engine(Settings(lock_timeout_ms=50, statement_timeout_ms=200), database_url)
    try:
        queue = Queue(quick, QueueConfig(lease_seconds=1.0))
        executor = BlockingExecutor()
        # Heartbeats go through the engine with the short lock timeout.
        pool: WorkerPool = await make_pool(executor, heartbeat=0.1, lease=1.0, queue=queue)
        run = await queue.enqueue(new_run(INTERACTIVE))

        async def executing() -> bool:
            return run.id in executor.started

        await eventually(executing, what="the run executing")
        async with quick.connect() as locker:
            await locker.execute(text("SET statement_timeout = 0"))
            await locker.execute(
                text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": run.id}
            )

            async def interrupted() -> bool:
                return bool(executor.interrupted)

            await eventually(interrupted, within=10, what="the self-fence")
            assert executor.interrupted == [(run.id, False, True)]
            assert pool.heartbeat_failures > 0
            await locker.rollback()
        # Nothing was written for the run by the self-fenced holder: it is still running, its
        # lease untouched, waiting for the sweeper.
        state = await queue.get_run(run.id)
        assert state is not None
        assert state.status == "running"
        assert [e.type for e in await queue.events(run.id)] == ["run.created", "run.claimed"]
    finally:
        await quick.dispose()


async def test_graceful_stop_releases_held_runs_and_deregisters(
    make_pool: Callable[..., Any], fast_queue: Queue, engine: AsyncEngine
) -> None:
    executor = BlockingExecutor()
    pool: WorkerPool = await make_pool(executor)
    runs = [await fast_queue.enqueue(new_run(ASYNC)) for _ in range(2)]

    async def both_running() -> bool:
        return len(executor.started) == 2

    await eventually(both_running, what="both runs executing")
    await pool.stop(grace_seconds=0.05)
    for run in runs:
        state = await status_of(fast_queue, run.id)
        assert (state.status, state.attempts, state.lease_owner) == ("queued", 0, None)
        last = (await fast_queue.events(run.id))[-1]
        assert (last.type, last.data["graceful"]) == ("run.released", True)
    stopped = await count(
        engine,
        "SELECT count(*) FROM workers WHERE id = :id AND stopped_at IS NOT NULL",
        id=pool.worker_id,
    )
    assert stopped == 1


async def test_an_executor_error_releases_the_run_early(
    make_pool: Callable[..., Any], fast_queue: Queue
) -> None:
    class Broken:
        async def execute(self, ctx: ExecutionContext) -> None:
            raise RuntimeError("bug in an agent")

    await make_pool(Broken())
    run = await fast_queue.enqueue(new_run(ASYNC))

    async def released() -> Run | None:
        state = await status_of(fast_queue, run.id)
        return state if state.status == "queued" and state.attempts == 1 else None

    state = await eventually(released, what="the early release")
    assert state.scheduled_for is not None
    last = (await fast_queue.events(run.id))[-1]
    assert last.type == "run.released"
    assert last.data["graceful"] is False
    assert "bug in an agent" in last.data["reason"]


async def test_lifespan_starts_and_stops_the_pool_in_a_real_server(
    database_url: str, engine: AsyncEngine
) -> None:
    settings = Settings(
        database_url=database_url, poll_interval_seconds=SLOW_POLL, drain_grace_seconds=1
    )
    app = create_app(settings)
    queue = Queue(engine)
    async with running_server(app):
        run = await queue.enqueue(new_run(INTERACTIVE))

        async def done() -> bool:
            return (await status_of(queue, run.id)).status == "succeeded"

        await eventually(done, within=10, what="the app's pool to run it")
        live = await count(engine, "SELECT count(*) FROM workers WHERE stopped_at IS NULL")
        assert live == 1
    assert await count(engine, "SELECT count(*) FROM workers WHERE stopped_at IS NULL") == 0
    assert await count(engine, "SELECT count(*) FROM workers") == 1


async def test_stop_is_idempotent(make_pool: Callable[..., Any]) -> None:
    pool: WorkerPool = await make_pool(CompletingExecutor())
    await pool.stop(grace_seconds=0)
    await pool.stop(grace_seconds=0)
    assert not pool.started


# --- found and fixed (docs/reliability.md) ---------------------------------------------------
class EndsThenLingers:
    """Ends its hold (the completion commits), then keeps the task busy (or fails) before it
    returns: the window in which a drain or an error used to write a spurious run.fenced."""

    def __init__(self, *, then_fail: bool = False, through_finish: bool = False) -> None:
        self.then_fail = then_fail
        self.through_finish = through_finish
        self.ended: list[UUID] = []

    async def execute(self, ctx: ExecutionContext) -> None:
        if self.through_finish:
            # As the runtime ends a hold: the context knows its ending write committed.
            await ctx.finish("complete", ctx.queue.complete(ctx.lease, {"done": True}))
        else:
            # An executor that only marks itself finishing: the outcome is unknown to the pool.
            ctx.finishing = True
            await ctx.checked(await ctx.queue.complete(ctx.lease, {"done": True}), "complete")
        self.ended.append(ctx.lease.run_id)
        if self.then_fail:
            raise RuntimeError("a bug after the run ended")
        await asyncio.Event().wait()


@pytest.mark.parametrize("through_finish", [True, False], ids=["finish", "finishing"])
@pytest.mark.parametrize("then_fail", [False, True], ids=["drain", "error"])
async def test_no_run_fenced_after_the_run_ended_its_own_hold(
    make_pool: Callable[..., Any],
    fast_queue: Queue,
    engine: AsyncEngine,
    then_fail: bool,
    through_finish: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    releases: list[Any] = []
    release = fast_queue.release

    async def counted_release(*args: Any, **kwargs: Any) -> Any:
        releases.append(args)
        return await release(*args, **kwargs)

    monkeypatch.setattr(fast_queue, "release", counted_release)
    executor = EndsThenLingers(then_fail=then_fail, through_finish=through_finish)
    pool: WorkerPool = await make_pool(executor)
    run = await fast_queue.enqueue(new_run(ASYNC))

    async def ended() -> bool:
        return executor.ended == [run.id]

    await eventually(ended, what="the completion")
    await pool.stop(grace_seconds=0.05)
    types = [e.type for e in await fast_queue.events(run.id)]
    assert types == ["run.created", "run.claimed", "run.succeeded"]
    assert await check_all_runs(engine) == 1
    if through_finish:
        assert releases == []  # a committed ending leaves nothing to give back


async def test_two_executions_of_one_run_in_one_process_are_two_holds(
    make_pool: Callable[..., Any], fast_queue: Queue, engine: AsyncEngine
) -> None:
    """The sweeper requeued a run whose execution here is still alive, and this process
    claimed it again: the stale hold must not share the fresh one's heartbeat, slot entry or
    completion."""
    executor = BlockingExecutor()
    # A 1 s lease that no heartbeat renews (one beat a minute): it lapses while running.
    pool: WorkerPool = await make_pool(executor, heartbeat=60, lease=1, poll=0.1)
    run = await fast_queue.enqueue(new_run(ASYNC))
    await eventually(lambda: asyncio.sleep(0, executor.started == [run.id]), what="the claim")

    async def swept() -> bool:
        return (await fast_queue.sweep()).requeued == 1

    await eventually(swept, what="the lease to lapse and be swept")
    await eventually(
        lambda: asyncio.sleep(0, executor.started == [run.id, run.id]), what="the second claim"
    )
    assert sorted(ctx.lease.epoch for ctx in pool.held()) == [1, 2]

    await pool.beat()  # renews the fresh hold only; the stale one learns it is fenced
    await eventually(
        lambda: asyncio.sleep(0, executor.interrupted == [(run.id, True, False)]),
        what="the stale hold's interruption",
    )
    await eventually(
        lambda: asyncio.sleep(0, [ctx.lease.epoch for ctx in pool.held()] == [2]),
        what="the stale hold's slot to free",
    )
    executor.release.set()

    async def succeeded() -> bool:
        return (await status_of(fast_queue, run.id)).status == "succeeded"

    await eventually(succeeded, what="the fresh hold's completion")
    events = await fast_queue.events(run.id)
    fenced = [e for e in events if e.type == "run.fenced"]
    assert [(e.epoch, e.data["during"]) for e in fenced] == [(1, "heartbeat")]
    assert [e.epoch for e in events if e.type == "run.succeeded"] == [2]
    assert await check_all_runs(engine) == 1


async def test_scheduled_and_backed_off_runs_start_on_time_despite_a_long_poll(
    make_pool: Callable[..., Any], fast_queue: Queue, engine: AsyncEngine
) -> None:
    """A run that becomes eligible by its time gets no notification then: the idle claim loop
    sleeps until the earliest such run is due (`Queue.next_due`), not a whole poll interval."""
    # A backed-off run: claimed by a worker that gives it back early (backoff 1 s).
    backed_off = await fast_queue.enqueue(new_run(ASYNC))
    [claimed] = await fast_queue.claim("w-gone", [ASYNC])
    await fast_queue.release(claimed.lease, graceful=False, reason="transient errors")
    await make_pool(CompletingExecutor(), poll=30.0)
    async with engine.connect() as conn:
        now = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
    scheduled = await fast_queue.enqueue(new_run(ASYNC, scheduled_for=now + timedelta(seconds=1.5)))

    async def finished(run_id: UUID) -> Run | None:
        run = await status_of(fast_queue, run_id)
        return run if run.status == "succeeded" else None

    for run_id in (scheduled.id, backed_off.id):
        run = await eventually(lambda r=run_id: finished(r), within=10, what="the run done")
        assert run.scheduled_for is not None
        async with engine.connect() as conn:
            claimed_at = (
                await conn.execute(
                    text(
                        "SELECT max(created_at) FROM run_events "
                        "WHERE run_id = :id AND type = 'run.claimed'"
                    ),
                    {"id": run_id},
                )
            ).scalar_one()
        # Liveness, not speed: well before the 30 s poll interval.
        assert timedelta(0) <= claimed_at - run.scheduled_for < timedelta(seconds=3)
