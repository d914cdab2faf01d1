"""Model budgets in the core (app/queue/model_budgets.py) on a real PostgreSQL and the
queue's manual clock: an admin's overrides and their validation, reservations exact on the
buckets (refilled with time, settled with the reported usage), fenced on the run's lease, a
lost lease giving its tokens back, a provider's pause, and a wait for capacity that gives the
run back with its attempt, for the time the budget has room."""

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
    endpoint_key,
    estimate_tokens,
)
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import ClaimedRun, Fenced, NewRun, Written
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs

ENDPOINT = "test-model@http://127.0.0.1:9/v1"


async def claimed(queue: Queue, count: int = 1, priority: int = 10) -> list[ClaimedRun]:
    for _ in range(count):
        await queue.enqueue(
            NewRun(tenant_id="t", principal="p", agent="openai", input={}, priority=priority)
        )
    held = await queue.claim("w", list(PriorityClass), limit=count)
    assert len(held) == count
    return held


def test_the_key_and_the_estimate() -> None:
    assert endpoint_key("http://h/v1/", "m") == "m@http://h/v1"
    assert estimate_tokens(401, 100) == 201


async def test_an_admins_budget_overrides_the_default_and_is_validated(queue: Queue) -> None:
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))
    first = await budgets.get_budget(ENDPOINT)
    assert first.to_document(budgets.defaults)["effective"] == {
        "requests_per_minute": 60,
        "tokens_per_minute": None,
    }
    changed = await budgets.set_budget(ENDPOINT, tokens_per_minute=1000)
    assert changed.tokens_per_minute == 1000
    assert changed.requests_per_minute is None
    kept = await budgets.set_budget(ENDPOINT, requests_per_minute=5)
    assert (kept.requests_per_minute, kept.tokens_per_minute) == (5, 1000)
    back = await budgets.set_budget(ENDPOINT, requests_per_minute=None)
    assert back.to_document(budgets.defaults)["effective"]["requests_per_minute"] == 60
    for bad in (0, -1, True, 1.5, 2**31):
        with pytest.raises(InvalidLimitsError) as refused:
            await budgets.set_budget(ENDPOINT, tokens_per_minute=bad)  # type: ignore[arg-type]
        assert refused.value.field == "tokens_per_minute"
    for endpoint in ("", "a b", "x" * 301):
        with pytest.raises(InvalidLimitsError):
            await budgets.set_budget(endpoint, tokens_per_minute=1)
    assert [b.endpoint for b in await budgets.budgets()] == [ENDPOINT]


async def test_reservations_are_exact_refill_with_time_and_settle_with_the_usage(
    queue: Queue, clock: ManualClock
) -> None:
    budgets = ModelBudgets(queue, BudgetDefaults(tokens_per_minute=600))
    a, b, c = await claimed(queue, 3)
    first = await budgets.reserve(a.lease, ENDPOINT, 250)
    second = await budgets.reserve(b.lease, ENDPOINT, 250)
    assert isinstance(first, Reservation)
    assert isinstance(second, Reservation)
    third = await budgets.reserve(c.lease, ENDPOINT, 250)
    # 100 left; 150 more come in 15 s at 600 a minute.
    assert isinstance(third, CapacityShort)
    assert third.short_of == "tokens"
    assert third.wait_seconds == pytest.approx(15)
    assert third.ready_at == clock.now + timedelta(seconds=15)
    # The first call used 50 of its 250: 200 come back at once.
    await budgets.settle(first, 50)
    again = await budgets.reserve(c.lease, ENDPOINT, 250)
    assert isinstance(again, Reservation)
    figures = await budgets.get_budget(ENDPOINT)
    assert (figures.requests_used, figures.tokens_used, figures.waits) == (1, 50, 1)
    assert (figures.reservations, figures.reserved_tokens) == (2, 500)
    # 50 left; 200 come back in 20 s.
    assert isinstance(await budgets.reserve(a.lease, ENDPOINT, 250), CapacityShort)
    clock.advance(20)
    assert isinstance(await budgets.reserve(a.lease, ENDPOINT, 250), Reservation)


async def test_requests_a_minute_and_a_call_larger_than_the_whole_budget(
    queue: Queue, clock: ManualClock
) -> None:
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=2, tokens_per_minute=100))
    (run,) = await claimed(queue)
    # Larger than a minute's tokens: it takes a full bucket, not forever.
    big = await budgets.reserve(run.lease, ENDPOINT, 10_000)
    assert isinstance(big, Reservation)
    assert big.tokens == 100
    await budgets.settle(big, 0)
    assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 1), Reservation)
    short = await budgets.reserve(run.lease, ENDPOINT, 1)
    assert isinstance(short, CapacityShort)
    assert short.short_of == "requests"
    assert short.wait_seconds == pytest.approx(30)  # one request every 30 s


async def test_a_reservation_is_fenced_and_a_lost_lease_gives_its_tokens_back(
    queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    budgets = ModelBudgets(queue, BudgetDefaults(tokens_per_minute=1000))
    a, _b = await claimed(queue, 2)
    assert isinstance(await budgets.reserve(a.lease, ENDPOINT, 900), Reservation)
    # a's worker dies holding the reservation; its lease expires and the sweeper requeues it.
    clock.advance(31)
    assert (await queue.sweep()).requeued == 2
    assert isinstance(await budgets.reserve(a.lease, ENDPOINT, 1), Fenced)
    clock.advance(3600)
    (again,) = await queue.claim("w2", list(PriorityClass), limit=1)
    # Without the give-back the bucket would have 100 (refilled to the top since, anyway);
    # make the refill nothing by asking at once for what only a given-back bucket has.
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE model_budgets SET refilled_at = :now"), {"now": clock.now})
    reserved = await budgets.reserve(again.lease, ENDPOINT, 1000)
    assert isinstance(reserved, Reservation)
    async with engine.connect() as conn:
        left = await conn.execute(text("SELECT count(*) FROM model_reservations"))
        assert left.scalar_one() == 1  # the dead run's is gone


async def test_a_pause_stops_every_reservation_until_it_ends(
    queue: Queue, clock: ManualClock
) -> None:
    budgets = ModelBudgets(queue)  # unlimited: only the pause stops it
    (run,) = await claimed(queue)
    until = await budgets.pause(ENDPOINT, 7)
    assert until == clock.now + timedelta(seconds=7)
    await budgets.pause(ENDPOINT, 2)  # never shortens the pause
    short = await budgets.reserve(run.lease, ENDPOINT, 10)
    assert isinstance(short, CapacityShort)
    assert short.short_of == "paused"
    assert short.ready_at == until
    clock.advance(7)
    assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 10), Reservation)
    assert (await budgets.get_budget(ENDPOINT)).pauses == 2


async def test_a_wait_for_capacity_gives_the_run_back_with_its_attempt(
    queue: Queue, clock: ManualClock
) -> None:
    budgets = ModelBudgets(queue, BudgetDefaults(tokens_per_minute=60))
    (run,) = await claimed(queue)
    assert run.run.attempts == 1
    assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 90), Reservation)  # capped
    short = await budgets.reserve(run.lease, ENDPOINT, 30)
    assert isinstance(short, CapacityShort)
    written = await queue.wait_for_capacity(
        run.lease, short.reason(), until=short.ready_at, endpoint=ENDPOINT
    )
    assert isinstance(written, Written)
    back = await queue.get_run(run.run.id)
    assert back is not None
    assert (back.status, back.attempts, back.scheduled_for) == ("queued", 0, short.ready_at)
    events = await queue.events(run.run.id)
    released = events[-1]
    assert released.type == "run.released"
    assert released.data["waited_for"] == "capacity"
    assert released.data["endpoint"] == ENDPOINT
    assert "tokens a minute" in released.data["reason"]
    # Not claimable before the budget has room; claimable then.
    assert await queue.claim("w", list(PriorityClass)) == []
    clock.advance(short.wait_seconds)
    (again,) = await queue.claim("w", list(PriorityClass))
    assert again.run.id == run.run.id
    assert again.run.attempts == 1
    await check_all_runs(queue.engine)  # the counts and the fair walk's marks agree


async def test_the_metrics_carry_each_endpoints_figures(queue: Queue, clock: ManualClock) -> None:
    budgets = ModelBudgets(queue, BudgetDefaults(tokens_per_minute=100))
    a, b = await claimed(queue, 2)
    first = await budgets.reserve(a.lease, ENDPOINT, 60)
    assert isinstance(first, Reservation)
    assert isinstance(await budgets.reserve(b.lease, ENDPOINT, 60), CapacityShort)
    await budgets.settle(first, 20)  # 40 left, 40 back
    assert isinstance(await budgets.reserve(b.lease, ENDPOINT, 60), Reservation)
    await budgets.pause(ENDPOINT, 30)
    metrics = Metrics()
    await QueueMetrics(queue, metrics, holder="test", interval=60).run_once()

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"endpoint": ENDPOINT, **labels})

    assert value("turnstile_model_requests", state="used") == 1
    assert value("turnstile_model_requests", state="reserved") == 1
    assert value("turnstile_model_tokens", state="used") == 20
    assert value("turnstile_model_tokens", state="reserved") == 60
    assert value("turnstile_model_capacity_waits") == 1
    assert value("turnstile_model_pauses") == 1
    assert value("turnstile_model_paused") == 1


async def test_interactive_runs_come_back_before_async_ones(
    queue: Queue, clock: ManualClock
) -> None:
    """Both wait for the same capacity: the claim's priority order brings the interactive
    run back first, whichever waited first."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=1))
    (async_run,) = await claimed(queue, priority=10)
    (interactive,) = await claimed(queue, priority=0)
    assert isinstance(await budgets.reserve(async_run.lease, ENDPOINT, 1), Reservation)
    waits = []
    for held in (async_run, interactive):
        short = await budgets.reserve(held.lease, ENDPOINT, 1)
        assert isinstance(short, CapacityShort)
        waits.append(short)
        await queue.wait_for_capacity(
            held.lease, short.reason(), until=short.ready_at, endpoint=ENDPOINT
        )
    clock.advance(max(w.wait_seconds for w in waits))
    (first,) = await queue.claim("w", list(PriorityClass))
    assert first.run.id == interactive.run.id
    (second,) = await queue.claim("w", list(PriorityClass))
    assert second.run.id == async_run.run.id
