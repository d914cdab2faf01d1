"""Fair shares between tenants (docs/adr/0006): the fair claim order, per-tenant concurrency
limits (exact under concurrency, never blocking another tenant, changed without a restart),
the queued quota, and the noisy neighbour end to end with real worker processes (and, with the
fair order switched off, the same load leaving the newcomer behind the backlog)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue, QueueConfig
from app.queue.errors import QueueQuotaError
from app.queue.scheduling import NewSchedule, Schedules
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import ClaimedRun, NewRun
from tests.support.api import running_api
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs
from tests.support.processes import turnstile
from tests.support.tenants import counts, set_limits
from tests.support.waiting import eventually

INTERACTIVE, ASYNC, MAINTENANCE = PriorityClass


async def backlog(queue: Queue, tenant: str, n: int, klass: PriorityClass = ASYNC) -> None:
    runs = [("scripted", {"script": [{"final": i}]}, klass.base, None) for i in range(n)]
    await queue.enqueue_many(tenant_id=tenant, principal="p", runs=runs)


async def claim_tenants(queue: Queue, n: int, *, limit: int = 1) -> list[str]:
    """The tenants of the runs `n` claims took, in claim order (a batch in its own order)."""
    taken: list[str] = []
    for _ in range(n):
        taken += [c.run.tenant_id for c in await queue.claim("w", [ASYNC], limit=limit)]
    return taken


# --- the order --------------------------------------------------------------------------------
async def test_a_tenant_behind_a_backlog_is_served_next(queue: Queue, clock: ManualClock) -> None:
    await backlog(queue, "alice", 50)
    clock.advance(1)
    await backlog(queue, "bob", 3)
    # alice's backlog is older, but bob has nothing running: turns alternate while both have
    # work (fewest running first, ties to the least recently served).
    assert await claim_tenants(queue, 8) == ["alice", "bob"] * 3 + ["alice"] * 2
    await check_all_runs(queue.engine)


async def test_a_batch_takes_a_share_of_each_tenant(queue: Queue, clock: ManualClock) -> None:
    for tenant in ("a", "b", "c"):
        await backlog(queue, tenant, 20)
        clock.advance(1)
    batch = await claim_tenants(queue, 1, limit=9)
    assert sorted(batch) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    # The next batch starts again from the fewest running: all equal, so every tenant again.
    batch = await claim_tenants(queue, 1, limit=6)
    assert sorted(batch) == ["a"] * 2 + ["b"] * 2 + ["c"] * 2
    assert await counts(queue.engine, "a", 1) == (5, 15)
    await check_all_runs(queue.engine)


async def test_pairs_come_due_take_their_place_in_the_fair_order(
    queue: Queue, clock: ManualClock
) -> None:
    """The walk merges two cursors, the marked pairs and the pairs whose work has come due
    (out of the walk until then): a pair come due is walked in its fair place among the marked
    ones, neither first nor last."""
    await backlog(queue, "bob", 1)
    assert await claim_tenants(queue, 1) == ["bob"]  # bob runs one, served first of all
    later = NewRun(
        tenant_id="bob",
        principal="p",
        agent="scripted",
        input={},
        priority=ASYNC.base,
        scheduled_for=clock.now + timedelta(hours=1),
    )
    await queue.enqueue(later)
    for tenant in ("alice", "carol"):
        await backlog(queue, tenant, 3)
    # The third claim walks bob first (running one, least recently served), finds nothing to
    # claim now and takes his pair out of the walk until his run's time.
    assert await claim_tenants(queue, 3) == ["alice", "carol", "alice"]
    async with queue.engine.connect() as conn:
        marks = await conn.execute(
            text("SELECT has_work, due_at FROM tenant_class_counts WHERE tenant_id = 'bob'")
        )
        assert marks.one() == (False, later.scheduled_for)
    await backlog(queue, "dave", 3)
    clock.advance(3601)
    # dave runs none: first. Then, running one each, bob (come due, served longest ago), carol,
    # dave; alice runs two.
    assert await claim_tenants(queue, 4) == ["dave", "bob", "carol", "dave"]
    await check_all_runs(queue.engine)


async def test_priority_between_classes_comes_before_tenants(
    queue: Queue, clock: ManualClock
) -> None:
    await backlog(queue, "alice", 3, INTERACTIVE)
    await backlog(queue, "bob", 3, ASYNC)
    claimed = await queue.claim("w", [INTERACTIVE, ASYNC], limit=1)
    assert [(c.run.tenant_id, c.run.priority) for c in claimed] == [("alice", 0)]
    # Inside a class, a priority of its band orders runs only within the tenant.
    await queue.enqueue(
        NewRun(tenant_id="bob", principal="p", agent="scripted", input={}, priority=11)
    )
    clock.advance(1)
    await queue.enqueue(
        NewRun(tenant_id="carol", principal="p", agent="scripted", input={}, priority=10)
    )
    taken = [c.run for c in await queue.claim("w", [ASYNC], limit=1)]
    # bob and carol have nothing running; bob's priority-10 runs come before its 11.
    assert [(r.tenant_id, r.priority) for r in taken] == [("bob", 10)]


async def test_the_fair_order_switched_off_is_first_come_first_served(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    queue = Queue(engine, QueueConfig(fair_claim=False), clock=clock)
    await backlog(queue, "alice", 5)
    clock.advance(1)
    await backlog(queue, "bob", 2)
    assert await claim_tenants(queue, 6) == ["alice"] * 5 + ["bob"]
    await check_all_runs(engine)


# --- limits -----------------------------------------------------------------------------------
async def test_a_limited_tenant_does_not_block_the_runs_behind_it(
    queue: Queue, clock: ManualClock
) -> None:
    await set_limits(queue.engine, "alice", max_running={"async": 2})
    await backlog(queue, "alice", 10)
    clock.advance(1)
    await backlog(queue, "bob", 6)
    taken = await claim_tenants(queue, 3, limit=4)
    assert taken.count("alice") == 2
    assert taken.count("bob") == 6
    assert await queue.claim("w", [ASYNC], limit=4) == []
    assert await counts(queue.engine, "alice", 1) == (2, 8)


async def test_changing_a_limit_applies_to_the_next_claim(queue: Queue, clock: ManualClock) -> None:
    await set_limits(queue.engine, "alice", max_running={"async": 1})
    await backlog(queue, "alice", 5)
    assert len(await queue.claim("w", [ASYNC], limit=3)) == 1
    assert await queue.claim("w", [ASYNC], limit=1) == []
    # An admin raises the limit: the same process's next claim sees it, no restart.
    await set_limits(queue.engine, "alice", max_running={"async": 3})
    assert len(await queue.claim("w", [ASYNC], limit=5)) == 2
    # The process default applies once the override is gone (other classes unaffected).
    limited = Queue(
        queue.engine, replace(queue.config, tenant_max_running=(None, 4, None)), clock=clock
    )
    await set_limits(queue.engine, "alice", max_running={})
    assert len(await limited.claim("w", [ASYNC], limit=5)) == 1
    assert await counts(queue.engine, "alice", 1) == (4, 1)


async def test_webhook_deliveries_are_held_to_the_limit(queue: Queue, clock: ManualClock) -> None:
    """Deliveries count against their tenant's running limit like its other runs (issue 40,
    item 2: four endpoints trickling one byte a second held every async slot for 41.9 s)."""
    await set_limits(queue.engine, "alice", max_running={"async": 1})
    await queue.enqueue_many(
        tenant_id="alice",
        principal="p",
        runs=[("webhook", {"webhook_id": "x"}, ASYNC.base, None)] * 2,
    )
    await backlog(queue, "alice", 3)
    taken = [c.run.agent for c in await queue.claim("w", [ASYNC], limit=5)]
    assert taken == ["webhook"]
    assert [c.run.agent for c in await queue.claim("w", [ASYNC], limit=1)] == []


async def test_schedule_ticks_are_not_refused_but_held_to_the_limit(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    """A schedule's tick is exempt from the queued quota, never from the concurrency limit
    (issue 40, item 2: four every-second schedules of a tenant limited to one running run
    kept every async slot of the pool busy)."""
    queue = Queue(engine, QueueConfig(tenant_max_queued=2), clock=clock)
    await set_limits(engine, "alice", max_running={"async": 1})
    await backlog(queue, "alice", 2)  # at its quota
    (held,) = await queue.claim("w", [ASYNC], limit=2)  # at its limit
    # A schedule's tick is created over the quota ...
    schedule = await Schedules(queue).create(
        NewSchedule(
            tenant_id="alice",
            principal="ops",
            cron="* * * * *",
            timezone="UTC",
            agent="scripted",
            input={"script": [{"final": "tick"}]},
            priority=ASYNC.base,
        )
    )
    clock.advance(61)
    # ... but waits for the tenant's room like its other runs.
    assert await queue.claim("w", [ASYNC], limit=2) == []
    assert await counts(engine, "alice", 1) == (1, 2)
    # It takes its turn with the tenant's other runs, by eligibility.
    await queue.complete(held.lease, {})
    (older,) = await queue.claim("w", [ASYNC], limit=2)
    assert older.run.schedule_id is None
    await queue.complete(older.lease, {})
    (tick,) = await queue.claim("w", [ASYNC], limit=2)
    assert tick.run.schedule_id == schedule.id
    await check_all_runs(engine)


async def test_limits_are_exact_under_a_race_of_eight_claimers(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    queue = Queue(engine, QueueConfig(), clock=clock)
    await set_limits(engine, "alice", max_running={"async": 3})
    await set_limits(engine, "bob", max_running={"async": 5})
    rng = random.Random(21)
    for round_ in range(4):
        await backlog(queue, "alice", 30)
        await backlog(queue, "bob", 30)
        await backlog(queue, "carol", 12)
        held: list[ClaimedRun] = []

        async def claimer(held: list[ClaimedRun] = held) -> None:
            while True:
                got = await queue.claim("w", [ASYNC], limit=rng.choice([1, 2, 4]))
                if not got:
                    return
                held.extend(got)

        await asyncio.gather(*(claimer() for _ in range(8)))
        # A claimer stops at its first empty claim, which may have met rows another claimer
        # had locked; one last claimer alone takes whatever is left.
        while more := await queue.claim("w", [ASYNC], limit=4):
            held.extend(more)
        by_tenant = {t: sum(c.run.tenant_id == t for c in held) for t in ("alice", "bob")}
        async with engine.connect() as conn:
            running = dict(
                (
                    await conn.execute(
                        text(
                            "SELECT tenant_id, count(*) FROM runs WHERE status = 'running' "
                            "GROUP BY tenant_id"
                        )
                    )
                ).all()
            )
        assert running.get("alice") == 3, (round_, running)
        assert running.get("bob") == 5, (round_, running)
        # carol has no limit: the limited tenants never held her runs back.
        assert running.get("carol") == 12, (round_, running)
        assert by_tenant["alice"] <= 3
        assert by_tenant["bob"] <= 5
        # Finish what was taken, so the next round races for freed room.
        await queue.complete_many([(c.lease, {"ok": True}) for c in held])
        await check_all_runs(engine)


# --- the queued quota -------------------------------------------------------------------------
async def test_a_tenant_at_its_quota_gets_no_new_run(
    engine: AsyncEngine, clock: ManualClock
) -> None:
    queue = Queue(engine, QueueConfig(tenant_max_queued=3), clock=clock)
    await backlog(queue, "alice", 3)
    with pytest.raises(QueueQuotaError) as refused:
        await backlog(queue, "alice", 1)
    assert (refused.value.max_queued, refused.value.queued) == (3, 3)
    with pytest.raises(QueueQuotaError):
        await queue.enqueue(NewRun(tenant_id="alice", principal="p", agent="scripted", input={}))
    # Another tenant is not affected; a claimed run makes room.
    await backlog(queue, "bob", 3)
    await queue.claim("w", [ASYNC], limit=1)
    await queue.enqueue(NewRun(tenant_id="alice", principal="p", agent="scripted", input={}))
    # A tenant's own quota overrides the default (0: no new runs at all).
    await set_limits(engine, "bob", max_queued=0)
    with pytest.raises(QueueQuotaError):
        await backlog(queue, "bob", 1)
    await check_all_runs(engine)


async def test_the_api_answers_429_queue_quota_and_still_delivers_answers(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, tenant_max_queued=1) as api:
        http = await api.client("acme", "alice")
        session = (await http.post("/sessions", json={})).json()["id"]
        ask = {"script": [{"ask": "account?"}, {"final": "done"}]}
        first = await http.post(f"/sessions/{session}/turns", json={"input": ask})
        assert first.status_code == 202, first.text
        refused = await http.post("/runs", json={"input": {"script": [{"final": 1}]}})
        assert refused.status_code == 429, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        body = refused.json()
        assert body["type"] == "/problems/queue-quota"
        assert (body["max_queued"], body["queued"]) == (1, 1)
        # The turn's run is claimed and asks the user; another run fills the quota again.
        claimed = await api.queue.claim("w", [INTERACTIVE], limit=1)
        await api.queue.wait_for_user(claimed[0].lease, {"text": "account?"}, step=0, state={})
        filler = await http.post("/runs", json={"input": {"script": [{"final": 2}]}})
        assert filler.status_code == 202, filler.text
        # The answer requeues the waiting run: never refused by the quota.
        answer = await http.post(f"/sessions/{session}/turns", json={"input": "42"})
        assert answer.status_code == 202, answer.text
        assert answer.json()["id"] == first.json()["id"]
        assert await counts(engine, "acme", 0) == (0, 1)
        assert await counts(engine, "acme", 1) == (0, 1)
    await check_all_runs(engine)


# --- the noisy neighbour, end to end ----------------------------------------------------------
async def noisy_neighbour(database_url: str, engine: AsyncEngine, *, fair: bool) -> dict[str, Any]:
    """Tenant A queues 400 async runs of 0.5 s; once A's runs are under way, tenant B submits
    20 of 0.1 s; a real worker process with four async slots takes them."""
    queue = Queue(engine)
    sleep = {"call": "sleep", "args": {"seconds": 0.5}}
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_FAIR_CLAIM": "true" if fair else "false",
        "TURNSTILE_SLOTS": "interactive:4,async:4,maintenance:1",
    }
    async with turnstile("worker", ready=b"running slots", env=env):
        await queue.enqueue_many(
            tenant_id="a",
            principal="p",
            runs=[
                ("scripted", {"script": [sleep, {"final": i}]}, ASYNC.base, None)
                for i in range(400)
            ],
        )

        async def started(tenant: str, at_least: int) -> bool:
            async with engine.connect() as conn:
                n = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM runs WHERE tenant_id = :t "
                            "AND started_at IS NOT NULL"
                        ),
                        {"t": tenant},
                    )
                ).scalar_one()
            return int(n) >= at_least

        await eventually(lambda: started("a", 8), within=30, what="A's runs under way")
        quick = {"call": "sleep", "args": {"seconds": 0.1}}
        await queue.enqueue_many(
            tenant_id="b",
            principal="p",
            runs=[
                ("scripted", {"script": [quick, {"final": i}]}, ASYNC.base, None) for i in range(20)
            ],
        )
        async with engine.connect() as conn:
            b_submitted = (
                await conn.execute(text("SELECT min(created_at) FROM runs WHERE tenant_id = 'b'"))
            ).scalar_one()
            a_before = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM runs WHERE tenant_id = 'a' AND started_at IS NOT NULL"
                    )
                )
            ).scalar_one()
        if fair:
            await eventually(lambda: started("b", 20), within=60, what="B's runs claimed")
        else:
            # First come, first served: twenty more of A's runs start, none of B's.
            await eventually(
                lambda: started("a", int(a_before) + 20), within=60, what="A's next runs"
            )
        async with engine.connect() as conn:
            b = (
                await conn.execute(
                    text(
                        "SELECT started_at, extract(epoch FROM started_at - created_at) AS wait "
                        "FROM runs WHERE tenant_id = 'b' ORDER BY started_at NULLS LAST"
                    )
                )
            ).all()
            a_queued = (
                await conn.execute(
                    text("SELECT count(*) FROM runs WHERE tenant_id = 'a' AND status = 'queued'")
                )
            ).scalar_one()
            window = [row[0] for row in b if row[0] is not None]
            a_in_window = 0
            if window:
                a_in_window = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM runs WHERE tenant_id = 'a' "
                            "AND started_at BETWEEN :first AND :last"
                        ),
                        {"first": window[0], "last": window[-1]},
                    )
                ).scalar_one()
    return {
        "b_started": len(window),
        "b_waits": [float(row[1]) for row in b if row[1] is not None],
        "a_queued": int(a_queued),
        "a_in_window": int(a_in_window),
        "b_submitted": b_submitted,
    }


@pytest.mark.timeout(120)
async def test_the_noisy_neighbour_does_not_hold_back_a_newcomer(
    database_url: str, engine: AsyncEngine
) -> None:
    seen = await noisy_neighbour(database_url, engine, fair=True)
    print(f"\nnoisy neighbour, fair order: {seen}")
    assert seen["b_started"] == 20
    # Every one of B's runs was claimed within 5 s of its submission ...
    assert max(seen["b_waits"]) < 5.0, seen["b_waits"]
    # ... while most of A's backlog was still queued ...
    assert seen["a_queued"] > 200, seen
    # ... and while both had work, B got at least its share of the claims.
    assert seen["a_in_window"] * 0.5 <= 20, seen


@pytest.mark.timeout(120)
async def test_without_the_fair_order_the_newcomer_waits_behind_the_backlog(
    database_url: str, engine: AsyncEngine
) -> None:
    seen = await noisy_neighbour(database_url, engine, fair=False)
    print(f"\nnoisy neighbour, fair order off: {seen}")
    # Twenty more of A's runs started after B submitted, and none of B's: B is behind all 400.
    assert seen["b_started"] == 0, seen
