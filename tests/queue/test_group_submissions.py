"""Group-committed submissions (docs/adr/0012-group-committed-submissions.md) on a real
PostgreSQL: submissions that arrive together go in one `submit_many` statement, one commit and
one notification, and each keeps its own answer: a turn to a busy session is refused alone
(its token given back), a keyed retry replays, a tenant over its rate limit is refused, and
the good turn beside them is created. A batch refused as a whole (a lock timeout) is sent
again one submission at a time, so only the submission that waited gets the error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack
from typing import Any
from uuid import UUID, uuid4

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app.config import Settings
from app.queue.core import Queue
from app.queue.errors import RateLimitedError, SessionBusyError
from app.queue.reads import Reads
from app.queue.submit import IdempotencyKey, RunSpec, Submissions, Submitted, Submitter
from app.queue.submit_batches import _RUN_ID, Submission, SubmissionBatcher
from app.store.engine import create_engine, plain_url, pool_limit
from tests.support.waiting import eventually

T = Submitter(tenant_id="t", principal="alice")
FLOOD = Submitter(tenant_id="flood", principal="bob")


def submissions(queue: Queue, *, lock_timeout_ms: int = 5000) -> Submissions:
    # Every tenant: four submissions, then none (the injected clock never moves).
    return Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=lock_timeout_ms,
        submit_rate_per_second=1.0,
        submit_burst=4,
    )


async def scalar(queue: Queue, sql: str, **params: Any) -> Any:
    async with queue.engine.connect() as conn:
        return (await conn.execute(text(sql), params)).scalar_one()


@pytest.fixture
async def notifications(database_url: str) -> AsyncIterator[list[str]]:
    """The payloads NOTIFYed on the queue's channel, as a listener receives them."""
    received: list[str] = []
    conn = await asyncpg.connect(plain_url(database_url))
    await conn.add_listener("turnstile", lambda *args: received.append(str(args[3])))
    try:
        yield received
    finally:
        await conn.close()


async def caught_up(database_url: str, received: list[str]) -> list[str]:
    """Everything committed so far has been delivered: a marker NOTIFYed now arrives after
    every notification committed before it (PostgreSQL delivers in commit order)."""
    conn = await asyncpg.connect(plain_url(database_url))
    try:
        await conn.execute("SELECT pg_notify('turnstile', 'marker')")
    finally:
        await conn.close()
    for _ in range(500):
        if "marker" in received:
            return received[: received.index("marker")]
        await asyncio.sleep(0.01)
    raise AssertionError(f"the marker never arrived; received {received}")


async def test_a_batch_gives_each_submission_its_own_answer(
    queue: Queue, database_url: str, notifications: list[str]
) -> None:
    submit = submissions(queue)
    assert submit.batcher is not None
    reads = Reads(queue)
    busy = await reads.create_session(tenant_id="t", principal="alice")
    idle = await reads.create_session(tenant_id="t", principal="alice")
    key = IdempotencyKey("k-1", "hash-1")
    first = await submit.submit_run(T, RunSpec(input={"n": 1}), key)
    active = await submit.submit_turn(T, busy.id, RunSpec(input="first"))
    for n in range(4):  # the flood tenant's whole burst
        await submit.submit_run(FLOOD, RunSpec(input={"flood": n}))
    before_runs = await scalar(queue, "SELECT count(*) FROM runs")
    await caught_up(database_url, notifications)
    notifications.clear()
    statements = submit.batcher.statements

    # Together: the busy turn first, so a token it took and kept would leave none for the
    # second good submission (tenant t has two left).
    answers = await asyncio.gather(
        submit.submit_turn(T, busy.id, RunSpec(input="again")),
        submit.submit_turn(T, idle.id, RunSpec(input="hello")),
        submit.submit_run(T, RunSpec(input={"n": 1}), key),
        submit.submit_run(FLOOD, RunSpec(input={"flood": 4})),
        submit.submit_run(T, RunSpec(input={"n": 2})),
        return_exceptions=True,
    )

    assert submit.batcher.statements == statements + 1  # one statement for all five
    refused_busy, good, replay, refused_flood, good_run = answers
    assert isinstance(refused_busy, SessionBusyError)
    assert refused_busy.active_run_id == active.run_id
    assert refused_busy.allowance is not None  # the RateLimit headers of its answer
    assert isinstance(good, Submitted)
    assert (good.routed, good.replayed) == ("created", False)
    assert good.document["session_id"] == str(idle.id)
    assert isinstance(replay, Submitted)
    assert replay.replayed
    assert replay.run_id == first.run_id
    assert isinstance(refused_flood, RateLimitedError)
    assert refused_flood.allowance is not None
    assert refused_flood.allowance.tokens < 1
    assert isinstance(good_run, Submitted)
    assert good_run.routed == "created"

    # Written: the two good submissions' runs and nothing else; the busy turn's token given
    # back (the second good one spent the last), the flood's bucket untouched.
    assert await scalar(queue, "SELECT count(*) FROM runs") == before_runs + 2
    created = await scalar(
        queue,
        "SELECT count(*) FROM run_events WHERE type = 'run.created' AND run_id = :r",
        r=good.run_id,
    )
    assert created == 1
    tokens = await scalar(queue, "SELECT tokens FROM submit_buckets WHERE tenant_id = 't'")
    assert tokens == pytest.approx(0.0)
    assert await scalar(queue, "SELECT tokens FROM submit_buckets WHERE tenant_id = 'flood'") == (
        pytest.approx(0.0)
    )
    # One notification for the batch (a submission alone sends one per run), naming the new
    # turn's session.
    sent = await caught_up(database_url, notifications)
    assert len(sent) == 1, sent
    assert str(idle.id)[:8] in sent[0]


async def test_a_batch_of_turns_to_one_session_routes_them_in_order(queue: Queue) -> None:
    submit = submissions(queue)
    reads = Reads(queue)
    session = await reads.create_session(tenant_id="t", principal="alice")
    answers = await asyncio.gather(
        submit.submit_turn(T, session.id, RunSpec(input="one")),
        submit.submit_turn(T, session.id, RunSpec(input="two")),
        return_exceptions=True,
    )
    first, second = answers
    assert isinstance(first, Submitted)
    assert first.routed == "created"
    assert isinstance(second, SessionBusyError)
    assert second.active_run_id == first.run_id


async def test_a_batch_refused_whole_is_sent_again_one_by_one(queue: Queue) -> None:
    submit = submissions(queue, lock_timeout_ms=300)
    reads = Reads(queue)
    held = await reads.create_session(tenant_id="t", principal="alice")
    free = await reads.create_session(tenant_id="t", principal="alice")
    # Another transaction holds the session's row, as a turn routed by another process would:
    # the batch's turn to it times out, which fails the whole statement.
    async with queue.engine.connect() as holder:
        await holder.begin()
        await holder.execute(
            text("SELECT 1 FROM sessions WHERE id = :s FOR UPDATE"), {"s": held.id}
        )
        waited, good, run = await asyncio.gather(
            # Keyed: its lock timeout is the submission's own (lock_timeout_ms).
            submit.submit_turn(T, held.id, RunSpec(input="waits"), IdempotencyKey("k", "h")),
            submit.submit_turn(T, free.id, RunSpec(input="goes")),
            submit.submit_run(T, RunSpec(input={"n": 2})),
            return_exceptions=True,
        )
        await holder.rollback()
    assert isinstance(waited, DBAPIError)
    assert getattr(waited.orig, "sqlstate", None) == "55P03"  # lock_not_available
    assert isinstance(good, Submitted)
    assert good.routed == "created"
    assert isinstance(run, Submitted)
    assert run.routed == "created"
    sessions = await scalar(
        queue,
        "SELECT count(*) FROM runs WHERE session_id = :s",
        s=held.id,
    )
    assert sessions == 0


async def test_without_group_commit_each_submission_is_its_own_statement(queue: Queue) -> None:
    alone = Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
        group_commit=False,
    )
    assert alone.batcher is None
    answers = await asyncio.gather(*(alone.submit_run(T, RunSpec(input=n)) for n in range(3)))
    assert len({answer.run_id for answer in answers}) == 3
    assert all(isinstance(answer.run_id, UUID) for answer in answers)


async def test_many_at_once_are_split_into_bounded_batches_and_each_answered(
    queue: Queue, notifications: list[str], database_url: str
) -> None:
    submit = Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
    )
    assert submit.batcher is not None
    reads = Reads(queue)
    sessions = [await reads.create_session(tenant_id="t", principal="alice") for _ in range(30)]
    await caught_up(database_url, notifications)
    notifications.clear()
    # Two turns for each session, interleaved with sessionless runs: 70 at once.
    calls = []
    for n, session in enumerate(sessions):
        calls.append(submit.submit_turn(T, session.id, RunSpec(input=f"a{n}")))
        calls.append(submit.submit_turn(T, session.id, RunSpec(input=f"b{n}")))
        if n % 3 == 0:
            calls.append(submit.submit_run(T, RunSpec(input={"n": n})))
    answers = await asyncio.gather(*calls, return_exceptions=True)

    created = [a for a in answers if isinstance(a, Submitted)]
    busy = [a for a in answers if isinstance(a, SessionBusyError)]
    assert len(created) == 30 + 10, answers
    assert len(busy) == 30, answers
    # Each session's first turn made its run, its second found it busy.
    by_session = {str(s.id): s for s in sessions}
    firsts = {a.document["session_id"] for a in created if a.document["session_id"]}
    assert firsts == set(by_session)
    assert await scalar(queue, "SELECT count(*) FROM runs") == 40
    # Fewer statements than submissions, none above the bound, none refused whole (the
    # batches in flight name the same sessions); one notification each at most.
    assert submit.batcher.statements < len(calls)
    assert submit.batcher.submissions == len(calls)
    assert submit.batcher.resent == 0
    sent = await caught_up(database_url, notifications)
    assert 1 <= len(sent) <= submit.batcher.statements


async def test_a_batch_that_finds_no_connection_gives_each_caller_the_pools_error(
    queue: Queue, settings: Settings, database_url: str
) -> None:
    """Every connection of the pool busy past its timeout: the batch was never sent, and each
    of its submissions gets the pool's error, as one sent alone would (not a cancellation)."""
    engine = create_engine(settings, database_url, pool_size=1, pool_timeout=0.2)
    try:
        submit = Submissions(
            Queue(engine, queue.config, clock=queue.clock),
            default_agent="scripted",
            idempotency_ttl_seconds=3600,
            idempotency_wait_seconds=2,
            lock_timeout_ms=5000,
        )
        async with AsyncExitStack() as held:
            for _ in range(pool_limit(1)):  # every connection the pool may hold
                await held.enter_async_context(engine.connect())
            answers = await asyncio.gather(
                submit.submit_run(T, RunSpec(input=1)),
                submit.submit_run(T, RunSpec(input=2)),
                return_exceptions=True,
            )
        assert [type(answer) for answer in answers] == [PoolTimeout, PoolTimeout], answers
        assert await scalar(queue, "SELECT count(*) FROM runs") == 0
    finally:
        await engine.dispose()


class Holding(SubmissionBatcher):
    """Keeps every submission until the test sends the batches it makes of them."""

    def __init__(self, batcher: SubmissionBatcher) -> None:
        super().__init__(batcher.db, batcher.refusals)
        self.held: list[tuple[Submission, asyncio.Future[Mapping[str, Any]]]] = []

    async def submit(self, submission: Submission) -> Mapping[str, Any]:
        future: asyncio.Future[Mapping[str, Any]] = asyncio.get_running_loop().create_future()
        self.held.append((submission, future))
        return await future


async def waiting_batches(queue: Queue, count: int) -> bool:
    """`count` backends wait on a lock in `turnstile_submit_many`."""
    waiting = await scalar(
        queue,
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE '%FROM turnstile_submit_many(%'",
    )
    return int(waiting) == count


async def test_batches_in_flight_that_name_the_same_sessions_do_not_deadlock(
    queue: Queue,
) -> None:
    """Two batches in flight, each with a turn to sessions the other names, in opposite orders
    (a turn and its follow-up to each of several sessions, as a chat client sends them). Taken
    in the order received, the first held one session and waited for the next while the second
    held that one and waited for the first: PostgreSQL's deadlock detector refused one batch
    whole after its second, and each of its submissions was sent again alone. Each batch now
    takes its sessions in one order (their ids): the second waits for the first, and each is
    answered by its one statement."""
    # No rate limit: its bucket, taken before any session, would put the second batch behind
    # the first.
    submit = Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
    )
    assert submit.batcher is not None
    holding = Holding(submit.batcher)
    submit.batcher = holding
    reads = Reads(queue)
    low, middle, high = sorted(
        [(await reads.create_session(tenant_id="t", principal="alice")).id for _ in range(3)]
    )
    order = [low, middle, high, high, low]
    calls = [
        asyncio.create_task(submit.submit_turn(T, session, RunSpec(input=f"turn {n}")))
        for n, session in enumerate(order)
    ]

    async def all_held() -> bool:  # each call builds its submission before it is held
        return len(holding.held) == len(order)

    await eventually(all_held, what="the submissions")
    first, second = holding.held[:3], holding.held[3:]
    async with queue.engine.connect() as holder:
        await holder.begin()
        await holder.execute(text("SELECT 1 FROM sessions WHERE id = :s FOR UPDATE"), {"s": middle})
        sending_first = asyncio.create_task(holding._send(first))
        # The first took `low` and waits for `middle`; then the second waits too.
        await eventually(lambda: waiting_batches(queue, 1), what="the first batch's wait")
        sending_second = asyncio.create_task(holding._send(second))
        await eventually(lambda: waiting_batches(queue, 2), what="the second batch's wait")
        await holder.rollback()
    await asyncio.gather(sending_first, sending_second)
    answers = await asyncio.gather(*calls, return_exceptions=True)

    assert (holding.statements, holding.resent) == (2, 0), answers
    created, middle_turn, high_turn, busy_high, busy_low = answers
    assert all(isinstance(a, Submitted) for a in (created, middle_turn, high_turn)), answers
    assert isinstance(busy_high, SessionBusyError), answers
    assert isinstance(busy_low, SessionBusyError), answers


async def test_a_submission_right_after_the_last_flusher_finished_is_sent(queue: Queue) -> None:
    """A flusher that has just finished still counted as in flight until its done-callback
    ran: a submission arriving in between (the caller the flusher had just answered, sending
    its next one at once) found every flusher's place taken and waited for the next
    submission to start one. One flusher at most, one caller sending in turn, each at once
    after its answer: each is answered."""
    submit = submissions(queue)
    assert submit.batcher is not None
    batcher = SubmissionBatcher(queue.db, submit.batcher.refusals, max_in_flight=1)
    submit.batcher = batcher
    sent: list[Submission] = []
    original = batcher.submit

    async def recording(submission: Submission) -> Mapping[str, Any]:
        sent.append(submission)
        return await original(submission)

    batcher.submit = recording  # type: ignore[method-assign]
    await submit.submit_run(T, RunSpec(input=0))
    args = list(sent[0].args)
    for n in range(1, 4):
        # A new run each time; sent straight to the batcher, nothing awaited in between.
        args[_RUN_ID] = uuid4()
        async with asyncio.timeout(30):  # a bound, not a timing: it never came back before
            row = await original(Submission(tuple(args), keyed=False))
        assert (row["outcome"], row["id"]) == ("created", args[_RUN_ID]), n
