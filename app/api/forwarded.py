"""Forwarded headers from a trusted TLS-terminating proxy (TURNSTILE_TRUST_FORWARDED_HEADERS).

Behind such a proxy the service itself speaks plain HTTP, so it cannot tell on its own that
the browser used HTTPS, and would leave the dashboard's cookie without `Secure`. When the proxy
is trusted, its `X-Forwarded-Proto` sets the request's scheme. Trust is an explicit setting,
never a default: a client that reaches the service directly could otherwise claim https (or
anything else) at will. `turnstile serve` turns uvicorn's own forwarded-header handling off so
that this setting is the only place the decision is made.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class ForwardedProto:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = dict(scope.get("headers") or []).get(b"x-forwarded-proto")
            if raw is not None:
                # Proxies append: the last value is the one the nearest (our) proxy wrote.
                proto = raw.decode("latin-1").rsplit(",", 1)[-1].strip().lower()
                if proto in ("http", "https"):
                    scope = {**scope, "scheme": proto}
        await self.app(scope, receive, send)
