"""The queue core's transitions against a real PostgreSQL, with a clock the tests move:
claim order, scheduling, leases, the sweeper, releases, waiting, delivery, cancel and failure.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest

from app.maintenance.sweeper import Sweeper
from app.queue.core import Queue
from app.queue.errors import RunFinishedError, RunNotFoundError, RunNotWaitingError
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Fenced, Lease, NewRun, Run, SweepReport, ToolCall, Written
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs

INTERACTIVE, ASYNC, MAINTENANCE = PriorityClass
ALL = list(PriorityClass)


def new_run(klass: PriorityClass = INTERACTIVE, **kwargs: Any) -> NewRun:
    kwargs.setdefault("input", {"n": 1})
    return NewRun(
        tenant_id="t",
        principal="p",
        agent="scripted",
        priority=klass.base,
        **kwargs,
    )


async def claim_one(queue: Queue, classes: list[PriorityClass] = ALL, owner: str = "w") -> Lease:
    claimed = await queue.claim(owner, classes)
    assert len(claimed) == 1
    return claimed[0].lease


async def current(queue: Queue, lease_or_run: Lease | Run) -> Run:
    run_id = lease_or_run.run_id if isinstance(lease_or_run, Lease) else lease_or_run.id
    run = await queue.get_run(run_id)
    assert run is not None
    return run


async def event_types(queue: Queue, run_id: Any) -> list[str]:
    return [e.type for e in await queue.events(run_id)]


# --- claim order ---------------------------------------------------------------------------------
async def test_claims_by_priority_then_age(queue: Queue, clock: ManualClock) -> None:
    maintenance = await queue.enqueue(new_run(MAINTENANCE))
    clock.advance(1)
    async_old = await queue.enqueue(new_run(ASYNC))
    clock.advance(1)
    async_new = await queue.enqueue(new_run(ASYNC))
    clock.advance(1)
    interactive = await queue.enqueue(new_run(INTERACTIVE))
    order = [(await claim_one(queue)).run_id for _ in range(4)]
    assert order == [interactive.id, async_old.id, async_new.id, maintenance.id]
    assert await queue.claim("w", ALL) == []


async def test_claim_only_from_eligible_classes(queue: Queue) -> None:
    await queue.enqueue(new_run(INTERACTIVE))
    maintenance = await queue.enqueue(new_run(MAINTENANCE))
    assert await queue.claim("w", [ASYNC]) == []
    # A slot eligible for two non-adjacent classes claims in one statement.
    claimed = await queue.claim("w", [MAINTENANCE, INTERACTIVE], limit=5)
    assert [c.run.priority_class for c in claimed] == [INTERACTIVE, MAINTENANCE]
    assert claimed[1].run.id == maintenance.id


async def test_age_counts_from_eligibility(queue: Queue, clock: ManualClock) -> None:
    early_but_scheduled = await queue.enqueue(
        new_run(ASYNC, scheduled_for=clock.now + timedelta(seconds=60))
    )
    clock.advance(10)
    later = await queue.enqueue(new_run(ASYNC))
    clock.advance(100)  # both eligible now; `later` has waited since t+10, the other since t+60
    assert (await claim_one(queue)).run_id == later.id
    assert (await claim_one(queue)).run_id == early_but_scheduled.id


async def test_scheduled_for_is_respected(queue: Queue, clock: ManualClock) -> None:
    run = await queue.enqueue(new_run(ASYNC, scheduled_for=clock.now + timedelta(seconds=30)))
    assert await queue.claim("w", ALL) == []
    clock.advance(29.9)
    assert await queue.claim("w", ALL) == []
    clock.advance(0.2)
    assert (await claim_one(queue)).run_id == run.id


async def test_claim_sets_lease_epoch_attempts_and_event(queue: Queue, clock: ManualClock) -> None:
    run = await queue.enqueue(new_run())
    claimed = (await queue.claim("worker-a", ALL))[0]
    assert claimed.lease == Lease(run_id=run.id, epoch=1, owner="worker-a")
    assert claimed.run.status == "running"
    assert claimed.run.attempts == 1
    assert claimed.run.lease_expires_at == clock.now + timedelta(seconds=30)
    assert await event_types(queue, run.id) == ["run.created", "run.claimed"]


async def test_batch_claim_gives_each_run_its_own_epoch(queue: Queue) -> None:
    for _ in range(5):
        await queue.enqueue(new_run(ASYNC))
    claimed = await queue.claim("w", [ASYNC], limit=3)
    assert len(claimed) == 3
    assert all(c.lease.epoch == 1 for c in claimed)
    assert len({c.run.id for c in claimed}) == 3
    assert len(await queue.claim("w", [ASYNC], limit=10)) == 2


async def test_concurrent_claimers_never_claim_one_run_twice(queue: Queue) -> None:
    await queue.enqueue_many(
        tenant_id="t", principal="p", runs=[("scripted", {}, ASYNC.base, None)] * 200
    )

    async def claimer(name: str) -> list[Any]:
        won: list[Any] = []
        while claimed := await queue.claim(name, ALL, limit=3):
            won.extend(c.run.id for c in claimed)
        return won

    results = await asyncio.gather(*(claimer(f"w{i}") for i in range(8)))
    everything = [run_id for won in results for run_id in won]
    assert len(everything) == 200
    assert len(set(everything)) == 200


# --- heartbeats and fencing --------------------------------------------------------------------
async def test_heartbeat_extends_and_returns_false_when_fenced(
    queue: Queue, clock: ManualClock
) -> None:
    await queue.enqueue(new_run())
    lease = await claim_one(queue)
    clock.advance(20)
    assert await queue.heartbeat(lease) is True
    assert (await current(queue, lease)).lease_expires_at == clock.now + timedelta(seconds=30)
    clock.advance(31)
    assert (await queue.sweep()).requeued == 1
    assert await queue.heartbeat(lease) is False
    assert await queue.heartbeat_many([lease]) == set()


async def test_batched_heartbeat_reports_only_held_leases(queue: Queue) -> None:
    for _ in range(3):
        await queue.enqueue(new_run(ASYNC))
    leases = [c.lease for c in await queue.claim("w", [ASYNC], limit=3)]
    await queue.cancel(leases[1].run_id, actor="op")
    stale = Lease(run_id=leases[2].run_id, epoch=leases[2].epoch - 1, owner="w")
    held = await queue.heartbeat_many([leases[0], leases[1], stale])
    assert held == {leases[0].key}


async def test_every_fenced_write_is_refused_after_reclaim(
    queue: Queue, clock: ManualClock
) -> None:
    run = await queue.enqueue(new_run())
    old = await claim_one(queue, owner="slow")
    clock.advance(31)
    await queue.sweep()
    clock.advance(10)  # past the backoff
    new = await claim_one(queue, owner="fast")
    assert new.epoch == old.epoch + 1
    before = await current(queue, run)
    call = ToolCall(step=1, tool="echo", idempotency_class="safe", args={})
    outcomes = [
        await queue.append_event(old, "x", {}),
        await queue.tool_started(old, call),
        await queue.tool_finished(old, call, "succeeded", {}, {}),
        await queue.save_checkpoint(old, 1, {}),
        await queue.wait_for_user(old, "q?", step=1, state={}),
        await queue.complete(old, {}),
        await queue.fail(old, {"kind": "permanent"}),
        await queue.release(old, graceful=True),
        await queue.release(old, graceful=False),
    ]
    assert all(isinstance(o, Fenced) for o in outcomes)
    assert await current(queue, run) == before  # nothing changed, not even the event counter
    seq = await queue.record_fenced(old, during="complete")
    after = await current(queue, run)
    assert seq == before.last_event_seq + 1
    assert after.last_event_seq == seq
    assert {k: v for k, v in vars(after).items() if k != "last_event_seq"} == {
        k: v for k, v in vars(before).items() if k != "last_event_seq"
    }
    fenced_event = (await queue.events(run.id))[-1]
    assert (fenced_event.type, fenced_event.epoch) == ("run.fenced", old.epoch)
    assert isinstance(await queue.complete(new, {"ok": 1}), Written)
    assert await check_all_runs(queue.engine) == 1


# --- the sweeper, backoff and the dead letter -------------------------------------------------
async def test_lease_expiry_backs_off_then_dead_letters_after_three(
    queue: Queue, clock: ManualClock
) -> None:
    run = await queue.enqueue(new_run())
    backoffs = []
    for attempt in (1, 2, 3):
        lease = await claim_one(queue)
        assert (await current(queue, lease)).attempts == attempt
        clock.advance(30.5)
        report = await queue.sweep()
        assert report == (SweepReport(requeued=1) if attempt < 3 else SweepReport(failed=1))
        state = await current(queue, run)
        if attempt < 3:
            assert state.status == "queued"
            assert state.scheduled_for is not None
            backoffs.append((state.scheduled_for - clock.now).total_seconds())
            assert await queue.claim("w", ALL) == []  # backing off
            clock.now = state.scheduled_for
    assert backoffs == [5.0, 10.0]
    dead = await current(queue, run)
    assert dead.status == "failed"
    assert dead.failure["kind"] == "lease_expired"
    assert "attempt 3 of 3" in dead.failure["message"]
    assert dead.lease_owner is None
    assert dead.finished_at == clock.now
    types = await event_types(queue, run.id)
    assert types.count("run.requeued") == 2
    assert types[-1] == "run.failed"
    await check_all_runs(queue.engine)


async def test_sweeper_leaves_live_leases_alone(queue: Queue, clock: ManualClock) -> None:
    await queue.enqueue(new_run())
    lease = await claim_one(queue)
    clock.advance(29)
    sweeper = Sweeper(queue, holder="test", interval=0)
    assert (await sweeper.run_once()).requeued == 0
    assert await queue.heartbeat(lease)


async def test_sweeper_service_runs_and_stops(queue: Queue, clock: ManualClock) -> None:
    run = await queue.enqueue(new_run())
    await claim_one(queue)
    clock.advance(31)
    sweeper = Sweeper(queue, holder="test", interval=0.01)
    task = asyncio.create_task(sweeper.run())
    for _ in range(500):
        if (await current(queue, run)).status == "queued":
            break
        await asyncio.sleep(0.01)
    await sweeper.stop()
    await sweeper.stop()  # idempotent
    await asyncio.wait_for(task, 5)
    assert (await current(queue, run)).status == "queued"


async def test_permanent_failure_is_never_requeued(queue: Queue, clock: ManualClock) -> None:
    run = await queue.enqueue(new_run())
    lease = await claim_one(queue)
    assert isinstance(await queue.fail(lease, {"kind": "permanent", "message": "bad"}), Written)
    clock.advance(3600)
    await queue.sweep()
    state = await current(queue, run)
    assert (state.status, state.attempts, state.failure["kind"]) == ("failed", 1, "permanent")
    assert await queue.claim("w", ALL) == []


# --- releases ------------------------------------------------------------------------------------
async def test_graceful_release_requeues_at_once_and_gives_the_attempt_back(
    queue: Queue,
) -> None:
    run = await queue.enqueue(new_run())
    lease = await claim_one(queue)
    assert isinstance(await queue.release(lease, graceful=True, reason="drain"), Written)
    state = await current(queue, run)
    assert (state.status, state.attempts, state.lease_owner) == ("queued", 0, None)
    again = await claim_one(queue)
    assert again.epoch == lease.epoch + 1
    await queue.complete(again, {"done": True})
    assert (await current(queue, run)).attempts == 1  # succeeded after a drain shows 1


async def test_early_release_backs_off_and_counts(queue: Queue, clock: ManualClock) -> None:
    run = await queue.enqueue(new_run())
    for attempt in (1, 2, 3):
        lease = await claim_one(queue)
        await queue.release(lease, graceful=False, reason="HTTP 503 three times")
        state = await current(queue, run)
        if attempt < 3:
            assert state.status == "queued"
            assert state.attempts == attempt
            assert state.scheduled_for == clock.now + timedelta(seconds=5 * 2 ** (attempt - 1))
            clock.now = state.scheduled_for
    assert state.status == "failed"
    assert state.failure["kind"] == "attempts_exhausted"
    assert "HTTP 503" in state.failure["message"]


# --- waiting for the user, delivery ---------------------------------------------------------------
async def test_wait_resets_attempts_and_delivery_requeues_the_same_run(
    queue: Queue, clock: ManualClock
) -> None:
    run = await queue.enqueue(new_run(ASYNC))
    lease = await claim_one(queue)
    result = await queue.wait_for_user(lease, {"text": "Which account?"}, step=2, state={"k": 1})
    assert isinstance(result, Written)
    waiting = await current(queue, run)
    assert waiting.status == "waiting_for_user"
    assert (waiting.attempts, waiting.lease_owner, waiting.question) == (
        0,
        None,
        {"text": "Which account?"},
    )
    checkpoint = await queue.latest_checkpoint(run.id)
    assert checkpoint is not None
    assert checkpoint.state == {"k": 1}
    clock.advance(3600)
    assert (await queue.sweep()).requeued == 0  # no lease to expire while waiting
    assert await queue.heartbeat(lease) is False

    resumed = await queue.deliver_input(run.id, "acct-7", principal="p")
    assert (resumed.id, resumed.status, resumed.priority) == (run.id, "queued", ASYNC.base)
    assert resumed.question is None
    assert await queue.inputs(run.id) == [{"n": 1}, "acct-7"]
    again = await claim_one(queue)
    assert again.run_id == run.id
    assert (await current(queue, run)).attempts == 1


async def test_delivery_to_a_run_not_waiting_is_refused(queue: Queue) -> None:
    run = await queue.enqueue(new_run())
    with pytest.raises(RunNotWaitingError):
        await queue.deliver_input(run.id, "x", principal="p")
    with pytest.raises(RunNotFoundError):
        await queue.deliver_input(uuid.uuid4(), "x", principal="p")


# --- cancel --------------------------------------------------------------------------------------
async def test_cancel_fences_a_running_run(queue: Queue) -> None:
    run = await queue.enqueue(new_run())
    lease = await claim_one(queue)
    outcome = await queue.cancel(run.id, actor="key:ops", reason="user left")
    assert outcome.changed
    assert outcome.run.status == "cancelled"
    assert outcome.run.lease_epoch == lease.epoch + 1
    assert await queue.heartbeat(lease) is False
    assert isinstance(await queue.complete(lease, {}), Fenced)
    assert (await queue.events(run.id))[-1].type == "run.cancelled"


@pytest.mark.parametrize("status", ["queued", "waiting_for_user"])
async def test_cancel_from_other_active_statuses(queue: Queue, status: str) -> None:
    run = await queue.enqueue(new_run())
    if status == "waiting_for_user":
        await queue.wait_for_user(await claim_one(queue), "q", step=1, state={})
    outcome = await queue.cancel(run.id, actor="op")
    assert outcome.changed
    assert outcome.run.status == "cancelled"
    assert outcome.run.question is None


async def test_cancel_is_a_no_op_on_cancelled_and_refused_on_finished(queue: Queue) -> None:
    run = await queue.enqueue(new_run())
    await queue.cancel(run.id, actor="op")
    seq = (await current(queue, run)).last_event_seq
    again = await queue.cancel(run.id, actor="op")
    assert not again.changed
    assert again.run.status == "cancelled"
    assert (await current(queue, run)).last_event_seq == seq

    done = await queue.enqueue(new_run(ASYNC))
    await queue.complete(await claim_one(queue), {})
    with pytest.raises(RunFinishedError, match="succeeded"):
        await queue.cancel(done.id, actor="op")
    failed = await queue.enqueue(new_run(ASYNC))
    await queue.fail(await claim_one(queue), {"kind": "permanent"})
    with pytest.raises(RunFinishedError, match="failed"):
        await queue.cancel(failed.id, actor="op")


async def test_cancel_is_tenant_scoped(queue: Queue) -> None:
    run = await queue.enqueue(new_run())
    with pytest.raises(RunNotFoundError):
        await queue.cancel(run.id, actor="op", tenant_id="someone-else")
    assert (await current(queue, run)).status == "queued"


async def test_enqueue_writes_created_event_and_first_input(queue: Queue) -> None:
    run = await queue.enqueue(new_run(input={"script": []}))
    events = await queue.events(run.id)
    assert [(e.seq, e.type, e.epoch) for e in events] == [(1, "run.created", 0)]
    assert await queue.inputs(run.id) == [{"script": []}]
