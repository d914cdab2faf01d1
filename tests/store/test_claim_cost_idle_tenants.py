"""The claim's cost does not depend on tenants with no work to claim now (issue 32, defect 2).

Every active schedule keeps one tick queued ahead, and webhook retries wait in backoff: their
tenants hold queued runs that are not eligible yet. Counting them as work kept those tenants in
the fair walk, sorted first (they run nothing), and every claim probed each of them before
reaching real work: 4 ms a claim with 200 such tenants, 36 ms with 2,000. The walk now holds
only tenants with a run to claim now (docs/adr/0009).

Measured as PostgreSQL does the work, not by the clock (auto_explain's plans of the statements
a claim runs, nested ones included): the tenants the claim walks, and the shared buffers it
touches, for `claim` of one run and of a batch taken from one busy tenant, beside 10,000 runs
due tomorrow that belong to one other tenant, and beside the same 10,000 runs spread over
10,000 tenants (the tables and indexes as large either way). The second walks as many tenants
and may cost at most 1.5 times the first. Tenants whose only runs were cancelled are walked
once, then out of the walk; and once tomorrow comes, the ticks are claimed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.queue.core import Queue
from app.store.engine import create_engine
from app.vocabulary.classes import PriorityClass, priorities_of
from app.vocabulary.records import NewRun
from tests.support.clock import ManualClock
from tests.support.databases import clone_database, drop_database
from tests.support.nested_plans import AutoExplainMissing, NestedPlan, start_explaining
from tests.support.system_tools import require_or_skip

IDLE_TENANTS = 10_000
HANDFUL = 40
CLAIM_BATCH = 1_000
ASYNC = PriorityClass.ASYNC


@pytest.fixture
async def quiet_engine(settings: Settings, database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(settings, database_url, pool_size=2)
    yield engine
    await engine.dispose()


async def _busy_tenant(queue: Queue) -> None:
    """A tenant with work, one of its runs running: tenants running none sort before it."""
    for n in range(HANDFUL + 1):
        await queue.enqueue(
            NewRun(
                tenant_id="busy",
                principal="p",
                agent="scripted",
                input={"n": n},
                priority=ASYNC.base,
            )
        )
    assert len(await queue.claim("w", [ASYNC])) == 1


async def _ticks_due_tomorrow(engine: AsyncEngine, clock: ManualClock, *, tenants: int) -> None:
    """IDLE_TENANTS runs due tomorrow, spread over `tenants` tenants, through the one creation
    path (as schedules' ticks and scheduled submissions are made)."""
    tomorrow = clock.now + timedelta(days=1)
    ids = [uuid.uuid4() for _ in range(IDLE_TENANTS)]
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "SELECT count(*) FROM turnstile_create_runs("
                " CAST(:now AS timestamptz), CAST(:ids AS uuid[]), CAST(:tenants AS text[]),"
                " CAST(:principals AS text[]), CAST(:sessions AS uuid[]),"
                " CAST(:priorities AS smallint[]), CAST(:agents AS text[]),"
                " CAST(:inputs AS jsonb[]), CAST(:attempts AS integer[]),"
                " CAST(:scheduled AS timestamptz[]), CAST(:nulls AS uuid[]),"
                " CAST(:times AS timestamptz[]), CAST(:nulls AS uuid[]),"
                " CAST(:texts AS text[]), CAST(:jsons AS jsonb[]), false, NULL)"
            ),
            {
                "now": clock.now,
                "ids": ids,
                "tenants": [f"idle-{n % tenants:05d}" for n in range(IDLE_TENANTS)],
                "principals": ["p"] * IDLE_TENANTS,
                "sessions": [None] * IDLE_TENANTS,
                "priorities": [ASYNC.base] * IDLE_TENANTS,
                "agents": ["scripted"] * IDLE_TENANTS,
                "inputs": ["{}"] * IDLE_TENANTS,
                "attempts": [3] * IDLE_TENANTS,
                "scheduled": [tomorrow] * IDLE_TENANTS,
                "nulls": [None] * IDLE_TENANTS,
                "times": [None] * IDLE_TENANTS,
                "texts": [None] * IDLE_TENANTS,
                "jsons": [None] * IDLE_TENANTS,
            },
        )
    await _vacuum(engine)


async def _vacuum(engine: AsyncEngine) -> None:
    """What autovacuum does in time: the measured claims read no dead index entries."""
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM ANALYZE runs, tenant_class_counts"))


@dataclass(frozen=True)
class ClaimCost:
    buffers: int  # shared buffers the claim statement touched, its function's included
    walked: int  # tenants it probed (the statements that look for a tenant's runs)
    claimed: int


def _probes_a_tenant(plan: NestedPlan) -> bool:
    """A statement of the claim that looks for a tenant's runs to claim: its walk's own (one
    run of each tenant walked, `unnest(v_priorities)`, the function's variable) or a call of
    turnstile_claim_heads (a tenant's share in the further rounds; its own statement, over
    `p_priorities`, is not counted again)."""
    query = plan.query.lstrip()
    return "FROM turnstile_claim_heads(" in query or (
        query.startswith("SELECT h.id") and "unnest(v_priorities)" in query
    )


async def _claim_cost(engine: AsyncEngine, queue: Queue, limit: int) -> ClaimCost:
    """What one claim of `limit` runs costs; rolled back. It runs twice on the connection and
    the second is measured: the first also reads the catalog to make its plans."""
    params: dict[str, Any] = {
        "owner": "w",
        "priorities": priorities_of([ASYNC]),
        "lease_seconds": 30.0,
        "limit": limit,
        "max_running": [None, None, None],
        "now": queue.clock(),
        "claim": None,
    }
    async with engine.connect() as conn:
        try:
            plans: list[NestedPlan] = await start_explaining(conn, generic=True)
        except AutoExplainMissing as missing:
            require_or_skip("auto_explain", str(missing))
            raise
        for _ in range(2):
            plans.clear()
            transaction = await conn.begin()
            rows = await queue.db.rows("claim", dict(params), conn)
            await transaction.rollback()
    outer = [p for p in plans if "FROM turnstile_claim(" in p.query]
    assert outer, "auto_explain logged no plan of the claim statement"
    return ClaimCost(
        buffers=outer[-1].buffers,
        walked=sum(1 for p in plans if _probes_a_tenant(p)),
        claimed=sum(1 for row in rows if row["id"] is not None),
    )


async def _setup(url: str, settings: Settings, clock: ManualClock, tenants: int) -> AsyncEngine:
    engine = create_engine(settings, url, pool_size=2)
    queue = Queue(engine, clock=clock)
    await _busy_tenant(queue)
    await _ticks_due_tomorrow(engine, clock, tenants=tenants)
    return engine


@pytest.mark.parametrize("limit", [1, 8], ids=["one", "batch"])
async def test_tenants_with_work_only_later_cost_the_claim_nothing(
    settings: Settings,
    server_url: str,
    template_database: str,
    clock: ManualClock,
    limit: int,
) -> None:
    urls = [await clone_database(server_url, template_database) for _ in range(2)]
    engines: list[AsyncEngine] = []
    try:
        costs = []
        for url, tenants in zip(urls, (1, IDLE_TENANTS), strict=True):
            engines.append(await _setup(url, settings, clock, tenants))
            costs.append(await _claim_cost(engines[-1], Queue(engines[-1], clock=clock), limit))
        one, many = costs
        print(
            f"claim of {limit}: {one} beside one tenant's runs due tomorrow, {many} beside "
            f"{IDLE_TENANTS} tenants'"
        )
        assert one.claimed == many.claimed == limit
        assert many.walked == one.walked
        assert many.buffers <= 1.5 * one.buffers, (one, many)
        # Tomorrow, the ticks are work like any other, and are claimed: in batches, as workers
        # claim (one claim of all 10,040 walks 10,001 tenants in one statement, which a
        # loaded CI machine can hold past the statement timeout).
        clock.advance(timedelta(days=1, seconds=1).total_seconds())
        queue = Queue(engines[-1], clock=clock)
        taken = 0
        while batch := await queue.claim("w", [ASYNC], limit=CLAIM_BATCH):
            taken += len(batch)
        assert taken == IDLE_TENANTS + HANDFUL
    finally:
        for engine in engines:
            await engine.dispose()
        for url in urls:
            await drop_database(server_url, url)


async def test_tenants_whose_work_was_taken_are_walked_once(
    quiet_engine: AsyncEngine, clock: ManualClock
) -> None:
    """Tenants whose only runs were cancelled are left in the walk; the first claim that walks
    them takes them out, and the next walks only the tenant with work."""
    queue = Queue(quiet_engine, clock=clock)
    await _busy_tenant(queue)
    others = [
        await queue.enqueue(
            NewRun(
                tenant_id=f"gone-{n:04d}",
                principal="p",
                agent="scripted",
                input={},
                priority=ASYNC.base,
            )
        )
        for n in range(500)
    ]
    for run in others:
        await queue.cancel(run.id, actor="op")
    walking = await _claim_cost(quiet_engine, queue, 1)
    assert walking.walked == 501  # rolled back: they are still in the walk
    # This claim walks them first, finds nothing, and takes them out of the walk.
    assert len(await queue.claim("w", [ASYNC])) == 1
    after = await _claim_cost(quiet_engine, queue, 1)
    assert (after.walked, after.claimed) == (1, 1)
