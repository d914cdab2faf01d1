"""The fair walk's marks (docs/adr/0009): no queued run is ever hidden from the claims.

A (tenant, band) pair is walked while it is marked as having work to claim now (`has_work`),
or once its `due_at` has come. New runs mark their pair under the pair's advisory lock held
shared (turnstile_mark_work); only turnstile_settle_work unmarks, holding it exclusively and
the count row, and never waiting. These tests hold transactions open on real connections at
the dangerous moments and wait on pg_stat_activity and pg_locks, never on sleeps:

- an enqueue in flight while a claim walks its (otherwise idle) tenant: the settle gives up;
- a claim that settled the tenant still open while an enqueue starts: the enqueue waits for the
  claim's commit and marks again on a snapshot taken after it;
- both through `enqueue` and through `turnstile_submit`;
- a graceful release of a tenant's run while a settle of its pair is open: the release's update
  of the count row, after the settle's commit, marks the pair again;
- future work: out of the walk until its time, then claimed; a backed-off retry likewise;
- a stress of enqueuers, claimers and a canceller on one tenant, checked against the runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.maintenance.work_settler import WorkSettler
from app.queue.core import Queue
from app.store.statements import q
from app.vocabulary.classes import PriorityClass, priorities_of
from app.vocabulary.records import NewRun
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs
from tests.support.waiting import eventually

ASYNC = PriorityClass.ASYNC
BAND = 1


def new_run(tenant: str, **fields: Any) -> NewRun:
    return NewRun(
        tenant_id=tenant,
        principal="p",
        agent="scripted",
        input={"script": [{"final": 1}]},
        priority=ASYNC.base,
        **fields,
    )


async def mark(engine: AsyncEngine, tenant: str) -> tuple[bool, Any]:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT has_work, due_at FROM tenant_class_counts "
                    "WHERE tenant_id = :t AND band = :b"
                ),
                {"t": tenant, "b": BAND},
            )
        ).one()
    return bool(row.has_work), row.due_at


async def pid_of(conn: AsyncConnection) -> int:
    return int(await conn.scalar(text("SELECT pg_backend_pid()")))


async def waiting_on_a_lock(engine: AsyncEngine, pid: int) -> bool:
    async with engine.connect() as conn:
        waits = await conn.scalar(
            text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
            {"pid": pid},
        )
    return bool(waits)


async def claim_on(conn: AsyncConnection, queue: Queue, limit: int = 1) -> list[uuid.UUID]:
    """The claim on the caller's open transaction."""
    rows = await conn.execute(
        q("claim"),
        {
            "owner": "holder",
            "priorities": priorities_of([ASYNC]),
            "lease_seconds": 30.0,
            "limit": limit,
            "max_running": [None, None, None],
            "now": queue.clock(),
            "claim": None,
        },
    )
    return [row["id"] for row in rows.mappings().all() if row["id"] is not None]


async def submit_on(conn: AsyncConnection, tenant: str) -> uuid.UUID:
    """turnstile_submit (the POST /runs path) on the caller's transaction."""
    run_id = uuid.uuid4()
    await conn.execute(
        text(
            "SELECT r.outcome FROM turnstile_submit("
            " p_now => NULL, p_tenant => :t, p_principal => 'p', p_own_sessions_only => false,"
            " p_actor => 'k', p_session => NULL, p_key => NULL, p_request_hash => NULL,"
            " p_ttl_seconds => 60, p_wait_ms => 1000, p_lock_timeout_ms => 60000,"
            " p_run_id => :id, p_agent => 'scripted', p_default_agent => 'scripted',"
            " p_priority => CAST(10 AS smallint), p_default_priority => CAST(10 AS smallint),"
            " p_scheduled_for => NULL, p_input => CAST('{}' AS jsonb), p_max_attempts => 3,"
            " p_traceparent => NULL, p_max_queued => NULL) r"
        ),
        {"t": tenant, "id": run_id},
    )
    return run_id


async def enqueue_on(conn: AsyncConnection, queue: Queue, tenant: str, path: str) -> uuid.UUID:
    if path == "submit":
        return await submit_on(conn, tenant)
    return (await queue.enqueue(new_run(tenant), conn=conn)).id


async def claimed_ids(queue: Queue) -> list[uuid.UUID]:
    return [c.run.id for c in await queue.claim("w", [ASYNC], limit=10)]


async def _an_enqueue_in_flight_while_a_claim_walks(queue: Queue, path: str) -> None:
    engine = queue.engine
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    first = await queue.enqueue(new_run(tenant))
    assert await claimed_ids(queue) == [first.id]  # the pair is idle now, but still marked
    async with engine.connect() as enqueuer:
        await enqueuer.begin()
        second = await enqueue_on(enqueuer, queue, tenant, path)
        # The claim walks the pair, finds nothing it can see, and offers it to the settle,
        # which cannot take the advisory lock the enqueue holds shared.
        assert await claimed_ids(queue) == []
        assert (await mark(engine, tenant))[0]
        await enqueuer.commit()
    assert await claimed_ids(queue) == [second]
    await check_all_runs(engine)


async def test_an_enqueue_in_flight_while_a_claim_walks_its_tenant(queue: Queue) -> None:
    await _an_enqueue_in_flight_while_a_claim_walks(queue, "enqueue")


async def test_a_submission_in_flight_while_a_claim_walks_its_tenant(queue: Queue) -> None:
    await _an_enqueue_in_flight_while_a_claim_walks(queue, "submit")


async def _a_settle_in_flight_while_an_enqueue_starts(queue: Queue, path: str) -> None:
    engine = queue.engine
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    first = await queue.enqueue(new_run(tenant))
    assert await claimed_ids(queue) == [first.id]
    async with contextlib.AsyncExitStack() as stack:
        claimer = await stack.enter_async_context(engine.connect())
        await claimer.begin()
        # Walks the idle pair and settles it: unmarked, the advisory lock held exclusively
        # until this commits.
        assert await claim_on(claimer, queue) == []
        enqueuer = await stack.enter_async_context(engine.connect())
        pid = await pid_of(enqueuer)
        await enqueuer.commit()
        await enqueuer.begin()
        task = asyncio.create_task(enqueue_on(enqueuer, queue, tenant, path))
        await eventually(lambda: waiting_on_a_lock(engine, pid), what="the enqueue waits")
        await claimer.commit()
        second = await task
        await enqueuer.commit()
    assert (await mark(engine, tenant))[0]
    assert await claimed_ids(queue) == [second]
    await check_all_runs(engine)


async def test_a_settle_in_flight_while_an_enqueue_starts(queue: Queue) -> None:
    await _a_settle_in_flight_while_an_enqueue_starts(queue, "enqueue")


async def test_a_settle_in_flight_while_a_submission_starts(queue: Queue) -> None:
    await _a_settle_in_flight_while_an_enqueue_starts(queue, "submit")


async def test_a_release_after_a_settle_marks_the_pair_again(queue: Queue) -> None:
    engine = queue.engine
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    first = await queue.enqueue(new_run(tenant))
    (held,) = await queue.claim("w", [ASYNC])
    assert held.run.id == first.id
    async with engine.connect() as claimer:
        await claimer.begin()
        assert await claim_on(claimer, queue) == []  # settles the idle pair, holds its row
        release = asyncio.create_task(queue.release(held.lease, graceful=True, reason="drain"))
        await eventually(
            lambda: _some_backend_waits(engine), what="the release waits on the count row"
        )
        await claimer.commit()
        await release
    assert (await mark(engine, tenant))[0]
    assert await claimed_ids(queue) == [first.id]
    await check_all_runs(engine)


async def _some_backend_waits(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        return bool(
            await conn.scalar(
                text(
                    "SELECT count(*) > 0 FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
            )
        )


async def test_future_work_stays_out_of_the_walk_until_its_time(
    queue: Queue, clock: ManualClock
) -> None:
    engine = queue.engine
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    later = await queue.enqueue(new_run(tenant, scheduled_for=clock.now + timedelta(hours=1)))
    assert await mark(engine, tenant) == (False, later.scheduled_for)
    assert await claimed_ids(queue) == []
    clock.advance(3601)
    assert await claimed_ids(queue) == [later.id]


async def test_a_backed_off_retry_is_due_at_its_retry_time(
    queue: Queue, clock: ManualClock
) -> None:
    engine = queue.engine
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    run = await queue.enqueue(new_run(tenant))
    (held,) = await queue.claim("w", [ASYNC])
    await queue.release(held.lease, graceful=False, reason="flaky")
    retried = await queue.get_run(run.id)
    assert retried is not None
    assert retried.scheduled_for is not None
    # The claim that walks the pair now settles it: out of the walk until the retry time.
    assert await claimed_ids(queue) == []
    assert await mark(engine, tenant) == (False, retried.scheduled_for)
    clock.now = retried.scheduled_for
    assert await claimed_ids(queue) == [run.id]
    await check_all_runs(engine)


async def test_the_settler_takes_out_pairs_no_claim_walks(queue: Queue) -> None:
    engine = queue.engine
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    run = await queue.enqueue(new_run(tenant))
    await queue.cancel(run.id, actor="op")
    assert (await mark(engine, tenant))[0]
    report = await WorkSettler(queue, holder="test", interval=1).run_once()
    assert report.cleared >= 1
    assert await mark(engine, tenant) == (False, None)


async def test_enqueuers_claimers_and_a_canceller_on_one_tenant(
    engine: AsyncEngine,
) -> None:
    """Four enqueuers of one tenant against two claimers and a canceller: every run ends
    claimed or cancelled once, the running count never drifts, nothing is left hidden."""
    queue = Queue(engine)
    tenant = "stressed"
    total = 400
    done = asyncio.Event()
    made: list[uuid.UUID] = []
    taken: list[uuid.UUID] = []

    async def enqueuer(n: int) -> None:
        for _ in range(total // 4):
            made.append((await queue.enqueue(new_run(tenant))).id)

    async def claimer() -> None:
        idle_after_done = 0
        while idle_after_done < 200:
            got = await queue.claim("w", [ASYNC], limit=4)
            for item in got:
                taken.append(item.run.id)
                await queue.complete(item.lease, {})
            if got:
                continue
            if done.is_set():
                if await _queued(engine) == 0:
                    return
                idle_after_done += 1  # a hidden run would keep this going: bounded
            await asyncio.sleep(0)

    async def canceller() -> None:
        while not done.is_set():
            if made:
                with contextlib.suppress(Exception):
                    await queue.cancel(made[len(made) // 2], actor="op")
            await asyncio.sleep(0)

    claimers = [asyncio.create_task(claimer()) for _ in range(2)]
    cancel_task = asyncio.create_task(canceller())
    await asyncio.gather(*(enqueuer(n) for n in range(4)))
    done.set()
    await asyncio.gather(*claimers)
    await cancel_task
    assert len(taken) == len(set(taken))
    assert await _queued(engine) == 0
    await check_all_runs(engine)


async def _queued(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(text("SELECT count(*) FROM runs WHERE status = 'queued'")))
