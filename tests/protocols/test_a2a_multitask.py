"""A message to a busy A2A context follows its session's multitask policy (issue 34;
docs/a2a.md, docs/turn-control.md), driven by the official `a2a-sdk` client against a real
server and real `turnstile worker` processes: under each policy with the context's task
submitted (queued: no worker yet) and working (a worker running it); `reject`'s error;
`enqueue` and `interrupt` answered with a pending task whose id its run takes, which completes
after the first and sees its transcript; `steer` answered with the active task; a pending task
got, listed, cancelled, subscribed to (every event once) and sent again by message id (the same
task); another tenant's pending task not found; the policy asked per message in metadata."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any
from uuid import UUID

import httpx
import pytest
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf import json_format
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.vocabulary.records import Run
from tests.support.api import Api, running_api
from tests.support.invariants import check_all_runs
from tests.support.processes import Child, turnstile
from tests.support.waiting import eventually
from tests.support.webhook_receiver import Delivery, receiver

S = TaskState
HTTP_CLIENTS: list[httpx.AsyncClient] = []
POLICIES = ("reject", "enqueue", "interrupt", "steer")


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    """The API without workers of its own: a context's first task stays submitted until the
    test starts a `turnstile worker` (`worker`). The interrupt bound is long: a running task
    interrupted stops at its worker's next boundary, not by the sweep."""
    async with running_api(database_url, engine, interrupt_grace_seconds=120) as running:
        try:
            yield running
        finally:
            while HTTP_CLIENTS:
                await HTTP_CLIENTS.pop().aclose()


def worker(database_url: str, **env: str) -> AbstractAsyncContextManager[Child]:
    return turnstile(
        "worker",
        ready=b"running slots",
        env={
            "DATABASE_URL": database_url,
            "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
            "TURNSTILE_DRAIN_GRACE_SECONDS": "0",
            **env,
        },
    )


async def sdk(
    api: Api,
    tenant: str = "acme",
    principal: str = "alice",
    *,
    streaming: bool = False,
    polling: bool = True,
    key: str | None = None,
    binding: str = "JSONRPC",
) -> Client:
    secret = key or await api.key(tenant, principal)
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {secret}"}, timeout=90)
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
    metadata: dict[str, Any] | None = None,
) -> SendMessageRequest:
    parts: list[dict[str, Any]] = [{"text": text_}]
    if data is not None:
        parts.append({"data": data})
    message: dict[str, Any] = {"messageId": message_id, "role": "ROLE_USER", "parts": parts}
    if context_id:
        message["contextId"] = context_id
    body: dict[str, Any] = {
        "message": message,
        "metadata": {"skill": "scripted", **(metadata or {})},
    }
    return json_format.ParseDict(body, SendMessageRequest())


async def sent(client: Client, req: SendMessageRequest) -> Task:
    [response] = [r async for r in client.send_message(req)]
    assert response.HasField("task")
    return response.task


def turnstile_metadata(task: Task) -> dict[str, Any]:
    found: dict[str, Any] = json_format.MessageToDict(task.metadata).get("turnstile", {})
    return found


async def set_policy(api: Api, context_id: str, policy: str) -> None:
    client = await api.client()
    answer = await client.patch(f"/sessions/{context_id}", json={"multitask": policy})
    assert answer.status_code == 200, answer.text


async def run_of(api: Api, task_id: str) -> Run:
    run = await api.queue.get_run(UUID(task_id))
    assert run is not None, task_id
    return run


async def state_of(client: Client, task_id: str, *states: int) -> Task | None:
    got = await client.get_task(GetTaskRequest(id=task_id))
    return got if got.status.state in states else None


async def tool_started(api: Api, task_id: str) -> bool:
    return "tool.started" in [e.type for e in await api.queue.events(UUID(task_id))]


async def count(engine: AsyncEngine, sql: str, **params: object) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql), params)).scalar_one())


FIRST = {"script": [{"call": "sleep", "args": {"seconds": 1}}] * 3 + [{"final": "first done"}]}
SECOND = {"echo_history": True}  # its result shows the session history it was given


def saw_the_first(second: Run) -> bool:
    """The second run's history ends with the first run's final answer (its transcript)."""
    assert isinstance(second.result, dict)
    history = second.result["history"]
    return bool(
        [(h["run_no"], h["role"], h["kind"]) for h in history][-1] == (1, "assistant", "final")
    )


# --- each policy, the context's task submitted (queued) ----------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
async def test_each_policy_with_the_contexts_task_submitted(
    api: Api, database_url: str, policy: str
) -> None:
    client = await sdk(api)
    first = await sent(client, request("first", message_id="m-1", data=FIRST))
    assert first.status.state == S.TASK_STATE_SUBMITTED  # no worker yet
    await set_policy(api, first.context_id, policy)
    second_request = request("second", message_id="m-2", data=SECOND, context_id=first.context_id)
    if policy == "reject":
        with pytest.raises(UnsupportedOperationError) as busy:
            await sent(client, second_request)
        assert busy.value.data is not None
        assert busy.value.data["activeTaskId"] == first.id
        assert await count(api.engine, "SELECT count(*) FROM pending_turns") == 0
        return
    second = await sent(client, second_request)
    assert second.context_id == first.context_id
    if policy == "steer":
        # The active task itself, with the message at the end of its history.
        assert second.id == first.id
        assert second.status.state == S.TASK_STATE_SUBMITTED
        assert [m.parts[0].text for m in second.history] == ["first", "second"]
        steer = turnstile_metadata(second)["steer"]
        async with worker(database_url):
            done = await eventually(
                lambda: state_of(client, first.id, S.TASK_STATE_COMPLETED), within=30
            )
        run = await run_of(api, done.id)
        assert isinstance(run.result, dict)
        assert [s["text"] for s in run.result["steered"]] == ["second"]
        turn = await count(
            api.engine,
            "SELECT count(*) FROM pending_turns WHERE id = :id AND status = 'delivered'",
            id=steer["pendingTurnId"],
        )
        assert turn == 1
        return
    assert second.id != first.id
    assert second.status.state == S.TASK_STATE_SUBMITTED
    assert [m.parts[0].text for m in second.history] == ["second"]
    if policy == "enqueue":
        meta = turnstile_metadata(second)
        assert (meta["pendingTurn"], meta["policy"], meta["position"]) == (True, "enqueue", 1)
        assert meta["activeTaskId"] == first.id
        got = await client.get_task(GetTaskRequest(id=second.id))
        assert (got.id, got.status.state) == (second.id, S.TASK_STATE_SUBMITTED)
        listed = await client.list_tasks(ListTasksRequest(context_id=first.context_id))
        assert [t.id for t in listed.tasks] == [second.id, first.id]
        submitted = await client.list_tasks(
            ListTasksRequest(context_id=first.context_id, status=S.TASK_STATE_SUBMITTED)
        )
        assert [t.id for t in submitted.tasks] == [second.id, first.id]
        working = await client.list_tasks(
            ListTasksRequest(context_id=first.context_id, status=S.TASK_STATE_WORKING)
        )
        assert list(working.tasks) == []
    else:
        # Interrupt of a submitted task: it ends at once, and the message is its run already.
        cancelled = await client.get_task(GetTaskRequest(id=first.id))
        assert cancelled.status.state == S.TASK_STATE_CANCELED
        assert (await run_of(api, second.id)).status == "queued"
    async with worker(database_url):
        done = await eventually(
            lambda: state_of(client, second.id, S.TASK_STATE_COMPLETED), within=30
        )
    assert done.id == second.id
    second_run = await run_of(api, second.id)  # the run has the pending turn's id
    first_run = await run_of(api, first.id)
    assert first_run.status == ("succeeded" if policy == "enqueue" else "cancelled")
    assert second_run.created_at >= first_run.updated_at  # started once the first ended
    assert saw_the_first(second_run) if policy == "enqueue" else True
    assert (
        await count(
            api.engine,
            "SELECT count(*) FROM pending_turns "
            "WHERE id = :id AND run_id = :id AND status = 'started'",
            id=second.id,
        )
        == 1
    )
    assert await check_all_runs(api.engine) == 2


# --- each policy, the context's task working ---------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
async def test_each_policy_with_the_contexts_task_working(
    api: Api, database_url: str, policy: str
) -> None:
    client = await sdk(api)
    async with worker(database_url):
        first = await sent(client, request("first", message_id="m-1", data=FIRST))
        await set_policy(api, first.context_id, policy)
        await eventually(lambda: tool_started(api, first.id), within=30, what="the first's tool")
        second_request = request(
            "second", message_id="m-2", data=SECOND, context_id=first.context_id
        )
        if policy == "reject":
            with pytest.raises(UnsupportedOperationError) as busy:
                await sent(client, second_request)
            assert busy.value.data is not None
            assert busy.value.data["activeTaskId"] == first.id
            return
        if policy == "enqueue":
            # A blocking send waits for the pending task to start and finish, as any send does.
            blocking = await sdk(api, polling=False)
            second = await sent(blocking, second_request)
            assert second.status.state == S.TASK_STATE_COMPLETED
            assert second.id != first.id
            assert (await run_of(api, first.id)).status == "succeeded"
            assert saw_the_first(await run_of(api, second.id))
            assert await check_all_runs(api.engine) == 2
            return
        second = await sent(client, second_request)
        if policy == "steer":
            assert second.id == first.id
            assert second.status.state == S.TASK_STATE_WORKING
            assert [m.parts[0].text for m in second.history] == ["first", "second"]
            done = await eventually(
                lambda: state_of(client, first.id, S.TASK_STATE_COMPLETED), within=30
            )
            run = await run_of(api, done.id)
            assert isinstance(run.result, dict)
            assert [s["text"] for s in run.result["steered"]] == ["second"]
            return
        # Interrupt of a working task: a pending task until the task stops at its boundary.
        assert second.id != first.id
        assert second.status.state == S.TASK_STATE_SUBMITTED
        assert turnstile_metadata(second)["policy"] == "interrupt"
        done = await eventually(
            lambda: state_of(client, second.id, S.TASK_STATE_COMPLETED), within=30
        )
    stopped = await run_of(api, first.id)
    assert stopped.status == "cancelled"
    assert "run.interrupted" in [e.type for e in await api.queue.events(stopped.id)]
    assert (
        await client.get_task(GetTaskRequest(id=first.id))
    ).status.state == S.TASK_STATE_CANCELED
    assert done.id == second.id
    assert await check_all_runs(api.engine) == 2


# --- a pending task ----------------------------------------------------------------------------
async def pending_pair(api: Api, client: Client) -> tuple[Task, Task]:
    """A context's submitted first task and, under enqueue, a second one pending behind it."""
    first = await sent(client, request("first", message_id="m-1", data=FIRST))
    await set_policy(api, first.context_id, "enqueue")
    second = await sent(
        client, request("second", message_id="m-2", data=SECOND, context_id=first.context_id)
    )
    assert turnstile_metadata(second)["pendingTurn"] is True
    return first, second


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_a_pending_task_is_cancelled_before_it_starts(
    api: Api, database_url: str, binding: str
) -> None:
    client = await sdk(api, binding=binding)
    first, second = await pending_pair(api, client)
    cancelled = await client.cancel_task(CancelTaskRequest(id=second.id))
    assert (cancelled.id, cancelled.status.state) == (second.id, S.TASK_STATE_CANCELED)
    again = await client.cancel_task(CancelTaskRequest(id=second.id))  # idempotent
    assert again.status.state == S.TASK_STATE_CANCELED
    got = await client.get_task(GetTaskRequest(id=second.id))
    assert got.status.state == S.TASK_STATE_CANCELED
    subscriber = await sdk(api, streaming=True, binding=binding)
    with pytest.raises(UnsupportedOperationError):  # nothing to subscribe to
        _ = [e async for e in subscriber.subscribe(SubscribeToTaskRequest(id=second.id))]
    listed = await client.list_tasks(ListTasksRequest(context_id=first.context_id))
    assert [t.id for t in listed.tasks] == [first.id]
    events = [e.type for e in await api.queue.events(UUID(first.id))]
    assert events[-2:] == ["turn.pending", "turn.cancelled"]
    async with worker(database_url):
        await eventually(lambda: state_of(client, first.id, S.TASK_STATE_COMPLETED), within=30)
    assert await count(api.engine, "SELECT count(*) FROM runs WHERE id = :id", id=second.id) == 0
    assert await check_all_runs(api.engine) == 1


async def test_a_pending_tasks_run_is_cancelled_as_the_task(api: Api, database_url: str) -> None:
    """Cancel once the pending task has started cancels its run (the same id)."""
    client = await sdk(api)
    first, second = await pending_pair(api, client)
    await client.cancel_task(CancelTaskRequest(id=first.id))  # the first ends: the second starts
    started = await client.get_task(GetTaskRequest(id=second.id))
    assert started.status.state == S.TASK_STATE_SUBMITTED
    assert turnstile_metadata(started).get("pendingTurn") is None  # a run now
    cancelled = await client.cancel_task(CancelTaskRequest(id=second.id))
    assert cancelled.status.state == S.TASK_STATE_CANCELED
    assert (await run_of(api, second.id)).status == "cancelled"


def event_id(response: StreamResponse) -> int | None:
    kind = response.WhichOneof("payload")
    assert kind is not None
    metadata = json_format.MessageToDict(getattr(response, kind).metadata)
    value = metadata.get("turnstile", {}).get("eventId")
    return int(value) if value is not None else None


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_a_pending_task_streamed_and_subscribed_to_gets_every_event_once(
    api: Api, database_url: str, binding: str
) -> None:
    client = await sdk(api, binding=binding)
    streaming = await sdk(api, streaming=True, binding=binding)
    first = await sent(client, request("first", message_id="m-1", data=FIRST))
    await set_policy(api, first.context_id, "enqueue")
    words = {"script": [{"say": "second one speaking", "delay": 0.01}]}
    stream = streaming.send_message(
        request("second", message_id="m-2", data=words, context_id=first.context_id)
    )
    opening = await anext(stream)  # the pending task, submitted
    assert opening.HasField("task")
    task_id = opening.task.id
    assert opening.task.status.state == S.TASK_STATE_SUBMITTED
    assert turnstile_metadata(opening.task)["pendingTurn"] is True
    subscription = streaming.subscribe(SubscribeToTaskRequest(id=task_id))
    subscribed_opening = await anext(subscription)
    assert subscribed_opening.task.id == task_id

    async def rest(items: AsyncIterator[StreamResponse]) -> list[StreamResponse]:
        return [item async for item in items]

    streamed = asyncio.create_task(rest(stream))
    subscribed = asyncio.create_task(rest(subscription))
    try:
        async with worker(database_url):
            seen = await asyncio.wait_for(asyncio.gather(streamed, subscribed), 60)
    finally:
        streamed.cancel()
        subscribed.cancel()
    run_events = await api.queue.events(UUID(task_id))
    mapped = {"run.created", "run.claimed", "run.succeeded", "message.completed"}
    expected = [e.seq for e in run_events if e.type in mapped]
    for items in seen:
        ids = [i for item in items if (i := event_id(item)) is not None]
        assert ids == sorted(set(ids))  # each once, in order
        assert ids == expected  # every one, from the run's first event
        assert all(
            getattr(item, str(item.WhichOneof("payload"))).task_id == task_id for item in items
        )
        states = [i.status_update.status.state for i in items if i.HasField("status_update")]
        assert states[0] == S.TASK_STATE_SUBMITTED  # run.created
        assert states[-1] == S.TASK_STATE_COMPLETED
        [result] = [
            i.artifact_update for i in items if i.artifact_update.artifact.artifact_id == "result"
        ]
        assert result.artifact.parts[0].text == "second one speaking"


async def test_a_resent_message_id_is_the_same_pending_task(api: Api, database_url: str) -> None:
    client = await sdk(api)
    first, second = await pending_pair(api, client)
    again = await sent(
        client, request("second", message_id="m-2", data=SECOND, context_id=first.context_id)
    )
    assert (again.id, again.status.state) == (second.id, S.TASK_STATE_SUBMITTED)
    assert await count(api.engine, "SELECT count(*) FROM pending_turns") == 1
    with pytest.raises(InvalidParamsError):  # the same id with another message
        await sent(client, request("other", message_id="m-2", context_id=first.context_id))
    async with worker(database_url):
        await eventually(lambda: state_of(client, second.id, S.TASK_STATE_COMPLETED), within=30)
    # Sent again after it ran: still that task (now its run), no new turn.
    late = await sent(
        client, request("second", message_id="m-2", data=SECOND, context_id=first.context_id)
    )
    assert (late.id, late.status.state) == (second.id, S.TASK_STATE_COMPLETED)
    assert await count(api.engine, "SELECT count(*) FROM pending_turns") == 1
    assert await check_all_runs(api.engine) == 2


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_another_tenants_pending_task_is_not_found(api: Api, binding: str) -> None:
    mine = await sdk(api, binding=binding)
    first, second = await pending_pair(api, mine)
    theirs = await sdk(api, "globex", "bob", binding=binding, streaming=True)
    colleague = await sdk(api, "acme", "bob", binding=binding, streaming=True)
    for other in (theirs, colleague):
        with pytest.raises(TaskNotFoundError):
            await other.get_task(GetTaskRequest(id=second.id))
        with pytest.raises(TaskNotFoundError):
            await other.cancel_task(CancelTaskRequest(id=second.id))
        with pytest.raises(TaskNotFoundError):
            _ = [e async for e in other.subscribe(SubscribeToTaskRequest(id=second.id))]
        listed = await other.list_tasks(ListTasksRequest(context_id=first.context_id))
        assert list(listed.tasks) == []
    # An operator key of the tenant sees every principal's tasks, pending ones too.
    operator = await sdk(api, key=await api.key("acme", "ops", "operator"), binding=binding)
    assert (await operator.get_task(GetTaskRequest(id=second.id))).id == second.id
    assert (await mine.get_task(GetTaskRequest(id=second.id))).status.state == (
        S.TASK_STATE_SUBMITTED
    )


async def test_the_policy_asked_in_a_messages_metadata(api: Api) -> None:
    """`metadata.multitask` (the request's, else the message's) overrides the session's
    policy for that message; a value that is no policy is invalid params, and writes nothing."""
    client = await sdk(api)
    first = await sent(client, request("first", message_id="m-1", data=FIRST))  # reject
    with pytest.raises(UnsupportedOperationError):
        await sent(client, request("no", message_id="m-2", context_id=first.context_id))
    queued = await sent(
        client,
        request(
            "later",
            message_id="m-3",
            context_id=first.context_id,
            metadata={"multitask": "enqueue"},
        ),
    )
    assert turnstile_metadata(queued)["policy"] == "enqueue"
    body = {
        "message": {
            "messageId": "m-4",
            "role": "ROLE_USER",
            "parts": [{"text": "steer me in"}],
            "contextId": first.context_id,
            "metadata": {"multitask": "steer"},
        },
        "configuration": {"returnImmediately": True},
    }
    steered = await sent(client, json_format.ParseDict(body, SendMessageRequest()))
    assert steered.id == first.id
    pending = await count(api.engine, "SELECT count(*) FROM pending_turns")
    with pytest.raises(InvalidParamsError) as invalid:
        await sent(
            client,
            request(
                "x", message_id="m-5", context_id=first.context_id, metadata={"multitask": "later"}
            ),
        )
    assert "multitask" in str(invalid.value)
    assert await count(api.engine, "SELECT count(*) FROM pending_turns") == pending == 2
    # A message naming a pending task is not its answer: it is not waiting for input.
    named = {
        "message": {
            "messageId": "m-6",
            "role": "ROLE_USER",
            "parts": [{"text": "answer"}],
            "taskId": queued.id,
        },
        "configuration": {"returnImmediately": True},
    }
    with pytest.raises(UnsupportedOperationError):
        await sent(client, json_format.ParseDict(named, SendMessageRequest()))


async def test_a_pending_tasks_push_configuration_reports_its_run(
    database_url: str, engine: AsyncEngine
) -> None:
    """A push configuration given with the message that became a pending task, or created on
    it, is the task's: its run (the same id) pushes its end to the receiver."""
    hooks: dict[str, Any] = {
        "secret_key": "k" * 40,
        "http_allowed_hosts": "127.0.0.1",
        "interrupt_grace_seconds": 120,
    }
    async with receiver() as hook, running_api(database_url, engine, **hooks) as api:
        try:
            client = await sdk(api)
            first = await sent(client, request("first", message_id="m-1", data=FIRST))
            await set_policy(api, first.context_id, "enqueue")
            body = json_format.MessageToDict(
                request("second", message_id="m-2", context_id=first.context_id)
            )
            body["configuration"] = {
                "returnImmediately": True,
                "taskPushNotificationConfig": {"url": hook.url, "token": "tok-given"},
            }
            second = await sent(client, json_format.ParseDict(body, SendMessageRequest()))
            assert turnstile_metadata(second)["pendingTurn"] is True
            made = await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=second.id, url=hook.url, token="tok-made")
            )
            assert made.task_id == second.id
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=second.id)
            )
            assert len(listed.configs) == 2
            # The worker delivers the notifications too: it needs the key and the allow list.
            delivering = {
                "TURNSTILE_SECRET_KEY": hooks["secret_key"],
                "TURNSTILE_HTTP_ALLOWED_HOSTS": hooks["http_allowed_hosts"],
            }
            async with worker(database_url, **delivering):
                await eventually(
                    lambda: state_of(client, second.id, S.TASK_STATE_COMPLETED), within=30
                )

                async def both() -> list[Delivery] | None:
                    return hook.deliveries if len(hook.deliveries) >= 2 else None

                deliveries = await eventually(both, within=30, what="the two notifications")
        finally:
            while HTTP_CLIENTS:
                await HTTP_CLIENTS.pop().aclose()
    tokens = sorted(d.headers["x-a2a-notification-token"] for d in deliveries)
    assert tokens == ["tok-given", "tok-made"]
    for delivery in deliveries:
        update = delivery.json["statusUpdate"]
        assert (update["taskId"], update["status"]["state"]) == (second.id, "TASK_STATE_COMPLETED")
