"""An A2A task survives its worker: real `turnstile worker` processes behind a real API
server, the official `a2a-sdk` client subscribed to the task while its worker is SIGKILLed
mid-task. Another worker takes the run back once the lease lapses, and the subscriber sees the
task go back to `submitted`, work again and complete once, with one result."""

from __future__ import annotations

import asyncio
from uuid import UUID

import httpx
from a2a.client import ClientConfig, ClientFactory
from a2a.types import GetTaskRequest, SendMessageRequest, StreamResponse, SubscribeToTaskRequest
from a2a.types import TaskState as S
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import running_api
from tests.support.processes import turnstile
from tests.support.waiting import eventually

WORKER_ENV = {
    "TURNSTILE_LEASE_SECONDS": "3",
    "TURNSTILE_HEARTBEAT_SECONDS": "1",
    "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.5",
    "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0",
    "TURNSTILE_RETRY_BACKOFF_MAX_SECONDS": "0",
    "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
    "TURNSTILE_DRAIN_GRACE_SECONDS": "0",
}


async def test_a_task_whose_worker_is_killed_completes_once(
    database_url: str, engine: AsyncEngine
) -> None:
    env = {"DATABASE_URL": database_url, **WORKER_ENV}
    async with running_api(database_url, engine, workers=False) as api:
        key = await api.key()
        async with httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as http:
            client = await ClientFactory(
                ClientConfig(httpx_client=http, streaming=True, polling=True)
            ).create_from_url(api.base)
            script = {"script": [{"call": "sleep", "args": {"seconds": 2}}, {"final": "done"}]}
            request = json_format.ParseDict(
                {
                    "message": {
                        "messageId": "m-1",
                        "role": "ROLE_USER",
                        "parts": [{"text": "survive"}, {"data": script}],
                    },
                    "metadata": {"skill": "scripted"},
                    "configuration": {"returnImmediately": True},
                },
                SendMessageRequest(),
            )
            # Sent non-blocking (no stream: the subscription below is the stream).
            sender = await ClientFactory(
                ClientConfig(httpx_client=http, streaming=False, polling=True)
            ).create_from_url(api.base)
            [opening] = [r async for r in sender.send_message(request)]
            task_id = opening.task.id
            seen: list[StreamResponse] = []

            async def follow() -> None:
                async for item in client.subscribe(SubscribeToTaskRequest(id=task_id)):
                    seen.append(item)

            async def state_is(state: int) -> bool:
                got = await client.get_task(GetTaskRequest(id=task_id))
                return bool(got.status.state == state)

            following = asyncio.create_task(follow())
            try:
                async with turnstile("worker", ready=b"running slots", env=env) as first:
                    await eventually(lambda: state_is(S.TASK_STATE_WORKING), within=30)
                    first.process.kill()  # SIGKILL: no drain, no release; the lease lapses
                    await first.process.wait()
                async with turnstile("worker", ready=b"running slots", env=env):
                    await asyncio.wait_for(following, 60)
            finally:
                following.cancel()
            done = await client.get_task(GetTaskRequest(id=task_id))
    assert done.status.state == S.TASK_STATE_COMPLETED
    assert [a.parts[0].text for a in done.artifacts] == ["done"]
    states = [i.status_update.status.state for i in seen if i.HasField("status_update")]
    assert states[-1] == S.TASK_STATE_COMPLETED
    assert states.count(S.TASK_STATE_COMPLETED) == 1
    # Taken back after the kill: submitted again, then working again, under the next claim.
    assert S.TASK_STATE_SUBMITTED in states
    assert states[states.index(S.TASK_STATE_SUBMITTED) :].count(S.TASK_STATE_WORKING) == 1
    results = [i for i in seen if i.HasField("artifact_update") and i.artifact_update.artifact.name]
    assert len(results) == 1
    run = await api.queue.get_run(UUID(task_id))
    assert run is not None
    claims = [e.epoch for e in await api.queue.events(run.id) if e.type == "run.claimed"]
    assert claims == [1, 2]
