"""Striped queued counts (docs/adr/0006, "Striped queued counts"; migration 0014).

New runs are counted on one of 8 stripes of their tenant's (tenant, class band), not on its
count row, and the fair walk reads `has_work` ("may have queued runs") instead of the row's
queued count. The flag is cleared only by turnstile_clear_work, holding the count row and all
8 stripes with the exact total at 0. These tests hold transactions open on real connections at
the two dangerous moments and check that no queued run is ever hidden from the walk (no lost
wakeup): an enqueue in flight while a claim drains the tenant, and a draining claim in flight
while an enqueue starts; through `enqueue` and through `turnstile_submit`. They wait on
pg_stat_activity's wait events, never on sleeps. Then a stress of 8 enqueuers of one tenant
against 2 claimers, and the maintenance backstop for a stale flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.maintenance.work_flags import WorkFlagClearer
from app.queue.core import Queue
from app.store.statements import q
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.invariants import check_all_runs
from tests.support.waiting import eventually

ASYNC = PriorityClass.ASYNC
BAND = 1


def new_run(tenant: str) -> NewRun:
    return NewRun(
        tenant_id=tenant,
        principal="p",
        agent="scripted",
        input={"script": [{"final": 1}]},
        priority=ASYNC.base,
    )


async def has_work(engine: AsyncEngine, tenant: str) -> bool:
    async with engine.connect() as conn:
        found = await conn.scalar(
            text("SELECT has_work FROM tenant_class_counts WHERE tenant_id = :t AND band = :b"),
            {"t": tenant, "b": BAND},
        )
    return bool(found)


async def pid_of(conn: AsyncConnection) -> int:
    return int(await conn.scalar(text("SELECT pg_backend_pid()")))


async def waiting_on_a_lock(engine: AsyncEngine, pid: int) -> bool:
    """The backend `pid` waits for a row lock held by another transaction (the stripe)."""
    async with engine.connect() as conn:
        waits = await conn.scalar(
            text(
                "SELECT a.wait_event_type = 'Lock' AND EXISTS ("
                "  SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted) "
                "FROM pg_stat_activity a WHERE a.pid = :pid"
            ),
            {"pid": pid},
        )
    return bool(waits)


async def claim_on(conn: AsyncConnection, queue: Queue) -> list[Any]:
    """claim_one on the caller's connection and transaction (left open by the caller)."""
    rows = await conn.execute(
        q("claim_one"),
        {
            "owner": "holder",
            "priorities": [ASYNC.base + i for i in range(10)],
            "lease_seconds": 30.0,
            "limit": 1,
            "max_running": [None, None, None],
            "now": queue.clock(),
        },
    )
    return [row.id for row in rows.mappings().all() if row["id"] is not None]


async def submit_on(conn: AsyncConnection, tenant: str) -> uuid.UUID:
    """turnstile_submit (the POST /runs path) on the caller's transaction: a sessionless run."""
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


async def on_two_stripes(
    engine: AsyncEngine, stack: contextlib.AsyncExitStack
) -> tuple[AsyncConnection, AsyncConnection]:
    """Two connections whose backends write different stripes (pid % 8), no transaction open.
    Within the pool (7 connections): all on one stripe has odds of 8**-6."""
    first = await stack.enter_async_context(engine.connect())
    stripe = await pid_of(first) % 8
    await first.rollback()
    for _ in range(6):
        other = await stack.enter_async_context(engine.connect())
        found = await pid_of(other) % 8
        await other.rollback()
        if found != stripe:
            return first, other
    raise AssertionError("no two connections on different stripes")


async def claimed_ids(queue: Queue) -> list[uuid.UUID]:
    return [c.run.id for c in await queue.claim("w", [ASYNC])]


# --- (a) an enqueue in flight while a claim drains the tenant --------------------------------
async def check_enqueue_in_flight(queue: Queue, path: str) -> None:
    engine = queue.engine
    async with contextlib.AsyncExitStack() as stack:
        # The first run on another stripe than the enqueue in flight: the clearer then finds
        # every stripe it can lock summing to 0 with the row, and only the stripe it could not
        # lock (and the count of 8) keeps it from clearing.
        settled, conn = await on_two_stripes(engine, stack)
        async with settled.begin():
            first = (await queue.enqueue(new_run("t"), conn=settled)).id
        tx = await conn.begin()
        second = await enqueue_on(conn, queue, "t", path)  # its stripe stays locked
        # The claim takes the last run its snapshot sees: the total reads 0, so it offers the
        # row to turnstile_clear_work, which finds the enqueue's stripe locked and keeps the flag.
        assert await claimed_ids(queue) == [first]
        assert await has_work(engine, "t")
        await tx.commit()
    assert await has_work(engine, "t")
    assert await claimed_ids(queue) == [second]
    # Now the tenant is empty and nothing is in flight: that claim cleared the flag.
    assert not await has_work(engine, "t")
    assert await claimed_ids(queue) == []
    await check_all_runs(engine)


async def test_an_enqueue_in_flight_keeps_the_flag_through_a_draining_claim(queue: Queue) -> None:
    await check_enqueue_in_flight(queue, "enqueue")


async def test_a_submission_in_flight_keeps_the_flag_through_a_draining_claim(
    queue: Queue,
) -> None:
    await check_enqueue_in_flight(queue, "submit")


# --- (b) a draining claim in flight while an enqueue starts -----------------------------------
async def check_claim_in_flight(queue: Queue, path: str) -> None:
    engine = queue.engine
    first = (await queue.enqueue(new_run("t"))).id
    async with engine.connect() as claimer, engine.connect() as enqueuer:
        claim_tx = await claimer.begin()
        assert await claim_on(claimer, queue) == [first]
        # The claim cleared the flag (uncommitted): it holds the count row and all 8 stripes.
        assert not await claimer.scalar(
            text("SELECT has_work FROM tenant_class_counts WHERE tenant_id = 't'")
        )
        enqueue_tx = await enqueuer.begin()
        pid = await pid_of(enqueuer)
        pending = asyncio.create_task(enqueue_on(enqueuer, queue, "t", path))
        # The enqueue waits on its stripe, which the clearing claim holds.
        await eventually(
            lambda: waiting_on_a_lock(engine, pid), what="the enqueue waiting on its stripe"
        )
        assert not pending.done()
        await claim_tx.commit()
        second = await asyncio.wait_for(pending, 30)
        await enqueue_tx.commit()
    # Its mark ran on a snapshot taken after the clear committed, and set the flag again.
    assert await has_work(engine, "t")
    assert await claimed_ids(queue) == [second]
    await check_all_runs(engine)


async def test_an_enqueue_behind_a_clearing_claim_sets_the_flag_again(queue: Queue) -> None:
    await check_claim_in_flight(queue, "enqueue")


async def test_a_submission_behind_a_clearing_claim_sets_the_flag_again(queue: Queue) -> None:
    await check_claim_in_flight(queue, "submit")


# --- the counts of a new tenant and of one tenant's concurrent enqueues ----------------------
async def test_a_first_run_creates_the_row_with_its_eight_stripes(queue: Queue) -> None:
    await queue.enqueue(new_run("fresh"))
    await queue.enqueue_many(
        tenant_id="fresh",
        principal="p",
        runs=[("scripted", {}, 0, None), ("scripted", {}, 11, None)],
    )
    async with queue.engine.connect() as conn:
        stripes = await conn.scalar(
            text("SELECT count(*) FROM tenant_queued_stripes WHERE tenant_id = 'fresh'")
        )
        rows = (
            await conn.execute(
                text(
                    "SELECT band, queued, has_work FROM tenant_class_totals "
                    "WHERE tenant_id = 'fresh' ORDER BY band"
                )
            )
        ).all()
    assert stripes == 16
    assert [tuple(r) for r in rows] == [(0, 1, True), (1, 2, True)]
    await check_all_runs(queue.engine)


async def test_one_tenants_enqueues_do_not_wait_for_each_others_commit(queue: Queue) -> None:
    """Two open transactions of one tenant on connections whose backends fall on two stripes
    both enqueue, the second without waiting for the first's commit."""
    engine = queue.engine
    await queue.enqueue(new_run("t"))  # the row and stripes exist: the common case
    async with contextlib.AsyncExitStack() as stack:
        first, other = await on_two_stripes(engine, stack)
        tx_a, tx_b = await first.begin(), await other.begin()
        await queue.enqueue(new_run("t"), conn=first)
        # Would wait for tx_a's commit if both wrote the count row.
        await asyncio.wait_for(queue.enqueue(new_run("t"), conn=other), 10)
        await tx_a.commit()
        await tx_b.commit()
    await check_all_runs(engine)


# --- a stale flag and the backstop -----------------------------------------------------------
async def test_a_stale_flag_is_cleared_by_the_maintenance_backstop(queue: Queue) -> None:
    engine = queue.engine
    run = (await queue.enqueue(new_run("t"))).id
    assert await claimed_ids(queue) == [run]
    assert not await has_work(engine, "t")
    # An enqueue rolled back after its stripe write and mark: the flag is set, nothing queued.
    async with engine.connect() as conn:
        tx = await conn.begin()
        await conn.execute(
            text("UPDATE tenant_class_counts SET has_work = false WHERE tenant_id = 't'")
        )
        await queue.enqueue(new_run("t"), conn=conn)
        await tx.rollback()
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE tenant_class_counts SET has_work = true WHERE tenant_id = 't'")
        )
    clearer = WorkFlagClearer(queue, holder="test", interval=1)
    report = await clearer.run_once()
    assert (report.offered, report.cleared) == (1, 1)
    assert not await has_work(engine, "t")
    # It never clears a tenant with work.
    await queue.enqueue(new_run("t"))
    assert (await clearer.run_once()).offered == 0
    assert await has_work(engine, "t")
    await check_all_runs(engine)


async def test_a_cancel_of_the_last_queued_run_clears_the_flag(queue: Queue) -> None:
    run = (await queue.enqueue(new_run("t"))).id
    await queue.cancel(run, actor="ops", reason="test")
    assert not await has_work(queue.engine, "t")
    await check_all_runs(queue.engine)


# --- stress -----------------------------------------------------------------------------------
async def test_eight_enqueuers_and_two_claimers_of_one_tenant(queue: Queue) -> None:
    """8 clients enqueue 250 runs each into one tenant (half through turnstile_submit) while
    2 claimers take them (one singly, one in batches): every run claimed exactly once, no
    claim finds nothing while a run is queued once the enqueuers are done, no drift, and the
    flag clear at the end."""
    engine = queue.engine
    per_client = 250
    enqueued: list[uuid.UUID] = []
    claimed: list[uuid.UUID] = []
    done = asyncio.Event()

    async def enqueuer(n: int) -> None:
        for _ in range(per_client):
            if n % 2:
                async with engine.begin() as conn:
                    enqueued.append(await submit_on(conn, "one"))
            else:
                enqueued.append((await queue.enqueue(new_run("one"))).id)

    async def claimer(limit: int) -> None:
        while True:
            finished = done.is_set()
            got = await queue.claim(f"w{limit}", [ASYNC], limit=limit)
            claimed.extend(c.run.id for c in got)
            if not got and finished:
                return

    claimers = [asyncio.create_task(claimer(1)), asyncio.create_task(claimer(4))]
    await asyncio.gather(*(enqueuer(n) for n in range(8)))
    done.set()
    await asyncio.gather(*claimers)
    assert len(enqueued) == 8 * per_client
    assert sorted(claimed) == sorted(enqueued), "a run was claimed twice, or left queued"
    await check_all_runs(engine)
    # The claim that took the last run offered the row and nothing was in flight: cleared
    # without the backstop (stripes only grow, so no snapshot overestimates the total).
    assert not await has_work(engine, "one")
