"""A tenant's own limits on a model endpoint's budget (app/queue/model_budgets.py, migration
0030; docs/model-budgets.md), on a real PostgreSQL and the queue's manual clock: an admin's
limits per endpoint and on every endpoint, validated; a call over its tenant's limit waits
(booked on the tenant's buckets, its run given back with its attempt, told its turn) while
other tenants' calls go; it takes no other tenant's turn and holds nothing of the
endpoint's; settlements give the tenant's tokens back and count what each tenant used."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.maintenance.queue_metrics import QueueMetrics
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.errors import InvalidLimitsError
from app.queue.model_budgets import (
    BudgetDefaults,
    CapacityShort,
    ModelBudgets,
    Reservation,
)
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import ClaimedRun, NewRun, Written
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs

ENDPOINT = "test-model@http://127.0.0.1:9/v1"
OTHER = "other-model@http://127.0.0.1:9/v1"


async def held_by(
    queue: Queue, tenant: str, count: int = 1, priority: int = 10
) -> list[ClaimedRun]:
    for _ in range(count):
        await queue.enqueue(
            NewRun(tenant_id=tenant, principal="p", agent="openai", input={}, priority=priority)
        )
    found = await queue.claim("w", list(PriorityClass), limit=count)
    assert len(found) == count
    assert {c.run.tenant_id for c in found} == {tenant}
    return found


async def scalar(engine: AsyncEngine, sql: str) -> object:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql))).scalar_one()


async def test_an_admin_sets_a_tenants_limits_per_endpoint_and_on_every_endpoint(
    queue: Queue,
) -> None:
    budgets = ModelBudgets(queue)
    every = await budgets.set_tenant_budget("acme", None, tokens_per_minute=1000)
    assert (every.endpoint, every.tokens_per_minute, every.requests_per_minute) == ("", 1000, None)
    own = await budgets.set_tenant_budget("acme", ENDPOINT, requests_per_minute=5)
    assert (own.requests_per_minute, own.tokens_per_minute) == (5, None)
    kept = await budgets.set_tenant_budget("acme", ENDPOINT, tokens_per_minute=50)
    assert (kept.requests_per_minute, kept.tokens_per_minute) == (5, 50)
    back = await budgets.set_tenant_budget("acme", ENDPOINT, requests_per_minute=None)
    assert (back.requests_per_minute, back.tokens_per_minute) == (None, 50)
    listed = await budgets.tenant_budgets("acme")
    assert [(t.endpoint, t.requests_per_minute, t.tokens_per_minute) for t in listed] == [
        ("", None, 1000),
        (ENDPOINT, None, 50),
    ]
    for bad in (0, -1, True, 1.5, 2**31):
        with pytest.raises(InvalidLimitsError) as refused:
            await budgets.set_tenant_budget("acme", ENDPOINT, tokens_per_minute=bad)  # type: ignore[arg-type]
        assert refused.value.field == "tokens_per_minute"
    for endpoint in ("", "a b", "x" * 301):
        with pytest.raises(InvalidLimitsError) as refused:
            await budgets.set_tenant_budget("acme", endpoint, tokens_per_minute=1)
        assert refused.value.field == "endpoint"
    for tenant in ("", "a\x00b", "x" * 500):
        with pytest.raises(InvalidLimitsError) as refused:
            await budgets.set_tenant_budget(tenant, ENDPOINT, tokens_per_minute=1)
        assert refused.value.field == "tenant"
    # Nothing refused was written.
    assert [t.endpoint for t in await budgets.tenant_budgets("acme")] == ["", ENDPOINT]


async def test_a_call_over_its_tenants_limit_waits_while_other_tenants_go(
    queue: Queue, clock: ManualClock
) -> None:
    """Two requests a minute for `small` on an endpoint of sixty: its third call is booked on
    its own buckets, told to come back in 30 s (one request every 30 s), and its run given
    back with its attempt; `big` reserves meanwhile; at its turn `small`'s call goes."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))
    await budgets.set_tenant_budget("small", ENDPOINT, requests_per_minute=2)
    (small,) = await held_by(queue, "small")
    (big,) = await held_by(queue, "big")
    for _ in range(2):
        assert isinstance(await budgets.reserve(small.lease, ENDPOINT, 1), Reservation)
    short = await budgets.reserve(small.lease, ENDPOINT, 1)
    assert isinstance(short, CapacityShort)
    assert short.short_of == "tenant_requests"
    assert short.wait_seconds == pytest.approx(30)
    assert short.ready_at == clock.now + timedelta(seconds=30)
    assert "the tenant's requests a minute" in short.reason()
    for _ in range(5):
        assert isinstance(await budgets.reserve(big.lease, ENDPOINT, 1), Reservation)
    written = await queue.wait_for_capacity(
        small.lease, short.reason(), until=short.ready_at, endpoint=ENDPOINT
    )
    assert isinstance(written, Written)
    back = await queue.get_run(small.run.id)
    assert back is not None
    assert (back.status, back.attempts, back.scheduled_for) == ("queued", 0, short.ready_at)
    assert await queue.claim("w", list(PriorityClass)) == []
    clock.advance(short.wait_seconds)
    (again,) = await queue.claim("w", list(PriorityClass))
    assert again.run.id == small.run.id
    taken = await budgets.reserve(again.lease, ENDPOINT, 1)
    assert isinstance(taken, Reservation)  # its booked turn on its tenant's buckets
    assert taken.tenant_id == "small"
    (budget,) = await budgets.budgets()
    holds = {hold.tenant_id: hold for hold in budget.tenants}
    # Its two earlier calls' reservations were its earlier lease's (given back as a crashed
    # call's would be: the test never settled them).
    assert holds["small"].reservations == 1
    assert holds["small"].waits == 1
    assert holds["small"].requests_per_minute == 2
    assert holds["big"].reservations == 5
    assert holds["big"].requests_per_minute is None
    await check_all_runs(queue.engine)


async def test_a_tenants_limit_on_every_endpoint_applies_to_each_and_yields_to_its_own(
    queue: Queue, clock: ManualClock
) -> None:
    budgets = ModelBudgets(queue)  # the endpoints unlimited: only the tenant's limits
    await budgets.set_tenant_budget("acme", None, tokens_per_minute=100)
    (run,) = await held_by(queue, "acme")
    for endpoint in (ENDPOINT, OTHER):  # a bucket of its own on each endpoint
        assert isinstance(await budgets.reserve(run.lease, endpoint, 100), Reservation)
        short = await budgets.reserve(run.lease, endpoint, 50)
        assert isinstance(short, CapacityShort)
        assert short.short_of == "tenant_tokens"
        assert short.wait_seconds == pytest.approx(30)
    # Its own limit on the endpoint comes before its limit on every endpoint.
    await budgets.set_tenant_budget("acme", OTHER, tokens_per_minute=100_000)
    (other,) = await held_by(queue, "acme")
    clock.advance(0.6)  # the refill at the new rate: 1,000 tokens
    assert isinstance(await budgets.reserve(other.lease, OTHER, 900), Reservation)
    # Another tenant has no limit of its own.
    (free,) = await held_by(queue, "free")
    assert isinstance(await budgets.reserve(free.lease, ENDPOINT, 10_000), Reservation)


async def test_a_call_held_back_by_its_tenant_takes_no_turn_and_holds_nothing_of_the_endpoint(
    queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    """A tenant holding fewer bookings than another takes that tenant's next turn (the fair
    share), but not when its own limit holds the call back: then the call is booked on its
    tenant's buckets alone, every booking of the endpoint's keeps its turn and the endpoint's
    buckets give it nothing."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))
    await budgets.set_tenant_budget("late", ENDPOINT, requests_per_minute=1)
    (filler,) = await held_by(queue, "flood")
    for _ in range(60):
        assert isinstance(await budgets.reserve(filler.lease, ENDPOINT, 1), Reservation)
    turns = []
    for held in await held_by(queue, "flood", 3):
        short = await budgets.reserve(held.lease, ENDPOINT, 1)
        assert isinstance(short, CapacityShort)
        turns.append(short.ready_at)
    first, second = await held_by(queue, "late", 2)
    taken = await budgets.reserve(first.lease, ENDPOINT, 1)
    assert isinstance(taken, CapacityShort)
    assert taken.ready_at == turns[0]  # within its limit: the flood's next turn (fair share)
    level = await scalar(engine, "SELECT request_level FROM model_budgets")
    held_back = await budgets.reserve(second.lease, ENDPOINT, 1)
    assert isinstance(held_back, CapacityShort)
    assert held_back.short_of == "tenant_requests"
    assert held_back.wait_seconds == pytest.approx(60)  # its own turn, one a minute
    assert await scalar(engine, "SELECT request_level FROM model_budgets") == level
    flood_turns = await scalar(
        engine,
        "SELECT count(*) FROM model_reservations WHERE wake_at IS NOT NULL AND tenant_id = 'flood'",
    )
    assert flood_turns == 2  # the one taken by `late` within its limit, no other
    assert await scalar(engine, "SELECT count(*) FROM model_tenant_bookings") == 1
    (budget,) = await budgets.budgets()
    holds = {hold.tenant_id: hold for hold in budget.tenants}
    assert (holds["late"].booked, holds["late"].tenant_booked) == (1, 1)
    # At its turn, it passes its limit and asks the endpoint as any call (which has room by
    # then): its tenant's request was taken once, at its booking, not again.
    clock.advance(60)
    going = await budgets.reserve(second.lease, ENDPOINT, 1)
    assert isinstance(going, Reservation)
    assert going.tenant_tokens == 0  # its tenant's share: one request, no token limit
    assert await scalar(engine, "SELECT count(*) FROM model_tenant_bookings") == 0
    tenant_level = await scalar(
        engine, "SELECT request_level FROM model_tenant_budgets WHERE tenant_id = 'late'"
    )
    assert tenant_level == pytest.approx(0)


async def test_settlements_give_a_tenants_tokens_back_and_count_what_it_used(
    queue: Queue, clock: ManualClock
) -> None:
    budgets = ModelBudgets(queue)
    await budgets.set_tenant_budget("acme", ENDPOINT, tokens_per_minute=600)
    a, b = await held_by(queue, "acme", 2)
    held = await budgets.reserve(a.lease, ENDPOINT, 600)
    assert isinstance(held, Reservation)
    assert held.tenant_tokens == 600
    assert isinstance(await budgets.reserve(b.lease, ENDPOINT, 300), CapacityShort)
    clock.advance(30)  # b's turn on its tenant: 300 refilled, its booking due
    await budgets.settle(held, 100)  # 500 back
    second = await budgets.reserve(b.lease, ENDPOINT, 300)
    assert isinstance(second, Reservation)
    (c,) = await held_by(queue, "acme")
    # 500 given back: a new call of 400 fits at once (the bucket alone would have none).
    third = await budgets.reserve(c.lease, ENDPOINT, 400)
    assert isinstance(third, Reservation)
    await budgets.settle(second, 250)
    (budget,) = await budgets.budgets()
    (hold,) = budget.tenants
    assert (hold.requests_used, hold.tokens_used, hold.waits) == (2, 350, 1)
    assert hold.reservations == 1
    (limits,) = await budgets.tenant_budgets("acme")
    assert (limits.requests_used, limits.tokens_used) == (2, 350)
    # Per tenant in the metrics: what it used, not only what it holds now.
    metrics = Metrics()
    await QueueMetrics(queue, metrics, holder="test", interval=60).run_once()

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(
            name, {"endpoint": ENDPOINT, "tenant": "acme", **labels}
        )

    assert value("turnstile_model_tenant_requests", state="used") == 2
    assert value("turnstile_model_tenant_tokens", state="used") == 350
    assert value("turnstile_model_tenant_tokens", state="reserved") == 400
    assert value("turnstile_model_tenant_requests", state="tenant_booked") == 0
    assert value("turnstile_model_tenant_waits") == 1


async def test_a_tenant_booking_not_taken_up_gives_its_share_back(
    queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    """A run booked on its tenant's buckets that does not come back in time (cancelled, or
    its workers busy) gives its request back to its tenant, whose next call then has it."""
    budgets = ModelBudgets(queue)
    await budgets.set_tenant_budget("acme", ENDPOINT, requests_per_minute=1)
    a, b, c, d = await held_by(queue, "acme", 4)
    assert isinstance(await budgets.reserve(a.lease, ENDPOINT, 1), Reservation)
    turns = []
    for held in (b, c):
        short = await budgets.reserve(held.lease, ENDPOINT, 1)
        assert isinstance(short, CapacityShort)
        turns.append(short.wait_seconds)
    assert turns == pytest.approx([60, 120])
    # Past b's turn and its grace, b never came (c's grace is not over): the next call finds
    # b's request back with the refill, where without the give-back it would book behind c.
    clock.advance(121)
    assert isinstance(await budgets.reserve(d.lease, ENDPOINT, 1), Reservation)
    assert await scalar(engine, "SELECT count(*) FROM model_tenant_bookings") == 1
    level = await scalar(engine, "SELECT request_level FROM model_tenant_budgets")
    assert level == pytest.approx(0)
