"""Approval before a tool call through the OpenAI Responses API at /v1 (issue 33 item 2;
docs/approvals.md, docs/responses-api.md), driven by the official `openai` SDK against a real
server with its workers: a run waiting for a call's approval ends its response with OpenAI's
`mcp_approval_request` item; an `mcp_approval_response` naming it approves (the call runs once
and the same response completes) or rejects (the agent is told, with the reason); a question's
answer, an unknown request id, or a decision beside a message is refused in OpenAI's error
shape and writes nothing; a decision sent again with its key replays; the conversation's items
show the request and the decision in their place."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.protocols.openai_responses import run_id_of
from tests.support.api import Api, running_api

# The scripted agent calls `echo` (which the server's policy holds for approval), then says.
SCRIPT = {"script": [{"call": "echo", "args": {"n": 1}}, {"say": "done"}]}


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, workers=True, approval_required="echo") as api:
        yield api


@pytest.fixture
async def client(api: Api) -> AsyncIterator[AsyncOpenAI]:
    key = await api.key("acme", "alice")
    sdk = AsyncOpenAI(base_url=f"{api.base}/v1", api_key=key, max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()


async def asked(client: AsyncOpenAI, conversation: str) -> openai.types.responses.Response:
    response = await client.responses.create(
        model="scripted", input="go", conversation=conversation, extra_body={"agent_input": SCRIPT}
    )
    assert response.status == "incomplete"
    return response


async def test_an_approved_call_runs_once_and_the_same_response_completes(
    api: Api, client: AsyncOpenAI
) -> None:
    conversation = await client.conversations.create()
    waiting = await asked(client, conversation.id)
    [request] = waiting.output
    assert request.type == "mcp_approval_request"
    assert request.name == "echo"
    assert request.server_label == "turnstile"
    assert json.loads(request.arguments) == {"n": 1}
    # Retrieved again, the response shows the same request.
    again = await client.responses.retrieve(waiting.id)
    assert [item.id for item in again.output] == [request.id]

    approval = {"type": "mcp_approval_response", "approval_request_id": request.id}
    approved = await client.responses.create(
        model="scripted",
        previous_response_id=waiting.id,
        input=[{**approval, "approve": True}],  # type: ignore[list-item]
        extra_headers={"Idempotency-Key": "approve-1"},
    )
    assert approved.id == waiting.id  # the same run, resumed
    assert approved.status == "completed"
    assert approved.output_text == "done"
    run = await api.queue.get_run(run_id_of(waiting.id))
    assert run is not None
    assert isinstance(run.result, dict)
    assert [o["status"] for o in run.result["tool_outcomes"]] == ["succeeded"]  # type: ignore[index,union-attr]

    # The same decision with its key replays; a fresh one finds nothing waiting.
    replayed = await client.responses.with_raw_response.create(
        model="scripted",
        previous_response_id=waiting.id,
        input=[{**approval, "approve": True}],  # type: ignore[list-item]
        extra_headers={"Idempotency-Key": "approve-1"},
    )
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.parse().id == waiting.id
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(
            model="scripted",
            conversation=conversation.id,
            input=[{**approval, "approve": True}],  # type: ignore[list-item]
        )

    items = await client.conversations.items.list(conversation.id, order="asc")
    kinds = [item.type for item in items.data]
    assert kinds == [
        "message",
        "mcp_approval_request",
        "mcp_approval_response",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert items.data[1].id == request.id
    decision = items.data[2]
    assert decision.type == "mcp_approval_response"
    assert decision.approval_request_id == request.id
    assert decision.approve is True


async def test_a_rejected_call_never_runs_and_the_agent_is_told_why(
    api: Api, client: AsyncOpenAI
) -> None:
    conversation = await client.conversations.create()
    waiting = await asked(client, conversation.id)
    [request] = waiting.output
    rejected = await client.responses.create(
        model="scripted",
        conversation=conversation.id,
        input=[
            {
                "type": "mcp_approval_response",
                "approval_request_id": request.id,
                "approve": False,
                "reason": "not today",
            }
        ],
    )
    assert rejected.id == waiting.id
    assert rejected.status == "completed"
    run = await api.queue.get_run(run_id_of(waiting.id))
    assert run is not None
    assert isinstance(run.result, dict)
    [outcome] = run.result["tool_outcomes"]  # type: ignore[misc]
    assert outcome["status"] == "rejected"  # type: ignore[index]
    assert "not today" in json.dumps(outcome)
    items = await client.conversations.items.list(conversation.id, order="asc")
    decision = next(item for item in items.data if item.type == "mcp_approval_response")
    assert decision.approve is False
    assert decision.reason == "not today"


async def test_what_does_not_decide_the_waiting_call_is_refused_and_writes_nothing(
    api: Api, client: AsyncOpenAI
) -> None:
    conversation = await client.conversations.create()
    waiting = await asked(client, conversation.id)
    [request] = waiting.output
    decision = {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}
    refusals = {
        # A question's answer to a run waiting for an approval: the error names the request.
        "function_call_output": [
            {"type": "function_call_output", "call_id": "call_x", "output": "yes"}
        ],
        "unknown request": [{**decision, "approval_request_id": "mcpr_nope"}],
        "a decision beside a message": [decision, {"role": "user", "content": "and hurry"}],
        "two decisions": [decision, decision],
    }
    for what, items in refusals.items():
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="scripted",
                conversation=conversation.id,
                input=items,  # type: ignore[arg-type]
            )
        assert refused.value.code == "invalid_request", what
        if what in ("function_call_output", "unknown request"):
            assert request.id in refused.value.message, what
    # A decision without its approve, and one without a conversation.
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(
            model="scripted",
            conversation=conversation.id,
            input=[{"type": "mcp_approval_response", "approval_request_id": request.id}],  # type: ignore[list-item]
        )
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="scripted", input=[decision])  # type: ignore[list-item]
    # Nothing was written: the run still waits for its one decision.
    run = await api.queue.get_run(run_id_of(waiting.id))
    assert run is not None
    assert run.status == "waiting_for_user"
    assert run.inputs_count == 1
