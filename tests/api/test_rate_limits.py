"""Submission rate limits (issue 21, item 3) through real HTTP: a tenant over its bucket gets
429 `rate-limited` with `Retry-After` and the RateLimit headers of
draft-ietf-httpapi-ratelimit-headers-11; time (the injected clock, no sleeping) refills it; a
replay spends nothing; a refused turn gives its token back; one tenant's bucket is not
another's; a tenant's override applies without a restart; and two API processes share one
bucket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import create_key
from app.store.embedded import free_port
from tests.support.api import Api, running_api
from tests.support.clock import ManualClock
from tests.support.processes import turnstile


@pytest.fixture
async def limited(database_url: str, engine: AsyncEngine, clock: ManualClock) -> AsyncIterator[Api]:
    """One submission a second, bursts of two, for every tenant; time moves by hand."""
    async with running_api(
        database_url, engine, clock=clock, submit_rate_per_second=1.0, submit_burst=2
    ) as api:
        yield api


def assert_rate_limited(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 429, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["type"] == "/problems/rate-limited"
    return body


async def count(engine: AsyncEngine, sql: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql))).scalar_one())


async def bucket_tokens(engine: AsyncEngine, tenant: str) -> float | None:
    async with engine.connect() as conn:
        found = (
            await conn.execute(
                text("SELECT tokens FROM submit_buckets WHERE tenant_id = :t"), {"t": tenant}
            )
        ).scalar_one_or_none()
    return None if found is None else float(found)


async def test_over_the_burst_answers_429_until_the_bucket_refills(
    limited: Api, clock: ManualClock
) -> None:
    api = limited
    client = await api.client("acme", "alice")
    first = await client.post("/runs", json={"input": 1}, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 202
    assert first.headers["ratelimit-policy"] == '"submit";q=2;w=2'
    assert first.headers["ratelimit"] == '"submit";r=1;t=1'
    second = await client.post("/runs", json={"input": 2})
    assert second.status_code == 202
    assert second.headers["ratelimit"] == '"submit";r=0;t=1'

    # Over the burst: refused before anything is written, for runs and turns alike.
    session = (await client.post("/sessions")).json()["id"]  # sessions are not submissions
    for refused in (
        await client.post("/runs", json={"input": 3}),
        await client.post(f"/sessions/{session}/turns", json={"input": "hi"}),
    ):
        body = assert_rate_limited(refused)
        assert body["retry_after_seconds"] == 1
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["ratelimit-policy"] == '"submit";q=2;w=2'
        assert refused.headers["ratelimit"] == '"submit";r=0;t=1'
    assert await count(api.engine, "SELECT count(*) FROM runs") == 2

    # A replay is the stored answer: no token spent, none needed.
    again = await client.post("/runs", json={"input": 1}, headers={"Idempotency-Key": "k1"})
    assert again.status_code == 202
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["ratelimit"] == '"submit";r=0;t=1'

    # Another tenant has a bucket of its own.
    other = await api.client("globex", "bob")
    assert (await other.post("/runs", json={"input": 1})).status_code == 202

    # Half a second gives half a token: still refused, and told to wait the rest.
    clock.advance(0.5)
    assert_rate_limited(await client.post("/runs", json={"input": 4}))
    clock.advance(0.5)
    accepted = await client.post(f"/sessions/{session}/turns", json={"input": "hi"})
    assert accepted.status_code == 202, accepted.text
    assert accepted.headers["ratelimit"] == '"submit";r=0;t=1'
    # A long pause fills the bucket to its burst, no further.
    clock.advance(3600)
    full = await client.post("/runs", json={"input": 5})
    assert full.headers["ratelimit"] == '"submit";r=1;t=1'
    assert await bucket_tokens(api.engine, "acme") == 1.0


async def test_a_refused_turn_leaves_its_token(limited: Api) -> None:
    api = limited
    client = await api.client("acme", "alice")
    session = (await client.post("/sessions")).json()["id"]
    assert (await client.post(f"/sessions/{session}/turns", json={"input": 1})).status_code == 202
    assert await bucket_tokens(api.engine, "acme") == 1.0
    busy = await client.post(f"/sessions/{session}/turns", json={"input": 2})
    assert busy.status_code == 409
    # The refusal took no token, and says what is left (read after the refusal).
    assert await bucket_tokens(api.engine, "acme") == 1.0
    assert busy.headers["ratelimit"] == '"submit";r=1;t=1'
    assert busy.headers["ratelimit-policy"] == '"submit";q=2;w=2'
    missing = await client.post(
        "/sessions/00000000-0000-0000-0000-000000000000/turns", json={"input": 1}
    )
    assert missing.status_code == 404
    assert missing.headers["ratelimit"] == '"submit";r=1;t=1'
    assert await bucket_tokens(api.engine, "acme") == 1.0


async def test_no_limit_no_headers_and_no_bucket(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client()
        for i in range(5):
            response = await client.post("/runs", json={"input": i})
            assert response.status_code == 202
            assert "ratelimit" not in response.headers
            assert "ratelimit-policy" not in response.headers
        session = (await client.post("/sessions")).json()["id"]
        await client.post(f"/sessions/{session}/turns", json={"input": 1})
        busy = await client.post(f"/sessions/{session}/turns", json={"input": 2})
        assert busy.status_code == 409
        assert "ratelimit" not in busy.headers
    # Unlimited submissions never touch a bucket row.
    assert await count(engine, "SELECT count(*) FROM submit_buckets") == 0


async def test_a_tenant_override_applies_without_a_restart(
    database_url: str, engine: AsyncEngine, clock: ManualClock
) -> None:
    async with running_api(database_url, engine, clock=clock) as api:
        admin = await api.client("platform", "sre", "admin")
        client = await api.client("acme", "alice")
        put = await admin.put(
            "/tenants/acme/limits", json={"submit_rate_per_second": 0.5, "submit_burst": 1}
        )
        assert put.status_code == 200, put.text
        first = await client.post("/runs", json={"input": 1})
        assert first.headers["ratelimit-policy"] == '"submit";q=1;w=2'
        assert first.headers["ratelimit"] == '"submit";r=0;t=2'
        refused = assert_rate_limited(await client.post("/runs", json={"input": 2}))
        assert refused["retry_after_seconds"] == 2
        # Other tenants keep the default: no limit.
        other = await api.client("globex", "bob")
        assert "ratelimit" not in (await other.post("/runs", json={"input": 1})).headers
        # Back to the default (none): accepted at once, no headers.
        assert (await admin.put("/tenants/acme/limits", json={})).status_code == 200
        back = await client.post("/runs", json={"input": 3})
        assert back.status_code == 202
        assert "ratelimit" not in back.headers


async def test_two_api_processes_share_one_bucket(database_url: str, engine: AsyncEngine) -> None:
    """Real `turnstile serve` processes: a burst of 5 and a rate so low (one token in 1,000 s)
    that the test cannot earn a sixth, so exactly 5 of 16 concurrent submissions, spread over
    both processes, are accepted."""
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_SUBMIT_RATE_PER_SECOND": "0.001",
        "TURNSTILE_SUBMIT_BURST": "5",
    }
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    ports = [free_port(), free_port()]
    async with AsyncExitStack() as stack:
        for port in ports:
            await stack.enter_async_context(
                turnstile(
                    "serve",
                    "--no-workers",
                    "--port",
                    str(port),
                    ready=b"Uvicorn running",
                    env=env,
                )
            )
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}",
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=30,
                )
            )
            for port in ports
        ]
        responses = await asyncio.gather(
            *(clients[i % 2].post("/runs", json={"input": i}) for i in range(16))
        )
    codes = [r.status_code for r in responses]
    assert sorted(codes) == [202] * 5 + [429] * 11
    # Both processes refused some: the bucket is the database's, not a process's.
    assert {codes[i] for i in range(0, 16, 2)} >= {429}
    assert {codes[i] for i in range(1, 16, 2)} >= {429}
    for response in responses:
        assert response.headers["ratelimit-policy"] == '"submit";q=5;w=5000'
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) > 900
            assert response.headers["ratelimit"].startswith('"submit";r=0;t=')
    assert await count(engine, "SELECT count(*) FROM runs") == 5
