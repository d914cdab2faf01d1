"""Start deadlines on the injected clock (docs/start-deadlines.md): a deadline met starts the
run; one missed under a backlog ends it `cancelled` ('expired') through the expirer, with its
event, its webhook delivery and its session freed, using no attempt and never claimed; a run
once started is never expired, even requeued; the claim (fair and FIFO) skips an overdue run;
the per-class defaults; the expirer wakes early for a sooner deadline; refusals."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from app.maintenance.expirer import Expirer
from app.queue.core import Queue, QueueConfig
from app.queue.errors import InvalidStartDeadlineError, SessionBusyError
from app.queue.reads import Reads
from app.queue.submit import IdempotencyKey, RunSpec, Submissions, Submitter
from app.queue.webhook_endpoints import Webhooks
from app.runtime.http_tool import HttpRequestTool
from app.runtime.webhook_delivery import register_endpoint
from app.security.secret_box import SecretBox
from app.vocabulary.classes import PriorityClass
from app.vocabulary.deadlines import START_BEFORE_TOLERANCE_SECONDS
from app.vocabulary.records import NewRun, Run
from tests.support.clock import ManualClock
from tests.support.waiting import eventually

ALICE = Submitter(tenant_id="t", principal="alice")


def submissions(queue: Queue, **defaults: float) -> Submissions:
    return Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
        start_within={PriorityClass(name): seconds for name, seconds in defaults.items()},
    )


def expirer(queue: Queue, interval: float = 60) -> Expirer:
    return Expirer(queue, holder="test", interval=interval)


async def current(queue: Queue, run_id: Any) -> Run:
    run = await queue.get_run(run_id)
    assert run is not None
    return run


async def scalar(queue: Queue, sql: str, **params: Any) -> Any:
    async with queue.engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar_one()


async def test_a_deadline_met_starts_the_run_and_a_started_run_is_never_expired(
    queue: Queue, clock: ManualClock
) -> None:
    submit = submissions(queue)
    run_id = (await submit.submit_run(ALICE, RunSpec(input={}, start_within=10))).run_id
    queued = await current(queue, run_id)
    assert queued.start_before == queued.created_at + timedelta(seconds=10)
    assert queued.to_document()["start_before"] == queued.start_before.isoformat()
    created = (await queue.events(run_id))[0]
    assert created.data["start_before"] is not None

    clock.advance(9)
    [claimed] = await queue.claim("w", [PriorityClass.ASYNC])
    assert claimed.run.id == run_id
    # Past the deadline, requeued by a graceful release (attempt given back): started once,
    # it is never expired, and claimed again.
    clock.advance(60)
    await queue.release(claimed.lease, graceful=True)
    assert (await current(queue, run_id)).status == "queued"
    assert await expirer(queue).run_once() == 0
    [again] = await queue.claim("w", [PriorityClass.ASYNC])
    assert again.run.id == run_id


async def test_a_deadline_missed_under_a_backlog_ends_the_run_expired(
    queue: Queue, clock: ManualClock
) -> None:
    # A webhook endpoint for the tenant: the expiry is delivered as a cancel is.
    await register_endpoint(
        Webhooks(queue), HttpRequestTool(["127.0.0.1"]), SecretBox("k" * 40),
        tenant_id="t", principal="ops", url="http://127.0.0.1:9/hook", events=[],
    )  # fmt: skip
    submit, reads = submissions(queue), Reads(queue)
    backlog = [(await submit.submit_run(ALICE, RunSpec(input={"n": n}))).run_id for n in range(5)]
    session = await reads.create_session(tenant_id="t", principal="alice")
    late = await submit.submit_turn(ALICE, session.id, RunSpec(input="hi", start_within=2))
    with pytest.raises(SessionBusyError):  # while the run is queued, the session is busy
        await submit.submit_turn(ALICE, session.id, RunSpec(input="again"))

    clock.advance(2)  # the deadline, to the microsecond: overdue
    assert [r.id for r in await queue.expire_overdue()] == [late.run_id]
    run = await current(queue, late.run_id)
    assert (run.status, run.attempts, run.started_at, run.lease_epoch) == (
        "cancelled",
        0,
        None,
        1,
    )
    events = await queue.events(late.run_id)
    assert [e.type for e in events] == ["run.created", "run.cancelled"]
    assert events[-1].data == {"by": "expirer", "reason": "expired"}
    [delivery] = await scalar(
        queue,
        "SELECT array_agg(r.input) FROM webhook_deliveries d JOIN runs r ON r.id = d.run_id "
        "WHERE d.source_run_id = :id",
        id=late.run_id,
    )
    assert delivery["body"]["type"] == "run.cancelled"
    assert delivery["body"]["data"]["reason"] == "expired"
    # The session is free: its next turn is a new run. The backlog is untouched.
    after = await submit.submit_turn(ALICE, session.id, RunSpec(input="again"))
    assert (after.routed, after.document["session_run_no"]) == ("created", 2)
    assert {(await current(queue, r)).status for r in backlog} == {"queued"}
    # Nothing left to expire; the next deadline is none.
    assert await expirer(queue).run_once() == 0
    assert await queue.next_start_deadline() is None


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
async def test_the_claim_never_starts_a_run_past_its_deadline(
    queue: Queue, clock: ManualClock, fair: bool
) -> None:
    claims = Queue(queue.engine, QueueConfig(fair_claim=fair), clock=clock)
    overdue = await queue.enqueue(
        NewRun(
            tenant_id="t",
            principal="p",
            agent="scripted",
            input={},
            start_before=clock.now + timedelta(seconds=1),
        )
    )
    clock.advance(0.5)
    plain = await queue.enqueue(NewRun(tenant_id="t", principal="p", agent="scripted", input={}))
    clock.advance(1)
    # The overdue run is the longest eligible, yet only the other one is claimed, before any
    # expirer has run.
    claimed = await claims.claim("w", [PriorityClass.INTERACTIVE], limit=2)
    assert [c.run.id for c in claimed] == [plain.id]
    assert (await current(queue, overdue.id)).status == "queued"
    assert await queue.next_start_deadline() == pytest.approx(-0.5)
    assert await claims.claim("w", [PriorityClass.INTERACTIVE], limit=2) == []
    assert [r.id for r in await queue.expire_overdue()] == [overdue.id]


async def test_the_class_defaults_apply_when_a_submission_names_no_deadline(
    queue: Queue, clock: ManualClock
) -> None:
    submit, reads = submissions(queue, interactive=30), Reads(queue)
    session = await reads.create_session(tenant_id="t", principal="alice")
    turn = await current(
        queue, (await submit.submit_turn(ALICE, session.id, RunSpec(input="hi"))).run_id
    )
    assert turn.start_before == clock.now + timedelta(seconds=30)
    # async has no default; a deadline given wins over the class's; start_within counts from
    # scheduled_for.
    run = await current(queue, (await submit.submit_run(ALICE, RunSpec(input={}))).run_id)
    assert run.start_before is None
    later = clock.now + timedelta(hours=1)
    spec = RunSpec(input={}, priority=PriorityClass.INTERACTIVE, scheduled_for=later)
    scheduled = await current(
        queue,
        (await submit.submit_run(ALICE, RunSpec(**{**spec.__dict__, "start_within": 5}))).run_id,
    )
    assert scheduled.start_before == later + timedelta(seconds=5)
    # A scheduled_for already past: eligible now, so the deadline counts from now.
    earlier = clock.now - timedelta(hours=1)
    overdue = RunSpec(input={}, scheduled_for=earlier, start_within=5)
    past = await current(queue, (await submit.submit_run(ALICE, overdue)).run_id)
    assert past.start_before == clock.now + timedelta(seconds=5)
    explicit = await current(
        queue,
        (
            await submit.submit_run(
                ALICE, RunSpec(input={}, start_before=clock.now + timedelta(seconds=7))
            )
        ).run_id,
    )
    assert explicit.start_before == clock.now + timedelta(seconds=7)


async def test_the_expirer_wakes_for_a_sooner_deadline(queue: Queue, clock: ManualClock) -> None:
    service = expirer(queue, interval=600)  # its own pace would never get there in this test
    task = asyncio.create_task(service.run())
    try:

        async def ticked() -> bool:
            return service.ticks >= 1

        await eventually(ticked, what="a first tick")
        submit = submissions(queue)
        deadline = clock.now + timedelta(seconds=1)
        run_id = (await submit.submit_run(ALICE, RunSpec(input={}, start_before=deadline))).run_id
        clock.advance(1)
        # What the process's notifier does with the run's notification: sooner than the
        # expirer's next look, so it looks now.
        service.deadline_submitted(deadline)

        async def expired() -> bool:
            return (await current(queue, run_id)).status == "cancelled"

        await eventually(expired, what="the run expired")
    finally:
        await service.stop()
        await task


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"start_within": 5, "start_before": 10}, "start_before"),
        ({"start_within": 0}, "start_within"),
        ({"start_within": -1}, "start_within"),
        ({"start_within": 31 * 86400}, "start_within"),
        ({"start_within": float("inf")}, "start_within"),
        ({"start_before": -60}, "start_before"),  # a minute ago
        ({"start_before": 31 * 86400}, "start_before"),
        ({"start_before": 30, "scheduled_for": 60}, "start_before"),
    ],
)
async def test_refused_deadlines_write_nothing(
    queue: Queue, clock: ManualClock, spec: dict[str, float], field: str
) -> None:
    times = {
        name: clock.now + timedelta(seconds=spec[name])
        for name in ("start_before", "scheduled_for")
        if name in spec
    }
    given = RunSpec(input={}, start_within=spec.get("start_within"), **times)
    with pytest.raises(InvalidStartDeadlineError) as refused:
        await submissions(queue).submit_run(ALICE, given)
    assert refused.value.field == field
    assert await scalar(queue, "SELECT count(*) FROM runs") == 0


async def test_a_deadline_a_moment_ago_is_taken_and_a_late_retry_replays(
    queue: Queue, clock: ManualClock
) -> None:
    submit = submissions(queue)
    # Within the tolerance of a client's clock a little behind: taken, and expired at once.
    moment = clock.now - timedelta(seconds=START_BEFORE_TOLERANCE_SECONDS - 0.5)
    run_id = (await submit.submit_run(ALICE, RunSpec(input={}, start_before=moment))).run_id
    assert [r.id for r in await queue.expire_overdue()] == [run_id]
    beyond = clock.now - timedelta(seconds=START_BEFORE_TOLERANCE_SECONDS + 0.5)
    with pytest.raises(InvalidStartDeadlineError):
        await submit.submit_run(ALICE, RunSpec(input={}, start_before=beyond))
    # A keyed submission retried after its deadline passed replays the first outcome: the
    # check comes after the key.
    key = IdempotencyKey(key="k", request_hash="h")
    spec = RunSpec(input={}, start_before=clock.now + timedelta(seconds=1))
    first = await submit.submit_run(ALICE, spec, key)
    clock.advance(60)
    again = await submit.submit_run(ALICE, spec, key)
    assert (again.replayed, again.run_id) == (True, first.run_id)


async def test_a_pending_turn_keeps_its_deadline_for_the_run_it_becomes(
    queue: Queue, clock: ManualClock
) -> None:
    """A turn that waits behind its session's run (enqueue) keeps its deadline, counted from
    its acceptance: started in time, its run carries it; started late, its run ends `expired`,
    never claimed, and the turn behind it starts next (migration 0027)."""
    submit, reads = submissions(queue), Reads(queue)
    session = await reads.create_session(tenant_id="t", principal="alice", multitask="enqueue")
    first = await submit.submit_turn(ALICE, session.id, RunSpec(input="first"))
    accepted_at = clock.now
    waits = await submit.submit_turn(ALICE, session.id, RunSpec(input="soon", start_within=10))
    assert waits.routed == "pending:enqueue"
    assert waits.document["start_before"] == (accepted_at + timedelta(seconds=10)).isoformat()
    after = await submit.submit_turn(ALICE, session.id, RunSpec(input="whenever"))
    # A deadline already past is refused for a pending turn too, and nothing is written.
    with pytest.raises(InvalidStartDeadlineError):
        await submit.submit_turn(
            ALICE,
            session.id,
            RunSpec(input="late", start_before=clock.now - timedelta(minutes=5)),
        )

    clock.advance(30)  # the first run holds the session past the pending turn's deadline
    await queue.cancel(first.run_id, actor="test", reason="done")
    promoted = await current(queue, waits.document["id"])
    assert promoted.status == "queued"
    assert promoted.start_before == accepted_at + timedelta(seconds=10)
    # Never claimed: the expirer ends it, and the turn behind it starts, with no deadline.
    assert await queue.claim("w", [PriorityClass.INTERACTIVE]) == []
    assert [r.id for r in await queue.expire_overdue()] == [promoted.id]
    expired = await current(queue, promoted.id)
    assert (expired.status, expired.attempts, expired.started_at) == ("cancelled", 0, None)
    assert (await queue.events(promoted.id))[-1].data == {"by": "expirer", "reason": "expired"}
    last = await current(queue, after.document["id"])
    assert (last.status, last.start_before) == ("queued", None)

    # In time: the run takes the deadline and is claimed before it.
    other = await reads.create_session(tenant_id="t", principal="alice", multitask="enqueue")
    active = await submit.submit_turn(ALICE, other.id, RunSpec(input="a"))
    kept = await submit.submit_turn(ALICE, other.id, RunSpec(input="b", start_within=60))
    await queue.cancel(active.run_id, actor="test", reason="done")
    started = await current(queue, kept.document["id"])
    assert started.start_before == clock.now + timedelta(seconds=60)
    claimed = await queue.claim("w", [PriorityClass.INTERACTIVE], limit=5)
    assert started.id in {c.run.id for c in claimed}
