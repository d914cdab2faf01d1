"""A fake OpenAI-compatible chat-completions endpoint for the in-flight phase (bench/inflight.py):
every POST is answered after a fixed delay with one assistant message and no tool call. It is a
raw asyncio HTTP/1.1 server (keep-alive, Content-Length bodies only) in a process of its own, so
that it can hold thousands of requests open at once and never limits the concurrency measured.

Usage: python bench/fake_model.py PORT [DELAY_SECONDS]   (prints "ready" once listening)

GET /stats answers {"inflight", "peak", "served"}: the calls open now, the most that were open
at once, and the calls answered.
"""

from __future__ import annotations

import asyncio
import json
import sys

ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "fake",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "done"},
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }
).encode()


class Endpoint:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.inflight = 0
        self.peak = 0
        self.served = 0
        self.connections = 0  # accepted: a client that reuses its connections opens few

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if head.startswith(b"GET /stats"):
                    body = json.dumps(
                        {
                            "inflight": self.inflight,
                            "peak": self.peak,
                            "served": self.served,
                            "connections": self.connections - 1,  # this /stats one aside
                        }
                    ).encode()
                else:
                    self.inflight += 1
                    self.peak = max(self.peak, self.inflight)
                    try:
                        await asyncio.sleep(self.delay)
                    finally:
                        self.inflight -= 1
                    self.served += 1
                    body = ANSWER
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def main() -> None:
    port = int(sys.argv[1])
    endpoint = Endpoint(float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
    server = await asyncio.start_server(endpoint.handle, "127.0.0.1", port, backlog=8192)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
