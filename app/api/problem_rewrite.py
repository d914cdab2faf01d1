"""The one way a protocol surface turns our problem+json answers into its own error shape.

An ASGI middleware that, under the paths a subclass covers, holds back a response whose
content type is `application/problem+json`, reads its (small) body whole, and lets the
subclass send the protocol's error instead (the OpenAI Responses API's at `/v1`, A2A's at
`/a2a`). Every other response passes through untouched, streamed as it comes.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ProblemRewrite:
    """Base of the protocols' error middlewares: `covers` names the paths, `answer` sends the
    protocol's error for one problem (its response start and whole body)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def covers(self, path: str) -> bool:
        raise NotImplementedError

    async def answer(self, start: Message, raw: bytes, send: Send, path: str) -> None:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path or not self.covers(path):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def sending(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if content_type.startswith(b"application/problem+json"):
                    start = message
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self.answer(start, b"".join(chunks), send, path)
                return
            await send(message)

        await self.app(scope, receive, sending)
