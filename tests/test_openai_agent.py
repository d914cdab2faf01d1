"""The `openai` agent against a fake chat-completions server on loopback (no network model):
a conversation with tool calls and a final answer, an `uncertain` outcome as the model sees it,
transient failures (503, 429 with Retry-After), a 400 failing the run, questions to the user,
and a crash between the model's tool call and the tool's outcome, recovered by class."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.queue.core import Queue
from app.queue.models import NewRun
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, SimulatedCrash, default_registry
from app.runtime.openai_agent import OpenAIAgent
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs
from tests.support.runtime import current, execute_once, recover
from tests.support.servers import running_server

API_KEY = "sk-test-secret-never-logged"


@dataclass
class FakeModel:
    """Answers each chat completion with the next scripted reply; records every request."""

    replies: list[tuple[int, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> JSONResponse:
            self.requests.append(await request.json())
            self.times.append(time.monotonic())
            self.auth.append(request.headers.get("authorization"))
            status, body, headers = self.replies.pop(0)
            return JSONResponse(body, status_code=status, headers=headers)

        return app

    def say(self, content: str, usage: int = 5) -> None:
        self.replies.append(
            (
                200,
                {
                    "choices": [{"message": {"role": "assistant", "content": content}}],
                    "usage": {
                        "prompt_tokens": usage,
                        "completion_tokens": 1,
                        "total_tokens": usage + 1,
                    },
                },
                {},
            )
        )

    def call(self, *calls: tuple[str, str, dict[str, Any]], usage: int = 10) -> None:
        self.replies.append(
            (
                200,
                {
                    "choices": [
                        {
                            "message": {
                                "role": "assistant",
                                "content": None,
                                "tool_calls": [
                                    {
                                        "id": call_id,
                                        "type": "function",
                                        "function": {"name": name, "arguments": json.dumps(args)},
                                    }
                                    for call_id, name, args in calls
                                ],
                            }
                        }
                    ],
                    "usage": {
                        "prompt_tokens": usage,
                        "completion_tokens": 2,
                        "total_tokens": usage + 2,
                    },
                },
                {},
            )
        )

    def fail(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        self.replies.append((status, body, headers or {}))


@pytest.fixture
async def model() -> AsyncIterator[tuple[FakeModel, str]]:
    fake = FakeModel()
    async with running_server(fake.app()) as base:
        yield fake, base


@pytest.fixture
async def effects() -> AsyncIterator[tuple[list[str], str]]:
    seen: list[str] = []
    app = FastAPI()

    @app.post("/pay")
    async def pay(request: Request) -> dict[str, Any]:
        seen.append(request.headers.get("idempotency-key") or "")
        return {"paid": True}

    async with running_server(app) as base:
        yield seen, base


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def executor(base: str, client: httpx.AsyncClient, crash: Any = None) -> RuntimeExecutor:
    registry = default_registry(["127.0.0.1"], http_timeout_seconds=5)
    registry.agents["openai"] = OpenAIAgent(
        base_url=f"{base}/v1",
        model="test-model",
        api_key=API_KEY,
        tools=lambda: registry.tools,
        backoff_seconds=0.01,
        client=client,
    )
    return RuntimeExecutor(registry, RuntimeLimits(retry_backoff_seconds=0.01), crash_hook=crash)


def turn(text: str = "What is 2+2?") -> NewRun:
    return NewRun(tenant_id="t", principal="p", agent="openai", input={"text": text})


async def test_a_conversation_with_tool_calls_and_a_final_answer(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.call(("c1", "echo", {"a": 1}), ("c2", "echo", {"b": 2}))  # two calls in one response
    fake.call(("c3", "sleep", {"seconds": 0}))
    fake.say("4")
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    done = await current(queue, run.id)
    assert done.status == "succeeded", done.failure
    assert done.result["final"] == "4"
    assert done.result["usage"] == {"prompt_tokens": 25, "completion_tokens": 5, "total_tokens": 30}
    assert [t["tool"] for t in done.result["tool_outcomes"]] == ["echo", "echo", "sleep"]
    first, second, third = fake.requests
    assert first["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert {t["function"]["name"] for t in first["tools"]} == {
        "echo",
        "sleep",
        "http_request",
        "ask_user",
    }
    tool_messages = [m for m in second["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["c1", "c2"]
    assert json.loads(tool_messages[0]["content"]) == {
        "status": "succeeded",
        "result": {"echo": {"a": 1}},
    }
    assert [m["role"] for m in third["messages"]] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
    ]
    assert fake.auth == [f"Bearer {API_KEY}"] * 3


async def test_an_unsafe_call_lost_in_a_crash_reaches_the_model_as_unknown(
    queue: Queue,
    http: httpx.AsyncClient,
    clock: ManualClock,
    model: tuple[FakeModel, str],
    effects: tuple[list[str], str],
) -> None:
    fake, base = model
    paid, shop = effects
    fake.call(("pay-1", "http_request", {"method": "POST", "url": f"{shop}/pay"}))
    fake.say("I could not confirm the payment.")
    run = await queue.enqueue(turn("Pay the invoice"))

    def crash(at: str, step: int) -> None:
        if at == "after_tool":
            raise SimulatedCrash(at)

    assert await execute_once(queue, executor(base, http, crash)) is False
    await recover(queue, clock)
    assert await execute_once(queue, executor(base, http))
    done = await current(queue, run.id)
    assert done.status == "succeeded"
    assert len(paid) == 1  # never repeated
    assert done.result["tool_outcomes"][0]["status"] == "uncertain"
    told = [m for m in fake.requests[-1]["messages"] if m["role"] == "tool"]
    assert len(told) == 1
    content = json.loads(told[0]["content"])
    assert content["status"] == "unknown"
    assert "unknown" in content["message"]
    assert "fail" not in content["message"].lower()
    await check_all_runs(queue.engine)


async def test_a_keyed_call_lost_in_a_crash_is_repeated_with_the_same_key(
    queue: Queue,
    http: httpx.AsyncClient,
    clock: ManualClock,
    model: tuple[FakeModel, str],
    effects: tuple[list[str], str],
) -> None:
    fake, base = model
    paid, shop = effects
    fake.call(
        ("pay-1", "http_request", {"method": "POST", "url": f"{shop}/pay", "idempotency_key": True})
    )
    fake.say("Paid.")
    run = await queue.enqueue(turn("Pay the invoice"))

    def crash(at: str, step: int) -> None:
        if at == "after_tool":
            raise SimulatedCrash(at)

    assert await execute_once(queue, executor(base, http, crash)) is False
    await recover(queue, clock)
    assert await execute_once(queue, executor(base, http))
    done = await current(queue, run.id)
    assert done.result["tool_outcomes"][0]["status"] == "succeeded"
    assert paid == [f"turnstile-{run.id}-step-1"] * 2


async def test_503_then_success(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.fail(503, {"error": "overloaded"})
    fake.say("fine")
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    assert (await current(queue, run.id)).result["final"] == "fine"
    assert len(fake.requests) == 2


async def test_429_honours_retry_after(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.fail(429, {"error": "slow down"}, {"Retry-After": "1"})
    fake.say("fine")
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    assert (await current(queue, run.id)).status == "succeeded"
    assert fake.times[1] - fake.times[0] >= 0.95  # waited at least what the endpoint asked


async def test_transient_failures_that_persist_release_the_run(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    for _ in range(4):
        fake.fail(502, {"error": "bad gateway"})
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    released = await current(queue, run.id)
    assert (released.status, released.attempts) == ("queued", 1)
    assert (await queue.events(run.id))[-1].type == "run.released"


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        ((400, {"error": {"message": "model 'x' does not exist"}}, {}), "does not exist"),
        ((200, {"unexpected": True}, {}), "no choices"),
        (
            (
                200,
                {
                    "choices": [
                        {
                            "message": {
                                "tool_calls": [
                                    {"id": "z", "function": {"name": "rm_rf", "arguments": "{}"}}
                                ]
                            }
                        }
                    ]
                },
                {},
            ),
            "unknown tool 'rm_rf'",
        ),
    ],
)
async def test_permanent_failures_fail_the_run_with_what_the_endpoint_said(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str], reply: Any, says: str
) -> None:
    fake, base = model
    fake.replies.append(reply)
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    failed = await current(queue, run.id)
    assert (failed.status, failed.failure["kind"]) == ("failed", "agent_error")
    assert says in failed.failure["message"]
    assert API_KEY not in json.dumps(failed.failure)
    assert all(API_KEY not in json.dumps(e.data) for e in await queue.events(run.id))


async def test_asking_the_user_is_a_tool(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.call(("q1", "ask_user", {"question": "Which currency?"}))
    fake.say("Converted to EUR.")
    run = await queue.enqueue(turn("Convert 10 USD"))
    assert await execute_once(queue, executor(base, http))
    waiting = await current(queue, run.id)
    assert (waiting.status, waiting.question) == ("waiting_for_user", "Which currency?")
    await queue.deliver_input(run.id, "EUR", principal="p")
    assert await execute_once(queue, executor(base, http))
    done = await current(queue, run.id)
    assert done.result["final"] == "Converted to EUR."
    assert done.result["answers"] == ["EUR"]
    last = fake.requests[-1]["messages"]
    assert last[-1] == {"role": "tool", "tool_call_id": "q1", "content": "EUR"}


async def test_a_call_never_started_is_run_before_the_model_is_asked_again(
    queue: Queue, http: httpx.AsyncClient, clock: ManualClock, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.call(("a", "echo", {"x": "A"}), ("b", "echo", {"x": "B"}))
    fake.say("both done")
    run = await queue.enqueue(turn())

    def crash(at: str, step: int) -> None:
        if (at, step) == ("before_started", 2):
            raise SimulatedCrash(at)

    assert await execute_once(queue, executor(base, http, crash)) is False
    await recover(queue, clock)
    assert await execute_once(queue, executor(base, http))
    done = await current(queue, run.id)
    assert [t["outcome"] for t in done.result["tool_outcomes"]] == [
        {"echo": {"x": "A"}},
        {"echo": {"x": "B"}},
    ]
    assert len(fake.requests) == 2  # B ran from the stored turn, without asking the model
    told = {
        m["tool_call_id"]: json.loads(m["content"])
        for m in fake.requests[-1]["messages"]
        if m["role"] == "tool"
    }
    assert told == {
        "a": {"status": "succeeded", "result": {"echo": {"x": "A"}}},
        "b": {"status": "succeeded", "result": {"echo": {"x": "B"}}},
    }


@pytest.mark.parametrize(
    "reply",
    [
        (401, {"error": {"message": f"Incorrect API key provided: {API_KEY}.", "pad": "x" * 9000}}),
        (400, {"pad": "y" * 9000, "echo": API_KEY}),
        (200, {"echo": API_KEY, "pad": "z" * 9000}),
    ],
    ids=["401-echoing-the-key", "400-long", "200-without-choices"],
)
async def test_an_endpoints_error_body_is_capped_and_never_shows_the_key(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str], reply: Any
) -> None:
    """The failure is tenant-visible: what the endpoint said is cut to a short excerpt, and
    the configured API key is redacted from it wherever it appears."""
    fake, base = model
    fake.fail(*reply)
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    failed = await current(queue, run.id)
    assert (failed.status, failed.failure["kind"]) == ("failed", "agent_error")
    message = failed.failure["message"]
    assert API_KEY not in message
    assert len(message) <= 600, len(message)
    events = json.dumps([e.data for e in await queue.events(run.id)])
    assert API_KEY not in events


async def test_a_transient_failure_message_never_shows_the_key(
    queue: Queue, http: httpx.AsyncClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    for _ in range(4):
        fake.fail(503, {"error": f"upstream rejected {API_KEY}"})
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    events = json.dumps([e.data for e in await queue.events(run.id)])
    assert "upstream rejected" in events
    assert API_KEY not in events
