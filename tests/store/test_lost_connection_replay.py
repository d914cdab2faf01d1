"""Lost connections (issue 19 item 2; docs/reliability.md, "Lost connections and replays"): a
statement whose connection was gone before it was sent is sent again on a fresh connection,
and a fenced write whose commit outcome is unknown is replayed so that it recognises its own
earlier commit: one event, one journal row, no spurious `run.fenced`.

The outcome is made unknown for real: a loopback proxy between the queue's engine and
PostgreSQL lets the statement reach the server and swallows the server's answer up to its
ReadyForQuery (sent after the commit), then cuts the connection; or it drops the statement
before it reaches the server; or the backend is terminated while the statement waits on a lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.queue.core import Queue, QueueConfig
from app.store.engine import create_engine
from app.store.statements import statements
from app.vocabulary.records import Fenced, Lease, NewRun, ToolCall, WriteOutcome, Written
from app.worker.completions import CompletionBatcher
from app.worker.execution import ExecutionContext
from tests.support.invariants import check_all_runs
from tests.support.pg_proxy import PgProxy, pg_proxy
from tests.support.waiting import eventually

CALL = ToolCall(step=1, tool="echo", idempotency_class="unsafe", args={"x": 1})


def new_run(max_attempts: int = 3) -> NewRun:
    return NewRun(
        tenant_id="t",
        principal="p",
        agent="scripted",
        priority=0,
        input={"n": 1},
        max_attempts=max_attempts,
    )


@pytest.fixture
async def proxy(database_url: str) -> AsyncIterator[PgProxy]:
    url = make_url(database_url)
    # A socket directory and port in the query (the embedded PostgreSQL) win over the URL's.
    socket_dir, socket_port = url.query.get("host"), url.query.get("port")
    host = socket_dir if isinstance(socket_dir, str) else url.host or "127.0.0.1"
    port = int(socket_port) if isinstance(socket_port, str) else url.port or 5432
    async with pg_proxy(host, port) as running:
        yield running


def _proxied_url(database_url: str, proxy: PgProxy) -> str:
    url = make_url(database_url).set(host="127.0.0.1", port=proxy.port)
    # Not the embedded server's socket: the proxy.
    url = url.difference_update_query(["host", "port"])
    return url.update_query_dict({"ssl": "disable"}).render_as_string(hide_password=False)


@pytest.fixture
async def proxied(
    settings: Settings, database_url: str, proxy: PgProxy
) -> AsyncIterator[AsyncEngine]:
    """An engine whose every connection goes through the proxy: one connection, reused."""
    engine = create_engine(settings, _proxied_url(database_url, proxy), pool_size=1)
    yield engine
    await engine.dispose()


@pytest.fixture
def direct(engine: AsyncEngine) -> Queue:
    """The queue on the test's own engine (no proxy): setup and checks."""
    return Queue(engine)


async def _claimed(direct: Queue, *, max_attempts: int = 3) -> Lease:
    run = await direct.enqueue(new_run(max_attempts))
    [claimed] = await direct.claim("w", [run.priority_class])
    return claimed.lease


async def _types(direct: Queue, run_id: UUID) -> list[str]:
    return [e.type for e in await direct.events(run_id)]


async def _warm(queue: Queue, run_id: UUID) -> None:
    """A connection through the proxy, set up (the dialect's first queries) before arming."""
    assert await queue.get_run(run_id) is not None


Write = Callable[[Queue, Lease], Awaitable[WriteOutcome]]

# Each fenced write, what it needs written before it, and the events it adds (the first one's
# type, quoted, marks its statement for the proxy).
WRITES: dict[str, tuple[Write, bool, list[str]]] = {
    "tool_started": (lambda q, lease: q.tool_started(lease, CALL), False, ["tool.started"]),
    "tool_finished": (
        lambda q, lease: q.tool_finished(lease, CALL, "succeeded", {"ok": 1}, {"s": 1}),
        True,
        ["tool.finished"],
    ),
    "tool_not_sent": (
        lambda q, lease: q.tool_not_sent(lease, CALL, "refused"),
        True,
        ["tool.not_sent"],
    ),
    "append_event": (
        lambda q, lease: q.append_event(lease, "agent.note", {"n": 1}),
        False,
        ["agent.note"],
    ),
    "save_checkpoint": (
        lambda q, lease: q.save_checkpoint(lease, 1, {"s": 1}),
        False,
        ["run.checkpoint"],
    ),
    "wait_for_user": (
        lambda q, lease: q.wait_for_user(lease, {"q": "?"}, step=1, state={}),
        False,
        ["run.waiting"],
    ),
    "complete": (lambda q, lease: q.complete(lease, {"done": True}), False, ["run.succeeded"]),
    "fail": (
        lambda q, lease: q.fail(lease, {"kind": "tool_error", "message": "no"}),
        False,
        ["run.failed"],
    ),
    "release_graceful": (
        lambda q, lease: q.release(lease, graceful=True, reason="drain"),
        False,
        ["run.released"],
    ),
    "release_early": (
        lambda q, lease: q.release(lease, graceful=False, reason="flaky"),
        False,
        ["run.released"],
    ),
}


async def _journal_rows(engine: AsyncEngine, run_id: UUID) -> list[tuple[int, str]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT step, entry FROM tool_journal WHERE run_id = :id ORDER BY event_seq"),
            {"id": run_id},
        )
        return [(int(step), str(entry)) for step, entry in rows]


@pytest.mark.parametrize("name", sorted(WRITES))
async def test_a_fenced_write_whose_answer_was_lost_recognises_its_own_commit(
    name: str, direct: Queue, proxied: AsyncEngine, proxy: PgProxy, engine: AsyncEngine
) -> None:
    """The write committed, its answer never came back: the replay finds the earlier commit
    and answers with it. One event, one journal row, no run.fenced, the earlier seq."""
    write, started_first, added = WRITES[name]
    lease = await _claimed(direct)
    if started_first:
        await direct.tool_started(lease, CALL)
    before = await _types(direct, lease.run_id)
    journal_before = await _journal_rows(engine, lease.run_id)
    queue = Queue(proxied)
    await _warm(queue, lease.run_id)

    # append_event's type is a parameter: its statement is the one inserting from `run`.
    proxy.lose_answer(
        "SELECT run.id, run.last_event_seq, $" if name == "append_event" else f"'{added[0]}'"
    )
    outcome = await write(queue, lease)

    assert proxy.cuts == 1
    assert len(proxy.lost_tags) == 1, "the statement ran, committed, and its answer was lost"
    after = await _types(direct, lease.run_id)
    assert after == before + added
    assert isinstance(outcome, Written)
    assert outcome.seq == len(after)
    journal = await _journal_rows(engine, lease.run_id)
    grew = {"tool_started": 1, "tool_finished": 1, "tool_not_sent": 1}.get(name, 0)
    assert len(journal) == len(journal_before) + grew
    await check_all_runs(engine)


async def test_a_write_that_never_reached_the_server_is_written_once(
    direct: Queue, proxied: AsyncEngine, proxy: PgProxy
) -> None:
    """The statement is dropped on its way: the client cannot tell this from a lost answer,
    replays, finds nothing of it, and writes it, once."""
    lease = await _claimed(direct)
    queue = Queue(proxied)
    await _warm(queue, lease.run_id)
    proxy.lose_request("'tool.started'")
    started = await queue.tool_started(lease, CALL)
    proxy.lose_request("'tool.finished'")
    finished = await queue.tool_finished(lease, CALL, "succeeded", {"ok": 1}, {})
    proxy.lose_request("'run.succeeded'")
    completed = await queue.complete(lease, {"done": True})
    assert proxy.cuts == 3
    assert [started, finished, completed] == [Written(seq=3), Written(seq=4), Written(seq=5)]
    assert await _types(direct, lease.run_id) == [
        "run.created",
        "run.claimed",
        "tool.started",
        "tool.finished",
        "run.succeeded",
    ]


async def test_a_replayed_completion_batch_recognises_each_run(
    direct: Queue, proxied: AsyncEngine, proxy: PgProxy, engine: AsyncEngine
) -> None:
    """A group commit whose answer was lost: each run of the batch is recognised as completed
    by it, and a run fenced in it stays fenced (no event, no run.fenced)."""
    first, second = await _claimed(direct), await _claimed(direct)
    stale = await _claimed(direct)
    await direct.cancel(stale.run_id, actor="op")
    queue = Queue(proxied)
    await _warm(queue, first.run_id)
    batcher = CompletionBatcher(queue)
    proxy.lose_answer("'run.succeeded'")
    outcomes = await asyncio.gather(
        *(batcher.complete(lease, {"n": i}) for i, lease in enumerate([first, second, stale]))
    )
    assert proxy.cuts == 1
    assert proxy.lost_tags == ["SELECT 1"]
    assert outcomes == [Written(seq=3), Written(seq=3), Fenced(stale)]
    for lease in (first, second):
        assert await _types(direct, lease.run_id) == ["run.created", "run.claimed", "run.succeeded"]
    assert "run.fenced" not in await _types(direct, stale.run_id)
    await check_all_runs(engine)


async def test_a_replayed_heartbeat_still_holds(
    direct: Queue, proxied: AsyncEngine, proxy: PgProxy
) -> None:
    lease = await _claimed(direct)
    queue = Queue(proxied)
    await _warm(queue, lease.run_id)
    proxy.lose_answer("AS h(run_id, epoch)")
    assert await queue.heartbeat(lease) is True
    assert proxy.cuts == 1


async def test_a_completion_on_a_terminated_backend_is_written_once(
    direct: Queue, engine: AsyncEngine, settings: Settings, database_url: str
) -> None:
    """The chaos suite's terminated backend, made deterministic: the completion waits on the
    run row's lock (held by the test), its backend is terminated (57P01 mid-statement), the
    lock is let go. The replay finds nothing committed and completes the run once."""
    lease = await _claimed(direct)
    worker_engine = create_engine(settings, database_url, application_name="replay-victim")
    try:
        queue = Queue(worker_engine)
        async with engine.connect() as holder:
            await holder.execute(
                text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": lease.run_id}
            )
            completing = asyncio.create_task(queue.complete(lease, {"done": True}))

            async def victim() -> int | None:
                async with engine.connect() as conn:
                    pid = await conn.scalar(
                        text(
                            "SELECT pid FROM pg_stat_activity WHERE application_name = "
                            "'replay-victim' AND wait_event_type = 'Lock'"
                        )
                    )
                    return None if pid is None else int(pid)

            pid = await eventually(victim, what="the completion to wait on the row lock")
            async with engine.connect() as conn:
                assert await conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})

            async def replay_waiting() -> bool:
                async with engine.connect() as conn:
                    waiting = await conn.scalar(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                            "'replay-victim' AND wait_event_type = 'Lock' AND pid <> :pid"
                        ),
                        {"pid": pid},
                    )
                    return bool(waiting)

            # The replay takes the row lock first: it waits behind the holder too.
            await eventually(replay_waiting, what="the replay to wait on the row lock")
            await holder.rollback()
        outcome = await completing
    finally:
        await worker_engine.dispose()
    assert isinstance(outcome, Written)
    assert await _types(direct, lease.run_id) == ["run.created", "run.claimed", "run.succeeded"]
    await check_all_runs(engine)


async def test_a_statement_on_a_connection_closed_before_it_was_sent_is_sent_again(
    direct: Queue, settings: Settings, database_url: str
) -> None:
    """The connection closes between the pool's check and the send (here: right after the
    pool's own checkout listener): the driver refuses before writing anything, and the
    statement goes on a fresh connection. Any statement, not only the recognising ones."""
    worker_engine = create_engine(settings, database_url, pool_size=1)
    closed: list[int] = []
    armed = False

    @event.listens_for(worker_engine.sync_engine, "checkout")
    def _close_once(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        nonlocal armed
        if armed:
            armed = False
            dbapi_connection.driver_connection.terminate()
            closed.append(1)

    try:
        queue = Queue(worker_engine)
        run = await queue.enqueue(new_run())  # a pooled connection to close
        for statement in ("claim", "tool_started", "complete"):
            armed = True
            if statement == "claim":
                [claimed] = await queue.claim("w", [run.priority_class])
                lease = claimed.lease
            elif statement == "tool_started":
                assert await queue.tool_started(lease, CALL) == Written(seq=3)
            else:
                assert await queue.complete(lease, {"done": True}) == Written(seq=4)
    finally:
        await worker_engine.dispose()
    assert len(closed) == 3
    assert await _types(direct, run.id) == [
        "run.created",
        "run.claimed",
        "tool.started",
        "run.succeeded",
    ]


async def test_a_claim_whose_answer_was_lost_is_recognised(
    direct: Queue, proxied: AsyncEngine, proxy: PgProxy
) -> None:
    """A claim whose answer was lost committed: its runs are found by the claim's own id (its
    run.claimed events carry it) and handed to the caller, once, instead of waiting for their
    leases to expire and losing an attempt (issue 40, item 10). It is not sent again: a second
    claim would take other runs."""
    first = await direct.enqueue(new_run())
    second = await direct.enqueue(new_run())
    queue = Queue(proxied)
    await _warm(queue, first.id)
    proxy.lose_answer("FROM turnstile_claim(")
    claimed = await queue.claim("w", [first.priority_class], limit=2)
    assert sorted(c.run.id for c in claimed) == sorted([first.id, second.id])
    assert proxy.cuts == 1
    for item in claimed:
        assert item.run.attempts == 1
        assert await direct.heartbeat(item.lease)
        assert await _types(direct, item.run.id) == ["run.created", "run.claimed"]


async def test_a_claim_whose_answer_was_lost_before_it_ran_claims_nothing(
    direct: Queue, proxied: AsyncEngine, proxy: PgProxy
) -> None:
    """Recognised as nothing (the request never reached the server, or rolled back), the lost
    claim returns no run, and the next claim takes the run."""
    run = await direct.enqueue(new_run())
    queue = Queue(proxied)
    await _warm(queue, run.id)
    proxy.lose_request("FROM turnstile_claim(")
    assert await queue.claim("w", [run.priority_class]) == []
    taken = await direct.claim("w", [run.priority_class])
    assert [c.run.id for c in taken] == [run.id]


@pytest.mark.parametrize("at_commit", [False, True])
async def test_through_transactions_a_lost_commit_is_replayed_and_a_lost_statement_resent(
    at_commit: bool, direct: Queue, proxied: AsyncEngine, proxy: PgProxy, engine: AsyncEngine
) -> None:
    """The path behind PgBouncer (BEGIN, statement, COMMIT): a connection lost before the
    COMMIT rolled the statement back and it is sent again; a lost COMMIT's outcome is unknown
    and the replay recognises it. Either way, one event."""
    lease = await _claimed(direct)
    queue = Queue(proxied, QueueConfig(direct_calls=False))
    await _warm(queue, lease.run_id)
    proxy.lose_answer("'tool.started'", at_commit=at_commit)
    assert await queue.tool_started(lease, CALL) == Written(seq=3)
    proxy.lose_answer("'run.succeeded'", at_commit=at_commit)
    assert await queue.complete(lease, {"done": True}) == Written(seq=4)
    assert proxy.cuts == 2
    assert proxy.lost_tags == (["COMMIT", "COMMIT"] if at_commit else ["INSERT 0 1", "SELECT 1"])
    assert await _types(direct, lease.run_id) == [
        "run.created",
        "run.claimed",
        "tool.started",
        "run.succeeded",
    ]
    assert await _journal_rows(engine, lease.run_id) == [(1, "started")]


async def test_an_execution_whose_writes_lose_their_answers_goes_on_and_ends_its_hold(
    direct: Queue, proxied: AsyncEngine, proxy: PgProxy, engine: AsyncEngine
) -> None:
    """What the worker sees: its hold journals a call and completes the run, both answers lost
    after the commit. Neither raises, the hold ends (`ended`, not fenced), and the log is the
    run's plain path, without a second tool.started or a run.fenced."""
    run = await direct.enqueue(new_run())
    [claimed] = await direct.claim("w", [run.priority_class])
    queue = Queue(proxied)
    await _warm(queue, run.id)
    ctx = ExecutionContext(
        queue=queue,
        claimed=claimed,
        slot_group="interactive",
        lease_seconds=30,
        trusted_until=time.monotonic() + 30,
        completions=CompletionBatcher(queue),
    )
    proxy.lose_answer("'tool.started'")
    await ctx.tool_started(CALL)
    proxy.lose_answer("'run.succeeded'")
    await ctx.complete({"done": True})
    assert proxy.cuts == 2
    assert ctx.ended
    assert not ctx.fenced
    assert await _types(direct, run.id) == [
        "run.created",
        "run.claimed",
        "tool.started",
        "run.succeeded",
    ]
    await check_all_runs(engine)


def test_every_fenced_write_has_its_recognising_read() -> None:
    """A fenced write replayed after an unknown outcome needs a read that recognises its
    earlier commit (runs.sql, "Replays"); heartbeat_many needs none (sent again as it is), nor
    model_budget_reserve: it is never replayed (a lost connection fails the model call, and a
    reservation it may have committed goes back to the budget once its run's hold ends or it
    expires, docs/model-budgets.md), nor take_steered: never replayed either (its unknown
    outcome gives the execution up; what it may have committed is in the run's inputs, which
    the recovered run reads, so a steered input is neither lost nor taken twice)."""
    named = statements()
    fenced = {name for name, statement in named.items() if statement.fenced}
    unreplayed = {"heartbeat_many", "model_budget_reserve", "take_steered"}
    missing = sorted(n for n in fenced - unreplayed if f"recognise_{n}" not in named)
    assert missing == []
