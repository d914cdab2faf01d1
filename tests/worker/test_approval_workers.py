"""Approval before a tool call against real `turnstile worker` processes (issue 33 item 2;
docs/approvals.md): a call that needs approval waits with its typed request; approved, edited
or rejected it resumes the same run; the answer replays under its Idempotency-Key; two
approvals of one call race and exactly one wins; a worker SIGKILLed after the approval (before
the call, or while an unsafe or a safe call runs) neither loses the approval nor repeats the
unsafe call; and after a rejection the `openai` agent's next request pairs the tool call with
a tool message saying the user refused it, and why."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from app.vocabulary.records import Run
from tests.support.api import Api, running_api
from tests.support.invariants import check_all_runs
from tests.support.processes import Child, turnstile
from tests.support.servers import running_server
from tests.support.waiting import eventually

UNSAFE = {"classes": ["unsafe"]}


@dataclass
class Effects:
    """A loopback service whose every request is an effect, counted by path. A path under
    /hold/ is answered only once `release` is set: a call the test can kill a worker in."""

    hits: list[str] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def record(path: str) -> JSONResponse:
            self.hits.append("/" + path)
            if path.startswith("hold/"):
                await self.release.wait()
            return JSONResponse({"ok": True, "n": len(self.hits)})

        return app


@dataclass
class FakeModel:
    """An OpenAI-compatible chat endpoint answering from a list, keeping every request."""

    replies: list[dict[str, Any]]
    requests: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> JSONResponse:
            self.requests.append(json.loads(await request.body()))
            message = self.replies[min(len(self.requests), len(self.replies)) - 1]
            return JSONResponse(
                {
                    "id": f"reply-{len(self.requests)}",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )

        return app


def worker_env(database_url: str, effects: str, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": database_url,
        "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
        "TURNSTILE_DRAIN_GRACE_SECONDS": "0",
        "TURNSTILE_HTTP_ALLOWED_HOSTS": effects.removeprefix("http://"),
        "TURNSTILE_LEASE_SECONDS": "2",
        "TURNSTILE_HEARTBEAT_SECONDS": "0.5",
        "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.3",
        "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0.1",
        **extra,
    }


def worker(env: dict[str, str]) -> AbstractAsyncContextManager[Child]:
    return turnstile("worker", ready=b"running slots", env=env)


@pytest.fixture
async def effects() -> AsyncIterator[tuple[Effects, str]]:
    service = Effects()
    async with running_server(service.app()) as base:
        try:
            yield service, base
        finally:
            service.release.set()


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine) as running:
        yield running


async def new_session(client: httpx.AsyncClient, approval: dict[str, Any] | None) -> str:
    response = await client.post(
        "/sessions", json={} if approval is None else {"approval": approval}
    )
    assert response.status_code == 201, response.text
    assert response.json()["approval"] == (
        None if approval is None else {"tools": [], "classes": [], **approval}
    )
    return str(response.json()["id"])


async def turn(
    client: httpx.AsyncClient, session: str, body: dict[str, Any], *, key: str | None = None
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return await client.post(f"/sessions/{session}/turns", json=body, headers=headers)


async def run_of(api: Api, run_id: str | UUID) -> Run:
    run = await api.queue.get_run(UUID(str(run_id)))
    assert run is not None
    return run


async def waiting_for_approval(api: Api, run_id: str) -> dict[str, Any] | None:
    request = (await run_of(api, run_id)).approval_request
    return request if isinstance(request, dict) else None


async def ended(api: Api, run_id: str | UUID) -> Run | None:
    run = await run_of(api, run_id)
    return run if run.status in ("succeeded", "failed", "cancelled") else None


async def event_types(api: Api, run_id: str | UUID) -> list[str]:
    return [e.type for e in await api.queue.events(UUID(str(run_id)))]


def post_effect(base: str, path: str) -> dict[str, Any]:
    """An unsafe call: a POST with no idempotency key."""
    return {"call": "http_request", "args": {"method": "POST", "url": f"{base}{path}", "json": {}}}


async def test_an_approved_call_runs_once_and_the_answer_replays(
    api: Api, database_url: str, effects: tuple[Effects, str]
) -> None:
    service, base = effects
    client = await api.client()
    session = await new_session(client, UNSAFE)
    script = [
        {"call": "echo", "args": {"n": 1}},  # safe: not asked for
        post_effect(base, "/effect/pay"),
        {"final": "paid"},
    ]
    async with worker(worker_env(database_url, base)):
        accepted = await turn(client, session, {"input": {"script": script}})
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["id"]
        request = await eventually(
            lambda: waiting_for_approval(api, run_id), within=30, what="the approval request"
        )
        assert request["call_id"] == f"{run_id}.2"
        assert request["tool"] == "http_request"
        assert request["idempotency_class"] == "unsafe"
        assert request["step"] == 2
        assert request["arguments"]["url"] == f"{base}/effect/pay"
        assert request["parameters"]["type"] == "object"
        assert service.hits == []  # nothing of the call happened

        # Visible in the run, the session, and the events (run.waiting carries it too).
        doc = (await client.get(f"/runs/{run_id}")).json()
        assert doc["status"] == "waiting_for_user"
        assert doc["approval_request"] == request
        session_doc = (await client.get(f"/sessions/{session}")).json()
        assert session_doc["approval_request"] == request
        events = await api.queue.events(UUID(run_id))
        asked = [e for e in events if e.type == "tool.approval_requested"]
        assert [e.data["call_id"] for e in asked] == [request["call_id"]]
        assert events[-1].type == "run.waiting"
        assert events[-1].data["approval_request"] == request

        # Only an approval naming the call answers it; nothing is written otherwise.
        before = (await run_of(api, run_id)).last_event_seq
        other = await turn(client, session, {"input": "go on"})
        assert other.status_code == 409
        assert other.headers["content-type"].startswith("application/problem+json")
        assert other.json()["type"] == "/problems/approval-pending"
        assert other.json()["call_id"] == request["call_id"]
        assert other.json()["tool"] == "http_request"
        steer = await turn(client, session, {"input": "go on", "multitask": "steer"})
        assert steer.status_code == 409
        assert steer.json()["call_id"] == request["call_id"]
        wrong = await turn(
            client, session, {"approval": {"call_id": f"{run_id}.9", "decision": "approve"}}
        )
        assert wrong.status_code == 409
        assert wrong.json()["type"] == "/problems/approval-call-mismatch"
        assert wrong.json()["pending_call_id"] == request["call_id"]
        for bad in (
            {"approval": {"call_id": request["call_id"], "decision": "maybe"}},
            {"approval": {"call_id": request["call_id"], "decision": "edit"}},
            {"approval": {"call_id": request["call_id"], "decision": "approve", "args": {}}},
            {"approval": {"call_id": request["call_id"], "decision": "approve"}, "input": 1},
        ):
            refused = await turn(client, session, bad)
            assert refused.status_code == 422, bad
            assert refused.headers["content-type"].startswith("application/problem+json")
        assert (await run_of(api, run_id)).last_event_seq == before

        approve = {"approval": {"call_id": request["call_id"], "decision": "approve"}}
        first = await turn(client, session, approve, key="approve-1")
        assert first.status_code == 202, first.text
        assert first.json()["id"] == run_id
        done = await eventually(lambda: ended(api, run_id), within=30, what="the run")
        again = await turn(client, session, approve, key="approve-1")
        assert again.status_code == 202
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == first.json()
        # Without its key, a second approval finds nothing pending.
        late = await turn(client, session, approve)
        assert late.status_code == 409
        assert late.json()["type"] == "/problems/no-approval-pending"

    assert done.status == "succeeded"
    assert service.hits == ["/effect/pay"]
    types = await event_types(api, run_id)
    assert types.count("tool.approved") == 1
    assert types.count("tool.approval_requested") == 1
    assert types.index("tool.approved") < types.index("tool.started", types.index("tool.approved"))
    transcript = (await client.get(f"/sessions/{session}/messages")).json()["items"]
    kinds = [(item["role"], item["kind"]) for item in transcript]
    assert kinds == [
        ("user", "input"),
        ("tool", "tool_call"),
        ("assistant", "approval_request"),
        ("user", "approval"),
        ("tool", "tool_call"),
        ("assistant", "final"),
    ]
    assert await check_all_runs(api.engine) == 1


async def test_an_edited_call_runs_with_the_edited_arguments_checked_against_its_schema(
    api: Api, database_url: str, effects: tuple[Effects, str]
) -> None:
    _, base = effects
    client = await api.client()
    session = await new_session(client, None)  # the turn's own policy decides
    body = {
        "input": {"script": [{"call": "sleep", "args": {"seconds": 30}}, {"final": "slept"}]},
        "approval": {"tools": ["sleep"]},
    }
    async with worker(worker_env(database_url, base)):
        accepted = await turn(client, session, body)
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["id"]
        request = await eventually(
            lambda: waiting_for_approval(api, run_id), within=30, what="the approval request"
        )
        assert request["idempotency_class"] == "safe"
        before = (await run_of(api, run_id)).last_event_seq
        for args in ({"seconds": "soon"}, {"seconds": 90}, {"seconds": 1, "extra": True}, {}):
            edit = {"approval": {"call_id": request["call_id"], "decision": "edit", "args": args}}
            refused = await turn(client, session, edit)
            assert refused.status_code == 422, args
            assert refused.json()["type"] == "/problems/invalid-approval"
            assert refused.json()["errors"][0]["loc"][:3] == ["body", "approval", "args"]
        assert (await run_of(api, run_id)).last_event_seq == before  # nothing written
        edit = {
            "approval": {
                "call_id": request["call_id"],
                "decision": "edit",
                "args": {"seconds": 0.05},
                "reason": "not that long",
            }
        }
        assert (await turn(client, session, edit)).status_code == 202
        done = await eventually(lambda: ended(api, run_id), within=30, what="the run")
    assert done.status == "succeeded"
    assert isinstance(done.result, dict)
    assert done.result["tool_outcomes"] == [
        {"step": 1, "tool": "sleep", "status": "succeeded", "outcome": {"slept": 0.05}}
    ]
    events = await api.queue.events(done.id)
    approved = [e.data for e in events if e.type == "tool.approved"]
    assert approved[0]["edited"] is True
    assert approved[0]["args"] == {"seconds": 0.05}
    started = [e.data for e in events if e.type == "tool.started"]
    assert [s["args"] for s in started] == [{"seconds": 0.05}]


async def test_a_rejected_call_is_never_made_and_the_model_is_told_why(
    database_url: str, engine: AsyncEngine, effects: tuple[Effects, str]
) -> None:
    service, base = effects
    call = {
        "id": "call_pay",
        "type": "function",
        "function": {
            "name": "http_request",
            "arguments": json.dumps({"method": "POST", "url": f"{base}/effect/pay", "json": {}}),
        },
    }
    model = FakeModel(
        replies=[
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "assistant", "content": "Understood, I will not pay."},
        ]
    )
    async with (
        running_server(model.app()) as endpoint,
        running_api(database_url, engine, openai_base_url=f"{endpoint}/v1") as api,
    ):
        client = await api.client()
        session = await new_session(client, {"tools": ["http_request"]})
        env = worker_env(
            database_url,
            base,
            TURNSTILE_OPENAI_BASE_URL=f"{endpoint}/v1",
            TURNSTILE_OPENAI_STREAM="false",
        )
        async with worker(env):
            accepted = await turn(client, session, {"agent": "openai", "input": "pay the bill"})
            assert accepted.status_code == 202, accepted.text
            run_id = accepted.json()["id"]
            request = await eventually(
                lambda: waiting_for_approval(api, run_id), within=30, what="the approval request"
            )
            reject = {
                "approval": {
                    "call_id": request["call_id"],
                    "decision": "reject",
                    "reason": "not this month",
                }
            }
            assert (await turn(client, session, reject)).status_code == 202
            done = await eventually(lambda: ended(api, run_id), within=30, what="the run")
        assert done.status == "succeeded"
        assert service.hits == []  # never made
        assert len(model.requests) == 2
        messages = model.requests[1]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
        assert messages[1]["tool_calls"] == [call]
        assert messages[2]["tool_call_id"] == "call_pay"
        told = json.loads(messages[2]["content"])
        assert told["status"] == "rejected"
        assert told["result"]["reason"] == "not this month"
        assert "refused" in told["result"]["message"]
        types = await event_types(api, run_id)
        assert "tool.rejected" in types
        assert "tool.started" not in types
        finished = [e.data for e in await api.queue.events(done.id) if e.type == "tool.finished"]
        assert [f["outcome_status"] for f in finished] == ["rejected"]
        # The transcript keeps the refused call with its arguments, for the session's next runs.
        transcript = (await client.get(f"/sessions/{session}/messages")).json()["items"]
        calls = [item for item in transcript if item["kind"] == "tool_call"]
        assert calls[0]["tool"]["status"] == "rejected"
        assert calls[0]["tool"]["args"]["url"] == f"{base}/effect/pay"


async def test_two_approvals_of_one_call_race_and_exactly_one_wins(
    api: Api, database_url: str, effects: tuple[Effects, str]
) -> None:
    service, base = effects
    client = await api.client()
    session = await new_session(client, UNSAFE)
    script = [post_effect(base, "/effect/once"), {"final": "ok"}]
    async with worker(worker_env(database_url, base)):
        run_id = (await turn(client, session, {"input": {"script": script}})).json()["id"]
        request = await eventually(
            lambda: waiting_for_approval(api, run_id), within=30, what="the approval request"
        )
        approve = {"approval": {"call_id": request["call_id"], "decision": "approve"}}
        answers = await asyncio.gather(
            *(turn(client, session, approve, key=f"racer-{n}") for n in range(4))
        )
        codes = sorted(a.status_code for a in answers)
        assert codes == [202, 409, 409, 409], [a.text for a in answers]
        assert {a.json()["type"] for a in answers if a.status_code == 409} == {
            "/problems/no-approval-pending"
        }
        done = await eventually(lambda: ended(api, run_id), within=30, what="the run")
    assert done.status == "succeeded"
    assert service.hits == ["/effect/once"]
    assert (await event_types(api, run_id)).count("tool.approved") == 1


async def test_an_approval_given_while_no_worker_runs_is_not_lost(
    api: Api, database_url: str, effects: tuple[Effects, str]
) -> None:
    service, base = effects
    client = await api.client()
    session = await new_session(client, UNSAFE)
    script = [post_effect(base, "/effect/later"), {"final": "ok"}]
    env = worker_env(database_url, base)
    async with worker(env) as first:
        run_id = (await turn(client, session, {"input": {"script": script}})).json()["id"]
        request = await eventually(
            lambda: waiting_for_approval(api, run_id), within=30, what="the approval request"
        )
        first.process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(first.process.wait(), 30)
    approve = {"approval": {"call_id": request["call_id"], "decision": "approve"}}
    assert (await turn(client, session, approve)).status_code == 202
    async with worker(env):
        done = await eventually(lambda: ended(api, run_id), within=30, what="the run")
    assert done.status == "succeeded"
    assert service.hits == ["/effect/later"]
    assert (await event_types(api, run_id)).count("tool.approval_requested") == 1


async def test_a_worker_killed_while_an_approved_unsafe_call_runs_never_repeats_it(
    api: Api, database_url: str, effects: tuple[Effects, str]
) -> None:
    service, base = effects
    client = await api.client()
    session = await new_session(client, UNSAFE)
    script = [post_effect(base, "/hold/pay"), {"final": "ok"}]
    env = worker_env(database_url, base)
    async with worker(env) as first:
        run_id = (await turn(client, session, {"input": {"script": script}})).json()["id"]
        request = await eventually(
            lambda: waiting_for_approval(api, run_id), within=30, what="the approval request"
        )
        approve = {"approval": {"call_id": request["call_id"], "decision": "approve"}}
        assert (await turn(client, session, approve)).status_code == 202

        async def reached() -> bool:
            return service.hits == ["/hold/pay"]

        await eventually(reached, within=30, what="the call reaching the service")
        first.process.send_signal(signal.SIGKILL)  # while the call is in flight
        await asyncio.wait_for(first.process.wait(), 30)
    service.release.set()
    async with worker(env):
        done = await eventually(lambda: ended(api, run_id), within=60, what="the recovery")
    assert done.status == "succeeded"
    assert service.hits == ["/hold/pay"]  # not repeated
    assert isinstance(done.result, dict)
    assert [t["status"] for t in done.result["tool_outcomes"]] == ["uncertain"]
    types = await event_types(api, run_id)
    # The approval was kept: the recovered run asked nothing again.
    assert types.count("tool.approval_requested") == 1
    assert types.count("tool.approved") == 1


async def test_a_worker_killed_while_an_approved_safe_call_runs_repeats_it_without_asking(
    api: Api, database_url: str, effects: tuple[Effects, str]
) -> None:
    service, base = effects
    client = await api.client()
    session = await new_session(client, {"tools": ["http_request"]})
    get = {"call": "http_request", "args": {"method": "GET", "url": f"{base}/hold/read"}}
    env = worker_env(database_url, base)
    async with worker(env) as first:
        run_id = (
            await turn(client, session, {"input": {"script": [get, {"final": "ok"}]}})
        ).json()["id"]
        request = await eventually(
            lambda: waiting_for_approval(api, run_id), within=30, what="the approval request"
        )
        assert request["idempotency_class"] == "safe"
        approve = {"approval": {"call_id": request["call_id"], "decision": "approve"}}
        assert (await turn(client, session, approve)).status_code == 202

        async def reached() -> bool:
            return service.hits == ["/hold/read"]

        await eventually(reached, within=30, what="the call reaching the service")
        first.process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(first.process.wait(), 30)
    service.release.set()
    async with worker(env):
        done = await eventually(lambda: ended(api, run_id), within=60, what="the recovery")
    assert done.status == "succeeded"
    assert service.hits == ["/hold/read", "/hold/read"]  # safe: run again, as always
    assert isinstance(done.result, dict)
    assert [t["status"] for t in done.result["tool_outcomes"]] == ["succeeded"]
    assert (await event_types(api, run_id)).count("tool.approval_requested") == 1
