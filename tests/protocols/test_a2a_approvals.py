"""Approval before a tool call over A2A (issue 33 item 2; docs/approvals.md, docs/a2a.md),
driven by the official `a2a-sdk` client on both bindings against a real server with its
workers: a task waiting for a call's approval is `input-required` with a text part saying how
to answer and the request as a data part; a message to the task whose data part `approval`
approves, edits or rejects the call resumes the same task (the call run once, with the edited
arguments, or refused with the message's text as the reason); a message id sent again replays;
a plain answer, another call's id and a malformed decision are refused and write nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import pytest
from a2a.types import Task, TaskState
from a2a.utils.errors import InvalidParamsError, UnsupportedOperationError
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.protocols.test_a2a import HTTP_CLIENTS, request, result_text, sdk, sent
from tests.support.api import Api, running_api

BINDINGS = pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
# The scripted agent calls `echo` (the server's policy holds it for approval), then finishes.
SCRIPT = {"script": [{"call": "echo", "args": {"n": 1}}, {"final": "done"}]}


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, workers=True, approval_required="echo") as api:
        try:
            yield api
        finally:
            while HTTP_CLIENTS:
                await HTTP_CLIENTS.pop().aclose()


def approval_request(task: Task) -> dict[str, Any]:
    assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    how, data = task.status.message.parts
    assert "approve" in how.text
    request_ = json_format.MessageToDict(data.data)["approval_request"]
    assert isinstance(request_, dict)
    assert request_["call_id"] in how.text
    return request_


def decision(message_id: str, task: Task, text: str = "", **approval: Any) -> Any:
    return request(
        text, message_id=message_id, task_id=task.id, data={"approval": approval}, skill=None
    )


async def outcomes(api: Api, task: Task) -> list[dict[str, Any]]:
    run = await api.queue.get_run(UUID(task.id))
    assert run is not None
    assert isinstance(run.result, dict)
    found = run.result["tool_outcomes"]
    assert isinstance(found, list)
    return [o for o in found if isinstance(o, dict)]


@BINDINGS
async def test_an_approved_call_runs_once_and_the_same_task_completes(
    api: Api, binding: str
) -> None:
    client = await sdk(api, binding=binding)
    task = await sent(client, request("go", message_id="m-1", data=SCRIPT))
    asked = approval_request(task)
    assert asked["tool"] == "echo"
    assert asked["arguments"] == {"n": 1}
    approved = await sent(
        client, decision("m-2", task, call_id=asked["call_id"], decision="approve")
    )
    assert approved.id == task.id  # the same run, resumed
    assert approved.status.state == TaskState.TASK_STATE_COMPLETED
    assert result_text(approved) == "done"
    [outcome] = await outcomes(api, task)
    assert outcome["status"] == "succeeded"
    # The decision sent again (a retry after a lost reply) is the same task, decided once.
    again = await sent(client, decision("m-2", task, call_id=asked["call_id"], decision="approve"))
    assert again.id == task.id
    assert len(await outcomes(api, task)) == 1


@BINDINGS
async def test_an_edit_runs_the_call_with_the_edited_arguments(api: Api, binding: str) -> None:
    client = await sdk(api, binding=binding)
    task = await sent(client, request("go", message_id="m-1", data=SCRIPT))
    asked = approval_request(task)
    edited = await sent(
        client, decision("m-2", task, call_id=asked["call_id"], decision="edit", args={"n": 2})
    )
    assert edited.status.state == TaskState.TASK_STATE_COMPLETED
    [outcome] = await outcomes(api, task)
    assert outcome["outcome"] == {"echo": {"n": 2}}


@BINDINGS
async def test_a_rejection_takes_the_messages_text_as_its_reason(api: Api, binding: str) -> None:
    client = await sdk(api, binding=binding)
    task = await sent(client, request("go", message_id="m-1", data=SCRIPT))
    asked = approval_request(task)
    rejected = await sent(
        client, decision("m-2", task, "not today", call_id=asked["call_id"], decision="reject")
    )
    assert rejected.id == task.id
    assert rejected.status.state == TaskState.TASK_STATE_COMPLETED
    [outcome] = await outcomes(api, task)
    assert outcome["status"] == "rejected"
    assert "not today" in str(outcome["outcome"])


@BINDINGS
async def test_what_does_not_decide_the_call_is_refused_and_writes_nothing(
    api: Api, binding: str
) -> None:
    client = await sdk(api, binding=binding)
    task = await sent(client, request("go", message_id="m-1", data=SCRIPT))
    asked = approval_request(task)
    # A plain answer: the error names the call and how to decide it.
    with pytest.raises(UnsupportedOperationError) as pending:
        await sent(client, request("yes", message_id="m-2", task_id=task.id, skill=None))
    assert pending.value.data is not None
    assert pending.value.data["callId"] == asked["call_id"]
    # Another call's id, a decision that is none, and an edit outside the tool's schema.
    with pytest.raises(InvalidParamsError):
        await sent(client, decision("m-3", task, call_id="call_other", decision="approve"))
    with pytest.raises(InvalidParamsError):
        await sent(client, decision("m-4", task, call_id=asked["call_id"], decision="maybe"))
    with pytest.raises(InvalidParamsError):
        await sent(client, request("x", message_id="m-5", task_id=task.id, data={"approval": 1}))
    # A decision that names no task has nothing to decide.
    with pytest.raises(InvalidParamsError):
        await sent(client, request("x", message_id="m-6", data={"approval": {"call_id": "c"}}))
    run = await api.queue.get_run(UUID(task.id))
    assert run is not None
    assert run.status == "waiting_for_user"
    assert run.inputs_count == 1
    # Still decidable afterwards.
    approved = await sent(
        client, decision("m-7", task, call_id=asked["call_id"], decision="approve")
    )
    assert approved.status.state == TaskState.TASK_STATE_COMPLETED
