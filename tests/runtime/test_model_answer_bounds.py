"""The `openai` agent reads its endpoint's answer within bounds (issue 40 item 5): an answer body
larger than `max_response_bytes`, one SSE line longer than `max_line_bytes`, or a stream of
small lines adding up past the body bound fails the run with a clear error, and the agent stops
reading there (the endpoint, a raw asyncio server on loopback that would send far more, sees
its connection closed long before the end: memory stays flat, nothing is read to the end)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from app.queue.core import Queue
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, default_registry
from app.runtime.openai_agent import OpenAIAgent
from app.runtime.outbound import ModelClient
from app.vocabulary.records import NewRun
from tests.support.runtime import current, execute_once

LIMIT = 64 * 1024
LINE = 16 * 1024
HUGE = 64 * 1024 * 1024  # what the endpoint would send: a thousand times the bound
CHUNK = 64 * 1024


@dataclass
class Flood:
    """An endpoint that answers every request with `kind` of `HUGE` bytes, counting what it
    managed to send before the client closed the connection."""

    kind: str
    sent: int = 0
    finished: bool = False

    def head(self) -> bytes:
        if self.kind == "json":
            return (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % HUGE
            )
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"

    def chunk(self) -> bytes:
        if self.kind == "line":
            return b"x" * CHUNK  # one line that never ends
        if self.kind == "lines":
            event = {"choices": [{"index": 0, "delta": {"content": "y" * 200}}]}
            line = b"data: " + json.dumps(event).encode() + b"\n\n"
            return line * (CHUNK // len(line))
        return b" " * CHUNK  # JSON whitespace, forever

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            writer.write(self.head())
            if self.kind == "line":
                writer.write(b"data: ")
            while self.sent < HUGE:
                writer.write(self.chunk())
                self.sent += CHUNK
                await writer.drain()
            self.finished = True
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def client() -> AsyncIterator[ModelClient]:
    model_client = ModelClient(4)
    yield model_client
    await model_client.aclose()


async def flood_server(flood: Flood) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(flood.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def executor(base: str, client: ModelClient, *, stream: bool) -> RuntimeExecutor:
    registry = default_registry(["127.0.0.1"], http_timeout_seconds=5)
    registry.agents["openai"] = OpenAIAgent(
        base_url=f"{base}/v1",
        model="test-model",
        api_key="sk-bounds",
        tools=lambda: registry.tools,
        backoff_seconds=0.01,
        client=client,
        stream=stream,
        max_response_bytes=LIMIT,
        max_line_bytes=LINE,
    )
    return RuntimeExecutor(registry, RuntimeLimits(retry_backoff_seconds=0.01))


@pytest.mark.parametrize(
    ("kind", "stream", "says"),
    [
        ("json", False, f"larger than {LIMIT} bytes"),
        ("json", True, f"larger than {LIMIT} bytes"),
        ("line", True, f"a line longer than {LINE} bytes"),
        ("lines", True, f"larger than {LIMIT} bytes"),
    ],
    ids=["plain-body", "plain-body-to-a-streaming-request", "one-sse-line", "many-sse-lines"],
)
async def test_an_oversized_answer_fails_the_run_and_is_not_read_to_its_end(
    queue: Queue, client: ModelClient, kind: str, stream: bool, says: str
) -> None:
    flood = Flood(kind)
    server, base = await flood_server(flood)
    try:
        run = await queue.enqueue(
            NewRun(tenant_id="t", principal="p", agent="openai", input={"text": "hi"})
        )
        assert await execute_once(queue, executor(base, client, stream=stream))
        failed = await current(queue, run.id)
        failure: dict[str, Any] = failed.failure or {}
        assert (failed.status, failure.get("kind")) == ("failed", "agent_error"), failure
        assert says in failure["message"], failure
        assert not flood.finished
        assert flood.sent < HUGE // 4, flood.sent
    finally:
        server.close()
        await server.wait_closed()
