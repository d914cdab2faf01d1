"""The lean submission path (docs/performance.md): a turn is one call to `turnstile_submit`,
pooled connections are not pinged before use, and stored answers replay in both formats."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import Api, running_api
from tests.support.waiting import eventually


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine) as running:
        yield running


def _idle_driver_connections(api: Api) -> list[Any]:
    """The service's pooled connections not checked out now (the pool's own queue)."""
    assert api.app is not None
    pool: Any = api.app.state.turnstile.engine.pool
    records = list(pool._pool._queue._queue)  # asyncio.Queue keeps its items in a deque
    return [record.dbapi_connection.driver_connection for record in records]


async def test_connections_closed_by_the_server_are_replaced_without_a_ping(api: Api) -> None:
    """No ping per checkout: the pool asks the driver whether the server closed the connection
    (it knows as soon as its loop reads the close). Every backend of the service terminated,
    the next submissions are answered, none with 503."""
    client = await api.client()
    sessions = [(await client.post("/sessions")).json()["id"] for _ in range(6)]
    # Several connections in the pool, then every one of them terminated by the server.
    warm = await asyncio.gather(
        *(client.post(f"/sessions/{s}/turns", json={"input": "warm"}) for s in sessions[:3])
    )
    assert {r.status_code for r in warm} == {202}
    assert _idle_driver_connections(api)
    async with api.engine.connect() as conn:
        killed = await conn.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'turnstile serve'"
            )
        )
    assert killed
    await eventually(
        lambda: _all_closed(api), what="the driver to see its connections closed by the server"
    )
    for index, session in enumerate(sessions[3:]):
        headers = {"Idempotency-Key": f"after-{index}"} if index % 2 else {}
        answer = await client.post(f"/sessions/{session}/turns", json={"input": 1}, headers=headers)
        assert answer.status_code == 202, answer.text


async def _all_closed(api: Api) -> bool:
    return all(connection.is_closed() for connection in _idle_driver_connections(api))


async def test_an_answer_stored_as_a_document_still_replays(api: Api) -> None:
    """Answers stored before migration 0007 hold the document itself; since, the run row it
    was rendered from. A replay of either gives the document."""
    client = await api.client()
    session = (await client.post("/sessions")).json()["id"]
    first = await client.post(
        f"/sessions/{session}/turns", json={"input": "hi"}, headers={"Idempotency-Key": "new"}
    )
    assert first.status_code == 202
    async with api.engine.begin() as conn:
        stored = await conn.scalar(
            text("SELECT response_body FROM idempotency_keys WHERE key = 'new'")
        )
        assert set(stored) == {"run"}, stored
        # The same answer as an older version stored it.
        await conn.execute(
            text(
                "INSERT INTO idempotency_keys (tenant_id, principal, key, request_hash, "
                "response_status, response_body, run_id, created_at, expires_at) "
                "SELECT tenant_id, principal, 'old', request_hash, 202, CAST(:doc AS jsonb), "
                "run_id, created_at, expires_at FROM idempotency_keys WHERE key = 'new'"
            ),
            {"doc": json.dumps(first.json())},
        )
    for key in ("new", "old"):
        again = await client.post(
            f"/sessions/{session}/turns", json={"input": "hi"}, headers={"Idempotency-Key": key}
        )
        assert again.status_code == 202
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()
