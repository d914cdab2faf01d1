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
from app.queue import model_budgets
from app.queue.core import Queue
from app.queue.errors import InvalidLimitsError
from app.queue.model_budgets import (
    BudgetDefaults,
    CapacityShort,
    ModelBudgets,
    ProviderLimits,
    Reservation,
    endpoint_key,
    estimate_tokens,
)
from app.runtime.openai_agent import provider_limits, reset_seconds
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
    # Per tenant: what its calls hold now, in flight and waiting their turn.
    assert value("turnstile_model_tenant_tokens", tenant="t", state="reserved") == 60
    assert value("turnstile_model_tenant_requests", tenant="t", state="booked") == 0
    assert value("turnstile_model_requests", state="booked") == 0


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


async def test_async_calls_leave_the_interactive_share_of_the_bucket(
    queue: Queue, clock: ManualClock
) -> None:
    """While interactive calls are in flight or booked, an async call must leave the
    interactive share of a minute's budget in the buckets: async calls spend at most the rest
    of a full bucket, and an interactive call asking then is granted at once. With no
    interactive call about, nothing is held back. A budget too small to hold a share back (one
    request a minute) holds none, and a share never keeps a call larger than the rest of a
    full bucket from fitting in it."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=10, interactive_share=0.2))
    async_runs = await claimed(queue, 8, priority=10)
    interactive = await claimed(queue, 3, priority=0)
    # An interactive call in flight: the share is held from now on.
    assert isinstance(await budgets.reserve(interactive[0].lease, ENDPOINT, 1), Reservation)
    for held in async_runs[:7]:
        assert isinstance(await budgets.reserve(held.lease, ENDPOINT, 1), Reservation)
    # Two requests left: the eighth async call would take the share, so it books its turn
    # (for when the bucket holds its request beside the share: one more request, 6 s).
    short = await budgets.reserve(async_runs[7].lease, ENDPOINT, 1)
    assert isinstance(short, CapacityShort)
    assert short.short_of == "interactive_share"
    assert "held for interactive calls" in short.reason()
    assert short.wait_seconds == pytest.approx(6, abs=0.01)
    # An interactive call takes what is left (the booking took its request) at once; the
    # next one takes the async booking's turn.
    assert isinstance(await budgets.reserve(interactive[1].lease, ENDPOINT, 1), Reservation)
    taken = await budgets.reserve(interactive[2].lease, ENDPOINT, 1)
    assert isinstance(taken, CapacityShort)
    assert taken.ready_at == short.ready_at

    # No interactive call about: async calls may spend the whole bucket.
    quiet = "quiet-model@http://127.0.0.1:9/v1"
    for held in await claimed(queue, 10, priority=10):
        assert isinstance(await budgets.reserve(held.lease, quiet, 1), Reservation)

    other = "other-model@http://127.0.0.1:9/v1"
    one_a_minute = ModelBudgets(
        queue, BudgetDefaults(requests_per_minute=1, tokens_per_minute=100, interactive_share=0.5)
    )
    (asking,) = await claimed(queue, 1, priority=0)
    (lone,) = await claimed(queue, 1, priority=10)
    # An interactive call in flight, and a minute later the buckets full again: half of 100
    # tokens is held, but an 80-token call still fits a full bucket, and the one request a
    # minute holds none back.
    assert isinstance(await one_a_minute.reserve(asking.lease, other, 1), Reservation)
    clock.advance(60)
    assert isinstance(await one_a_minute.reserve(lone.lease, other, 80), Reservation)


async def test_an_unlimited_endpoints_calls_hold_nothing_and_are_counted(
    queue: Queue, engine: AsyncEngine
) -> None:
    """An endpoint with no limit for the run's tenant (no budget, no provider limits, no
    pause, no tenant limit) is the unlimited path: a call holds nothing and takes no row lock,
    and what it used is added to the endpoint's and the tenant's figures at the process's next
    question. A budget, a tenant's limit or a pause puts calls back on the reservation."""
    budgets = ModelBudgets(queue, BudgetDefaults(unlimited_trust_seconds=0))
    runs = await claimed(queue, 4)
    for held in runs[:2]:
        free = await budgets.reserve(held.lease, ENDPOINT, 100, tenant_id="t")
        assert isinstance(free, Reservation)
        assert free.id is None
        await budgets.settle(free, 30)
    async with engine.connect() as conn:
        held_rows = await conn.execute(text("SELECT count(*) FROM model_reservations"))
        assert held_rows.scalar_one() == 0
    # The next question adds the two calls to the figures.
    assert (await budgets.reserve(runs[2].lease, ENDPOINT, 100, tenant_id="t")).id is None  # type: ignore[union-attr]
    figures = await budgets.get_budget(ENDPOINT)
    assert (figures.requests_used, figures.tokens_used) == (2, 60)
    (tenant,) = await budgets.tenant_budgets("t")
    assert (tenant.requests_used, tenant.tokens_used) == (2, 60)
    # A tenant's own limit there: that tenant's calls reserve again, another's do not.
    await budgets.set_tenant_budget("t", ENDPOINT, tokens_per_minute=10_000)
    limited = await budgets.reserve(runs[3].lease, ENDPOINT, 100, tenant_id="t")
    assert isinstance(limited, Reservation)
    assert limited.id is not None
    (other,) = await claimed(queue, 1)
    assert (await budgets.reserve(other.lease, ENDPOINT, 100, tenant_id="u")).id is None  # type: ignore[union-attr]
    # A 429 pauses the endpoint for every tenant's calls.
    await budgets.pause(ENDPOINT, 30)
    paused = await budgets.reserve(other.lease, ENDPOINT, 100, tenant_id="u")
    assert isinstance(paused, CapacityShort)
    assert paused.short_of == "paused"


async def test_a_process_trusts_an_unlimited_endpoint_for_a_while(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within its trust window a process asks nothing: a budget another process sets reaches
    its calls once the window has passed (1 s by default), not at once."""
    monotonic = [1000.0]
    monkeypatch.setattr(model_budgets.time, "monotonic", lambda: monotonic[0])
    budgets = ModelBudgets(queue, BudgetDefaults())
    admin = ModelBudgets(queue, BudgetDefaults())
    (first, second) = await claimed(queue, 2)
    assert (await budgets.reserve(first.lease, ENDPOINT, 1, tenant_id="t")).id is None  # type: ignore[union-attr]
    await admin.set_budget(ENDPOINT, requests_per_minute=60)
    monotonic[0] += 0.9
    assert (await budgets.reserve(second.lease, ENDPOINT, 1, tenant_id="t")).id is None  # type: ignore[union-attr]
    monotonic[0] += 0.2  # past the second: it asks again, and reserves
    held = await budgets.reserve(second.lease, ENDPOINT, 1, tenant_id="t")
    assert isinstance(held, Reservation)
    assert held.id is not None


async def test_a_transaction_older_than_the_last_refill_does_not_refill_again(
    queue: Queue, clock: ManualClock, engine: AsyncEngine
) -> None:
    """A reservation whose transaction began (its now()) before another one refilled and
    committed, while it waited for the endpoint's row lock, refills nothing: given its own
    older now, it once refilled the same seconds a second time and the budget gave out more
    than its rate (the provider answered 429)."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))
    (run,) = await claimed(queue)
    for _ in range(60):
        assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 1), Reservation)
    clock.advance(5)  # five requests come back
    for _ in range(5):
        assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 1), Reservation)
    clock.advance(-4)  # a transaction that began 4 s ago reserves now
    late = await budgets.reserve(run.lease, ENDPOINT, 1)
    assert isinstance(late, CapacityShort)
    assert late.short_of == "requests"
    clock.advance(4)  # back to the present: those 4 s were refilled once already
    again = await budgets.reserve(run.lease, ENDPOINT, 1)
    assert isinstance(again, CapacityShort)  # its booked turn is still to come
    assert again.short_of == "booked"
    async with engine.connect() as conn:
        level = (await conn.execute(text("SELECT request_level FROM model_budgets"))).scalar_one()
    assert level == pytest.approx(-1)  # the one booking, nothing refilled twice


async def test_waiting_calls_are_booked_one_after_another(queue: Queue, clock: ManualClock) -> None:
    """No herd: each call the budget cannot take gets a turn of its own, the later ones
    behind it, and at its turn its booking becomes its reservation, even though the bucket
    is empty to everyone else."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))
    first, *waiting = await claimed(queue, 4)
    assert isinstance(await budgets.reserve(first.lease, ENDPOINT, 1), Reservation)
    clock.advance(0)
    # 59 requests left: use them up.
    for _ in range(59):
        assert isinstance(await budgets.reserve(first.lease, ENDPOINT, 1), Reservation)
    shorts = []
    for held in waiting:
        short = await budgets.reserve(held.lease, ENDPOINT, 1)
        assert isinstance(short, CapacityShort)
        shorts.append(short)
    # One request a second: the three waiting calls come due 1, 2 and 3 s from now.
    assert [s.wait_seconds for s in shorts] == pytest.approx([1, 2, 3])
    assert len({s.ready_at for s in shorts}) == 3
    clock.advance(1)
    # A newcomer does not take the first one's turn: it books behind the others.
    (newcomer,) = await claimed(queue)
    late = await budgets.reserve(newcomer.lease, ENDPOINT, 1)
    assert isinstance(late, CapacityShort)
    assert late.wait_seconds == pytest.approx(3)
    # The second one, early, is told its turn again; the first one's is now.
    early = await budgets.reserve(waiting[1].lease, ENDPOINT, 1)
    assert isinstance(early, CapacityShort)
    assert early.short_of == "booked"
    assert early.ready_at == shorts[1].ready_at
    assert isinstance(await budgets.reserve(waiting[0].lease, ENDPOINT, 1), Reservation)
    clock.advance(1)
    assert isinstance(await budgets.reserve(waiting[1].lease, ENDPOINT, 1), Reservation)
    figures = await budgets.get_budget(ENDPOINT)
    assert (figures.reservations, figures.booked) == (62, 2)  # held; two still waiting


async def test_tokens_given_back_bring_the_bookings_forward(
    queue: Queue, clock: ManualClock
) -> None:
    """A settlement that gives back what its call did not use brings every booking forward
    by that much, without rewriting them; and the bookings' wake times count on it (the
    budget's moving average of what calls use of their reservations)."""
    budgets = ModelBudgets(queue, BudgetDefaults(tokens_per_minute=600))
    a, b, c = await claimed(queue, 3)
    held = await budgets.reserve(a.lease, ENDPOINT, 600)
    assert isinstance(held, Reservation)
    short = await budgets.reserve(b.lease, ENDPOINT, 300)
    assert isinstance(short, CapacityShort)
    assert short.wait_seconds == pytest.approx(30)
    await budgets.settle(held, 300)  # 300 back: b's turn is now
    assert isinstance(await budgets.reserve(b.lease, ENDPOINT, 300), Reservation)
    # What calls use of their reservations (300 of 600 here) brings the next wake forward:
    # c's 300 come 30 s from now by the bucket alone, sooner counting on b's 300 held now.
    later = await budgets.reserve(c.lease, ENDPOINT, 300)
    assert isinstance(later, CapacityShort)
    assert later.wait_seconds < 30


async def test_an_interactive_call_takes_an_async_bookings_turn(
    queue: Queue, clock: ManualClock
) -> None:
    """Interactive before async within a budget: an interactive call that finds no room
    takes the turn of the next async booking not yet due; the async run, when it comes back,
    books again behind."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))
    (filler,) = await claimed(queue, priority=10)
    async_runs = await claimed(queue, 2, priority=10)
    (interactive,) = await claimed(queue, priority=0)
    for _ in range(60):
        assert isinstance(await budgets.reserve(filler.lease, ENDPOINT, 1), Reservation)
    booked = []
    for held in async_runs:
        short = await budgets.reserve(held.lease, ENDPOINT, 1)
        assert isinstance(short, CapacityShort)
        booked.append(short)
    taken = await budgets.reserve(interactive.lease, ENDPOINT, 1)
    assert isinstance(taken, CapacityShort)
    assert taken.ready_at == booked[0].ready_at  # the first async booking's turn
    clock.advance(booked[0].wait_seconds)
    assert isinstance(await budgets.reserve(interactive.lease, ENDPOINT, 1), Reservation)
    again = await budgets.reserve(async_runs[0].lease, ENDPOINT, 1)
    assert isinstance(again, CapacityShort)
    assert again.ready_at > booked[1].ready_at  # behind the other async booking
    figures = await budgets.get_budget(ENDPOINT)
    assert (figures.reservations, figures.booked) == (61, 2)


async def test_a_settlement_wakes_the_runs_whose_bookings_came_due_early(
    queue: Queue, clock: ManualClock
) -> None:
    """The tokens a settlement gives back are spent now: a run that gave its slot back until
    its booked turn is made eligible at once when the turn comes due early, and its booking
    becomes its reservation."""
    budgets = ModelBudgets(queue, BudgetDefaults(tokens_per_minute=600))
    a, b = await claimed(queue, 2)
    held = await budgets.reserve(a.lease, ENDPOINT, 600)
    assert isinstance(held, Reservation)
    short = await budgets.reserve(b.lease, ENDPOINT, 300)
    assert isinstance(short, CapacityShort)
    await queue.wait_for_capacity(b.lease, short.reason(), until=short.ready_at, endpoint=ENDPOINT)
    assert await queue.claim("w", list(PriorityClass)) == []  # 30 s to its turn
    await budgets.settle(held, 300)  # 300 back: its turn is now
    (again,) = await queue.claim("w", list(PriorityClass))
    assert again.run.id == b.run.id
    assert isinstance(await budgets.reserve(again.lease, ENDPOINT, 300), Reservation)
    await check_all_runs(queue.engine)


async def test_the_providers_headers_set_the_rate_for_every_process(
    queue: Queue, clock: ManualClock
) -> None:
    """The provider's rate-limit headers, as observed with an answer: its limit becomes the
    budget's ceiling (kept in PostgreSQL, so every process's next reservation follows it);
    the tokens it says remain do not lower the bucket (it counts answered calls at their
    usage, the budget at their estimates until they settle)."""
    budgets = ModelBudgets(queue, BudgetDefaults(tokens_per_minute=600))
    (run,) = await claimed(queue)
    assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 500), Reservation)
    await budgets.observe(ENDPOINT, ProviderLimits(limit_tokens=300, remaining_tokens=0))
    figures = await budgets.get_budget(ENDPOINT)
    document = figures.to_document(budgets.defaults)
    assert document["effective"] == {"requests_per_minute": None, "tokens_per_minute": 300}
    # Another process (another ModelBudgets on the same database) follows it: the bucket is
    # capped at 300 a minute's worth... of which 100 are left, and 50 more take 10 s.
    other = ModelBudgets(Queue(queue.engine, clock=clock), BudgetDefaults(tokens_per_minute=600))
    short = await other.reserve(run.lease, ENDPOINT, 150)
    assert isinstance(short, CapacityShort)
    assert short.wait_seconds == pytest.approx(10)


def test_the_rate_limit_headers_as_openai_sends_them() -> None:
    assert reset_seconds("1m2.5s") == pytest.approx(62.5)
    assert reset_seconds("6ms") == pytest.approx(0.006)
    assert reset_seconds("20s") == 20
    assert reset_seconds("soon") is None
    limits = provider_limits(
        {
            "x-ratelimit-limit-requests": "500",
            "x-ratelimit-remaining-requests": "499",
            "x-ratelimit-reset-requests": "120ms",
            "x-ratelimit-limit-tokens": "200000",
            "x-ratelimit-remaining-tokens": "150000",
            "x-ratelimit-reset-tokens": "15s",
        }
    )
    assert limits == ProviderLimits(500, 200_000, 499, 150_000)
    # No limit sent: what remains and when the bucket is full again give it.
    inferred = provider_limits(
        {"x-ratelimit-remaining-tokens": "45000", "x-ratelimit-reset-tokens": "15s"}
    )
    assert inferred.limit_tokens == 60_000
    assert not provider_limits({}).said()


async def test_a_tenants_flood_of_bookings_does_not_put_another_tenant_behind_it(
    queue: Queue, clock: ManualClock
) -> None:
    """Fair between tenants on one budget (docs/adr/0006's fair share, at the budget): a call
    of a tenant holding two or more fewer bookings of its class than another takes that
    tenant's next turn, instead of waiting behind its whole flood; a tenant holding about as
    many books behind."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))

    async def held_by(tenant: str, count: int) -> list[ClaimedRun]:
        for _ in range(count):
            await queue.enqueue(
                NewRun(tenant_id=tenant, principal="p", agent="openai", input={}, priority=10)
            )
        found = await queue.claim("w", list(PriorityClass), limit=count)
        assert len(found) == count
        return found

    (filler,) = await held_by("flood", 1)
    for _ in range(60):
        assert isinstance(await budgets.reserve(filler.lease, ENDPOINT, 1), Reservation)
    flood = await held_by("flood", 3)
    turns = []
    for held in flood:
        short = await budgets.reserve(held.lease, ENDPOINT, 1)
        assert isinstance(short, CapacityShort)
        turns.append(short.ready_at)
    late, later = await held_by("late", 2)
    first = await budgets.reserve(late.lease, ENDPOINT, 1)
    assert isinstance(first, CapacityShort)
    assert first.ready_at == turns[0]  # the flood's next turn, not behind its three
    # Now 2 of the flood's against 1 of its own: the next one books behind.
    second = await budgets.reserve(later.lease, ENDPOINT, 1)
    assert isinstance(second, CapacityShort)
    assert second.ready_at > turns[-1]
    # Each tenant's holds, as the metrics and GET /queue/stats show them.
    (budget,) = await budgets.budgets()
    holds = {hold.tenant_id: hold for hold in budget.tenants}
    assert (holds["flood"].reservations, holds["flood"].booked) == (60, 2)
    assert (holds["late"].reservations, holds["late"].booked) == (0, 2)


async def test_what_the_provider_says_remains_is_not_refilled_twice(
    queue: Queue, clock: ManualClock
) -> None:
    """What the provider says remains counts its refill until now: the bucket set to it is
    refilled from now, not again from its last refill (which gave out more than the rate and
    brought 429s back)."""
    budgets = ModelBudgets(queue, BudgetDefaults(requests_per_minute=60))
    (run,) = await claimed(queue)
    for _ in range(60):
        assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 1), Reservation)
    clock.advance(3)  # 3 requests come back, by both counts
    await budgets.observe(ENDPOINT, ProviderLimits(remaining_requests=2))  # 1 was another's
    for _ in range(2):
        assert isinstance(await budgets.reserve(run.lease, ENDPOINT, 1), Reservation)
    short = await budgets.reserve(run.lease, ENDPOINT, 1)
    assert isinstance(short, CapacityShort)


async def test_a_call_settles_after_its_endpoints_token_budget_was_lifted(
    queue: Queue, clock: ManualClock
) -> None:
    """A call reserved under a token budget that an admin lifts while it is in flight (or a
    process of another setting settles it) still settles: its usage counted, no error raised
    in place of the model's answer."""
    limited = ModelBudgets(queue, BudgetDefaults())
    await limited.set_budget(ENDPOINT, tokens_per_minute=1000)
    [a] = await claimed(queue)
    held = await limited.reserve(a.lease, ENDPOINT, 300)
    assert isinstance(held, Reservation)
    await limited.set_budget(ENDPOINT, tokens_per_minute=None)  # unlimited, no default
    await limited.settle(held, 120)
    figures = await limited.get_budget(ENDPOINT)
    assert (figures.requests_used, figures.tokens_used, figures.reservations) == (1, 120, 0)
