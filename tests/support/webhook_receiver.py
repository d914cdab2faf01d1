"""A webhook receiver on loopback for tests: a small asyncio HTTP server that records every
delivery (its headers and exact body), answers from a script of statuses (then 200), and
verifies Standard Webhooks signatures the way the webhooks guide's receiver does."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    url: str
    statuses: list[int] = field(default_factory=list)  # answered in order, then 200
    deliveries: list[Delivery] = field(default_factory=list)
    # Set: the first delivery gets no answer until it is released (a sender killed mid-request).
    hold_first: asyncio.Event | None = None

    def verify(self, secret: str, delivery: Delivery) -> bool:
        key = base64.b64decode(secret.removeprefix("whsec_"))
        signed = f"{delivery.id}.{delivery.headers['webhook-timestamp']}.".encode() + delivery.body
        expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        given = [s.removeprefix("v1,") for s in delivery.headers["webhook-signature"].split()]
        return any(hmac.compare_digest(expected, s) for s in given)


@asynccontextmanager
async def receiver() -> AsyncIterator[Receiver]:
    state = Receiver(url="")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in lines[1:] if line)
            }
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            state.deliveries.append(Delivery(headers, body))
            if state.hold_first is not None and len(state.deliveries) == 1:
                await state.hold_first.wait()
            status = state.statuses.pop(0) if state.statuses else 200
            head_out = f"HTTP/1.1 {status} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
            writer.write(head_out.encode() + b"{}")
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}/hooks"
    try:
        yield state
    finally:
        if state.hold_first is not None:
            state.hold_first.set()
        server.close()
        await server.wait_closed()
