"""The Python client (clients/python, `turnstile_client`) against the live service: a real
uvicorn server on loopback with its worker pool, reached through a proxy that breaks connections
where a test says so. Submitting, waiting on the long poll, answering a question, events resumed
after a cut, problem+json as exceptions, a lost answer retried with the same Idempotency-Key,
the client's own errors for a server that is down, silent or cut off, the blocking client, and
an import that stays light."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID, uuid4

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from turnstile_client import (
    AnswerConflictError,
    AsyncTurnstile,
    ConnectionLostError,
    Event,
    InvalidRequestError,
    NotFoundError,
    RateLimitedError,
    ResponseTimeoutError,
    RetryPolicy,
    RunFinishedError,
    ServiceUnavailableError,
    SessionBusyError,
    TooManyStreamsError,
    TransportError,
    Turnstile,
    UnreachableError,
    WaitTimeoutError,
)
from turnstile_client.retry import retry_after_of, retryable_answer

from app.store.embedded import free_port
from tests.support.api import Api, running_api
from tests.support.proxy import BreakingProxy, breaking_proxy, http_response

SCRIPT_WITH_QUESTION = {
    "script": [
        {"call": "echo", "args": {"lookup": "accounts"}},
        {"ask": "Which account?"},
        {"final": "transfer booked"},
    ]
}
SLOW_SCRIPT = {
    "script": [
        {"call": "sleep", "args": {"seconds": 0.3}},
        {"call": "sleep", "args": {"seconds": 0.3}},
        {"final": "done"},
    ]
}
CLIENTS_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "clients.md"
FAST_RETRIES = RetryPolicy(attempts=5, base_delay=0.05, max_delay=0.2)


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, workers=True) as running:
        yield running


@pytest.fixture
async def proxy(api: Api) -> AsyncIterator[BreakingProxy]:
    async with breaking_proxy(api.base) as running:
        yield running


async def runs_of_session(engine: AsyncEngine, session: UUID) -> list[UUID]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT id FROM runs WHERE session_id = :s"), {"s": session})
        return [row.id for row in rows]


async def test_submit_wait_answer_and_finish(api: Api) -> None:
    async with AsyncTurnstile(api.base, await api.key()) as turnstile:
        session = await turnstile.create_session()
        assert session.state == "idle"
        run = await turnstile.submit_turn(session, SCRIPT_WITH_QUESTION)
        assert run.session_id == session.id
        assert run.priority_class == "interactive"

        asked = await turnstile.wait(run, timeout=30)
        assert asked.waiting_for_user
        assert asked.question == "Which account?"
        assert (await turnstile.get_session(session.id)).state == "waiting_for_user"

        answered = await turnstile.answer(asked, "acct-42")
        assert answered.id == run.id  # the answer resumes the same run
        done = await turnstile.wait(answered, timeout=30)
        assert done.status == "succeeded"
        assert done.finished
        assert done.result["final"] == "transfer booked"
        assert done.result["answers"] == ["acct-42"]

        # Its whole log, read after the fact, ends with the terminal event.
        events = [event async for event in turnstile.events(run)]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].type == "run.succeeded"
        assert events[-1].terminal

        # A sessionless run, and its cancel (twice: the second answers again).
        later = await turnstile.submit_run(
            {"report": "weekly"}, scheduled_for="2030-01-01T09:00:00Z"
        )
        assert later.session_id is None
        assert later.priority_class == "async"
        with pytest.raises(WaitTimeoutError) as timed_out:
            await turnstile.wait(later, timeout=0.2)
        assert timed_out.value.run.status == "queued"
        assert (await turnstile.cancel(later)).status == "cancelled"
        assert (await turnstile.cancel(later.id)).status == "cancelled"


async def test_problems_are_exceptions_with_their_fields(api: Api) -> None:
    async with AsyncTurnstile(api.base, await api.key()) as turnstile:
        session = await turnstile.create_session()
        # Scheduled for later, so it stays queued and holds the session.
        first = await turnstile.submit_turn(
            session, {"text": "first"}, scheduled_for="2030-01-01T09:00:00+00:00"
        )
        with pytest.raises(SessionBusyError) as busy:
            await turnstile.submit_turn(session, {"text": "second"})
        problem = busy.value
        assert problem.status == 409
        assert problem.type == "/problems/session-busy"
        assert problem.title == "The session already has a run in progress"
        assert problem.detail
        assert problem.active_run_id == first.id
        assert problem.active_run_status == "queued"
        assert await runs_of_session(api.engine, session.id) == [first.id]  # not retried

        with pytest.raises(NotFoundError) as missing:
            await turnstile.get_run(uuid4())
        assert missing.value.status == 404

        done = await turnstile.wait(
            await turnstile.submit_run({"script": [{"final": "ok"}]}), timeout=30
        )
        with pytest.raises(RunFinishedError) as finished:
            await turnstile.cancel(done)
        assert finished.value.body["run_status"] == "succeeded"


async def test_events_resume_after_the_connection_is_cut(api: Api, proxy: BreakingProxy) -> None:
    async with AsyncTurnstile(proxy.base, await api.key(), retry=FAST_RETRIES) as turnstile:
        run = await turnstile.submit_run(SLOW_SCRIPT)
        seen: list[Event] = []
        async for event in turnstile.events(run):
            seen.append(event)
            if len(seen) == 1:
                proxy.cut()  # mid-stream: the run has two tool calls of 0.3 s still to go
        assert [e.seq for e in seen] == list(range(1, len(seen) + 1))  # no gap, no repeat
        assert seen[-1].type == "run.succeeded"
        # The stream was resumed where it broke (after the events already read, which may be
        # more than one: they can come in one chunk), not started again.
        resumed = [int(seq) for seq in proxy.sent_headers("Last-Event-ID")]
        assert resumed
        assert 1 <= resumed[0] < seen[-1].seq
        assert proxy.connections >= 2


async def test_a_lost_answer_is_retried_with_the_same_key(api: Api, proxy: BreakingProxy) -> None:
    async with AsyncTurnstile(proxy.base, await api.key(), retry=FAST_RETRIES) as turnstile:
        session = await turnstile.create_session()
        proxy.sent.clear()
        # The turn reaches the server and is committed; its answer never comes back.
        proxy.drop_responses = 1
        run = await turnstile.submit_turn(session, {"text": "hello"})
        keys = proxy.sent_headers("Idempotency-Key")
        assert len(keys) == 2  # the first try and the retry
        assert keys[0] == keys[1]
        assert keys[0].startswith("turnstile-client-")
        # One run: the retry was replayed, not run again.
        assert await runs_of_session(api.engine, session.id) == [run.id]

        # A key given by the caller is the one sent, on every try.
        proxy.sent.clear()
        proxy.drop_responses = 1
        other = await turnstile.submit_run({"text": "batch"}, idempotency_key="job-7")
        assert proxy.sent_headers("Idempotency-Key") == ["job-7", "job-7"]
        assert (await turnstile.submit_run({"text": "batch"}, idempotency_key="job-7")).id == (
            other.id
        )


async def test_5xx_and_429_answers_are_retried_with_the_same_key(
    api: Api, proxy: BreakingProxy
) -> None:
    problem = b'{"type": "/problems/database-unavailable", "title": "x", "status": 503}'
    async with AsyncTurnstile(proxy.base, await api.key(), retry=FAST_RETRIES) as turnstile:
        session = await turnstile.create_session()
        proxy.sent.clear()
        # Answered in the server's place: nothing reaches the server until the third try.
        proxy.answer_with = [
            http_response(
                503, "Service Unavailable", problem, Content_Type="application/problem+json",
                Retry_After="0",
            ),
            http_response(429, "Too Many Requests", Retry_After="0"),
        ]  # fmt: skip
        run = await turnstile.submit_turn(session, {"text": "hello"})
        keys = proxy.sent_headers("Idempotency-Key")
        assert len(keys) == 3
        assert len(set(keys)) == 1
        assert await runs_of_session(api.engine, session.id) == [run.id]

        # Bounded: when every try fails, the last answer is raised, with its fields.
        proxy.answer_with = [
            http_response(
                503, "Service Unavailable", problem, Content_Type="application/problem+json",
                Retry_After="0",
            )
        ] * FAST_RETRIES.attempts  # fmt: skip
        with pytest.raises(ServiceUnavailableError) as unavailable:
            await turnstile.get_run(run)
        assert unavailable.value.status == 503
        assert unavailable.value.retry_after == 0.0
        assert proxy.answer_with == []


async def test_too_many_streams_is_retried_then_raised(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, max_streams_per_key=1) as api:
        policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, max_retry_after=0.05)
        async with AsyncTurnstile(api.base, await api.key(), retry=policy) as turnstile:
            later = await turnstile.submit_run({"n": 1}, scheduled_for="2030-01-01T09:00:00Z")
            stream = turnstile.events(later)
            # Its first event read, the stream stays open and holds the key's one place.
            assert (await anext(stream)).type == "run.created"
            with pytest.raises(TooManyStreamsError) as refusal:
                await turnstile.wait(later, timeout=5)
            assert refusal.value.status == 429
            assert refusal.value.retry_after == 5.0  # as the API said; the policy capped it
            await stream.aclose()
            # The place given back, long polls work again.
            with pytest.raises(WaitTimeoutError):
                await turnstile.wait(later, timeout=0.2)


async def test_over_the_rate_limit_is_a_rate_limited_error(
    database_url: str, engine: AsyncEngine
) -> None:
    async with (
        running_api(database_url, engine, submit_rate_per_second=0.001, submit_burst=1) as api,
        AsyncTurnstile(api.base, await api.key(), retry=RetryPolicy(attempts=1)) as turnstile,
    ):
        await turnstile.submit_run({"n": 1}, scheduled_for="2030-01-01T09:00:00Z")
        with pytest.raises(RateLimitedError) as limited:
            await turnstile.submit_run({"n": 2})
    assert limited.value.status == 429
    assert limited.value.retry_after is not None
    assert limited.value.retry_after > 0


async def test_the_blocking_client(api: Api) -> None:
    key = await api.key()

    def use() -> list[str]:
        with Turnstile(api.base, key) as turnstile:
            session = turnstile.create_session()
            run = turnstile.submit_turn(session, SCRIPT_WITH_QUESTION)
            asked = turnstile.wait(run, timeout=30)
            assert asked.question == "Which account?"
            # An answer that would change the waiting run is refused, naming the field.
            with pytest.raises(AnswerConflictError) as conflict:
                turnstile.submit_turn(session, "x", priority="async")
            assert conflict.value.body["field"] == "priority"
            done = turnstile.wait(turnstile.answer(asked, "acct-1"), timeout=30)
            assert done.status == "succeeded"
            return [event.type for event in turnstile.events(done)]

    types = await asyncio.to_thread(use)
    assert types[0] == "run.created"
    assert types[-1] == "run.succeeded"
    assert "run.input_delivered" in types


async def test_a_server_that_is_down_is_the_clients_own_error() -> None:
    base = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)
    async with AsyncTurnstile(base, "key", retry=policy) as turnstile:
        with pytest.raises(UnreachableError) as down:
            await turnstile.submit_run({"text": "hello"}, idempotency_key="job-1")
    error = down.value
    assert isinstance(error, TransportError)
    assert isinstance(error, ConnectionError)  # `except ConnectionError` catches it too
    assert isinstance(error.__cause__, httpx.ConnectError)
    assert (error.base_url, error.attempts, error.idempotency_key) == (base, 3, "job-1")
    assert str(error).startswith(f"cannot reach the Turnstile API at {base}: ")
    assert str(error).endswith(" (after 3 attempts)")

    # Streams give up the same way, and so does the blocking client.
    async with AsyncTurnstile(base, "key", retry=policy) as turnstile:
        with pytest.raises(UnreachableError):
            await anext(turnstile.events(uuid4()))

    def blocking() -> None:
        with Turnstile(base, "key", retry=RetryPolicy(attempts=1)) as turnstile:
            turnstile.get_run(uuid4())

    with pytest.raises(UnreachableError) as once:
        await asyncio.to_thread(blocking)
    assert once.value.attempts == 1
    assert " (after" not in str(once.value)


async def test_a_silent_server_is_a_response_timeout() -> None:
    handlers: list[asyncio.Task[None]] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()
        await writer.wait_closed()

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.create_task(never_answer(reader, writer)))

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    policy = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02)
    async with server:
        async with AsyncTurnstile(
            f"http://127.0.0.1:{port}", "key", timeout=0.2, retry=policy
        ) as turnstile:
            with pytest.raises(ResponseTimeoutError) as silent:
                await turnstile.create_session()
        await asyncio.gather(*handlers)  # each connection closed by the client
    assert isinstance(silent.value, TimeoutError)
    assert isinstance(silent.value.__cause__, httpx.ReadTimeout)
    assert silent.value.attempts == 2
    assert len(handlers) == 2  # one connection per try


async def test_a_connection_lost_on_every_try_names_the_key_to_send_again(
    api: Api, proxy: BreakingProxy
) -> None:
    async with AsyncTurnstile(proxy.base, await api.key(), retry=FAST_RETRIES) as turnstile:
        session = await turnstile.create_session()
        # Each try reaches the server and is committed (the first) or replayed; no answer
        # ever comes back.
        proxy.drop_responses = FAST_RETRIES.attempts
        with pytest.raises(ConnectionLostError) as lost:
            await turnstile.submit_turn(session, {"text": "hello"})
        key = lost.value.idempotency_key
        assert key is not None
        assert key.startswith("turnstile-client-")
        assert lost.value.attempts == FAST_RETRIES.attempts
        assert proxy.sent_headers("Idempotency-Key") == [key] * FAST_RETRIES.attempts
        (only,) = await runs_of_session(api.engine, session.id)
        # Sent again later with that key, it is the same run, not a second one.
        again = await turnstile.submit_turn(session, {"text": "hello"}, idempotency_key=key)
        assert again.id == only
        assert await runs_of_session(api.engine, session.id) == [only]


def test_a_base_url_that_is_not_http_is_refused_at_once() -> None:
    for bad in ("127.0.0.1:8000", "ftp://example.com", "http://"):
        with pytest.raises(ValueError, match="base_url must be an http"):
            AsyncTurnstile(bad, "key")
    assert AsyncTurnstile("http://127.0.0.1:8000/", "key").base_url == "http://127.0.0.1:8000"


async def test_the_blocking_client_streams_from_threads_and_closes(api: Api) -> None:
    key = await api.key()

    def use() -> tuple[list[str], list[str]]:
        with Turnstile(api.base, key) as turnstile:
            later = turnstile.submit_run({"n": 1}, scheduled_for="2030-01-01T09:00:00Z")
            # Leaving a stream early closes it (its place is given back: the key may hold it).
            first = next(iter(turnstile.events(later)))
            assert first.type == "run.created"
            # One client, calls from several threads at once.
            with concurrent.futures.ThreadPoolExecutor(4) as threads:
                runs = list(
                    threads.map(lambda n: turnstile.submit_run({"script": [{"final": n}]}), "abcd")
                )
            done = [turnstile.wait(run, timeout=30).status for run in runs]
            cancelled = turnstile.cancel(later).status
        with pytest.raises(RuntimeError, match="closed"):
            turnstile.get_run(later)
        turnstile.close()  # a second close is a no-op
        return done, [cancelled]

    done, cancelled = await asyncio.to_thread(use)
    assert done == ["succeeded"] * 4
    assert cancelled == ["cancelled"]


def test_a_blocking_client_dropped_without_close_stops_its_thread() -> None:
    def loop_threads() -> int:
        return sum(thread.name == "turnstile-client" for thread in threading.enumerate())

    before = loop_threads()
    client = Turnstile("http://127.0.0.1:8000", "key")
    assert loop_threads() == before + 1
    del client
    gc.collect()
    assert loop_threads() == before


def test_retry_decisions_and_retry_after() -> None:
    def answer(status: int, body: object = None, **headers: str) -> httpx.Response:
        return httpx.Response(status, json=body, headers=headers)

    assert retryable_answer(answer(503))
    assert retryable_answer(answer(429))
    assert retryable_answer(answer(409, {"type": "/problems/idempotency-key-in-flight"}))
    assert not retryable_answer(answer(409, {"type": "/problems/session-busy"}))
    assert not retryable_answer(answer(422, {"type": "/problems/invalid-request"}))
    assert retry_after_of(answer(429, **{"Retry-After": "5"})) == 5.0
    assert retry_after_of(answer(429, **{"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0
    assert retry_after_of(answer(429, **{"Retry-After": "soon"})) is None
    policy = RetryPolicy(attempts=3, base_delay=1, max_delay=4, max_retry_after=10)
    assert policy.delay(1, 30.0) == 10.0  # Retry-After honoured, up to the cap
    assert 2.0 <= policy.delay(5, None) <= 4.0


def test_the_client_imports_nothing_of_the_server() -> None:
    heavy = (
        "app", "fastapi", "starlette", "sqlalchemy", "asyncpg", "uvicorn", "pydantic", "alembic",
    )  # fmt: skip
    code = (
        "import sys, turnstile_client; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


async def test_the_readme_example_runs(api: Api) -> None:
    section = CLIENTS_GUIDE.read_text(encoding="utf-8").split("## The Python client", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8000" in example
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        example.replace("http://127.0.0.1:8000", api.base),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TURNSTILE_KEY": await api.key()},
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines[0].startswith("409 /problems/session-busy ")
    assert lines[1:3] == ["waiting_for_user Which account?", "succeeded transfer booked"]
    assert lines[-1].endswith(" run.succeeded 2")


async def test_the_readme_short_example_runs(api: Api) -> None:
    section = CLIENTS_GUIDE.read_text(encoding="utf-8").split("\n## Which client, where\n", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "from turnstile_client import" in example
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        example.replace("http://127.0.0.1:8000", api.base),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TURNSTILE_KEY": await api.key()},
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    assert out.decode().splitlines() == ["succeeded hello"]


async def test_deadlines_to_start_through_both_clients(
    database_url: str, engine: AsyncEngine
) -> None:
    # This process serves async runs only: its turns wait, and the expirer ends them.
    async with running_api(
        database_url, engine, workers=True, slots="async:1", partial_layout=True
    ) as api:
        key = await api.key()
        async with AsyncTurnstile(api.base, key) as turnstile:
            session = await turnstile.create_session()
            run = await turnstile.submit_turn(session, "hi", start_within=0.5)
            assert run.start_before is not None
            ended = await turnstile.wait(run, timeout=30)
            assert (ended.status, ended.attempts, ended.started_at) == ("cancelled", 0, None)
            events = [event async for event in turnstile.events(run)]
            assert events[-1].data == {"by": "expirer", "reason": "expired"}
            # The session is free: its next turn is a new run.
            again = await turnstile.submit_turn(session, "again")
            assert (again.id != run.id, again.status) == (True, "queued")
            with pytest.raises(InvalidRequestError):
                await turnstile.submit_run({}, start_before="2020-01-01T00:00:00Z")
            with pytest.raises(ValueError, match="not both"):
                await turnstile.submit_run({}, start_within=1, start_before=datetime.now(UTC))

        def blocking() -> tuple[datetime | None, datetime | None]:
            with Turnstile(api.base, key) as client:
                later = datetime.now(UTC) + timedelta(hours=1)
                run = client.submit_run({}, scheduled_for=later, start_within=60)
                return run.scheduled_for, run.start_before

        scheduled_for, start_before = await asyncio.to_thread(blocking)
        assert scheduled_for is not None
        assert start_before == scheduled_for + timedelta(seconds=60)


async def test_multitask_policies_through_the_client(api: Api) -> None:
    """`multitask=` on sessions and turns, pending turns followed and withdrawn (issue 33)."""
    from turnstile_client import PendingTurn, Run, TooManyPendingTurnsError, TurnStartedError

    async with AsyncTurnstile(api.base, await api.key()) as turnstile:
        session = await turnstile.create_session(multitask="enqueue")
        assert session.multitask == "enqueue"
        # Scheduled for later, so it stays queued and holds the session.
        first = await turnstile.submit_turn(
            session, {"text": "first"}, scheduled_for="2030-01-01T09:00:00+00:00"
        )
        assert isinstance(first, Run)
        pending = await turnstile.submit_turn(session, {"text": "second"})
        assert isinstance(pending, PendingTurn)
        assert (pending.position, pending.active_run_id) == (1, first.id)
        withdrawn = await turnstile.cancel_pending_turn(pending)
        assert withdrawn.status == "cancelled"
        assert (await turnstile.get_pending_turn((session, pending.id))).status == "cancelled"
        kept = await turnstile.submit_turn(session, {"text": "third"}, start_within=600)
        assert isinstance(kept, PendingTurn)
        assert kept.start_before is not None  # the deadline the run it becomes takes
        assert (await turnstile.get_session(session)).pending_turns == 1
        assert [turn.id for turn in await turnstile.list_pending_turns(session)] == [kept.id]

        # The turn's own policy overrides the session's: a queued run is interrupted at once.
        interrupting = await turnstile.submit_turn(session, {"text": "now"}, multitask="interrupt")
        assert isinstance(interrupting, Run)
        assert (await turnstile.get_run(first)).status == "cancelled"
        done = await turnstile.wait(interrupting, timeout=30)
        assert done.status == "succeeded"
        # The enqueued turn followed the interrupting one.
        started = await turnstile.get_pending_turn(kept)
        assert started.status == "started"
        assert started.run_id is not None
        assert (await turnstile.wait(started.run_id, timeout=30)).status == "succeeded"
        with pytest.raises(TurnStartedError) as late:
            await turnstile.cancel_pending_turn(kept)
        assert late.value.status == 409

        changed = await turnstile.set_multitask(session, "reject")
        assert changed.multitask == "reject"
        assert TooManyPendingTurnsError.slug == "too-many-pending-turns"

    key = await api.key()

    def blocking_calls() -> None:
        # In a thread: the server under test answers on this test's event loop.
        with Turnstile(api.base, key) as blocking:
            other = blocking.create_session(multitask="enqueue")
            blocking.submit_turn(other, {"t": 1}, scheduled_for="2030-01-01T09:00:00+00:00")
            queued = blocking.submit_turn(other, {"t": 2})
            assert isinstance(queued, PendingTurn)
            assert [turn.id for turn in blocking.list_pending_turns(other)] == [queued.id]
            assert blocking.cancel_pending_turn(queued).status == "cancelled"
            assert blocking.list_pending_turns(other) == []
            assert blocking.set_multitask(other, "steer").multitask == "steer"

    await asyncio.to_thread(blocking_calls)
