"""A loopback TCP proxy in front of PostgreSQL that loses a statement's fate on demand, by
reading the protocol's message framing (a type byte and a length) in both directions. The
statement is named by a fragment of its SQL (`marker`), seen in the client's Parse message, so
the driver's own queries (type introspection) never trigger it:

- `lose_answer(marker)`: the statement reaches the server and runs; the server's answer up to
  its ReadyForQuery, which PostgreSQL sends only after the implicit transaction committed at
  the Sync, is swallowed and both ends are closed: committed, never acknowledged. With
  `at_commit=True` (statements in BEGIN ... COMMIT), it is the answer to the COMMIT that
  follows the statement that is lost.
- `lose_request(marker)`: the statement's Execute never reaches the server; both ends are
  closed. The client cannot tell this from a lost answer.

Clients must connect without TLS (`?ssl=disable`): the proxy reads plain messages."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Link:
    """One client connection and its server connection."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    # Set when this link carries the statement whose answer is to be lost.
    losing: bool = False
    prepared: dict[bytes, bytes] = field(default_factory=dict)  # statement name: its SQL
    bound: bytes = b""  # the SQL of the statement last bound
    awaiting_commit: bool = False
    withheld: bytearray = field(default_factory=bytearray)


class PgProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.connections = 0
        self.cuts = 0  # connections cut on purpose so far
        # The CommandComplete tags of the answers lost so far ("INSERT 0 1", "COMMIT"): what
        # the server did and the client never heard.
        self.lost_tags: list[str] = []
        self._answer_to: bytes | None = None  # the marker armed by lose_answer
        self._at_commit = False
        self._drop_request: bytes | None = None  # the marker armed by lose_request
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    def lose_answer(self, marker: str, *, at_commit: bool = False) -> None:
        self._answer_to = marker.encode()
        self._at_commit = at_commit

    def lose_request(self, marker: str) -> None:
        self._drop_request = marker.encode()

    def cut_all(self) -> None:
        for link in list(self._links):
            self._cut(link)

    def _cut(self, link: _Link) -> None:
        self.cuts += 1
        link.client.transport.abort()
        link.server.transport.abort()

    def _read(self, link: _Link, kind: bytes, body: bytes) -> bool:
        """Note what the client sends; True when its answer is to be lost from here on."""
        if kind == b"P":
            name, _, rest = body.partition(b"\0")
            link.prepared[name] = rest.partition(b"\0")[0]
        elif kind == b"B":
            statement = body.split(b"\0", 2)[1]
            link.bound = link.prepared.get(statement, b"")
        elif kind == b"E" and self._answer_to is not None and self._answer_to in link.bound:
            if not self._at_commit:
                self._answer_to = None
                return True
            link.awaiting_commit = True
        elif kind == b"Q" and link.awaiting_commit and body.upper().startswith(b"COMMIT"):
            self._answer_to = None
            link.awaiting_commit = False
            return True
        return False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)  # type: ignore[arg-type]
        host, port = self.upstream
        if host.startswith("/"):
            # The embedded PostgreSQL (the suite's default without TEST_DATABASE_URL) listens
            # on a Unix socket in that directory only.
            up_reader, up_writer = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        else:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        link = _Link(client=writer, server=up_writer)
        self._links.add(link)

        async def to_server() -> None:
            # The startup message has no type byte: its length, then its body.
            (length,) = struct.unpack("!i", await reader.readexactly(4))
            up_writer.write(struct.pack("!i", length) + await reader.readexactly(length - 4))
            while True:
                kind = await reader.readexactly(1)
                (length,) = struct.unpack("!i", await reader.readexactly(4))
                body = await reader.readexactly(length - 4)
                if self._read(link, kind, body):
                    link.losing = True
                if kind == b"E" and self._drop_request and self._drop_request in link.bound:
                    self._drop_request = None
                    self._cut(link)
                    return
                up_writer.write(kind + struct.pack("!i", length) + body)
                await up_writer.drain()

        async def to_client() -> None:
            while True:
                kind = await up_reader.readexactly(1)
                (length,) = struct.unpack("!i", await up_reader.readexactly(4))
                message = kind + struct.pack("!i", length) + await up_reader.readexactly(length - 4)
                if link.losing:
                    link.withheld.extend(message)
                    if kind == b"C":
                        self.lost_tags.append(message[5:].rstrip(b"\0").decode())
                    if kind == b"Z":  # ReadyForQuery: the server is done, committed
                        self._cut(link)
                        return
                    continue
                writer.write(message)
                await writer.drain()

        pipes = [asyncio.create_task(to_server()), asyncio.create_task(to_client())]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._links.discard(link)
            for end in (writer, up_writer):
                end.close()
                with contextlib.suppress(OSError, ConnectionError):
                    await end.wait_closed()


@asynccontextmanager
async def pg_proxy(host: str, port: int) -> AsyncIterator[PgProxy]:
    """A proxy on 127.0.0.1 in front of PostgreSQL at `host:port` (`host` a directory: its
    Unix socket), for the block."""
    proxy = PgProxy(host, port)
    server = await asyncio.start_server(proxy._handle, "127.0.0.1", 0)
    proxy.port = server.sockets[0].getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()
        proxy.cut_all()
        # Every connection's handler ends once its ends are closed: wait for them, so none is
        # left for the event loop to cancel.
        await asyncio.gather(*proxy._handlers, return_exceptions=True)
        await server.wait_closed()
