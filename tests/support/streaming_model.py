"""A fake OpenAI-compatible endpoint's streamed answers (`stream: true`): chunked Server-Sent
Events as the chat-completions API sends them (text pieces, tool-call fragments, the finish
reason, a usage chunk, `[DONE]`), with delays between chunks, and a cut-off connection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def pieces(text: str, count: int) -> list[str]:
    size = max(1, -(-len(text) // count))
    return [text[i : i + size] for i in range(0, len(text), size)]


def text_chunks(text: str, count: int = 5) -> list[dict[str, Any]]:
    return [
        {"id": "chatcmpl-1", "model": "fake", "choices": [{"index": 0, "delta": {"content": p}}]}
        for p in pieces(text, count)
    ]


def call_chunks(call_id: str, name: str, arguments: str, count: int = 3) -> list[dict[str, Any]]:
    """A tool call as fragments: the first names it, the others add to its arguments."""
    first = {
        "index": 0,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]}]
    for part in pieces(arguments, count):
        fragment = {"index": 0, "function": {"arguments": part}}
        chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}}]})
    return chunks


def ending(reason: str = "stop", tokens: int = 5) -> list[dict[str, Any]]:
    return [
        {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": tokens, "completion_tokens": 2, "total_tokens": tokens + 2},
        },
    ]


@dataclass
class Streamed:
    """One streamed answer: its chunks, `delay` seconds apart; `cut_after` chunks, the
    connection is dropped without the end of the body."""

    chunks: list[dict[str, Any]]
    delay: float = 0.0
    cut_after: int | None = None

    def response(self) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for index, chunk in enumerate(self.chunks):
                if self.cut_after is not None and index == self.cut_after:
                    raise ConnectionAbortedError("the fake endpoint drops the stream")
                if index and self.delay:
                    await asyncio.sleep(self.delay)
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")


@dataclass
class SlowTalker:
    """An endpoint that answers every request with the same text, streamed slowly."""

    text: str
    count: int = 30
    delay: float = 0.1
    requests: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> StreamingResponse:
            self.requests.append(await request.json())
            return Streamed(
                text_chunks(self.text, self.count) + ending(), delay=self.delay
            ).response()

        return app
