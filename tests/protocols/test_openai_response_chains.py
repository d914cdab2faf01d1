"""`previous_response_id` against a response of its own (no conversation), driven by the
official `openai` SDK against a real server with real workers: a stored response is the first
turn of a session of its own, so the next response chained from it sees the first exchange (the
`openai` agent against the fake model endpoint); chaining from a response that is not its
chain's latest is refused (Turnstile cannot branch a history), as is chaining from a
`store: false` one; a create retried with its `Idempotency-Key` replays and makes no second
session; another tenant's response is not found; an `ask_user` question is answered through
`previous_response_id`; a chain's response is deleted alone only while it is the chain's only
one; a refused create (the rate limit) leaves no session behind."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.protocols.openai_conversations import conversation_id
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


async def counts(engine: AsyncEngine) -> tuple[int, int]:
    """How many sessions and runs the database holds."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text("SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM runs)")
            )
        ).one()
        return int(row[0]), int(row[1])


async def session_of(api: Api, response_id: str) -> str:
    run = await api.queue.get_run(run_id_of(response_id))
    assert run is not None
    assert run.session_id is not None
    return conversation_id(run.session_id)


async def test_a_response_chained_to_a_response_of_its_own_sees_the_first_exchange(
    database_url: str, engine: AsyncEngine
) -> None:
    fake = FakeModel()
    fake.say("Nice to meet you, Ada.")
    fake.say("Your name is Ada.")
    fake.say("You asked me your name.")
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
            first = await client.responses.create(model="openai", input="My name is Ada.")
            assert first.output_text == "Nice to meet you, Ada."
            # A response of its own: no conversation, as OpenAI shows it.
            assert first.conversation is None
            assert first.store is True
            second = await client.responses.create(
                model="openai", input="What is my name?", previous_response_id=first.id
            )
            assert second.output_text == "Your name is Ada."
            assert second.conversation is None
            # The second model call was given the first exchange.
            turns = [(m["role"], m["content"]) for m in fake.requests[1]["messages"]]
            assert ("user", "My name is Ada.") in turns
            assert ("assistant", "Nice to meet you, Ada.") in turns
            assert turns[-1] == ("user", "What is my name?")
            assert await session_of(running, first.id) == await session_of(running, second.id)
            # OpenAI would branch a new history from the older response; Turnstile cannot,
            # and says so, writing nothing.
            before = await counts(engine)
            with pytest.raises(openai.BadRequestError) as branched:
                await client.responses.create(
                    model="openai", input="And my age?", previous_response_id=first.id
                )
            assert branched.value.body["param"] == "previous_response_id"  # type: ignore[index]
            assert "branch" in branched.value.message
            assert second.id in branched.value.message  # where to continue from instead
            assert await counts(engine) == before
            # From the latest, the chain goes on, with both exchanges before it.
            third = await client.responses.create(
                model="openai", input="What did I ask?", previous_response_id=second.id
            )
            assert third.output_text == "You asked me your name."
            turns = [(m["role"], m["content"]) for m in fake.requests[2]["messages"]]
            assert ("assistant", "Your name is Ada.") in turns
            assert ("user", "My name is Ada.") in turns
            # Every response of the chain reads back as it was.
            assert (await client.responses.retrieve(first.id)).output_text == first.output_text
            assert len(fake.requests) == 3
        finally:
            while SDK_CLIENTS:
                await SDK_CLIENTS.pop().close()


async def test_a_store_false_response_is_not_chainable(api: Api) -> None:
    client = await sdk(api)
    before = await counts(api.engine)
    alone = await client.responses.create(model="scripted", input="forget me", store=False)
    assert alone.status == "completed"
    assert alone.store is False
    assert alone.conversation is None
    # A sessionless run: no session was made for it.
    assert await counts(api.engine) == (before[0], before[1] + 1)
    run = await api.queue.get_run(run_id_of(alone.id))
    assert run is not None
    assert run.session_id is None
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="scripted", input="x", previous_response_id=alone.id)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert "store=false" in refused.value.message
    # A continuation is kept in its session's history, so store=false is refused on it too.
    kept = await client.responses.create(model="scripted", input="kept")
    with pytest.raises(openai.BadRequestError) as unstored:
        await client.responses.create(
            model="scripted", input="x", previous_response_id=kept.id, store=False
        )
    assert unstored.value.body["param"] == "store"  # type: ignore[index]
    assert await counts(api.engine) == (before[0] + 1, before[1] + 2)
    # A store=false response of its own is still read, and deleted, as any.
    assert (await client.responses.retrieve(alone.id)).output_text == "forget me"
    await client.responses.delete(alone.id)


async def test_a_chained_create_retried_with_its_key_replays_and_makes_no_second_session(
    api: Api,
) -> None:
    client = await sdk(api)
    before = await counts(api.engine)
    first = await client.responses.create(
        model="scripted", input="once", background=True, extra_headers={"Idempotency-Key": "c-1"}
    )
    again = await client.responses.with_raw_response.create(
        model="scripted", input="once", background=True, extra_headers={"Idempotency-Key": "c-1"}
    )
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.parse().id == first.id
    assert await counts(api.engine) == (before[0] + 1, before[1] + 1)
    # The same key with another body is refused before anything is made.
    with pytest.raises(openai.UnprocessableEntityError):
        await client.responses.create(
            model="scripted", input="other", extra_headers={"Idempotency-Key": "c-1"}
        )
    assert await counts(api.engine) == (before[0] + 1, before[1] + 1)

    async def done() -> bool:
        return (await client.responses.retrieve(first.id)).status == "completed"

    await eventually(done, what="the first response's end")
    # A continuation retried with its key is one run in the same session.
    second = await client.responses.create(
        model="scripted",
        input="twice",
        previous_response_id=first.id,
        extra_headers={"Idempotency-Key": "c-2"},
    )
    replayed = await client.responses.with_raw_response.create(
        model="scripted",
        input="twice",
        previous_response_id=first.id,
        extra_headers={"Idempotency-Key": "c-2"},
    )
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert replayed.parse().id == second.id
    assert await counts(api.engine) == (before[0] + 1, before[1] + 2)
    assert await session_of(api, second.id) == await session_of(api, first.id)


async def test_another_tenants_previous_response_is_not_found(api: Api) -> None:
    mine = await sdk(api, "acme", "alice")
    theirs = await sdk(api, "globex", "bob")
    created = await mine.responses.create(model="scripted", input="private")
    before = await counts(api.engine)
    with pytest.raises(openai.NotFoundError) as hidden:
        await theirs.responses.create(model="scripted", input="x", previous_response_id=created.id)
    assert hidden.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for unknown in ("resp_" + "0" * 32, "resp_1"):
        with pytest.raises(openai.NotFoundError):
            await mine.responses.create(model="scripted", input="x", previous_response_id=unknown)
    assert await counts(api.engine) == before


async def test_a_question_is_answered_through_previous_response_id(api: Api) -> None:
    client = await sdk(api)
    script = [{"ask": "Which account?"}, {"say": "Paid from the account you named."}]
    asked = await client.responses.create(
        model="scripted", input="pay the bill", extra_body={"agent_input": {"script": script}}
    )
    assert asked.status == "incomplete"
    [call] = asked.output
    assert call.type == "function_call"
    assert json.loads(call.arguments) == {"question": "Which account?"}
    answered = await client.responses.create(
        model="scripted",
        previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "savings"}],
    )
    # The same run, resumed: the same response, now complete.
    assert answered.id == asked.id
    assert answered.status == "completed"
    assert answered.output_text == "Paid from the account you named."
    # Without previous_response_id (or a conversation) an answer names nothing to answer.
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(
            model="scripted",
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "x"}],
        )


async def test_a_chains_response_is_deleted_alone_only_while_it_is_the_only_one(
    api: Api,
) -> None:
    client = await sdk(api)
    before = await counts(api.engine)
    alone = await client.responses.create(model="scripted", input="alone")
    await client.responses.delete(alone.id)
    # Its session went with it.
    assert await counts(api.engine) == before
    first = await client.responses.create(model="scripted", input="first")
    second = await client.responses.create(
        model="scripted", input="second", previous_response_id=first.id
    )
    chain = await session_of(api, first.id)
    for response in (first, second):
        with pytest.raises(openai.BadRequestError) as kept:
            await client.responses.delete(response.id)
        assert chain in kept.value.message  # how to delete the whole chain
    assert (await client.responses.retrieve(first.id)).status == "completed"
    deleted = await client.conversations.delete(chain)
    assert deleted.deleted is True
    assert await counts(api.engine) == before


async def test_a_response_over_the_rate_limit_is_refused_and_leaves_no_session(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url, engine, workers=True, submit_rate_per_second=0.001, submit_burst=1
    ) as limited:
        try:
            client = await sdk(limited)
            await client.responses.create(model="scripted", input="first", background=True)
            before = await counts(engine)
            with pytest.raises(openai.RateLimitError) as refused:
                await client.responses.create(model="scripted", input="second", background=True)
            assert int(refused.value.response.headers["retry-after"]) >= 1
            # No run, and not even the session the response would have started.
            assert await counts(engine) == before
        finally:
            while SDK_CLIENTS:
                await SDK_CLIENTS.pop().close()
