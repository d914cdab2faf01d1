"""The OpenAI Responses API at /v1 driven by the official `openai` SDK, unchanged, against a
real server with real workers: a background response polled to completion, one waited for
(`background: false`), one streamed, a cancel, an `Idempotency-Key` retry making one run,
another tenant's response not found, a bad key, and bad input answered in OpenAI's error shape
(never a 5xx), also under a bounded fuzz of the /v1 routes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI
from openai.types.responses import Response
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.protocols.openai_responses import CHUNK_LIMIT, chunk_ends, run_id_of
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


def client_of(api: Api, key: str) -> AsyncOpenAI:
    # No retries of the SDK's own: a failure shows at once.
    client = AsyncOpenAI(base_url=f"{api.base}/v1", api_key=key, max_retries=0)
    SDK_CLIENTS.append(client)
    return client


async def sdk(api: Api, tenant: str = "acme", principal: str = "alice") -> AsyncOpenAI:
    return client_of(api, await api.key(tenant, principal))


async def count_runs(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM runs"))).scalar_one())


async def finished(client: AsyncOpenAI, response_id: str) -> Response | None:
    response = await client.responses.retrieve(response_id)
    return response if response.status not in ("queued", "in_progress") else None


def openai_error(exc: openai.APIStatusError) -> dict[str, Any]:
    body: dict[str, Any] = exc.response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert exc.response.headers["content-type"].startswith("application/json")
    return dict(body["error"])


async def test_a_background_response_is_polled_to_completion(api: Api) -> None:
    client = await sdk(api)
    created = await client.responses.create(
        model="scripted",
        input="hello from the SDK",
        instructions="answer briefly",
        metadata={"ticket": "T-1"},
        background=True,
    )
    assert created.id.startswith("resp_")
    assert created.object == "response"
    assert created.status in ("queued", "in_progress", "completed")
    assert created.background is True
    done = await eventually(lambda: finished(client, created.id), what="the response's end")
    assert done.status == "completed"
    # The scripted agent without a script answers with its input: the text came through.
    assert done.output_text == "hello from the SDK"
    assert (done.model, done.instructions, done.metadata) == (
        "scripted",
        "answer briefly",
        {"ticket": "T-1"},
    )
    assert done.usage is not None
    assert done.usage.total_tokens == 0


async def test_a_response_without_background_answers_when_the_run_ends(api: Api) -> None:
    client = await sdk(api)
    response = await client.responses.create(
        model="scripted",
        input=[
            {"role": "developer", "content": "be kind"},
            {"role": "user", "content": [{"type": "input_text", "text": "greet me"}]},
        ],
        # Turnstile's extension: more of the run's input, here the scripted agent's script.
        extra_body={"agent_input": {"script": [{"say": "Hello there, friend."}]}},
    )
    assert response.status == "completed"
    assert response.output_text == "Hello there, friend."
    [message] = response.output
    assert message.type == "message"
    assert message.role == "assistant"
    run = await api.queue.get_run(run_id_of(response.id))

    assert run is not None
    assert isinstance(run.input, dict)
    assert run.input["text"] == "greet me"
    assert run.input["messages"] == [
        {"role": "developer", "content": "be kind"},
        {"role": "user", "content": "greet me"},
    ]


async def test_a_streamed_response_sends_the_live_text_then_completes(api: Api) -> None:
    client = await sdk(api)
    text = "one two three four five six"
    stream = await client.responses.create(
        model="scripted",
        input="stream it",
        stream=True,
        extra_body={"agent_input": {"script": [{"say": text, "delay": 0.05}]}},
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.in_progress") == 1
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas  # at least the text not heard live comes as one
    assert "".join(deltas) == text
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed"
    assert final.output_text == text
    assert (await client.responses.retrieve(final.id)).output_text == text


def shown(event: Any) -> tuple[str, int, str | None]:
    """What a stream's event says, beside the response snapshots it carries."""
    text = getattr(event, "delta", None) or getattr(event, "text", None)
    return (event.type, event.sequence_number, text if isinstance(text, str) else None)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(text=st.text(alphabet=" \nab\u00e9\U0001f600", max_size=200), cut=st.integers(0, 200))
def test_live_text_is_cut_into_the_chunks_of_the_whole(text: str, cut: int) -> None:
    """What makes a stream resumable: the chunks of any heard prefix of a message are the first
    chunks of the whole message, so the n-th delta is the same on every connection."""
    live = chunk_ends(text[:cut], whole=False)
    whole = chunk_ends(text, whole=True)
    assert whole[: len(live)] == live
    assert all(end < len(text[:cut]) for end in live)  # each confirmed by the next character
    assert (whole[-1] if whole else 0) == len(text)
    pieces = [text[a:b] for a, b in zip([0, *whole], whole, strict=False)]
    assert "".join(pieces) == text
    assert all(0 < len(piece) <= CHUNK_LIMIT for piece in pieces)


async def test_a_dropped_stream_resumes_after_its_last_sequence_number(api: Api) -> None:
    client = await sdk(api)
    text = "every word of this answer comes once and in order, resumed or not"
    stream = await client.responses.create(
        model="scripted",
        input="stream it",
        stream=True,
        extra_body={"agent_input": {"script": [{"say": text, "delay": 0.05}]}},
    )
    heard = []
    async for event in stream:
        heard.append(event)
        if sum(e.type == "response.output_text.delta" for e in heard) == 2:
            break  # the connection drops in the middle of the text
    await stream.close()
    last = heard[-1].sequence_number
    resumed = await client.responses.retrieve(
        heard[0].response.id, stream=True, starting_after=last
    )  # type: ignore[union-attr]
    rest = [event async for event in resumed]
    assert rest[0].sequence_number == last + 1
    assert rest[-1].type == "response.completed"
    together = heard + rest
    assert [e.sequence_number for e in together] == list(range(len(together)))
    deltas = [e.delta for e in together if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text
    # The same stream read again from the start, after the end: the same events, same numbers.
    again = await client.responses.retrieve(heard[0].response.id, stream=True)  # type: ignore[union-attr]
    replayed = [event async for event in again]
    assert [shown(e) for e in replayed] == [shown(e) for e in together]
    # Resumed from any point, the rest of that same sequence.
    for point in (0, 3, len(together) - 2):
        tail = await client.responses.retrieve(
            replayed[0].response.id, stream=True, starting_after=point
        )  # type: ignore[union-attr]
        assert [shown(e) async for e in tail] == [shown(e) for e in replayed[point + 1 :]]


async def test_the_sdks_stream_helper_assembles_the_response_and_resumes_it(api: Api) -> None:
    client = await sdk(api)
    text = "the helper builds its snapshot from the items, then resumes"
    async with client.responses.stream(
        model="scripted",
        input="stream it",
        extra_body={"agent_input": {"script": [{"say": text, "delay": 0.02}]}},
    ) as stream:
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == text
    assert (await client.responses.retrieve(final.id)).output[0].id == final.output[0].id
    # The helper resumes by reading the stream from the start and leaving out what it had.
    async with client.responses.stream(response_id=final.id, starting_after=5) as resumed:
        rest = [event async for event in resumed]
        again = await resumed.get_final_response()
    assert rest[0].sequence_number == 6
    assert again.output_text == text


async def test_the_openai_agent_gets_the_instructions_and_answers_with_usage_figures(
    database_url: str, engine: AsyncEngine
) -> None:
    fake = FakeModel()
    fake.say("It is sunny.", usage=7)
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
            response = await client.responses.create(
                model="openai", input="Weather?", instructions="Answer in one line."
            )
            assert response.status == "completed"
            assert response.output_text == "It is sunny."
            assert response.usage is not None
            assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 1)
            assert response.usage.total_tokens == 8
            [request] = fake.requests
            assert request["messages"][-2:] == [
                {"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": "Weather?"},
            ]
            # `openai:<model>` asks that upstream model instead of the configured one.
            fake.say("Still sunny.")
            chosen = await client.responses.create(model="openai:gpt-test-mini", input="Now?")
            assert chosen.output_text == "Still sunny."
            assert chosen.model == "openai:gpt-test-mini"
            assert fake.requests[-1]["model"] == "gpt-test-mini"
            assert request["model"] != "gpt-test-mini"
        finally:
            while SDK_CLIENTS:
                await SDK_CLIENTS.pop().close()


async def test_a_run_asking_the_user_ends_its_response_with_an_ask_user_call(api: Api) -> None:
    client = await sdk(api)
    response = await client.responses.create(
        model="scripted",
        input="pay the bill",
        extra_body={"agent_input": {"script": [{"ask": "Which account?"}, {"final": "paid"}]}},
    )
    assert response.status == "incomplete"
    [call] = response.output
    assert call.type == "function_call"
    assert call.name == "ask_user"
    assert json.loads(call.arguments) == {"question": "Which account?"}
    assert (await client.responses.retrieve(response.id)).status == "incomplete"


async def test_a_response_is_cancelled(api: Api) -> None:
    client = await sdk(api)
    created = await client.responses.create(
        model="scripted",
        input="wait a while",
        background=True,
        extra_body={"agent_input": {"script": [{"call": "sleep", "args": {"seconds": 30}}]}},
    )
    cancelled = await client.responses.cancel(created.id)
    assert cancelled.id == created.id
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(created.id)).status == "cancelled"
    # Again: a cancelled response answers as it is.
    assert (await client.responses.cancel(created.id)).status == "cancelled"
    # A finished one cannot be cancelled: 400, as OpenAI answers (a 409 would be retried).
    done = await client.responses.create(model="scripted", input="quick")
    assert done.status == "completed"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.cancel(done.id)
    assert openai_error(refused.value)["code"] == "run_finished"


async def test_a_response_lists_its_input_items_and_is_deleted(api: Api) -> None:
    client = await sdk(api)
    response = await client.responses.create(
        model="scripted",
        input=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "noted"},
            {"role": "user", "content": "second"},
        ],
    )
    items = [item async for item in client.responses.input_items.list(response.id)]
    texts = [(i.role, i.content[0].text) for i in items]  # type: ignore[union-attr]
    assert texts == [
        ("user", "second"),
        ("assistant", "noted"),
        ("user", "first"),
        ("developer", "be brief"),
    ]
    page = await client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [items[3].id, items[2].id]
    assert page.has_more
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(response.id)
    # One still going is not deleted under its worker: cancel it first.
    going = await client.responses.create(
        model="scripted",
        input="wait",
        background=True,
        extra_body={"agent_input": {"script": [{"call": "sleep", "args": {"seconds": 30}}]}},
    )
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.delete(going.id)
    assert "cancel" in refused.value.message
    await client.responses.cancel(going.id)
    await client.responses.delete(going.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(going.id)
    # A failed one is in the dead letter, which is the operator's: kept.
    failed = await client.responses.create(
        model="scripted", input="x", extra_body={"agent_input": {"script": [{"nothing": 1}]}}
    )
    assert failed.status == "failed"
    with pytest.raises(openai.BadRequestError) as kept:
        await client.responses.delete(failed.id)
    assert "dead letter" in kept.value.message
    assert (await client.responses.retrieve(failed.id)).status == "failed"


async def test_a_create_retried_with_an_idempotency_key_is_one_run(api: Api) -> None:
    client = await sdk(api)
    before = await count_runs(api.engine)
    first = await client.responses.create(
        model="scripted",
        input="only once",
        background=True,
        extra_headers={"Idempotency-Key": "create-1"},
    )
    # What the SDK sends again on a timeout or a 5xx: the same body with the same key.
    again = await client.responses.with_raw_response.create(
        model="scripted",
        input="only once",
        background=True,
        extra_headers={"Idempotency-Key": "create-1"},
    )
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.parse().id == first.id
    assert await count_runs(api.engine) == before + 1
    # The same key with another body is refused, and writes nothing.
    with pytest.raises(openai.UnprocessableEntityError) as reused:
        await client.responses.create(
            model="scripted",
            input="something else",
            background=True,
            extra_headers={"Idempotency-Key": "create-1"},
        )
    assert openai_error(reused.value)["code"] == "idempotency_key_reused"
    assert await count_runs(api.engine) == before + 1


async def test_another_tenants_response_is_not_found(api: Api) -> None:
    mine = await sdk(api, "acme", "alice")
    theirs = await sdk(api, "globex", "bob")
    created = await mine.responses.create(model="scripted", input="private", background=True)
    with pytest.raises(openai.NotFoundError) as hidden:
        await theirs.responses.retrieve(created.id)
    assert openai_error(hidden.value)["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        await theirs.responses.cancel(created.id)
    for unknown in ("resp_" + "0" * 32, "resp_nothex", "not-a-response"):
        with pytest.raises(openai.NotFoundError):
            await mine.responses.retrieve(unknown)
    await eventually(lambda: finished(mine, created.id), what="the response's end")


async def test_a_bad_key_is_an_authentication_error(api: Api) -> None:
    for key in ("not-a-key", "tsk_" + "x" * 40):
        client = client_of(api, key)
        with pytest.raises(openai.AuthenticationError) as refused:
            await client.responses.create(model="scripted", input="hi")
        error = openai_error(refused.value)
        assert error["code"] == "invalid_api_key"
        assert refused.value.response.headers["www-authenticate"].startswith("Bearer")


async def test_bad_input_is_a_bad_request_in_openais_shape(api: Api) -> None:
    client = await sdk(api)
    before = await count_runs(api.engine)
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"model": "no-such-agent", "input": "hi"}, "model"),
        ({"model": "scripted:gpt-5", "input": "hi"}, "model"),
        ({"model": "openai:", "input": "hi"}, "model"),
        ({"model": "scripted"}, "input"),
        ({"model": "scripted", "input": 12}, "input"),
        ({"model": "scripted", "input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"model": "scripted", "input": "a\x00b"}, "input"),
        ({"model": "scripted", "input": "hi", "metadata": {"n": 1}}, "metadata.n"),
        ({"model": "scripted", "input": "hi", "metadata": {"k" * 65: "v"}}, None),
        (
            {"model": "scripted", "input": "hi", "store": False, "previous_response_id": "x"},
            "store",
        ),
        ({"model": "scripted", "input": "hi", "stream": True, "tools": [{}]}, "tools"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.post("/responses", cast_to=Response, body=body)
        error = openai_error(refused.value)
        assert error["type"] == "invalid_request_error", body
        assert isinstance(error["message"], str), body
        assert error["message"], body
        if param is not None:
            assert error["param"] == param, (body, error)
    # Not JSON at all; and a route /v1 does not have.
    plain = await api.client()
    raw = await plain.post(
        "/v1/responses", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert raw.status_code == 400
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        await client.get("/conversations/conv_1", cast_to=Response)
    assert await count_runs(api.engine) == before


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["message", "function_call_output", "x"]) | JSON_VALUES,
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
            "content": st.text(max_size=20)
            | st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "type": st.sampled_from(["input_text", "image"]),
                        "text": JSON_VALUES,
                    },
                ),
                max_size=3,
            )
            | JSON_VALUES,
        },
    ),
    max_size=3,
)
BODIES = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["scripted", "openai:x", "nope", ""]) | JSON_VALUES,
        "input": st.text(max_size=30) | MESSAGES | JSON_VALUES,
        "instructions": JSON_VALUES,
        "metadata": st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3) | JSON_VALUES,
        "agent_input": st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3) | JSON_VALUES,
        "stream": JSON_VALUES,
        "previous_response_id": JSON_VALUES,
        "conversation": st.sampled_from(["conv_" + "0" * 32, "conv_x"]) | JSON_VALUES,
        "tools": JSON_VALUES,
        "temperature": JSON_VALUES,
    },
)


CONVERSATIONS = (
    st.fixed_dictionaries(
        {},
        optional={
            "items": st.lists(JSON_VALUES, max_size=2) | JSON_VALUES,
            "metadata": st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=2) | JSON_VALUES,
        },
    )
    | JSON_VALUES
)


def assert_openai_shaped(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str), error


async def test_a_bounded_fuzz_of_v1_answers_openai_errors_never_a_5xx(api: Api) -> None:
    key = await api.key()
    headers = {"Authorization": f"Bearer {key}"}

    @settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @given(
        body=BODIES,
        response_id=st.text(max_size=40),
        query=st.dictionaries(
            st.sampled_from(["stream", "starting_after", "limit", "order", "after"]),
            st.text(max_size=8) | st.integers().map(str),
            max_size=3,
        ),
        conversation=CONVERSATIONS,
    )
    def probe(
        body: dict[str, Any], response_id: str, query: dict[str, str], conversation: Any
    ) -> None:
        body = {**body, "background": True}  # a valid body is answered at once, not waited for
        with httpx.Client(base_url=api.base, headers=headers, timeout=30) as client:
            assert_openai_shaped(client.post("/v1/responses", json=body))
            target = quote(response_id, safe="")
            assert_openai_shaped(client.get(f"/v1/responses/{target}", params=query))
            assert_openai_shaped(client.post(f"/v1/responses/{target}/cancel"))
            assert_openai_shaped(client.delete(f"/v1/responses/{target}"))
            assert_openai_shaped(client.get(f"/v1/responses/{target}/input_items", params=query))
            assert_openai_shaped(client.post("/v1/conversations", json=conversation))
            conv = quote("conv_" + response_id, safe="")
            assert_openai_shaped(client.get(f"/v1/conversations/{conv}"))
            assert_openai_shaped(client.post(f"/v1/conversations/{conv}", json=conversation))
            assert_openai_shaped(client.get(f"/v1/conversations/{conv}/items", params=query))
            assert_openai_shaped(client.get(f"/v1/conversations/{conv}/items/{target}"))
            assert_openai_shaped(client.post(f"/v1/conversations/{conv}/items", json=conversation))
            assert_openai_shaped(client.delete(f"/v1/conversations/{conv}/items/{target}"))
            assert_openai_shaped(client.delete(f"/v1/conversations/{conv}"))

    await asyncio.to_thread(probe)
