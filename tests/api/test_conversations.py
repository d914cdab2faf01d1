"""Sessions as conversations: the transcript (`GET /sessions/{id}/messages`) derived from run
inputs and events, its pages and its visibility; what failed, cancelled and uncertain runs
leave in it; the history the scripted agent is given; a run recovered after its worker process
was killed seeing the same history; and session retention, which deletes idle sessions whole
and keeps active conversations whole."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.maintenance.pruners import RunRetention, SessionRetention
from app.queue.core import Queue
from app.queue.reads import Reads
from app.queue.submit import RunSpec, Submissions, Submitter
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, SimulatedCrash, default_registry
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.api import Api, running_api
from tests.support.clock import ManualClock
from tests.support.processes import turnstile
from tests.support.runtime import current, execute_once, recover
from tests.support.servers import running_server
from tests.support.waiting import eventually

DAY = 86_400.0


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine, clock: ManualClock) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, clock=clock) as running:
        yield running


def runtime(crash: Any = None) -> RuntimeExecutor:
    return RuntimeExecutor(
        default_registry(["127.0.0.1"], http_timeout_seconds=5),
        RuntimeLimits(retry_backoff_seconds=0.01),
        crash_hook=crash,
    )


async def new_session(client: httpx.AsyncClient) -> str:
    response = await client.post("/sessions")
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def turn(client: httpx.AsyncClient, session: str, body: Any) -> dict[str, Any]:
    response = await client.post(f"/sessions/{session}/turns", json={"input": body})
    assert response.status_code == 202, response.text
    document: dict[str, Any] = response.json()
    return document


async def messages(client: httpx.AsyncClient, session: str, **params: Any) -> list[dict[str, Any]]:
    """Every entry, page after page."""
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        query = {**params, **({"cursor": cursor} if cursor else {})}
        response = await client.get(f"/sessions/{session}/messages", params=query)
        assert response.status_code == 200, response.text
        page = response.json()
        items.extend(page["items"])
        cursor = page["next"]
        if cursor is None:
            return items


def shape(items: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    return [(item["run_no"], item["role"], item["kind"]) for item in items]


async def test_the_transcript_lists_turns_tool_calls_questions_and_finals(api: Api) -> None:
    client = await api.client()
    session = await new_session(client)
    first = await turn(
        client,
        session,
        {
            "script": [
                {"call": "echo", "args": {"x": 1}},
                {"ask": "Which account?"},
                {"final": "done"},
            ]
        },
    )
    assert first["session_run_no"] == 1
    assert await execute_once(api.queue, runtime())
    await turn(client, session, "savings")  # the answer, delivered to the same run
    assert await execute_once(api.queue, runtime())
    second = await turn(client, session, {"text": "and again", "echo_history": True})
    assert second["session_run_no"] == 2
    assert await execute_once(api.queue, runtime())

    items = await messages(client, session)
    assert shape(items) == [
        (1, "user", "input"),
        (1, "tool", "tool_call"),
        (1, "assistant", "question"),
        (1, "user", "answer"),
        (1, "assistant", "final"),
        (2, "user", "input"),
        (2, "assistant", "final"),
    ]
    assert items[1]["tool"] == {
        "name": "echo",
        "step": 1,
        "args": {"x": 1},
        "status": "succeeded",
        "idempotency_class": "safe",
    }
    assert items[1]["content"] == {"echo": {"x": 1}}
    assert items[2]["content"] == "Which account?"
    assert items[3]["content"] == "savings"
    assert items[4]["content"] == "done"
    assert {item["run_id"] for item in items[:5]} == {first["id"]}
    # Oldest first within a run, by the sequence of the event each entry comes from.
    assert [item["seq"] for item in items[:5]] == sorted(item["seq"] for item in items[:5])

    # The scripted agent shows the history it was given: run 1's transcript, nothing of run 2.
    done = await current(api.queue, second["id"])
    assert done.result["history"] == [
        {"run_no": 1, "role": item["role"], "kind": item["kind"], "content": item["content"]}
        for item in items[:5]
    ]

    # Pages of two give the same entries, in the same order.
    assert await messages(client, session, limit=2) == items
    broken = await client.get(f"/sessions/{session}/messages", params={"cursor": "bm9wZQ"})
    assert broken.status_code == 422
    assert broken.headers["content-type"].startswith("application/problem+json")
    assert broken.json()["type"] == "/problems/invalid-request"


async def test_another_tenants_or_principals_transcript_is_not_found(api: Api) -> None:
    alice = await api.client("acme", "alice")
    session = await new_session(alice)
    await turn(alice, session, "hello")
    bob = await api.client("acme", "bob")
    mallory = await api.client("evil", "alice", "operator")
    for stranger in (bob, mallory):
        response = await stranger.get(f"/sessions/{session}/messages")
        assert response.status_code == 404, response.text
        assert response.json()["type"] == "/problems/not-found"
    operator = await api.client("acme", "ops", "operator")
    response = await operator.get(f"/sessions/{session}/messages")
    assert response.status_code == 200
    assert shape(response.json()["items"]) == [(1, "user", "input")]


async def test_failed_and_cancelled_runs_keep_the_users_turn_and_record_their_end(
    api: Api,
) -> None:
    client = await api.client()
    session = await new_session(client)
    failed = await turn(client, session, {"script": [{"call": "no_such_tool"}]})
    assert await execute_once(api.queue, runtime())
    assert (await current(api.queue, failed["id"])).status == "failed"
    cancelled = await turn(client, session, "never mind")
    response = await client.post(f"/runs/{cancelled['id']}/cancel")
    assert response.status_code == 200, response.text
    await turn(client, session, "still there?")

    items = await messages(client, session)
    assert shape(items) == [
        (1, "user", "input"),
        (1, "system", "failed"),
        (2, "user", "input"),
        (2, "system", "cancelled"),
        (3, "user", "input"),
    ]
    assert items[1]["content"]["status"] == "failed"
    assert items[1]["content"]["failure"]["kind"] == "unknown_tool"
    assert items[3]["content"]["status"] == "cancelled"
    assert items[4]["content"] == "still there?"


async def test_an_uncertain_tool_call_is_in_the_transcript_as_such(
    queue: Queue, clock: ManualClock
) -> None:
    calls: list[str] = []
    shop = FastAPI()

    @shop.post("/pay")
    async def pay(request: Request) -> dict[str, bool]:
        calls.append(request.url.path)
        return {"paid": True}

    async with running_server(shop) as base:
        reads = Reads(queue)
        session = await reads.create_session(tenant_id="t", principal="p")
        run = await queue.enqueue(
            NewRun(
                tenant_id="t",
                principal="p",
                agent="scripted",
                session_id=session.id,
                input={
                    "script": [
                        {"call": "http_request", "args": {"method": "POST", "url": f"{base}/pay"}},
                        {"final": "sent"},
                    ]
                },
            )
        )

        def crash(at: str, step: int) -> None:
            if at == "after_tool":
                raise SimulatedCrash(at)

        assert await execute_once(queue, runtime(crash)) is False
        await recover(queue, clock)
        assert await execute_once(queue, runtime())
    assert calls == ["/pay"]  # never repeated
    assert (await current(queue, run.id)).status == "succeeded"
    page = await reads.session_transcript_page(session.id, cursor=None, limit=50)
    tool = [entry for entry in page.entries if entry.role == "tool"]
    assert len(tool) == 1
    assert tool[0].tool["status"] == "uncertain"
    assert tool[0].tool["args"] == {"method": "POST", "url": f"{base}/pay"}
    assert "unknown" in tool[0].content["message"]


# --- retention -----------------------------------------------------------------------------------
def submissions(queue: Queue) -> Submissions:
    return Submissions(
        queue,
        default_agent="scripted",
        idempotency_ttl_seconds=3600,
        idempotency_wait_seconds=2,
        lock_timeout_ms=5000,
    )


async def count(queue: Queue, sql: str, **params: Any) -> int:
    async with queue.engine.connect() as conn:
        return int((await conn.execute(text(sql), params)).scalar_one())


async def test_retention_deletes_idle_sessions_whole_and_keeps_active_conversations_whole(
    queue: Queue, clock: ManualClock
) -> None:
    reads, submit = Reads(queue), submissions(queue)
    alice = Submitter(tenant_id="t", principal="alice")

    async def conversation(turns: int) -> Any:
        session = await reads.create_session(tenant_id="t", principal="alice")
        for n in range(turns):
            await submit.submit_turn(alice, session.id, RunSpec(input=f"turn {n}"))
            assert await execute_once(queue, runtime())
        return session.id

    idle = await conversation(2)
    lively = await conversation(2)
    waiting = await reads.create_session(tenant_id="t", principal="alice")
    await submit.submit_turn(alice, waiting.id, RunSpec(input={"script": [{"ask": "Which one?"}]}))
    assert await execute_once(queue, runtime())
    dead_letter = await reads.create_session(tenant_id="t", principal="alice")
    await submit.submit_turn(
        alice, dead_letter.id, RunSpec(input={"script": [{"call": "no_such_tool"}]})
    )
    assert await execute_once(queue, runtime())
    sessionless = await queue.enqueue(
        NewRun(tenant_id="t", principal="p", agent="scripted", input="batch")
    )
    assert await execute_once(queue, runtime())

    # Past the runs' retention (7 days), within the sessions' (30 days): the sessionless run
    # goes; every run of a session stays, the middle of a conversation included.
    clock.advance(8 * DAY)
    await submit.submit_turn(alice, lively, RunSpec(input="back again"))
    assert await execute_once(queue, runtime())
    runs = RunRetention(queue, holder="a", interval=1, retention_seconds=7 * DAY)
    sessions = SessionRetention(queue, holder="a", interval=1, retention_seconds=30 * DAY)
    assert (await runs.run_once()).deleted == 1
    assert (await sessions.run_once()).sessions == 0
    assert await count(queue, "SELECT count(*) FROM runs WHERE id = :id", id=sessionless.id) == 0
    assert await count(queue, "SELECT count(*) FROM runs WHERE session_id IS NOT NULL") == 7

    # Past the sessions' retention for `idle` only: it goes whole, with everything its runs own;
    # the others stay whole (a turn 22 days ago, a question still open, an undismissed failure).
    clock.advance(23 * DAY)
    pruned = await sessions.run_once()
    assert (pruned.sessions, pruned.runs) == (1, 2)
    assert await count(queue, "SELECT count(*) FROM sessions WHERE id = :id", id=idle) == 0
    assert await count(queue, "SELECT count(*) FROM runs WHERE session_id = :id", id=idle) == 0
    assert (
        await count(
            queue,
            "SELECT count(*) FROM run_events e WHERE NOT EXISTS "
            "(SELECT 1 FROM runs r WHERE r.id = e.run_id)",
        )
        == 0
    )
    assert await count(queue, "SELECT count(*) FROM runs WHERE session_id = :id", id=lively) == 3
    lively_page = await reads.session_transcript_page(lively, cursor=None, limit=50)
    assert [e.content for e in lively_page.entries if e.kind == "input"] == [
        "turn 0",
        "turn 1",
        "back again",
    ]
    assert await count(queue, "SELECT count(*) FROM sessions") == 3

    # Dismissed, the failure no longer holds its session; a cancelled question lets it go too.
    async with queue.engine.begin() as conn:
        await conn.execute(
            text("UPDATE runs SET dismissed_at = :now WHERE session_id = :id"),
            {"now": clock.now, "id": dead_letter.id},
        )
    await queue.cancel(await waiting_run_of(queue, waiting.id), actor="op")
    clock.advance(31 * DAY)
    assert (await sessions.run_once()).sessions == 3
    assert await count(queue, "SELECT count(*) FROM runs") == 0


async def waiting_run_of(queue: Queue, session_id: Any) -> Any:
    async with queue.engine.connect() as conn:
        return (
            await conn.execute(
                text("SELECT id FROM runs WHERE session_id = :id AND status = 'waiting_for_user'"),
                {"id": session_id},
            )
        ).scalar_one()


async def test_a_turn_moves_the_sessions_last_activity(queue: Queue, clock: ManualClock) -> None:
    reads, submit = Reads(queue), submissions(queue)
    session = await reads.create_session(tenant_id="t", principal="alice")
    clock.advance(29 * DAY)
    await submit.submit_turn(Submitter("t", "alice"), session.id, RunSpec(input="hi"))
    await queue.cancel((await submit.queue.claim("w", list(PriorityClass)))[0].run.id, actor="op")
    clock.advance(2 * DAY)  # 31 days after creation, 2 after the turn
    sessions = SessionRetention(queue, holder="a", interval=1, retention_seconds=30 * DAY)
    assert (await sessions.run_once()).sessions == 0
    clock.advance(29 * DAY)
    assert (await sessions.run_once()).sessions == 1


# --- memory survives a killed worker -------------------------------------------------------------
async def test_a_run_recovered_after_its_worker_is_killed_sees_the_same_history(
    database_url: str, engine: AsyncEngine
) -> None:
    """Real worker processes, the `openai` agent against a fake endpoint on loopback: turn 2's
    worker is killed (SIGKILL) inside a tool call; another worker recovers the run, and its
    request to the model carries the same history as the first worker's."""
    requests: list[list[dict[str, Any]]] = []
    hits: list[int] = []
    hold = asyncio.Event()  # never set: the first tool call hangs until its worker dies
    fake = FastAPI()

    def say(content: str) -> dict[str, Any]:
        return {"choices": [{"message": {"role": "assistant", "content": content}}]}

    @fake.post("/v1/chat/completions")
    async def complete(request: Request) -> dict[str, Any]:
        sent: list[dict[str, Any]] = (await request.json())["messages"]
        requests.append(sent)
        last = sent[-1]
        if last["role"] == "tool":
            return say("Your name is Bob.")
        if last["content"] == "what is my name?":
            call = {"method": "GET", "url": f"{base}/lookup"}
            return {
                "choices": [
                    {
                        "message": {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "lookup-1",
                                    "type": "function",
                                    "function": {
                                        "name": "http_request",
                                        "arguments": json.dumps(call),
                                    },
                                }
                            ],
                        }
                    }
                ]
            }
        return say("Hello Bob")

    @fake.get("/lookup")
    async def lookup() -> dict[str, bool]:
        hits.append(len(hits) + 1)
        if len(hits) == 1:
            await hold.wait()
        return {"found": True}

    async with running_server(fake) as base:
        env = {
            "DATABASE_URL": database_url,
            "TURNSTILE_OPENAI_BASE_URL": f"{base}/v1",
            "TURNSTILE_HTTP_ALLOWED_HOSTS": "127.0.0.1",
            "TURNSTILE_LEASE_SECONDS": "3",
            "TURNSTILE_HEARTBEAT_SECONDS": "1",
            "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0",
            "TURNSTILE_RETRY_BACKOFF_MAX_SECONDS": "0",
            "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_DRAIN_GRACE_SECONDS": "0",
        }
        queue = Queue(engine)
        reads, submit = Reads(queue), submissions(queue)
        alice = Submitter(tenant_id="t", principal="alice")
        session = await reads.create_session(tenant_id="t", principal="alice")

        async def finished(run_id: Any) -> bool:
            return (await current(queue, run_id)).status == "succeeded"

        async def in_the_tool_call() -> bool:
            return bool(hits)

        async with turnstile("worker", ready=b"running slots", env=env) as first:
            one = await submit.submit_turn(
                alice, session.id, RunSpec(input={"text": "my name is Bob"}, agent="openai")
            )
            await eventually(lambda: finished(one.run_id), within=30, what="turn 1")
            two = await submit.submit_turn(
                alice, session.id, RunSpec(input={"text": "what is my name?"}, agent="openai")
            )
            await eventually(in_the_tool_call, within=30, what="turn 2's tool call")
            first.process.kill()  # SIGKILL: no drain, no release, the lease just lapses
            await first.process.wait()
        async with turnstile("worker", ready=b"running slots", env=env):
            await eventually(lambda: finished(two.run_id), within=60, what="recovery")
        hold.set()

    done = await current(queue, two.run_id)
    assert done.result["final"] == "Your name is Bob."
    claims = [e.epoch for e in await queue.events(two.run_id) if e.type == "run.claimed"]
    assert claims == [1, 2]
    assert len(hits) == 2  # the safe GET ran again on recovery
    history = [
        {"role": "user", "content": "my name is Bob"},
        {"role": "assistant", "content": "Hello Bob"},
        {"role": "user", "content": "what is my name?"},
    ]
    # Turn 1's request, then turn 2's from the killed worker, then from the one that recovered.
    assert requests[0] == [{"role": "user", "content": "my name is Bob"}]
    assert requests[1] == history
    assert requests[-1][:3] == history
    assert [m["role"] for m in requests[-1][3:]] == ["assistant", "tool"]
