"""The `openai` agent against a fake chat-completions server on loopback (no network model):
a conversation with tool calls and a final answer, an `uncertain` outcome as the model sees it,
transient failures (503, 429 with Retry-After), a 400 failing the run, questions to the user,
and a crash between the model's tool call and the tool's outcome, recovered by class. Memory
across a session's turns: the history ahead of a run's messages, its budget, and a recovered
run seeing the history it started with."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.queue.core import Queue
from app.queue.reads import Reads
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, SimulatedCrash, default_registry
from app.runtime.history import chat_messages, exchanges, trim_history
from app.runtime.openai_agent import OpenAIAgent
from app.runtime.outbound import ModelClient
from app.vocabulary.live_deltas import Delta
from app.vocabulary.records import NewRun, Run
from tests.support.clock import ManualClock
from tests.support.invariants import check_all_runs
from tests.support.runtime import current, execute_once, recover
from tests.support.servers import running_server
from tests.support.streaming_model import Streamed, call_chunks, ending, text_chunks

API_KEY = "sk-test-secret-never-logged"


@dataclass
class FakeModel:
    """Answers each chat completion with the next scripted reply; records every request."""

    replies: list[tuple[int, dict[str, Any], dict[str, str]] | Streamed] = field(
        default_factory=list
    )
    requests: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> Response:
            self.requests.append(await request.json())
            self.times.append(time.monotonic())
            self.auth.append(request.headers.get("authorization"))
            reply = self.replies.pop(0)
            if isinstance(reply, Streamed):
                return reply.response()
            status, body, headers = reply
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

    def stream(self, chunks: list[dict[str, Any]], **options: Any) -> None:
        self.replies.append(Streamed(chunks, **options))

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
async def http() -> AsyncIterator[ModelClient]:
    client = ModelClient(8)
    yield client
    await client.aclose()


def executor(
    base: str, client: ModelClient, crash: Any = None, *, stream: bool = True
) -> RuntimeExecutor:
    registry = default_registry(["127.0.0.1"], http_timeout_seconds=5)
    registry.agents["openai"] = OpenAIAgent(
        base_url=f"{base}/v1",
        model="test-model",
        api_key=API_KEY,
        tools=lambda: registry.tools,
        backoff_seconds=0.01,
        client=client,
        stream=stream,
    )
    return RuntimeExecutor(registry, RuntimeLimits(retry_backoff_seconds=0.01), crash_hook=crash)


def turn(text: str = "What is 2+2?") -> NewRun:
    return NewRun(tenant_id="t", principal="p", agent="openai", input={"text": text})


async def test_a_conversation_with_tool_calls_and_a_final_answer(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
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
    http: ModelClient,
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
    http: ModelClient,
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
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.fail(503, {"error": "overloaded"})
    fake.say("fine")
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    assert (await current(queue, run.id)).result["final"] == "fine"
    assert len(fake.requests) == 2


async def test_429_honours_retry_after(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.fail(429, {"error": "slow down"}, {"Retry-After": "1"})
    fake.say("fine")
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    assert (await current(queue, run.id)).status == "succeeded"
    assert fake.times[1] - fake.times[0] >= 0.95  # waited at least what the endpoint asked


async def test_transient_failures_that_persist_release_the_run(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
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
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str], reply: Any, says: str
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
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
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
    queue: Queue, http: ModelClient, clock: ManualClock, model: tuple[FakeModel, str]
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
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str], reply: Any
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
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    for _ in range(4):
        fake.fail(503, {"error": f"upstream rejected {API_KEY}"})
    run = await queue.enqueue(turn())
    assert await execute_once(queue, executor(base, http))
    events = json.dumps([e.data for e in await queue.events(run.id)])
    assert "upstream rejected" in events
    assert API_KEY not in events


# --- memory across turns -----------------------------------------------------------------------
def remembering(
    base: str, client: ModelClient, crash: Any = None, **budget: int
) -> RuntimeExecutor:
    registry = default_registry(["127.0.0.1"], http_timeout_seconds=5)
    registry.agents["openai"] = OpenAIAgent(
        base_url=f"{base}/v1",
        model="test-model",
        api_key=API_KEY,
        tools=lambda: registry.tools,
        backoff_seconds=0.01,
        client=client,
        **budget,
    )
    return RuntimeExecutor(registry, RuntimeLimits(retry_backoff_seconds=0.01), crash_hook=crash)


async def session_turn(queue: Queue, session_id: Any, text: str) -> Run:
    return await queue.enqueue(
        NewRun(
            tenant_id="t",
            principal="p",
            agent="openai",
            session_id=session_id,
            input={"text": text},
        )
    )


async def test_the_second_turn_carries_the_first_turns_user_and_assistant_messages(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    session = await Reads(queue).create_session(tenant_id="t", principal="p")
    fake.call(("c1", "echo", {"name": "Bob"}))
    fake.say("Hello Bob")
    await session_turn(queue, session.id, "my name is Bob")
    assert await execute_once(queue, remembering(base, http))
    fake.say("Your name is Bob.")
    second = await session_turn(queue, session.id, "what is my name?")
    assert await execute_once(queue, remembering(base, http))
    assert (await current(queue, second.id)).result["final"] == "Your name is Bob."

    sent = fake.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "assistant", "user"]
    assert sent[0] == {"role": "user", "content": "my name is Bob"}
    call = sent[1]["tool_calls"][0]
    assert call["function"] == {"name": "echo", "arguments": json.dumps({"name": "Bob"})}
    assert sent[2]["tool_call_id"] == call["id"]
    assert json.loads(sent[2]["content"]) == {
        "status": "succeeded",
        "result": {"echo": {"name": "Bob"}},
    }
    assert sent[3] == {"role": "assistant", "content": "Hello Bob"}
    assert sent[4] == {"role": "user", "content": "what is my name?"}


async def test_the_history_budget_drops_the_oldest_whole_exchanges(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    session = await Reads(queue).create_session(tenant_id="t", principal="p")
    # Turn 1 is four messages (user, tool call, tool result, answer), turn 2 is two.
    fake.call(("c1", "echo", {"a": 1}))
    fake.say("one")
    await session_turn(queue, session.id, "first")
    assert await execute_once(queue, remembering(base, http))
    fake.say("two")
    await session_turn(queue, session.id, "second")
    assert await execute_once(queue, remembering(base, http))
    # A budget of three messages: turn 2 fits, turn 1 would only fit cut, so it goes whole
    # (its tool result never arrives without its call, nor its call without its result).
    fake.say("three")
    await session_turn(queue, session.id, "third")
    assert await execute_once(queue, remembering(base, http, history_max_messages=3))
    assert fake.requests[-1]["messages"] == [
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "third"},
    ]
    # The character budget counts the same way: "second" + "two" is 9 characters.
    fake.say("four")
    await session_turn(queue, session.id, "fourth")
    assert await execute_once(queue, remembering(base, http, history_max_chars=10))
    assert fake.requests[-1]["messages"] == [
        {"role": "user", "content": "third"},
        {"role": "assistant", "content": "three"},
        {"role": "user", "content": "fourth"},
    ]


async def test_a_recovered_run_sees_the_history_it_started_with(
    queue: Queue, http: ModelClient, clock: ManualClock, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    session = await Reads(queue).create_session(tenant_id="t", principal="p")
    fake.say("Hello Bob")
    await session_turn(queue, session.id, "my name is Bob")
    assert await execute_once(queue, remembering(base, http))

    fake.call(("c1", "echo", {"x": 1}))
    fake.say("Bob, and the echo said 1.")
    second = await session_turn(queue, session.id, "what is my name?")

    def crash(at: str, step: int) -> None:
        if at == "after_outcome":  # the checkpoint after the tool committed, then the worker died
            raise SimulatedCrash(at)

    assert await execute_once(queue, remembering(base, http, crash)) is False
    # The checkpoint holds where the history ends, not the history.
    checkpoint = await queue.latest_checkpoint(second.id)
    assert checkpoint is not None
    assert checkpoint.state["history_window"] == {"from_run_no": 1, "through_run_no": 1}
    assert "history" not in checkpoint.state
    await recover(queue, clock)
    assert await execute_once(queue, remembering(base, http))
    assert (await current(queue, second.id)).status == "succeeded"

    before, after = fake.requests[-2]["messages"], fake.requests[-1]["messages"]
    history = [
        {"role": "user", "content": "my name is Bob"},
        {"role": "assistant", "content": "Hello Bob"},
    ]
    assert before[:2] == history
    assert after[:2] == history
    assert after[2] == {"role": "user", "content": "what is my name?"}
    await check_all_runs(queue.engine)


def test_trimming_keeps_the_newest_whole_exchanges() -> None:
    def user(text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    def call(call_id: str) -> list[dict[str, Any]]:
        return [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "echo"}}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "{}"},
        ]

    messages = [
        user("a"),
        {"role": "assistant", "content": "A"},
        user("b"),
        *call("b1"),
        *call("b2"),
        {"role": "assistant", "content": "B"},
        user("c"),
        {"role": "assistant", "content": "C"},
    ]
    everything = trim_history(messages, max_messages=100, max_chars=10_000)
    assert everything == messages
    # Seven messages would reach into b's exchange (six long): b goes whole, and a with it.
    assert trim_history(messages, max_messages=7, max_chars=10_000) == messages[-2:]
    assert trim_history(messages, max_messages=8, max_chars=10_000) == messages[2:]
    # However the budget cuts, no tool result is left without its call, nor a call without it.
    for budget in range(0, 12):
        kept = trim_history(messages, max_messages=budget, max_chars=10_000)
        assert kept == messages[len(messages) - len(kept) :]
        calls = {c["id"] for m in kept for c in m.get("tool_calls") or []}
        results = {m["tool_call_id"] for m in kept if m["role"] == "tool"}
        assert calls == results
        assert not kept or kept[0]["role"] == "user"
    assert trim_history(messages, max_messages=100, max_chars=2) == messages[-2:]
    assert trim_history(messages, max_messages=0, max_chars=10_000) == []
    # A transcript that starts otherwise than with a user turn keeps that head as one exchange.
    assert exchanges([*call("x"), user("y")]) == [call("x"), [user("y")]]


def test_transcript_entries_become_chat_messages() -> None:
    entries = [
        {"run_no": 1, "role": "user", "kind": "input", "content": {"text": "pay it"}},
        {
            "run_no": 1,
            "role": "tool",
            "kind": "tool_call",
            "content": {"message": "?"},
            "tool": {"name": "http_request", "step": 1, "args": {}, "status": "uncertain"},
        },
        {"run_no": 1, "role": "system", "kind": "failed", "content": {"status": "failed"}},
        {"run_no": 2, "role": "user", "kind": "input", "content": "again"},
        {"run_no": 2, "role": "assistant", "kind": "question", "content": "Which?"},
        {"run_no": 2, "role": "user", "kind": "answer", "content": "that one"},
        {"run_no": 2, "role": "assistant", "kind": "final", "content": {"done": True}},
    ]
    sent = chat_messages(entries)
    assert [m["role"] for m in sent] == [
        "user",
        "assistant",
        "tool",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert sent[0]["content"] == "pay it"
    assert sent[1]["tool_calls"][0]["id"] == sent[2]["tool_call_id"] == "history_1_1"
    assert json.loads(sent[2]["content"])["status"] == "unknown"  # never "failed"
    assert sent[6]["content"] == json.dumps({"done": True})


# --- streaming (issue 23) ----------------------------------------------------------------------
class Recorder:
    """The process's delta publisher, as a run sees it: keeps every delta it is offered."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []

    def offer(self, delta: Delta) -> bool:
        self.deltas.append(delta)
        return True

    async def settle(self, run_id: UUID, within: float | None = None) -> bool:
        return True

    def text(self, message: int) -> str:
        text = ""
        for delta in self.deltas:
            if delta.message == message:
                assert delta.offset <= len(text), "no delta missing"
                text = text[: delta.offset] + delta.text
        return text


async def test_a_streamed_answer_shows_its_text_live_and_assembles_its_tool_calls(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.stream(
        text_chunks("Let me check that. ", 4)
        + call_chunks("c1", "echo", json.dumps({"a": 1, "note": "from fragments"}), 4)
        + ending("tool_calls", tokens=10),
        delay=0.01,
    )
    fake.stream(text_chunks("The answer is 4.", 5) + ending(tokens=20), delay=0.01)
    run = await queue.enqueue(turn())
    recorder = Recorder()
    assert await execute_once(queue, executor(base, http), deltas=recorder)
    done = await current(queue, run.id)
    assert done.status == "succeeded", done.failure
    assert done.result["final"] == "The answer is 4."
    assert done.result["tool_outcomes"][0]["outcome"] == {
        "echo": {"a": 1, "note": "from fragments"}
    }
    assert done.result["usage"]["prompt_tokens"] == 30
    assert all(request["stream"] is True for request in fake.requests)
    # The model's tool call went back to it whole, with the text it came with.
    assistant = [m for m in fake.requests[1]["messages"] if m["role"] == "assistant"]
    assert assistant[0]["content"] == "Let me check that. "
    assert assistant[0]["tool_calls"][0]["id"] == "c1"
    events = await queue.events(run.id)
    types = [e.type for e in events]
    completed = [e for e in events if e.type == "message.completed"]
    assert [e.data for e in completed] == [
        {"text": "Let me check that. ", "message": 0},
        {"text": "The answer is 4.", "message": 1},
    ]
    assert types.index("message.completed") < types.index("tool.started")
    assert types[-2:] == ["message.completed", "run.succeeded"]
    assert recorder.text(0) == "Let me check that. "
    assert recorder.text(1) == "The answer is 4."
    assert {(d.run_id, d.epoch) for d in recorder.deltas} == {(run.id, completed[0].epoch)}
    assert len(recorder.deltas) == 8


async def test_a_stream_cut_off_midway_is_retried_and_its_partial_text_replaced(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.stream(text_chunks("A first try that breaks off", 6) + ending(), cut_after=3)
    fake.stream(text_chunks("The whole answer.", 3) + ending())
    run = await queue.enqueue(turn())
    recorder = Recorder()
    assert await execute_once(queue, executor(base, http), deltas=recorder)
    done = await current(queue, run.id)
    assert done.status == "succeeded", done.failure
    assert done.result["final"] == "The whole answer."
    assert [d.offset for d in recorder.deltas][3] == 0  # the retry starts the message over
    assert recorder.text(0) == "The whole answer."
    completed = [e.data for e in await queue.events(run.id) if e.type == "message.completed"]
    assert completed == [{"text": "The whole answer.", "message": 0}]


async def test_with_streaming_off_the_request_is_plain_and_nothing_is_live(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    fake, base = model
    fake.say("Plain.")
    fake.say("Also plain.")  # an endpoint that ignores `stream: true` answers plain JSON
    recorder = Recorder()
    for stream in (False, True):
        run = await queue.enqueue(turn())
        assert await execute_once(queue, executor(base, http, stream=stream), deltas=recorder)
        done = await current(queue, run.id)
        assert done.status == "succeeded", done.failure
        types = [e.type for e in await queue.events(run.id)]
        assert "message.completed" not in types  # no live text: no extra write
    assert "stream" not in fake.requests[0]
    assert fake.requests[1]["stream"] is True
    assert recorder.deltas == []


async def test_steered_input_reaches_the_model_before_its_next_call(
    queue: Queue, http: ModelClient, model: tuple[FakeModel, str]
) -> None:
    """A steer (docs/turn-control.md) is a user message in the next request, after the tool
    results that preceded it; one that waited before the first call follows the turn's text."""
    from typing import ClassVar

    from app.queue.submit import RunSpec, Submissions, Submitter
    from app.runtime.tools import ToolContext

    fake, base = model
    submissions = Submissions(
        queue,
        default_agent="openai",
        idempotency_ttl_seconds=60,
        idempotency_wait_seconds=1,
        lock_timeout_ms=2000,
    )
    who = Submitter(tenant_id="t", principal="p")
    session = await Reads(queue).create_session(tenant_id="t", principal="p")

    class Nudge:
        """A tool whose call is the moment the user steers the run."""

        name = "nudge"
        description = "Lets the user steer."
        parameters: ClassVar[dict[str, Any]] = {"type": "object"}

        def idempotency_class(self, args: dict[str, Any]) -> str:
            return "safe"

        async def run(self, args: dict[str, Any], ctx: ToolContext) -> Any:
            await submissions.submit_turn(
                who, session.id, RunSpec(input={"text": "in euros, please"}), multitask="steer"
            )
            return {"nudged": True}

    runtime = executor(base, http)
    runtime.registry.tools["nudge"] = Nudge()  # type: ignore[assignment]
    first = await submissions.submit_turn(who, session.id, RunSpec(input={"text": "Price?"}))
    # Steered while still queued: taken at the run's first boundary.
    await submissions.submit_turn(
        who, session.id, RunSpec(input={"text": "for two"}), multitask="steer"
    )
    fake.call(("n1", "nudge", {}))
    fake.say("20 euros")
    assert await execute_once(queue, runtime)
    done = await current(queue, first.run_id)
    assert done.status == "succeeded", done.failure
    opening, after_tool = fake.requests
    assert opening["messages"] == [
        {"role": "user", "content": "Price?"},
        {"role": "user", "content": "for two"},
    ]
    assert [(m["role"], m.get("content")) for m in after_tool["messages"]][-3:] == [
        ("assistant", None),
        ("tool", json.dumps({"status": "succeeded", "result": {"nudged": True}})),
        ("user", "in euros, please"),
    ]
    assert await check_all_runs(queue.engine) == 1
