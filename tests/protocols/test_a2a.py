"""The A2A 1.0 JSON-RPC binding driven by the official `a2a-sdk` client, unchanged, against a
real server with real workers: the agent card discovered, the extended card (the caller, its
tenant's limits; refused without a key), a blocking and a non-blocking send,
an `input-required` task answered by a message naming it, a busy context refused, cancel, an
idempotent resend by message id, another tenant's task not found, a bad key, streams (live text
as artifact updates, the result as an artifact) and a subscription resumed after a dropped
connection with every event once; and a bounded fuzz of `/a2a` answering JSON-RPC errors,
never a 5xx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote
from uuid import UUID

import httpx
import pytest
from a2a.client import (
    A2ACardResolver,
    A2AClientError,
    Client,
    ClientCallContext,
    ClientConfig,
    ClientFactory,
)
from a2a.types import (
    CancelTaskRequest,
    GetExtendedAgentCardRequest,
    GetTaskRequest,
    ListTasksRequest,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import (
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.tenant_limits import Tenants
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import ToolCall, Written
from tests.support.api import Api, running_api
from tests.support.waiting import eventually

HTTP_CLIENTS: list[httpx.AsyncClient] = []


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, workers=True) as running:
        try:
            yield running
        finally:
            while HTTP_CLIENTS:
                await HTTP_CLIENTS.pop().aclose()


async def sdk(
    api: Api,
    tenant: str = "acme",
    principal: str = "alice",
    *,
    streaming: bool = False,
    polling: bool = False,
    key: str | None = None,
    binding: str = "JSONRPC",
) -> Client:
    """The SDK's client for the agent at the server's base URL, found through its card, on
    the binding asked for."""
    secret = key or await api.key(tenant, principal)
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    HTTP_CLIENTS.append(http)
    config = ClientConfig(
        streaming=streaming,
        polling=polling,
        httpx_client=http,
        supported_protocol_bindings=[binding],
    )
    return await ClientFactory(config).create_from_url(api.base)


def request(
    text_: str,
    *,
    message_id: str,
    data: dict[str, Any] | None = None,
    context_id: str | None = None,
    task_id: str | None = None,
    skill: str | None = "scripted",
) -> SendMessageRequest:
    parts: list[dict[str, Any]] = [{"text": text_}]
    if data is not None:
        parts.append({"data": data})
    message: dict[str, Any] = {"messageId": message_id, "role": "ROLE_USER", "parts": parts}
    if context_id:
        message["contextId"] = context_id
    if task_id:
        message["taskId"] = task_id
    body: dict[str, Any] = {"message": message}
    if skill:
        body["metadata"] = {"skill": skill}
    return json_format.ParseDict(body, SendMessageRequest())


async def sent(client: Client, req: SendMessageRequest) -> Task:
    [response] = [r async for r in client.send_message(req)]
    assert response.HasField("task")
    return response.task


async def count_runs(engine: AsyncEngine, table: str = "runs") -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


def result_text(task: Task) -> str:
    [artifact] = [a for a in task.artifacts if a.artifact_id == "result"]
    return "".join(part.text for part in artifact.parts)


async def test_the_agent_card_lists_the_agents_as_skills(api: Api) -> None:
    async with httpx.AsyncClient() as plain:
        card = await A2ACardResolver(plain, api.base).get_agent_card()
    assert card.name == "Turnstile"
    assert {"scripted"} <= {skill.id for skill in card.skills}
    interfaces = {i.protocol_binding: i for i in card.supported_interfaces}
    assert set(interfaces) == {"JSONRPC", "HTTP+JSON"}
    assert {i.protocol_version for i in interfaces.values()} == {"1.0"}
    assert interfaces["JSONRPC"].url == f"{api.base}/a2a"
    assert interfaces["HTTP+JSON"].url == f"{api.base}/a2a/rest"
    assert card.capabilities.streaming
    # No TURNSTILE_SECRET_KEY here: push tokens cannot be stored (tests/protocols/test_a2a_push.py).
    assert not card.capabilities.push_notifications
    scheme = card.security_schemes["bearer"]
    assert scheme.http_auth_security_scheme.scheme == "Bearer"
    assert "bearer" in card.security_requirements[0].schemes
    assert card.capabilities.extended_agent_card
    assert "urn:turnstile:a2a:caller:v1" not in {e.uri for e in card.capabilities.extensions}
    # The card needs no key: a client discovers the agent first.
    async with httpx.AsyncClient() as plain:
        raw = await plain.get(f"{api.base}/.well-known/agent-card.json")
    assert raw.status_code == 200
    assert raw.json()["name"] == "Turnstile"


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_a_blocking_send_answers_with_the_completed_task(api: Api, binding: str) -> None:
    client = await sdk(api, binding=binding)
    task = await sent(client, request("hello over A2A", message_id="m-1"))
    assert task.status.state == TaskState.TASK_STATE_COMPLETED
    assert result_text(task) == "hello over A2A"
    assert task.context_id  # a new context: a session
    again = await client.get_task(GetTaskRequest(id=task.id))
    assert (again.id, again.context_id) == (task.id, task.context_id)
    assert again.status.state == TaskState.TASK_STATE_COMPLETED
    assert [m.parts[0].text for m in again.history] == ["hello over A2A"]
    assert list((await client.get_task(GetTaskRequest(id=task.id, history_length=0))).history) == []
    run = await api.queue.get_run(UUID(task.id))
    assert run is not None
    assert str(run.session_id) == task.context_id
    # A later message in the same context is the session's next run.
    follow = await sent(client, request("and again", message_id="m-2", context_id=task.context_id))
    assert follow.context_id == task.context_id
    assert follow.id != task.id
    assert result_text(follow) == "and again"


async def test_a_non_blocking_send_answers_at_once_and_is_polled(api: Api) -> None:
    client = await sdk(api, polling=True)
    script = {"script": [{"call": "sleep", "args": {"seconds": 0.3}}, {"final": "slept"}]}
    task = await sent(client, request("nap", message_id="m-1", data=script))
    assert task.status.state in (
        TaskState.TASK_STATE_SUBMITTED,
        TaskState.TASK_STATE_WORKING,
    )

    async def done() -> Task | None:
        got = await client.get_task(GetTaskRequest(id=task.id))
        return got if got.status.state == TaskState.TASK_STATE_COMPLETED else None

    finished = await eventually(done, what="the task's end")
    assert result_text(finished) == "slept"


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_an_input_required_task_is_resumed_by_a_message_naming_it(
    api: Api, binding: str
) -> None:
    client = await sdk(api, binding=binding)
    script = {"script": [{"ask": "Which account?"}, {"final": "paid"}]}
    task = await sent(client, request("pay the bill", message_id="m-1", data=script))
    assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    assert task.status.message.parts[0].text == "Which account?"
    answered = await sent(
        client,
        request("savings", message_id="m-2", task_id=task.id, context_id=task.context_id),
    )
    assert answered.id == task.id  # the same run, resumed
    assert answered.status.state == TaskState.TASK_STATE_COMPLETED
    assert result_text(answered) == "paid"
    # The answer sent again (a retry after a lost reply) is the same task, not a new turn.
    resent = await sent(
        client,
        request("savings", message_id="m-2", task_id=task.id, context_id=task.context_id),
    )
    assert resent.id == task.id
    # A finished task takes no more messages.
    with pytest.raises(UnsupportedOperationError):
        await sent(client, request("more", message_id="m-3", task_id=task.id))


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_a_busy_context_is_refused_and_a_task_is_cancelled(api: Api, binding: str) -> None:
    client = await sdk(api, polling=True, binding=binding)
    script = {"script": [{"call": "sleep", "args": {"seconds": 30}}]}
    task = await sent(client, request("wait a while", message_id="m-1", data=script))
    before = await count_runs(api.engine)
    with pytest.raises(UnsupportedOperationError) as busy:
        await sent(client, request("me too", message_id="m-2", context_id=task.context_id))
    assert busy.value.data is not None
    assert busy.value.data["activeTaskId"] == task.id
    with pytest.raises(UnsupportedOperationError):  # a task not waiting for input
        await sent(client, request("answer", message_id="m-3", task_id=task.id))
    assert await count_runs(api.engine) == before
    cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
    assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
    again = await client.cancel_task(CancelTaskRequest(id=task.id))  # idempotent
    assert again.status.state == TaskState.TASK_STATE_CANCELED
    done = await sent(client, request("quick", message_id="m-4", context_id=task.context_id))
    finished = await eventually(lambda: _finished(client, done.id), what="the quick task's end")
    with pytest.raises(TaskNotCancelableError):
        await client.cancel_task(CancelTaskRequest(id=finished.id))


async def _finished(client: Client, task_id: str) -> Task | None:
    got = await client.get_task(GetTaskRequest(id=task_id))
    return got if got.status.state == TaskState.TASK_STATE_COMPLETED else None


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_a_resent_message_id_is_one_task(api: Api, binding: str) -> None:
    client = await sdk(api, binding=binding)
    before = await count_runs(api.engine)
    first = await sent(client, request("only once", message_id="same-id"))
    again = await sent(client, request("only once", message_id="same-id"))
    assert (again.id, again.context_id) == (first.id, first.context_id)
    assert await count_runs(api.engine) == before + 1
    # The same id with another message is refused and writes nothing.
    with pytest.raises(InvalidParamsError):
        await sent(client, request("something else", message_id="same-id"))
    # Message ids are the principal's own: another principal's same id is another task.
    other = await sent(
        await sdk(api, "acme", "bob", binding=binding), request("only once", message_id="same-id")
    )
    assert other.id != first.id
    assert await count_runs(api.engine) == before + 2


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_another_tenants_task_is_not_found(api: Api, binding: str) -> None:
    mine = await sdk(api, "acme", "alice", binding=binding)
    theirs = await sdk(api, "globex", "bob", binding=binding)
    task = await sent(mine, request("private", message_id="m-1"))
    with pytest.raises(TaskNotFoundError):
        await theirs.get_task(GetTaskRequest(id=task.id))
    with pytest.raises(TaskNotFoundError):
        await theirs.cancel_task(CancelTaskRequest(id=task.id))
    with pytest.raises(TaskNotFoundError):
        await sent(theirs, request("hijack", message_id="m-1", task_id=task.id))
    with pytest.raises(InvalidParamsError):  # their context is no context of ours
        await sent(theirs, request("join", message_id="m-2", context_id=task.context_id))
    # Another principal of the same tenant, with a key without a scope: not found either; an
    # operator key of the tenant sees every principal's tasks.
    colleague = await sdk(api, "acme", "bob", binding=binding)
    with pytest.raises(TaskNotFoundError):
        await colleague.get_task(GetTaskRequest(id=task.id))
    operator_key = await api.key("acme", "ops", "operator")
    operator = await sdk(api, key=operator_key, binding=binding)
    assert (await operator.get_task(GetTaskRequest(id=task.id))).id == task.id
    for unknown in ("00000000-0000-0000-0000-000000000000", "not-a-task"):
        with pytest.raises(TaskNotFoundError):
            await mine.get_task(GetTaskRequest(id=unknown))


async def test_a_bad_key_is_refused_with_401(api: Api) -> None:
    client = await sdk(api, key="tsk_" + "x" * 40)
    with pytest.raises(A2AClientError) as refused:
        await sent(client, request("hi", message_id="m-1"))
    assert "401" in str(refused.value)


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_the_extended_card_shows_the_caller_and_its_tenants_limits(
    api: Api, binding: str
) -> None:
    await Tenants(api.queue).set_limits("acme", max_queued=7, submit_rate_per_second=5.0)
    client = await sdk(api, binding=binding)
    script = {"script": [{"ask": "Which account?"}, {"final": "paid"}]}
    await sent(client, request("pay", message_id="m-1", data=script))  # waits: not queued
    card = await client.get_extended_agent_card(GetExtendedAgentCardRequest())
    assert card.name == "Turnstile"
    assert {"scripted"} <= {skill.id for skill in card.skills}
    [caller] = [e for e in card.capabilities.extensions if e.uri == "urn:turnstile:a2a:caller:v1"]
    params = json_format.MessageToDict(caller.params)
    assert (params["tenant"], params["principal"], params["scopes"]) == ("acme", "alice", [])
    assert params["limits"]["max_queued"] == 7
    assert params["limits"]["submit_rate_per_second"] == 5.0
    assert params["limits"]["submit_burst"] == 5  # one second's worth, as the bucket takes it
    assert params["runs"] == {"running": 0, "queued": 0}
    # Another tenant's caller sees its own tenant, none of acme's limits.
    operator = await sdk(
        api, "globex", "bob", binding=binding, key=await api.key("globex", "bob", "operator")
    )
    theirs = await operator.get_extended_agent_card(GetExtendedAgentCardRequest())
    [other] = [e for e in theirs.capabilities.extensions if e.uri == caller.uri]
    other_params = json_format.MessageToDict(other.params)
    assert (other_params["tenant"], other_params["scopes"]) == ("globex", ["operator"])
    assert other_params["limits"]["max_queued"] is None


async def test_the_extended_card_counts_the_tenants_queued_runs(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, tenant_max_queued=3) as idle:  # no workers
        try:
            client = await sdk(idle, polling=True)  # non-blocking: the task stays submitted
            await sent(client, request("wait", message_id="m-1"))
            card = await client.get_extended_agent_card(GetExtendedAgentCardRequest())
            [caller] = [
                e for e in card.capabilities.extensions if e.uri == "urn:turnstile:a2a:caller:v1"
            ]
            params = json_format.MessageToDict(caller.params)
            assert params["runs"] == {"running": 0, "queued": 1}
            assert params["limits"]["max_queued"] == 3  # the service's default applies
        finally:
            while HTTP_CLIENTS:
                await HTTP_CLIENTS.pop().aclose()


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_the_extended_card_needs_a_key(api: Api, binding: str) -> None:
    client = await sdk(api, key="tsk_" + "x" * 40, binding=binding)
    # JSON-RPC: the transport's HTTP 401; HTTP+JSON: the 401's google.rpc.Status, mapped.
    refusal = A2AClientError if binding == "JSONRPC" else InvalidRequestError
    with pytest.raises(refusal) as refused:
        await client.get_extended_agent_card(GetExtendedAgentCardRequest())
    assert "401" in str(refused.value) or "API key" in str(refused.value)
    async with httpx.AsyncClient() as plain:
        for answer in (
            await plain.get(f"{api.base}/a2a/rest/extendedAgentCard"),
            await plain.post(
                f"{api.base}/a2a",
                json={"jsonrpc": "2.0", "id": 1, "method": "GetExtendedAgentCard", "params": {}},
            ),
        ):
            assert answer.status_code == 401
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")
            error = answer.json()["error"]
            assert error.get("status", "UNAUTHENTICATED") == "UNAUTHENTICATED"
            assert "caller:v1" not in answer.text


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_tasks_are_listed_newest_first_by_context_and_state(api: Api, binding: str) -> None:
    client = await sdk(api, binding=binding)
    one = await sent(client, request("one", message_id="m-1"))
    two = await sent(client, request("two", message_id="m-2", context_id=one.context_id))
    other = await sent(client, request("three", message_id="m-3"))
    listed = await client.list_tasks(ListTasksRequest(context_id=one.context_id))
    assert [t.id for t in listed.tasks] == [two.id, one.id]
    assert listed.next_page_token == ""
    assert all(not t.artifacts for t in listed.tasks)  # unless asked for
    everything = await client.list_tasks(ListTasksRequest(include_artifacts=True))
    assert [t.id for t in everything.tasks] == [other.id, two.id, one.id]
    assert result_text(everything.tasks[0]) == "three"
    first = await client.list_tasks(ListTasksRequest(page_size=2))
    assert [t.id for t in first.tasks] == [other.id, two.id]
    rest = await client.list_tasks(ListTasksRequest(page_size=2, page_token=first.next_page_token))
    assert [t.id for t in rest.tasks] == [one.id]
    assert rest.next_page_token == ""
    working = await client.list_tasks(ListTasksRequest(status=TaskState.TASK_STATE_WORKING))
    assert list(working.tasks) == []
    theirs = await sdk(api, "globex", "bob", binding=binding)
    assert list((await theirs.list_tasks(ListTasksRequest())).tasks) == []
    with pytest.raises(InvalidParamsError):
        await client.list_tasks(ListTasksRequest(page_token="forged"))


async def test_a_message_over_the_rate_limit_is_refused_and_writes_nothing(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url, engine, workers=True, submit_rate_per_second=0.001, submit_burst=1
    ) as limited:
        try:
            client = await sdk(limited)
            await sent(client, request("first", message_id="m-1"))
            before = (await count_runs(engine), await count_runs(engine, "sessions"))
            with pytest.raises(InternalError) as refused:
                await sent(client, request("second", message_id="m-2"))
            assert refused.value.data is not None
            assert int(refused.value.data["retryAfterSeconds"]) >= 1
            # No run, and not even the context the message would have started.
            assert (await count_runs(engine), await count_runs(engine, "sessions")) == before
        finally:
            while HTTP_CLIENTS:
                await HTTP_CLIENTS.pop().aclose()


# --- streams -----------------------------------------------------------------------------------
def event_id(response: StreamResponse) -> str | None:
    kind = response.WhichOneof("payload")
    assert kind is not None
    metadata = json_format.MessageToDict(getattr(response, kind).metadata)
    value = metadata.get("turnstile", {}).get("eventId")
    return str(value) if value is not None else None


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_a_streamed_message_sends_live_text_then_the_result(api: Api, binding: str) -> None:
    client = await sdk(api, streaming=True, binding=binding)
    words = "one two three four five six"
    script = {"script": [{"say": words, "delay": 0.02}]}
    events = [e async for e in client.send_message(request("go", message_id="m-1", data=script))]
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds[0] == "task"
    task_id = events[0].task.id
    states = [e.status_update.status.state for e in events if e.HasField("status_update")]
    assert states[-1] == TaskState.TASK_STATE_COMPLETED
    # Working: in the opening task, or an update once a worker claims it.
    opening = events[0].task.status.state
    assert opening == TaskState.TASK_STATE_WORKING or TaskState.TASK_STATE_WORKING in states
    updates = [e.artifact_update for e in events if e.HasField("artifact_update")]
    assert all(u.task_id == task_id for u in updates)
    live = [u for u in updates if u.artifact.artifact_id.startswith("message-")]
    # The live pieces, appended, and the message's end with the whole text.
    assert live[-1].last_chunk
    assert not live[-1].append
    assert "".join(p.text for p in live[-1].artifact.parts) == words
    pieces = [u for u in live if not u.last_chunk]
    if pieces:
        assert (
            "".join(u.artifact.parts[0].text for u in pieces)
            == words[: sum(len(u.artifact.parts[0].text) for u in pieces)]
        )
    [result] = [u for u in updates if u.artifact.artifact_id == "result"]
    assert result.artifact.parts[0].text == words
    # Every durable event's item names its event id, in order.
    ids = [int(i) for e in events if (i := event_id(e)) is not None]
    assert ids == sorted(set(ids))


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_a_subscription_after_a_dropped_stream_gets_every_event_once(
    api: Api, binding: str
) -> None:
    client = await sdk(api, streaming=True, binding=binding)
    script = {"script": [{"ask": "Which account?"}, {"say": "paid in full"}]}
    first = [e async for e in client.send_message(request("pay", message_id="m-1", data=script))]
    task = first[0].task
    assert first[-1].status_update.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    # The answer's stream is dropped after its first item (the task as it stands).
    stream = client.send_message(
        request("savings", message_id="m-2", task_id=task.id, context_id=task.context_id)
    )
    opening = await anext(stream)
    await stream.aclose()
    seen = event_id(opening)
    assert seen is not None
    # Back, from where it left: every durable event after it, each once, to the end.
    resumed = [
        e
        async for e in client.subscribe(
            SubscribeToTaskRequest(id=task.id),
            context=ClientCallContext(service_parameters={"Last-Event-ID": seen}),
        )
    ]
    assert resumed[0].HasField("task")
    ids = [int(i) for e in resumed[1:] if (i := event_id(e)) is not None]
    assert ids == sorted(set(ids))
    assert ids[0] > int(seen)
    states = [e.status_update.status.state for e in resumed if e.HasField("status_update")]
    assert states[-1] == TaskState.TASK_STATE_COMPLETED
    [result] = [
        e.artifact_update for e in resumed if e.artifact_update.artifact.artifact_id == "result"
    ]
    assert result.artifact.parts[0].text == "paid in full"
    # The run's events after the dropped point, each once: none lost, none repeated.
    run_events = await api.queue.events(UUID(task.id), after=int(seen))
    mapped = {"run.claimed", "run.input_delivered", "run.succeeded", "message.completed"}
    assert {str(e.seq) for e in run_events if e.type in mapped} <= {str(i) for i in ids}
    # A finished task has nothing to subscribe to, unless resuming with events still to come.
    with pytest.raises(UnsupportedOperationError):
        _ = [e async for e in client.subscribe(SubscribeToTaskRequest(id=task.id))]


# --- bad input ---------------------------------------------------------------------------------
def assert_jsonrpc_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code < 500, response.text
    assert response.status_code in (200, 401), response.text
    body = response.json()
    assert body["jsonrpc"] == "2.0"
    error = body["error"]
    assert isinstance(error["code"], int)
    assert isinstance(error["message"], str)
    assert error["message"]
    assert any(d.get("@type", "").endswith("ErrorInfo") for d in error["data"])
    return dict(error)


async def test_bad_requests_are_jsonrpc_errors(api: Api) -> None:
    client = await api.client()
    before = await count_runs(api.engine)
    message = {"messageId": "x", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    cases: list[tuple[Any, int]] = [
        ({"jsonrpc": "2.0", "id": 1, "method": "Nope", "params": {}}, -32601),
        ({"jsonrpc": "1.0", "id": 1, "method": "GetTask", "params": {}}, -32600),
        ([1, 2], -32600),
        ({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {}}, -32602),
        ({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {}}, -32602),
        (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "SendMessage",
                "params": {"message": {**message, "parts": []}},
            },
            -32602,
        ),
        (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "SendMessage",
                "params": {"message": {**message, "parts": [{"url": "https://x/y.png"}]}},
            },
            -32005,
        ),
        (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "SendMessage",
                "params": {"message": message, "metadata": {"skill": "no-such-agent"}},
            },
            -32602,
        ),
        (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "SendMessage",
                "params": {"message": {**message, "parts": [{"text": "a\x00b"}]}},
            },
            -32602,
        ),
        (
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "CreateTaskPushNotificationConfig",
                "params": {"taskId": "t", "url": "http://127.0.0.1/"},
            },
            -32001,  # no task "t" (push configurations: tests/protocols/test_a2a_push.py)
        ),
    ]
    for body, code in cases:
        error = assert_jsonrpc_error(await client.post("/a2a", json=body))
        assert error["code"] == code, (body, error)
    raw = await client.post(
        "/a2a", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert assert_jsonrpc_error(raw)["code"] == -32700
    for nesting in (
        b"[" * 100_000,
        b'{"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": '
        b'{"messageId": "d", "role": "ROLE_USER", "parts": [{"data": '
        + b"[" * 700
        + b"]" * 700
        + b"}]}}}",
    ):
        deep = await client.post(
            "/a2a", content=nesting, headers={"Content-Type": "application/json"}
        )
        assert assert_jsonrpc_error(deep)["code"] in (-32700, -32600)
    versioned = await client.post(
        "/a2a",
        json={"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}},
        headers={"A2A-Version": "0.3"},
    )
    assert assert_jsonrpc_error(versioned)["code"] == -32009
    assert await count_runs(api.engine) == before


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
PARTS = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "text": st.text(max_size=20) | JSON_VALUES,
            "data": JSON_VALUES,
            "url": JSON_VALUES,
            "mediaType": JSON_VALUES,
        },
    ),
    max_size=3,
)
MESSAGES = st.fixed_dictionaries(
    {},
    optional={
        "messageId": st.text(max_size=10) | JSON_VALUES,
        "role": st.sampled_from(["ROLE_USER", "ROLE_AGENT", "user", ""]) | JSON_VALUES,
        "parts": PARTS | JSON_VALUES,
        "contextId": st.text(max_size=40) | JSON_VALUES,
        "taskId": st.text(max_size=40) | JSON_VALUES,
        "metadata": JSON_VALUES,
    },
)
PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "message": MESSAGES | JSON_VALUES,
        "configuration": st.fixed_dictionaries(
            {}, optional={"returnImmediately": JSON_VALUES, "historyLength": JSON_VALUES}
        )
        | JSON_VALUES,
        "metadata": st.fixed_dictionaries(
            {},
            optional={
                "skill": JSON_VALUES,
                "multitask": st.sampled_from(["enqueue", "steer", "interrupt", "x"]) | JSON_VALUES,
            },
        )
        | JSON_VALUES,
        "id": st.text(max_size=40) | JSON_VALUES,
        "historyLength": JSON_VALUES,
    },
)
ENVELOPES = st.fixed_dictionaries(
    {
        "method": st.sampled_from(
            ["SendMessage", "GetTask", "CancelTask", "SubscribeToTask", "ListTasks", "x"]
        )
        | JSON_VALUES,
    },
    optional={
        "jsonrpc": st.just("2.0") | JSON_VALUES,
        "id": JSON_VALUES,
        "params": PARAMS | JSON_VALUES,
    },
)


async def test_a_bounded_fuzz_of_a2a_answers_jsonrpc_errors_never_a_5xx(api: Api) -> None:
    key = await api.key()
    headers = {"Authorization": f"Bearer {key}"}

    def rest_shaped(answer: httpx.Response) -> None:
        assert answer.status_code < 500, answer.text
        if answer.status_code >= 400:
            error = answer.json()["error"]
            assert isinstance(error["code"], int), error
            assert isinstance(error["message"], str), error
            assert any(d["@type"].endswith("ErrorInfo") for d in error["details"]), error

    @settings(max_examples=80, deadline=None, derandomize=True, database=None)
    @given(envelope=ENVELOPES, task_id=st.text(max_size=40))
    def probe(envelope: dict[str, Any], task_id: str) -> None:
        params = envelope.get("params")
        if isinstance(params, dict):
            # A valid send is answered at once, not waited for.
            params["configuration"] = {"returnImmediately": True}
        with httpx.Client(base_url=api.base, headers=headers, timeout=30) as client:
            answer = client.post(
                "/a2a", content=json.dumps(envelope), headers={"Content-Type": "application/json"}
            )
            assert answer.status_code < 500, answer.text
            if answer.headers.get("content-type", "").startswith("application/json"):
                body = answer.json()
                assert body.get("jsonrpc") == "2.0", body
                assert ("error" in body) != ("result" in body), body
            # The HTTP+JSON binding: the same params as bodies, the id in the path.
            rest = envelope.get("params")
            content = json.dumps(rest)
            rest_shaped(client.post("/a2a/rest/message:send", content=content))
            target = quote(task_id, safe="")
            rest_shaped(client.get(f"/a2a/rest/tasks/{target}"))
            rest_shaped(client.post(f"/a2a/rest/tasks/{target}:cancel", content=content))
            rest_shaped(client.get("/a2a/rest/tasks", params={"pageSize": task_id}))

    await asyncio.to_thread(probe)


async def test_an_uncertain_tool_outcome_travels_as_the_extensions_data_part(
    database_url: str, engine: AsyncEngine
) -> None:
    """No worker here: the test claims the run and starts an unsafe call through the core, as a
    worker would; the task is cancelled mid-call through A2A and its subscriber reads the
    call's unknown outcome as the card's extension says."""
    async with running_api(database_url, engine, workers=False) as bare:
        try:
            client = await sdk(bare, streaming=True, polling=True)
            card = await A2ACardResolver(HTTP_CLIENTS[-1], bare.base).get_agent_card()
            [extension] = card.capabilities.extensions
            sender = await sdk(bare, polling=True)
            task = await sent(sender, request("mail the report", message_id="m-1"))
            [claimed] = await bare.queue.claim("test-worker", list(PriorityClass))
            assert str(claimed.run.id) == task.id
            call = ToolCall(step=1, tool="send_email", idempotency_class="unsafe", args={})
            assert isinstance(await bare.queue.tool_started(claimed.lease, call), Written)
            stream = client.subscribe(SubscribeToTaskRequest(id=task.id))
            assert (await anext(stream)).HasField("task")
            cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
            assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
            rest = [item async for item in stream]
        finally:
            while HTTP_CLIENTS:
                await HTTP_CLIENTS.pop().aclose()
    [outcome] = [i.artifact_update.artifact for i in rest if i.HasField("artifact_update")]
    assert list(outcome.extensions) == [extension.uri]
    data = json_format.MessageToDict(outcome.parts[0].data)
    assert (data["tool"], data["step"], data["status"]) == ("send_email", 1, "uncertain")
    assert data["idempotencyClass"] == "unsafe"
    assert rest[-1].status_update.status.state == TaskState.TASK_STATE_CANCELED
