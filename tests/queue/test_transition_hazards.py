"""Defects a review of the queue found, each held by a test that failed before its fix
(docs/reliability.md, "Found and fixed"):

1. a mass expiry, or a large completion batch, overflowed PostgreSQL's notification payload and
   rolled the whole transition back (the sweeper wedged; finished runs ran again);
2. heartbeat_many and complete_many locked rows in their arrays' order and deadlocked;
3. results were matched by run id, not by (run id, epoch);
6. concurrent resubmits of one failed run created two runs;
8. a run dead-lettered in the middle of an unsafe call kept no record that its outcome was
   unknown.
(4, 5, 7 and 9 are in the worker pool, submission, runtime and process tests.)
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from app.queue.submit import RunSpec, Submissions, Submitter
from app.store.engine import plain_url
from app.store.statements import statements
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Fenced, Lease, NewRun, SweepReport, ToolCall, Written
from app.worker.completions import MAX_BATCH
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs
from tests.support.waiting import eventually

ALL = list(PriorityClass)
ASYNC = PriorityClass.ASYNC


async def _bulk(queue: Queue, count: int, *, max_attempts: int = 3) -> list[Lease]:
    await queue.enqueue_many(
        tenant_id="t",
        principal="p",
        runs=[("scripted", {"n": i}, ASYNC.base, None) for i in range(count)],
        max_attempts=max_attempts,
    )
    claimed = await queue.claim("w", ALL, limit=count)
    assert len(claimed) == count
    return [c.lease for c in claimed]


async def _statuses(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT status, count(*) FROM runs GROUP BY status"))
        return {status: int(n) for status, n in rows}


# --- 1. bounded notifications ----------------------------------------------------------------
async def test_a_thousand_runs_expiring_on_their_last_attempt_are_all_dead_lettered(
    queue: Queue, clock: ManualClock
) -> None:
    await _bulk(queue, 1000, max_attempts=1)
    clock.advance(31)
    report = await queue.sweep()  # two batches of 500: each named 500 runs in one payload
    assert report == SweepReport(requeued=0, failed=1000)
    assert await _statuses(queue.engine) == {"failed": 1000}
    async with queue.engine.connect() as conn:
        events = await conn.execute(
            text("SELECT count(*) FROM run_events WHERE type = 'run.failed'")
        )
        assert events.scalar_one() == 1000
    assert await check_all_runs(queue.engine) == 1000


async def test_a_thousand_runs_expiring_together_are_all_requeued(
    queue: Queue, clock: ManualClock
) -> None:
    await _bulk(queue, 1000)
    clock.advance(31)
    assert await queue.sweep() == SweepReport(requeued=1000, failed=0)
    assert await _statuses(queue.engine) == {"queued": 1000}
    assert await check_all_runs(queue.engine) == 1000


@pytest.mark.parametrize(
    ("size", "named", "more"), [(MAX_BATCH, MAX_BATCH, False), (600, 500, True)]
)
async def test_a_completion_batch_commits_with_one_bounded_notification(
    queue: Queue, database_url: str, size: int, named: int, more: bool
) -> None:
    """The largest batch the pool forms names every run it completed (listeners wake only the
    streams of those runs); a larger one names 500 and says there were more."""
    leases = await _bulk(queue, size)
    listener = await asyncpg.connect(plain_url(database_url))
    heard: list[str] = []
    await listener.add_listener("turnstile", lambda *args: heard.append(args[3]))
    try:
        outcomes = await queue.complete_many([(lease, {"ok": True}) for lease in leases])
        await eventually(lambda: asyncio.sleep(0, bool(heard)), what="the notification")
    finally:
        await listener.close()
    assert all(isinstance(o, Written) for o in outcomes)
    assert await _statuses(queue.engine) == {"succeeded": size}
    assert len(heard) == 1
    assert len(heard[0].encode()) < 8000
    payload = json.loads(heard[0])
    assert payload["more"] is more
    assert len(payload["runs"]) == named
    assert set(payload["runs"]) <= {str(lease.run_id)[:8] for lease in leases}


# An aggregate inside a notification is bounded only as the distinct priorities of the rows
# (at most the 30 of the CHECK range) or over a subquery with a LIMIT.
_BOUNDED_AGGREGATE = re.compile(
    r"jsonb_agg\(DISTINCT priority\)"
    r"|\(SELECT jsonb_agg\(left\(named\.id::text, 8\)\)\s+FROM \(SELECT id FROM \w+"
    r"(?: WHERE [^()]*)? LIMIT 500\)"
)
_AGGREGATE = re.compile(r"\b\w*_agg\(")


def _notify_argument(sql: str) -> str:
    start = sql.index("pg_notify(") + len("pg_notify(")
    depth = 1
    for i in range(start, len(sql)):
        depth += {"(": 1, ")": -1}.get(sql[i], 0)
        if depth == 0:
            return sql[start:i]
    raise AssertionError("unbalanced pg_notify(")


@pytest.mark.parametrize(
    "name", sorted(n for n, s in statements().items() if "pg_notify(" in s.sql)
)
def test_no_notification_aggregates_an_unbounded_list(name: str) -> None:
    argument = _notify_argument(statements()[name].sql)
    unbounded = _AGGREGATE.findall(_BOUNDED_AGGREGATE.sub("", argument))
    assert not unbounded, f"{name}: unbounded aggregate in its notification: {unbounded}"


# --- 2. lock order ---------------------------------------------------------------------------
async def _waiting_on_locks(engine: AsyncEngine, count: int) -> bool:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        )
        return int(rows.scalar_one()) >= count


async def test_heartbeats_and_completions_in_opposite_orders_do_not_deadlock(
    queue: Queue,
) -> None:
    """The interleaving that deadlocked: a third session holds row B; the heartbeat (A, B, C)
    takes A and waits on B; the completion (C, A) takes C and waits on A; B is let go; the
    heartbeat goes on to C, which the completion holds. Locking in id order first removes it."""
    leases = sorted(await _bulk(queue, 3), key=lambda lease: lease.run_id)
    a, b, c = leases
    beat_order = [a, b, c]
    complete_order = [c, a]
    async with queue.engine.connect() as holder:
        await holder.begin()
        await holder.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": b.run_id})
        beat = asyncio.create_task(queue.heartbeat_many(beat_order))
        await eventually(lambda: _waiting_on_locks(queue.engine, 1), what="the heartbeat waiting")
        done = asyncio.create_task(queue.complete_many([(x, {}) for x in complete_order]))
        await eventually(lambda: _waiting_on_locks(queue.engine, 2), what="both waiting")
        await holder.rollback()
    held = await asyncio.wait_for(beat, 30)
    outcomes = await asyncio.wait_for(done, 30)
    # Whichever went first, both committed: no deadlock victim, no lost completion.
    assert all(isinstance(o, Written) for o in outcomes)
    assert held >= {b.key}
    assert await _statuses(queue.engine) == {"running": 1, "succeeded": 2}
    assert await check_all_runs(queue.engine) == 3


# --- 3. (run id, epoch), never the id alone --------------------------------------------------
async def _stale_and_fresh(queue: Queue, clock: ManualClock) -> tuple[Lease, Lease]:
    await queue.enqueue(
        NewRun(tenant_id="t", principal="p", agent="scripted", input={}, priority=ASYNC.base)
    )
    (stale,) = [c.lease for c in await queue.claim("w", ALL)]
    clock.advance(31)
    assert (await queue.sweep()).requeued == 1
    clock.advance(3600)
    (fresh,) = [c.lease for c in await queue.claim("w", ALL)]  # the same process claims again
    assert fresh.run_id == stale.run_id
    assert fresh.epoch == stale.epoch + 1
    return stale, fresh


async def test_a_stale_execution_is_not_told_its_completion_was_written(
    queue: Queue, clock: ManualClock
) -> None:
    stale, fresh = await _stale_and_fresh(queue, clock)
    outcomes = await queue.complete_many([(stale, {"from": "stale"}), (fresh, {"from": "fresh"})])
    assert isinstance(outcomes[0], Fenced)
    assert isinstance(outcomes[1], Written)
    run = await queue.get_run(fresh.run_id)
    assert run is not None
    assert run.result == {"from": "fresh"}


async def test_a_stale_lease_is_not_renewed_by_the_fresh_heartbeat(
    queue: Queue, clock: ManualClock
) -> None:
    stale, fresh = await _stale_and_fresh(queue, clock)
    assert await queue.heartbeat_many([stale, fresh]) == {fresh.key}


# --- 6. one resubmission per failed run ------------------------------------------------------
async def test_concurrent_resubmits_of_one_failed_run_create_one_run(
    queue: Queue, clock: ManualClock
) -> None:
    await _bulk(queue, 1, max_attempts=1)
    clock.advance(31)
    assert (await queue.sweep()).failed == 1
    async with queue.engine.connect() as conn:
        failed_id = (await conn.execute(text("SELECT id FROM runs"))).scalar_one()
    submissions = Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
    )
    operator = Submitter(tenant_id="t", principal="ops", actor="key:ops")
    outcomes = await asyncio.gather(
        *(submissions.resubmit(operator, failed_id, tenant_id="t") for _ in range(4))
    )
    assert len({o.run_id for o in outcomes}) == 1
    assert sorted(o.replayed for o in outcomes) == [False, True, True, True]
    async with queue.engine.connect() as conn:
        count = await conn.execute(
            text("SELECT count(*) FROM runs WHERE resubmitted_from = :id"), {"id": failed_id}
        )
        assert count.scalar_one() == 1
        notes = await conn.execute(
            text("SELECT count(*) FROM run_events WHERE type = 'operator.resubmitted'")
        )
        assert notes.scalar_one() == 1
    assert await check_all_runs(queue.engine) == 2


# --- 8. dead-lettered in the middle of an unsafe call ---------------------------------------
async def test_a_run_dead_lettered_mid_unsafe_call_records_its_outcome_as_unknown(
    queue: Queue, clock: ManualClock
) -> None:
    (lease,) = await _bulk(queue, 1, max_attempts=1)
    safe = ToolCall(step=1, tool="echo", idempotency_class="safe", args={})
    assert isinstance(await queue.tool_started(lease, safe), Written)
    assert isinstance(await queue.tool_finished(lease, safe, "succeeded", {}, {"s": 1}), Written)
    payment = ToolCall(step=2, tool="pay", idempotency_class="unsafe", args={"cents": 100})
    assert isinstance(await queue.tool_started(lease, payment), Written)
    clock.advance(31)  # the worker died inside the payment call
    assert (await queue.sweep()).failed == 1

    run = await queue.get_run(lease.run_id)
    assert run is not None
    assert run.status == "failed"
    assert run.failure is not None
    assert run.failure["uncertain_calls"] == [{"step": 2, "tool": "pay"}]
    assert "pay (step 2)" in run.failure["message"]
    events = await queue.events(lease.run_id)
    assert [e.type for e in events][-2:] == ["tool.finished", "run.failed"]
    assert events[-2].data["outcome_status"] == "uncertain"
    journal = await queue.journal(lease.run_id)
    last: dict[int, Any] = {entry.step: entry for entry in journal}
    assert last[2].entry == "finished"
    assert last[2].outcome_status == "uncertain"
    assert last[2].event_seq == events[-2].seq
    assert await check_all_runs(queue.engine) == 1


async def test_a_requeued_run_keeps_its_open_call_for_recovery(
    queue: Queue, clock: ManualClock
) -> None:
    (lease,) = await _bulk(queue, 1, max_attempts=3)
    payment = ToolCall(step=1, tool="pay", idempotency_class="unsafe", args={})
    assert isinstance(await queue.tool_started(lease, payment), Written)
    clock.advance(31)
    assert (await queue.sweep()).requeued == 1
    # Not dead-lettered: the next attempt's recovery settles the call, not the sweeper.
    assert [e.entry for e in await queue.journal(lease.run_id)] == ["started"]


# --- 5. a turn racing a cancel ---------------------------------------------------------------
def _submissions(queue: Queue) -> Submissions:
    return Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
    )


async def test_a_turn_racing_a_cancel_of_the_waiting_run_gets_a_new_run(queue: Queue) -> None:
    """The turn reads the waiting run, then a cancel commits before its delivery: the session
    has no active run any more, so the turn starts a new one (it used to get 409)."""
    submissions = _submissions(queue)
    alice = Submitter(tenant_id="t", principal="alice")
    async with queue.engine.begin() as conn:
        session_id = (
            await conn.execute(
                text(
                    "INSERT INTO sessions (tenant_id, principal) VALUES ('t', 'alice') RETURNING id"
                )
            )
        ).scalar_one()
    first = await submissions.submit_turn(alice, session_id, RunSpec(input="hello"))
    (claimed,) = await queue.claim("w", ALL)
    assert isinstance(
        await queue.wait_for_user(claimed.lease, "which one?", step=1, state={}), Written
    )

    async with queue.engine.connect() as holder:
        # Hold the run row, so the cancel and then the delivery queue up on it in that order.
        await holder.begin()
        await holder.execute(
            text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": first.run_id}
        )
        cancel = asyncio.create_task(queue.cancel(first.run_id, actor="op"))
        await eventually(lambda: _waiting_on_locks(queue.engine, 1), what="the cancel waiting")
        turn = asyncio.create_task(
            submissions.submit_turn(alice, session_id, RunSpec(input="the blue one"))
        )
        await eventually(lambda: _waiting_on_locks(queue.engine, 2), what="the delivery waiting")
        await holder.rollback()
    assert (await asyncio.wait_for(cancel, 30)).changed
    answered = await asyncio.wait_for(turn, 30)
    assert answered.routed == "created"
    assert answered.run_id != first.run_id
    new = await queue.get_run(answered.run_id)
    assert new is not None
    assert (new.status, new.input) == ("queued", "the blue one")
    assert await check_all_runs(queue.engine) == 2


async def test_an_early_release_that_dead_letters_records_open_unsafe_calls(
    queue: Queue,
) -> None:
    """The executor failed unexpectedly inside an unsafe call on the run's last attempt: the
    early release dead-letters the run, and says the call's outcome is unknown."""
    (lease,) = await _bulk(queue, 1, max_attempts=1)
    payment = ToolCall(step=1, tool="pay", idempotency_class="unsafe", args={})
    assert isinstance(await queue.tool_started(lease, payment), Written)
    assert isinstance(await queue.release(lease, graceful=False, reason="bug"), Written)
    run = await queue.get_run(lease.run_id)
    assert run is not None
    assert run.status == "failed"
    assert run.failure is not None
    assert run.failure["kind"] == "attempts_exhausted"
    assert run.failure["uncertain_calls"] == [{"step": 1, "tool": "pay"}]
    assert [e.type for e in await queue.events(lease.run_id)][-2:] == [
        "tool.finished",
        "run.failed",
    ]
    assert [e.entry for e in await queue.journal(lease.run_id)] == ["started", "finished"]
    assert await check_all_runs(queue.engine) == 1


async def test_an_early_release_that_requeues_leaves_open_calls_to_recovery(
    queue: Queue,
) -> None:
    (lease,) = await _bulk(queue, 1, max_attempts=3)
    payment = ToolCall(step=1, tool="pay", idempotency_class="unsafe", args={})
    assert isinstance(await queue.tool_started(lease, payment), Written)
    assert isinstance(await queue.release(lease, graceful=False, reason="bug"), Written)
    run = await queue.get_run(lease.run_id)
    assert run is not None
    assert (run.status, run.failure) == ("queued", None)
    assert [e.entry for e in await queue.journal(lease.run_id)] == ["started"]
    assert await check_all_runs(queue.engine) == 1


async def test_a_permanent_failure_mid_unsafe_call_records_its_outcome_as_unknown(
    queue: Queue,
) -> None:
    """The run's time limit ran out inside an unsafe call: the failure says the call's outcome
    is unknown, and the journal records it so, before run.failed."""
    (lease,) = await _bulk(queue, 1)
    payment = ToolCall(step=1, tool="pay", idempotency_class="unsafe", args={})
    assert isinstance(await queue.tool_started(lease, payment), Written)
    failure = {"kind": "timeout", "message": "execution time limit reached in a tool"}
    assert isinstance(await queue.fail(lease, failure), Written)
    run = await queue.get_run(lease.run_id)
    assert run is not None
    assert run.failure is not None
    assert run.failure["kind"] == "timeout"
    assert run.failure["uncertain_calls"] == [{"step": 1, "tool": "pay"}]
    assert run.failure["message"].endswith("outcome unknown of pay (step 1)")
    types = [e.type for e in await queue.events(lease.run_id)]
    assert types[-2:] == ["tool.finished", "run.failed"]
    assert await check_all_runs(queue.engine) == 1


async def test_a_permanent_failure_without_open_calls_keeps_its_failure_as_given(
    queue: Queue,
) -> None:
    (lease,) = await _bulk(queue, 1)
    failure = {"kind": "tool_error", "message": "bad arguments"}
    assert isinstance(await queue.fail(lease, failure), Written)
    run = await queue.get_run(lease.run_id)
    assert run is not None
    assert run.failure == failure
