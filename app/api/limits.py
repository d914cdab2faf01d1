"""What a request's body may cost, enforced before anything reads it: its size (413) and the
time it may take to arrive (408), both as problem+json.

- Size: `max_bytes` (TURNSTILE_MAX_BODY_BYTES), from the declared `Content-Length` when there is
  one, else counted as the chunks arrive.
- Time: `timeout_seconds` (TURNSTILE_HTTP_BODY_TIMEOUT_SECONDS) for the whole body, from the
  app's first read of it: a client that trickles a body a byte at a time would otherwise hold
  its connection and its request's task for as long as it liked. Only the body is timed: once it
  is whole, later reads (a streaming response listening for the client to leave) wait freely.
  The request's head has its own deadline, in the server (app/api/connections.py).
"""

from __future__ import annotations

import asyncio
import json
import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_DIGITS = re.compile(rb"[0-9]+")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_seconds: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_seconds = timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        # ASCII digits only (a strict pattern, like every number read by hand); more digits
        # than any limit could have is too large without converting them.
        if (
            declared is not None
            and _DIGITS.fullmatch(declared)
            and (len(declared) > 18 or int(declared) > self.max_bytes)
        ):
            await self._refuse(send, *self._too_large())
            return
        seen = 0
        whole = False  # the body has arrived (or the client left): no deadline any more
        deadline: float | None = None
        started = False
        loop = asyncio.get_running_loop()

        async def limited() -> Message:
            nonlocal seen, whole, deadline
            if whole or self.timeout_seconds is None:
                message = await receive()
            else:
                if deadline is None:
                    deadline = loop.time() + self.timeout_seconds
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
                except TimeoutError:
                    # The rest of the body may still be on its way: the connection is not reused.
                    raise _TimedOut(
                        408, self._slow_detail(), headers={"Connection": "close"}
                    ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # An HTTPException passes through FastAPI's body parsing unchanged and is
                    # answered by the problem+json handlers.
                    raise _TooLarge(413, f"bodies are limited to {self.max_bytes} bytes")
                whole = whole or not message.get("more_body", False)
            else:
                whole = True
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, watched)
        except _TooLarge:
            if not started:
                await self._refuse(send, *self._too_large())
        except _TimedOut:
            if not started:
                await self._refuse(send, *self._too_slow(), close=True)

    def _too_large(self) -> tuple[int, str, str, str]:
        return (
            413,
            "body-too-large",
            "The request body is too large",
            f"bodies are limited to {self.max_bytes} bytes",
        )

    def _too_slow(self) -> tuple[int, str, str, str]:
        return 408, "request-timeout", "The request body took too long", self._slow_detail()

    def _slow_detail(self) -> str:
        return f"the whole body must arrive within {self.timeout_seconds:g} s"

    async def _refuse(
        self, send: Send, status: int, slug: str, title: str, detail: str, *, close: bool = False
    ) -> None:
        body = json.dumps(
            {"type": f"/problems/{slug}", "title": title, "status": status, "detail": detail}
        ).encode()
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(HTTPException):
    pass


class _TimedOut(HTTPException):
    pass
