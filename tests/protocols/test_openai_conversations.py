"""The OpenAI Conversations API at /v1, and responses that join a conversation, driven by the
official `openai` SDK against a real server with real workers: a two-turn conversation whose
second answer shows the first was remembered (the `openai` agent against the fake model
endpoint), `previous_response_id`, the conversation's items from its transcript, what is
refused (items added or deleted on their own), metadata kept and updated, deleting a
conversation, another
tenant's conversation (not found), and a question asked with `ask_user` answered by a
`function_call_output` that resumes the same run."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial

import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.protocols.openai_responses import run_id_of
from tests.runtime.test_openai_agent import FakeModel
from tests.support.api import Api, running_api
from tests.support.servers import running_server
from tests.support.waiting import eventually

SDK_CLIENTS: list[AsyncOpenAI] = []


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, workers=True) as running:
        try:
            yield running
        finally:
            while SDK_CLIENTS:
                await SDK_CLIENTS.pop().close()


async def sdk(api: Api, tenant: str = "acme", principal: str = "alice") -> AsyncOpenAI:
    key = await api.key(tenant, principal)
    client = AsyncOpenAI(base_url=f"{api.base}/v1", api_key=key, max_retries=0)
    SDK_CLIENTS.append(client)
    return client


async def test_a_two_turn_conversation_remembers_the_first_turn(
    database_url: str, engine: AsyncEngine
) -> None:
    fake = FakeModel()
    fake.say("Nice to meet you, Ada.")
    fake.say("Your name is Ada.")
    async with (
        running_server(fake.app()) as model_base,
        running_api(
            database_url,
            engine,
            workers=True,
            openai_base_url=f"{model_base}/v1",
            openai_stream=False,
        ) as running,
    ):
        try:
            client = await sdk(running)
            conversation = await client.conversations.create()
            assert conversation.id.startswith("conv_")
            assert conversation.object == "conversation"
            first = await client.responses.create(
                model="openai", input="My name is Ada.", conversation=conversation.id
            )
            assert first.status == "completed"
            assert first.output_text == "Nice to meet you, Ada."
            assert first.conversation is not None
            assert first.conversation.id == conversation.id
            second = await client.responses.create(
                model="openai", input="What is my name?", conversation={"id": conversation.id}
            )
            assert second.output_text == "Your name is Ada."
            # The second model call was given the first turn: the conversation was remembered.
            turns = [(m["role"], m["content"]) for m in fake.requests[1]["messages"]]
            assert ("user", "My name is Ada.") in turns
            assert ("assistant", "Nice to meet you, Ada.") in turns
            assert turns[-1] == ("user", "What is my name?")
            # The items are the transcript, newest first by default.
            items = [item async for item in client.conversations.items.list(conversation.id)]
            said = [(i.role, i.content[0].text) for i in items if i.type == "message"]  # type: ignore[union-attr]
            assert said == [
                ("assistant", "Your name is Ada."),
                ("user", "What is my name?"),
                ("assistant", "Nice to meet you, Ada."),
                ("user", "My name is Ada."),
            ]
            oldest = await client.conversations.items.list(conversation.id, order="asc", limit=1)
            assert [i.id for i in oldest.data] == [items[-1].id]
            assert oldest.has_more
            fetched = await client.conversations.items.retrieve(
                items[0].id, conversation_id=conversation.id
            )
            assert fetched.id == items[0].id
            # Deleted whole, with its runs; then not found.
            deleted = await client.conversations.delete(conversation.id)
            assert deleted.deleted is True
            with pytest.raises(openai.NotFoundError):
                await client.conversations.retrieve(conversation.id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(first.id)
        finally:
            while SDK_CLIENTS:
                await SDK_CLIENTS.pop().close()


async def test_previous_response_id_continues_its_conversation(api: Api) -> None:
    client = await sdk(api)
    conversation = await client.conversations.create()
    first = await client.responses.create(
        model="scripted", input="first", conversation=conversation.id
    )
    second = await client.responses.create(
        model="scripted", input="second", previous_response_id=first.id
    )
    assert second.conversation is not None
    assert second.conversation.id == conversation.id
    first_run = await api.queue.get_run(run_id_of(first.id))
    second_run = await api.queue.get_run(run_id_of(second.id))
    assert first_run is not None
    assert second_run is not None
    assert first_run.session_id == second_run.session_id
    # Only from the latest response (no branches: tests/protocols/test_openai_response_chains.py
    # has responses of their own chained).
    with pytest.raises(openai.BadRequestError) as branched:
        await client.responses.create(model="scripted", input="x", previous_response_id=first.id)
    assert "latest" in branched.value.message
    assert branched.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_what_the_transcript_cannot_do_is_refused_and_writes_nothing(api: Api) -> None:
    client = await sdk(api)
    conversation = await client.conversations.create()
    item = {"type": "message", "role": "user", "content": "hi"}
    with pytest.raises(openai.BadRequestError):
        await client.conversations.items.create(conversation.id, items=[item])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError):
        await client.conversations.items.delete("msg_1_1", conversation_id=conversation.id)
    with pytest.raises(openai.BadRequestError):
        await client.conversations.create(items=[item])  # type: ignore[list-item]
    page = await client.conversations.items.list(conversation.id)
    assert page.data == []
    with pytest.raises(openai.NotFoundError):
        await client.conversations.items.retrieve("msg_1_1", conversation_id=conversation.id)
    # Another tenant sees no such conversation, and cannot add a response to it.
    theirs = await sdk(api, "globex", "bob")
    with pytest.raises(openai.NotFoundError):
        await theirs.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        await theirs.responses.create(model="scripted", input="x", conversation=conversation.id)
    with pytest.raises(openai.NotFoundError):
        await theirs.conversations.delete(conversation.id)
    for unknown in ("conv_" + "0" * 32, "conv_x", "nope"):
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(unknown)


async def test_an_ask_user_call_answered_with_its_output_resumes_the_same_run(api: Api) -> None:
    client = await sdk(api)
    conversation = await client.conversations.create()
    script = [{"ask": "Which account?"}, {"say": "Paid from the account you named."}]
    asked = await client.responses.create(
        model="scripted",
        input="pay the bill",
        conversation=conversation.id,
        extra_body={"agent_input": {"script": script}},
    )
    assert asked.status == "incomplete"
    [call] = asked.output
    assert call.type == "function_call"
    assert call.name == "ask_user"
    assert json.loads(call.arguments) == {"question": "Which account?"}
    # A run waiting for its answer keeps the conversation: not deleted under it.
    with pytest.raises(openai.ConflictError) as busy:
        await client.conversations.delete(conversation.id)
    assert busy.value.body["code"] == "session_busy"  # type: ignore[index]
    # The question is waiting, so an unknown call_id is refused.
    with pytest.raises(openai.BadRequestError) as wrong:
        await client.responses.create(
            model="scripted",
            conversation=conversation.id,
            input=[{"type": "function_call_output", "call_id": "call_x", "output": "no"}],
        )
    assert call.call_id in wrong.value.message
    answered = await client.responses.create(
        model="scripted",
        conversation=conversation.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "savings"}],
    )
    # The same run, resumed: the same response, now complete.
    assert answered.id == asked.id
    assert answered.status == "completed"
    assert answered.output_text == "Paid from the account you named."
    run = await api.queue.get_run(run_id_of(asked.id))
    assert run is not None
    assert run.inputs_count == 2
    items = await client.conversations.items.list(conversation.id, order="asc")
    kinds = [(i.type, getattr(i, "call_id", None)) for i in items.data]
    assert kinds == [
        ("message", None),
        ("function_call", call.call_id),
        ("function_call_output", call.call_id),
        ("message", None),
    ]
    # Answered once: the same output again names no waiting question.
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(
            model="scripted",
            conversation=conversation.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "x"}],
        )
    # A conversation with nothing going is deleted whole.
    await eventually(
        lambda: client.conversations.delete(conversation.id), what="the conversation's delete"
    )


async def test_a_conversations_metadata_is_kept_and_updated_key_by_key(api: Api) -> None:
    client = await sdk(api)
    conversation = await client.conversations.create(metadata={"topic": "billing", "tier": "1"})
    assert conversation.metadata == {"topic": "billing", "tier": "1"}
    fetched = await client.conversations.retrieve(conversation.id)
    assert fetched.metadata == {"topic": "billing", "tier": "1"}
    # An update sets the keys it gives and keeps the others, as OpenAI's does.
    updated = await client.conversations.update(conversation.id, metadata={"tier": "2", "a": ""})
    assert updated.metadata == {"topic": "billing", "tier": "2", "a": ""}
    assert (await client.conversations.retrieve(conversation.id)).metadata == updated.metadata
    # A response in it keeps its own metadata; the conversation's is unchanged.
    response = await client.responses.create(
        model="scripted", input="hi", conversation=conversation.id, metadata={"r": "1"}
    )
    assert response.metadata == {"r": "1"}
    assert (await client.conversations.retrieve(conversation.id)).metadata == updated.metadata
    # OpenAI's bounds, each a 400 naming metadata, writing nothing.
    bad: list[object] = [
        {f"k{n}": "v" for n in range(17)},  # more than 16 pairs
        {"k" * 65: "v"},  # a key longer than 64 characters
        {"k": "v" * 513},  # a value longer than 512
        {"k": 1},  # not a string
        ["k"],  # not an object
    ]
    for metadata in bad:
        for call in (
            partial(client.conversations.create, metadata=metadata),
            partial(client.conversations.update, conversation.id, metadata=metadata),
            partial(client.responses.create, model="scripted", input="x", metadata=metadata),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await call()
            param = refused.value.body["param"]  # type: ignore[index]
            assert param.startswith("metadata"), (metadata, refused.value.body)
            assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    # At the bounds it is taken.
    longest = {f"{n:02d}" + "k" * 62: "v" * 512 for n in range(16)}
    full = await client.conversations.create(metadata=longest)
    assert (await client.conversations.retrieve(full.id)).metadata == longest
    # 16 pairs at most counted on the merged set: a 17th key is refused, nothing changed.
    with pytest.raises(openai.BadRequestError) as over:
        await client.conversations.update(full.id, metadata={"one-more": "x"})
    assert over.value.body["param"] == "metadata"  # type: ignore[index]
    assert "16" in over.value.message
    assert (await client.conversations.retrieve(full.id)).metadata == longest
    # Keys already there may change.
    changed = await client.conversations.update(full.id, metadata={"00" + "k" * 62: "new"})
    assert changed.metadata["00" + "k" * 62] == "new"
    # Another tenant neither sees nor updates it.
    theirs = await sdk(api, "globex", "bob")
    with pytest.raises(openai.NotFoundError):
        await theirs.conversations.update(conversation.id, metadata={"topic": "stolen"})
    assert (await client.conversations.retrieve(conversation.id)).metadata == updated.metadata
