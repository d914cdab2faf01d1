"""What a slow or greedy HTTP client can hold (issue 40, item 11), against `turnstile serve`'s
own server settings (app/roles.py) on loopback, with raw sockets where a client misbehaves.

- A request's head (line and headers) must arrive within TURNSTILE_HTTP_HEADER_TIMEOUT_SECONDS
  of the connection's opening or of the request's first byte: a client that opens a connection
  and sends nothing, or sends its headers a byte at a time, is disconnected (uvicorn alone
  waited forever).
- A request's body must arrive within TURNSTILE_HTTP_BODY_TIMEOUT_SECONDS of the app's first
  read: a trickled body is answered 408 `request-timeout`, the connection closed, nothing
  written. Streams that outlive that time are not touched (tests/api/test_open_streams.py runs
  its session streams with a body timeout shorter than they stay open).
- TURNSTILE_MAX_CONNECTIONS bounds the connections one process takes (uvicorn's
  limit_concurrency): beyond, 503, so the process keeps file descriptors for its database.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from tests.support.api import Api, running_api
from tests.support.waiting import eventually

GUARD = 20.0  # how long the test waits for the server to act before it fails instead of hanging
DEADLINE = 0.5


@asynccontextmanager
async def raw(api: Api) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    where = urlsplit(api.base)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        await writer.wait_closed()


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), GUARD)


async def test_a_slow_or_missing_request_head_is_disconnected(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url, engine, as_served=True, http_header_timeout_seconds=DEADLINE
    ) as api:
        # Connected, and nothing sent.
        async with raw(api) as (reader, _):
            assert await closed_by_server(reader) == b""
        # Half a head, then silence.
        async with raw(api) as (reader, writer):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: turnstile\r\n")
            await writer.drain()
            assert await closed_by_server(reader) == b""
        # A first request answered on a kept-alive connection; the next head stalls.
        async with raw(api) as (reader, writer):
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: turnstile\r\n\r\n")
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), GUARD)
            assert status.startswith(b"HTTP/1.1 200"), status
            writer.write(b"GET /healthz HTTP/1.1\r\nHo")
            await writer.drain()
            rest = await closed_by_server(reader)
            assert rest.count(b"HTTP/1.1") == 0, rest  # no second answer
        # A head that arrives in time, if slowly, is served.
        async with raw(api) as (reader, writer):
            for piece in (b"GET /healthz HTTP/1.1\r\n", b"Host: turnstile\r\n", b"\r\n"):
                writer.write(piece)
                await writer.drain()
            status = await asyncio.wait_for(reader.readline(), GUARD)
            assert status.startswith(b"HTTP/1.1 200"), status


async def test_a_trickled_body_is_408_and_writes_nothing(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(
        database_url, engine, as_served=True, http_body_timeout_seconds=DEADLINE
    ) as api:
        key = await api.key("acme", "alice")
        body = json.dumps({"input": {"text": "x" * 100}}).encode()
        async with raw(api) as (reader, writer):
            writer.write(
                b"POST /runs HTTP/1.1\r\nHost: turnstile\r\n"
                + f"Authorization: Bearer {key}\r\n".encode()
                + b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body[:10]
            )
            await writer.drain()
            answer = await closed_by_server(reader)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        assert b"content-type: application/problem+json" in head.lower()
        assert b"connection: close" in head.lower()
        problem = json.loads(payload)
        assert problem["type"] == "/problems/request-timeout"
        assert problem["status"] == 408
        assert str(DEADLINE) in problem["detail"]
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM runs"))).scalar() == 0
        # The same body, sent whole, is taken.
        client = await api.client("acme", "alice")
        created = await client.post(
            "/runs", content=body, headers={"Content-Type": "application/json"}
        )
        assert created.status_code == 202, created.text


async def test_connections_beyond_the_process_cap_answer_503(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, as_served=True, max_connections=3) as api:
        client = await api.client()  # one connection of its own, kept alive

        async with raw(api):
            assert (await client.get("/healthz")).status_code == 200
            async with raw(api):
                # Three connections open with this one: over the cap, refused, not queued.
                refused = await client.get("/healthz")
                assert refused.status_code == 503, refused.text

        async def served() -> bool:
            return (await client.get("/healthz")).status_code == 200

        await eventually(served, what="a place to be free once the idle connections closed")


def test_the_connection_cap_leaves_room_beside_the_streams_by_default() -> None:
    settings = Settings(database_url=None)
    assert settings.connection_limit == settings.max_streams_per_process + 1_000 == 2_000
    assert Settings(database_url=None, max_connections=50).connection_limit == 50
    with pytest.raises(ValueError, match="http_header_timeout_seconds"):
        Settings(database_url=None, http_header_timeout_seconds=0)
