"""Open event streams and long polls against revoked keys and greedy tenants (issue 40, items 3
and 4).

- A key revoked while its streams are open: a session stream opened before `turnstile keys
  revoke` kept delivering the next answer's text and `run.succeeded`, and never ended. Now each
  API process checks the keys holding places every `stream_key_recheck_seconds` (one statement
  for all of them): a run's or a session's stream sends `stream.ended` (`key-revoked`) and
  closes, a long poll answers 401, and the key's next request is refused at once. Other keys'
  streams go on.
- One tenant with many keys could take every place of a process (caps were per key and per
  process). Now `max_streams_per_tenant` caps a tenant's streams and long polls in a process
  (a quarter of the process's places by default): another tenant still gets its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from uuid import uuid4

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine
from turnstile_client import AsyncTurnstile, UnauthorizedError

from app.api.watch import KeyRecheck, StreamLimits
from app.config import Settings
from app.security.api_keys import authenticate, revoke_key
from tests.support.api import Api, running_api
from tests.support.sse import Item, sse
from tests.support.waiting import eventually

SSE = {"Accept": "text/event-stream"}
RECHECK = 0.2  # the tests' recheck interval (5 s by default)
GUARD = 20.0  # how long a stream may take to end before the test fails instead of hanging


async def to_the_end(response: httpx.Response) -> list[Item]:
    """Every item until the server closes the stream."""
    return [item async for item in sse(response)]


async def key_and_client(api: Api, tenant: str, principal: str) -> tuple[str, httpx.AsyncClient]:
    key = await api.key(tenant, principal)
    client = httpx.AsyncClient(
        base_url=api.base, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    api.clients.append(client)
    return key, client


async def revoke(api: Api, key: str) -> None:
    caller = await authenticate(api.engine, key)
    assert caller is not None
    assert await revoke_key(api.engine, caller.key_id)


# --- a key revoked while its streams are open ---------------------------------------------------
async def test_a_revoked_keys_session_stream_ends_saying_why_and_others_go_on(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url,
        engine,
        stream_key_recheck_seconds=RECHECK,
        workers=True,
        # Shorter than the streams stay open: only a body is timed, never a stream.
        http_body_timeout_seconds=RECHECK / 4,
    ) as api:
        alice_key, alice = await key_and_client(api, "acme", "alice")
        _, bob = await key_and_client(api, "acme", "bob")
        alices = (await alice.post("/sessions")).json()["id"]
        bobs = (await bob.post("/sessions")).json()["id"]
        async with (
            alice.stream("GET", f"/sessions/{alices}/events", headers=SSE) as alice_stream,
            bob.stream("GET", f"/sessions/{bobs}/events", headers=SSE) as bob_stream,
        ):
            assert (alice_stream.status_code, bob_stream.status_code) == (200, 200)
            await revoke(api, alice_key)
            items = await asyncio.wait_for(to_the_end(alice_stream), GUARD)
            assert [i.event for i in items] == ["stream.ended"]
            assert items[-1].id is None  # nothing to resume from
            assert items[-1].data["reason"] == "key-revoked"
            assert "revoked" in items[-1].data["detail"]
            # Refused at once: not left to the 5 s cache of verified keys.
            refused = await alice.get(f"/sessions/{alices}")
            assert refused.status_code == 401
            # Bob's stream is untouched: his next turn's events still reach it.
            turn = await bob.post(f"/sessions/{bobs}/turns", json={"input": {"text": "hi"}})
            assert turn.status_code == 202, turn.text
            seen: list[str] = []

            async def until_succeeded() -> None:
                async for item in sse(bob_stream):
                    seen.append(item.event)
                    if item.event == "run.succeeded":
                        return

            await asyncio.wait_for(until_succeeded(), GUARD)
            assert "stream.ended" not in seen
        assert api.app is not None
        await eventually(
            lambda: _nothing_open(api), what="the revoked key's place to be given back"
        )


async def _nothing_open(api: Api) -> bool:
    assert api.app is not None
    return bool(api.app.state.turnstile.streams.open == 0)


async def test_a_revoked_keys_run_stream_and_long_poll_end(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, stream_key_recheck_seconds=RECHECK) as api:
        key, client = await key_and_client(api, "acme", "alice")
        run = (await client.post("/runs", json={"input": {}})).json()["id"]  # stays queued
        async with client.stream("GET", f"/runs/{run}/events", headers=SSE) as stream:
            assert stream.status_code == 200
            poll = asyncio.ensure_future(
                client.get(f"/runs/{run}", params={"wait": 60, "status": "queued"})
            )
            await eventually(
                lambda: _places(api, 2), what="the stream and the long poll to hold places"
            )
            await revoke(api, key)
            items = await asyncio.wait_for(to_the_end(stream), GUARD)
            answer = await asyncio.wait_for(poll, GUARD)
        assert items[-1].event == "stream.ended"
        assert items[-1].data["reason"] == "key-revoked"
        assert [i.event for i in items[:-1]] == ["run.created"]
        assert answer.status_code == 401, answer.text
        assert answer.headers["content-type"].startswith("application/problem+json")
        assert answer.headers["www-authenticate"].startswith("Bearer ")
        problem = answer.json()
        assert problem["type"] == "/problems/unauthorized"
        assert "revoked" in problem["detail"]


async def _places(api: Api, count: int) -> bool:
    assert api.app is not None
    return bool(api.app.state.turnstile.streams.open == count)


async def test_the_client_raises_unauthorized_when_its_stream_is_ended(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, stream_key_recheck_seconds=RECHECK) as api:
        key, client = await key_and_client(api, "acme", "alice")
        session = (await client.post("/sessions")).json()["id"]
        async with AsyncTurnstile(api.base, key) as turnstile:

            async def follow() -> list[object]:
                return [item async for item in turnstile.session_events(session)]

            following = asyncio.ensure_future(follow())
            await eventually(lambda: _places(api, 1), what="the client's stream to open")
            await revoke(api, key)
            with pytest.raises(UnauthorizedError):
                await asyncio.wait_for(following, GUARD)


async def test_the_recheck_asks_nothing_while_no_stream_is_open() -> None:
    limits = StreamLimits(per_key=5, per_tenant=5, per_process=5)
    asked: list[set[Any]] = []

    async def active(key_ids: set[Any]) -> set[Any]:
        asked.append(key_ids)
        return set()

    forgotten: list[set[Any]] = []
    recheck = KeyRecheck(limits, active, interval=60, forget=forgotten.append)
    assert await recheck.run_once() == set()
    assert asked == []
    kept, revoked = uuid4(), uuid4()

    async def only_kept(key_ids: set[Any]) -> set[Any]:
        return key_ids & {kept}

    recheck.active_keys = only_kept
    with limits.acquire(kept, "acme") as a, limits.acquire(revoked, "acme") as b:
        assert await recheck.run_once() == {revoked}
        assert (a.ended.is_set(), b.ended.is_set()) == (False, True)
        assert b.reason == "key-revoked"
        assert forgotten == [{revoked}]
    assert limits.open == 0
    assert limits.held_keys() == set()


# --- one tenant cannot take every place -------------------------------------------------------
async def test_one_tenant_cannot_take_every_stream_of_a_process(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url,
        engine,
        max_streams_per_key=5,
        max_streams_per_tenant=2,
        max_streams_per_process=10,
    ) as api:
        acme = [(await key_and_client(api, "acme", f"user{n}"))[1] for n in range(3)]
        _, globex = await key_and_client(api, "globex", "gail")
        runs = [(await c.post("/runs", json={"input": {}})).json()["id"] for c in acme]
        theirs = (await globex.post("/runs", json={"input": {}})).json()["id"]
        async with contextlib.AsyncExitStack() as held:
            for client, run in list(zip(acme, runs, strict=True))[:2]:
                opened = await held.enter_async_context(
                    client.stream("GET", f"/runs/{run}/events", headers=SSE)
                )
                assert opened.status_code == 200
            # The tenant's third key is refused, for a stream and for a long poll alike...
            for request in (
                acme[2].get(f"/runs/{runs[2]}/events", headers=SSE),
                acme[2].get(f"/runs/{runs[2]}", params={"wait": 5}),
            ):
                refused = await asyncio.wait_for(request, GUARD)
                assert refused.status_code == 429, refused.text
                problem = refused.json()
                assert problem["type"] == "/problems/too-many-streams"
                assert "per tenant limit 2" in problem["detail"]
                assert int(refused.headers["retry-after"]) >= 1
            # ...while another tenant gets its stream and its long poll.
            stream = await held.enter_async_context(
                globex.stream("GET", f"/runs/{theirs}/events", headers=SSE)
            )
            assert stream.status_code == 200
            poll = await globex.get(f"/runs/{theirs}", params={"wait": 0.2, "status": "queued"})
            assert poll.status_code == 200, poll.text
        # Places come back when streams close.

        async def third_key_served() -> bool:
            response = await acme[2].get(
                f"/runs/{runs[2]}", params={"wait": 0.05, "status": "queued"}
            )
            return response.status_code == 200

        await eventually(third_key_served, what="the tenant's places to be given back")


def test_the_tenant_cap_is_below_the_process_cap_by_default() -> None:
    settings = Settings(database_url=None)
    assert settings.max_streams_per_tenant is None
    assert settings.stream_tenant_limit == settings.max_streams_per_process // 4 == 250
    small = Settings(database_url=None, max_streams_per_process=3)
    assert small.stream_tenant_limit == 1
    assert Settings(database_url=None, max_streams_per_tenant=1000).stream_tenant_limit == 1000
    with pytest.raises(ValidationError, match="TURNSTILE_MAX_STREAMS_PER_TENANT"):
        Settings(database_url=None, max_streams_per_tenant=1001)
