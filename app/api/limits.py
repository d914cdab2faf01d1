"""Request body size limit, enforced before anything reads the body (413 problem+json)."""

from __future__ import annotations

import json
import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_DIGITS = re.compile(rb"[0-9]+")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
            await self._refuse(send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # An HTTPException passes through FastAPI's body parsing unchanged and is
                    # answered by the problem+json handlers.
                    raise _TooLarge(413, f"bodies are limited to {self.max_bytes} bytes")
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "type": "/problems/body-too-large",
                "title": "The request body is too large",
                "status": 413,
                "detail": f"bodies are limited to {self.max_bytes} bytes",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/problem+json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(HTTPException):
    pass
