"""A2A push notifications driven by the official `a2a-sdk` client against a real server with
real workers, delivered to a real receiver on loopback: the four configuration methods on both
bindings, a configuration given in SendMessage, the task's status updates to its end with the
`X-A2A-Notification-Token` header, the configuration's `Authorization` and our Standard
Webhooks signature (keyed by the token), a delivery the receiver refused retried until it
lands, another tenant's task not found, and without TURNSTILE_SECRET_KEY push is not
supported (the card says so) and a message asking for it writes nothing."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import httpx
import pytest
from a2a.client import A2ACardResolver, A2AClientError, Client, ClientConfig, ClientFactory
from a2a.types import (
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import (
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotFoundError,
)
from google.protobuf import json_format
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.protocols import a2a
from app.queue.webhook_endpoints import Webhooks
from app.security.secret_box import SecretBox
from tests.support.api import Api, running_api
from tests.support.waiting import eventually
from tests.support.webhook_receiver import Delivery, Receiver, receiver

HOOKS: dict[str, Any] = {
    "secret_key": "k" * 40,
    "http_allowed_hosts": "127.0.0.1",  # the receiver's address, listed literally
    "webhook_backoff_base_seconds": 0.05,
    "webhook_backoff_max_seconds": 0.2,
}
BINDINGS = ["JSONRPC", "HTTP+JSON"]


@pytest.fixture
async def hook() -> AsyncIterator[Receiver]:
    async with receiver() as running:
        yield running


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, workers=True, **HOOKS) as running:
        yield running


@pytest.fixture
async def clients() -> AsyncIterator[list[httpx.AsyncClient]]:
    made: list[httpx.AsyncClient] = []
    yield made
    for http in made:
        await http.aclose()


async def sdk(
    api: Api, clients: list[httpx.AsyncClient], binding: str, tenant: str = "acme"
) -> Client:
    secret = await api.key(tenant, "alice")
    http = httpx.AsyncClient(headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    clients.append(http)
    config = ClientConfig(streaming=False, httpx_client=http, supported_protocol_bindings=[binding])
    return await ClientFactory(config).create_from_url(api.base)


def request(
    text_: str,
    *,
    message_id: str,
    data: dict[str, Any] | None = None,
    task_id: str | None = None,
    push: dict[str, Any] | None = None,
) -> SendMessageRequest:
    parts: list[dict[str, Any]] = [{"text": text_}]
    if data is not None:
        parts.append({"data": data})
    message: dict[str, Any] = {"messageId": message_id, "role": "ROLE_USER", "parts": parts}
    if task_id:
        message["taskId"] = task_id
    body: dict[str, Any] = {"message": message, "metadata": {"skill": "scripted"}}
    if push is not None:
        body["configuration"] = {"taskPushNotificationConfig": push}
    return json_format.ParseDict(body, SendMessageRequest())


async def sent(client: Client, req: SendMessageRequest) -> Task:
    [response] = [r async for r in client.send_message(req)]
    assert response.HasField("task")
    return response.task


ASKS = {"script": [{"ask": "Which account?"}, {"final": "paid"}]}


def states(hook: Receiver) -> list[str]:
    return [d.json["statusUpdate"]["status"]["state"] for d in hook.deliveries]


def signed_by_token(hook: Receiver, delivery: Delivery, token: str) -> bool:
    """Our Standard Webhooks signature, keyed by the configuration's token."""
    return hook.verify("whsec_" + base64.b64encode(token.encode()).decode(), delivery)


@pytest.mark.parametrize("binding", BINDINGS)
async def test_push_configurations_are_created_read_listed_and_deleted(
    api: Api, clients: list[httpx.AsyncClient], hook: Receiver, binding: str
) -> None:
    client = await sdk(api, clients, binding)
    async with httpx.AsyncClient() as plain:
        card = await A2ACardResolver(plain, api.base).get_agent_card()
    assert card.capabilities.push_notifications
    task = await sent(client, request("pay", message_id="m-1", data=ASKS))
    assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    made = await client.create_task_push_notification_config(
        TaskPushNotificationConfig(
            task_id=task.id,
            url=hook.url,
            token="tok-1",
            authentication={"scheme": "Bearer", "credentials": "receiver-secret"},
        )
    )
    assert (made.task_id, made.url, made.token) == (task.id, hook.url, "tok-1")
    assert made.id
    assert made.authentication.scheme == "Bearer"
    assert not made.authentication.credentials  # never shown back
    # Without a token, the configuration gets one of ours (it keys the signature).
    second = await client.create_task_push_notification_config(
        TaskPushNotificationConfig(task_id=task.id, url=hook.url)
    )
    assert len(second.token) >= 32
    got = await client.get_task_push_notification_config(
        GetTaskPushNotificationConfigRequest(task_id=task.id, id=made.id)
    )
    assert (got.id, got.url, got.token) == (made.id, hook.url, "tok-1")
    listed = await client.list_task_push_notification_configs(
        ListTaskPushNotificationConfigsRequest(task_id=task.id)
    )
    assert sorted(c.id for c in listed.configs) == sorted([made.id, second.id])
    one = await client.list_task_push_notification_configs(
        ListTaskPushNotificationConfigsRequest(task_id=task.id, page_size=1)
    )
    assert len(one.configs) == 1
    assert one.next_page_token
    rest = await client.list_task_push_notification_configs(
        ListTaskPushNotificationConfigsRequest(
            task_id=task.id, page_size=1, page_token=one.next_page_token
        )
    )
    assert {one.configs[0].id, rest.configs[0].id} == {made.id, second.id}
    await client.delete_task_push_notification_config(
        DeleteTaskPushNotificationConfigRequest(task_id=task.id, id=second.id)
    )
    listed = await client.list_task_push_notification_configs(
        ListTaskPushNotificationConfigsRequest(task_id=task.id)
    )
    assert [c.id for c in listed.configs] == [made.id]
    with pytest.raises(TaskNotFoundError):
        await client.get_task_push_notification_config(
            GetTaskPushNotificationConfigRequest(task_id=task.id, id=second.id)
        )
    # A URL the egress checks refuse is a bad parameter, and nothing is stored.
    with pytest.raises(InvalidParamsError):
        await client.create_task_push_notification_config(
            TaskPushNotificationConfig(task_id=task.id, url="http://10.0.0.1/hooks")
        )
    # The answer is pushed: the task's end reaches the receiver, authenticated both ways.
    done = await sent(client, request("checking", message_id="m-2", task_id=task.id))
    assert done.status.state == TaskState.TASK_STATE_COMPLETED
    [delivery] = await eventually(lambda: _some(hook), what="the push notification")
    assert delivery.headers["x-a2a-notification-token"] == "tok-1"
    assert delivery.headers["authorization"] == "Bearer receiver-secret"
    assert signed_by_token(hook, delivery, "tok-1")
    update = delivery.json["statusUpdate"]
    assert update["taskId"] == task.id
    assert update["contextId"] == task.context_id
    assert update["status"]["state"] == "TASK_STATE_COMPLETED"
    assert update["status"]["message"]["parts"] == [{"text": "paid"}]
    # The notification parses as the SDK's StreamResponse.
    parsed = json_format.ParseDict(delivery.json, StreamResponse(), ignore_unknown_fields=True)
    assert parsed.status_update.status.state == TaskState.TASK_STATE_COMPLETED


async def _some(hook: Receiver) -> list[Delivery] | None:
    return list(hook.deliveries) or None


@pytest.mark.parametrize("binding", BINDINGS)
async def test_a_configuration_in_send_message_pushes_every_status_to_the_end(
    api: Api, clients: list[httpx.AsyncClient], hook: Receiver, binding: str
) -> None:
    client = await sdk(api, clients, binding)
    script = {"script": [{"ask": "Which account?"}, {"ask": "Sure?"}, {"final": "paid"}]}
    task = await sent(client, request("pay", message_id="m-1", data=script))
    assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    push = {"url": hook.url, "token": "tok-send"}
    asked = await sent(client, request("savings", message_id="m-2", task_id=task.id, push=push))
    assert asked.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    done = await sent(client, request("yes", message_id="m-3", task_id=task.id))
    assert done.status.state == TaskState.TASK_STATE_COMPLETED

    async def both() -> list[str] | None:
        return states(hook) if len(hook.deliveries) >= 2 else None

    assert await eventually(both, what="two notifications") == [
        "TASK_STATE_INPUT_REQUIRED",
        "TASK_STATE_COMPLETED",
    ]
    first, last = hook.deliveries
    assert first.json["statusUpdate"]["status"]["message"]["parts"] == [{"text": "Sure?"}]
    for delivery in hook.deliveries:
        assert delivery.headers["x-a2a-notification-token"] == "tok-send"
        assert "authorization" not in delivery.headers
        assert signed_by_token(hook, delivery, "tok-send")
    assert first.id != last.id  # webhook-id: one per notification
    # A new task given a configuration has it too, stored as the task is created: its end is
    # pushed once, whether the transition saw the configuration or it came just after it.
    fresh = await sent(
        client, request("hi", message_id="m-4", push={"url": hook.url, "token": "tok-new"})
    )
    assert fresh.status.state == TaskState.TASK_STATE_COMPLETED
    listed = await client.list_task_push_notification_configs(
        ListTaskPushNotificationConfigsRequest(task_id=fresh.id)
    )
    [config] = listed.configs
    assert config.url == hook.url

    async def of_fresh() -> list[Delivery] | None:
        found = [d for d in hook.deliveries if d.json["statusUpdate"]["taskId"] == fresh.id]
        return found or None

    [pushed] = await eventually(of_fresh, what="the new task's notification")
    assert pushed.json["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
    assert pushed.headers["x-a2a-notification-token"] == "tok-new"
    async with api.engine.connect() as conn:
        made = await conn.execute(
            text("SELECT count(*) FROM webhook_deliveries WHERE endpoint_id = :id"),
            {"id": config.id},
        )
    assert made.scalar_one() == 1


async def test_a_refused_notification_is_retried_until_the_receiver_takes_it(
    api: Api, clients: list[httpx.AsyncClient], hook: Receiver
) -> None:
    client = await sdk(api, clients, "JSONRPC")
    hook.statuses = [503, 500]  # down twice, then up
    task = await sent(client, request("pay", message_id="m-1", data=ASKS))
    await client.create_task_push_notification_config(
        TaskPushNotificationConfig(task_id=task.id, url=hook.url, token="tok-r")
    )
    await sent(client, request("savings", message_id="m-2", task_id=task.id))

    async def three() -> list[Delivery] | None:
        return list(hook.deliveries) if len(hook.deliveries) >= 3 else None

    attempts = await eventually(three, what="the third attempt")
    assert len({d.id for d in attempts}) == 1  # one notification, the same webhook-id
    assert {d.json["statusUpdate"]["status"]["state"] for d in attempts} == {"TASK_STATE_COMPLETED"}
    assert all(d.headers["x-a2a-notification-token"] == "tok-r" for d in attempts)


@pytest.mark.parametrize("binding", BINDINGS)
async def test_another_tenants_task_has_no_push_configurations(
    api: Api, clients: list[httpx.AsyncClient], hook: Receiver, binding: str
) -> None:
    owner = await sdk(api, clients, binding)
    task = await sent(owner, request("pay", message_id="m-1", data=ASKS))
    made = await owner.create_task_push_notification_config(
        TaskPushNotificationConfig(task_id=task.id, url=hook.url)
    )
    other = await sdk(api, clients, binding, tenant="globex")
    with pytest.raises(TaskNotFoundError):
        await other.create_task_push_notification_config(
            TaskPushNotificationConfig(task_id=task.id, url=hook.url)
        )
    with pytest.raises(TaskNotFoundError):
        await other.get_task_push_notification_config(
            GetTaskPushNotificationConfigRequest(task_id=task.id, id=made.id)
        )
    with pytest.raises(TaskNotFoundError):
        await other.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task.id)
        )
    with pytest.raises((TaskNotFoundError, A2AClientError)):
        await other.delete_task_push_notification_config(
            DeleteTaskPushNotificationConfigRequest(task_id=task.id, id=made.id)
        )
    listed = await owner.list_task_push_notification_configs(
        ListTaskPushNotificationConfigsRequest(task_id=task.id)
    )
    assert [c.id for c in listed.configs] == [made.id]
    # Per-task configurations are not the tenant's webhook endpoints.
    ops = await api.client("acme", "ops", "operator")
    hooks = await ops.get("/webhooks")
    assert hooks.status_code == 200, hooks.text
    assert hooks.json()["webhooks"] == []


@pytest.mark.parametrize("binding", BINDINGS)
async def test_without_the_secret_key_push_is_not_supported_and_nothing_is_written(
    database_url: str, engine: AsyncEngine, clients: list[httpx.AsyncClient], binding: str
) -> None:
    async with running_api(database_url, engine, http_allowed_hosts="127.0.0.1") as api:
        client = await sdk(api, clients, binding)
        async with httpx.AsyncClient() as plain:
            card = await A2ACardResolver(plain, api.base).get_agent_card()
        assert not card.capabilities.push_notifications
        task = await sent(
            client,
            json_format.ParseDict(
                {
                    "message": {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "x"}]},
                    "configuration": {"returnImmediately": True},
                },
                SendMessageRequest(),
            ),
        )
        with pytest.raises(PushNotificationNotSupportedError):
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task.id, url="http://127.0.0.1:9/hooks")
            )
        # A message whose configuration cannot be kept makes no task either.
        with pytest.raises(PushNotificationNotSupportedError):
            await sent(client, request("hi", message_id="m-2", push={"url": "http://127.0.0.1:9/"}))
        async with engine.connect() as conn:
            runs = (await conn.execute(text("SELECT count(*) FROM runs"))).scalar_one()
            hooks = (
                await conn.execute(text("SELECT count(*) FROM webhook_endpoints"))
            ).scalar_one()
        assert (runs, hooks) == (1, 0)


async def test_a_configuration_stored_after_its_tasks_transition_gets_that_delivery_once(
    api: Api, clients: list[httpx.AsyncClient], hook: Receiver
) -> None:
    """The catch-up a SendMessage that starts a task runs after storing its configuration
    (the task may have asked or ended meanwhile), made deterministic: the task is already
    waiting when the configuration is stored through the core."""
    client = await sdk(api, clients, "JSONRPC")
    task = await sent(client, request("pay", message_id="m-1", data=ASKS))
    assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    webhooks = Webhooks(api.queue)
    config = await webhooks.create_task_push(
        tenant_id="acme",
        principal="alice",
        run_id=UUID(task.id),
        url=hook.url,
        secret=SecretBox(HOOKS["secret_key"]).encrypt(a2a.push_secret("tok-late", None)),
    )
    assert await webhooks.catch_up_task_push(config)
    assert not await webhooks.catch_up_task_push(config)  # once
    [delivery] = await eventually(lambda: _some(hook), what="the caught-up notification")
    status = delivery.json["statusUpdate"]["status"]
    assert status["state"] == "TASK_STATE_INPUT_REQUIRED"
    assert status["message"]["parts"] == [{"text": "Which account?"}]
    assert delivery.headers["x-a2a-notification-token"] == "tok-late"
    assert signed_by_token(hook, delivery, "tok-late")
    # The task's later transitions reach it as any configuration's do.
    await sent(client, request("savings", message_id="m-2", task_id=task.id))

    async def two() -> list[str] | None:
        return states(hook) if len(hook.deliveries) >= 2 else None

    assert await eventually(two, what="the end's notification") == [
        "TASK_STATE_INPUT_REQUIRED",
        "TASK_STATE_COMPLETED",
    ]
