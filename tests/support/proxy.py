"""A TCP proxy on loopback in front of a test server, that breaks connections on demand: to
show what a client does when a connection dies mid-stream (`cut`), when a request reached
the server but its answer never came back (`drop_responses`, the keep-alive race's worst
case), or when something in between answers in the server's place (`answer_with`: a load
balancer's 502, say)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class BreakingProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.drop_responses = 0  # the next N answers are swallowed and their connection closed
        self.sent = bytearray()  # everything clients sent, for tests to read the requests
        # Whole HTTP responses to answer the next requests with, in place of the server's (each
        # request must come in one read: the small requests of the tests do).
        self.answer_with: list[bytes] = []
        self.connections = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Reset every open connection, as a network failure would."""
        for writer in list(self._open):
            writer.transport.abort()

    def sent_headers(self, name: str) -> list[str]:
        """The values of header `name` in every request sent so far, in order."""
        prefix = name.lower().encode() + b":"
        return [
            line[len(prefix) :].strip().decode()
            for line in bytes(self.sent).split(b"\r\n")
            if line.lower().startswith(prefix)
        ]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._open.update((writer, up_writer))

        async def to_upstream() -> None:
            while data := await reader.read(65536):
                self.sent.extend(data)
                if self.answer_with:
                    writer.write(self.answer_with.pop(0))
                    await writer.drain()
                    continue
                up_writer.write(data)
                await up_writer.drain()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if self.drop_responses > 0:
                    self.drop_responses -= 1
                    return  # the server answered; the client never hears it
                writer.write(data)
                await writer.drain()

        try:
            pipes = [asyncio.create_task(to_upstream()), asyncio.create_task(to_client())]
            self._tasks.update(pipes)
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._tasks.difference_update(pipes)
        finally:
            self._open.difference_update((writer, up_writer))
            for end in (writer, up_writer):
                end.close()
                with contextlib.suppress(OSError, ConnectionError):
                    await end.wait_closed()


def http_response(status: int, reason: str, body: bytes = b"", **headers: str) -> bytes:
    """A whole HTTP/1.1 response, for `BreakingProxy.answer_with`."""
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@asynccontextmanager
async def breaking_proxy(base_url: str) -> AsyncIterator[BreakingProxy]:
    """A proxy in front of `http://127.0.0.1:PORT`, for the duration of the block."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    proxy = BreakingProxy(host, int(port))
    server = await asyncio.start_server(proxy._handle, "127.0.0.1", 0)
    proxy.port = server.sockets[0].getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()
        proxy.cut()
        await server.wait_closed()
