"""The `http_request` tool, with a destination allow-list that a tenant cannot talk around.

Hosts must match `TURNSTILE_HTTP_ALLOWED_HOSTS` (names, `*.suffix` patterns, or `*`). Every
address the name resolves to is checked, and the request goes to that checked address (the
name is pinned, so DNS cannot change between the check and the connection). Loopback, private,
link-local, reserved and cloud-metadata addresses are refused unless the host is listed by its
exact name or address: `*` never opens them, so a tenant cannot reach the service's neighbours.

Idempotency: GET, HEAD, PUT and DELETE are safe to repeat; POST and PATCH are unsafe, or keyed
when the call asks for `"idempotency_key": true` (sent as the `Idempotency-Key` header).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import httpx

from app.runtime.tools import (
    IdempotencyClass,
    PermanentToolError,
    ToolContext,
    TransientToolError,
)

JSON = Any
SAFE_METHODS = {"GET", "HEAD", "PUT", "DELETE"}
METHODS = SAFE_METHODS | {"POST", "PATCH"}
METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
MAX_BODY_CHARS = 64_000


class HttpRequestTool:
    name = "http_request"
    description = (
        "Make an HTTP request to an allowed host and answer with the status, headers and body."
    )
    parameters: ClassVar[dict[str, JSON]] = {
        "type": "object",
        "properties": {
            "method": {"type": "string", "enum": sorted(METHODS)},
            "url": {"type": "string"},
            "headers": {"type": "object", "additionalProperties": {"type": "string"}},
            "json": {},
            "idempotency_key": {
                "type": "boolean",
                "description": "Send an Idempotency-Key so a retried POST/PATCH is safe.",
            },
        },
        "required": ["method", "url"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        allowed_hosts: list[str],
        *,
        timeout_seconds: float = 10.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.allowed = [h.strip().lower() for h in allowed_hosts if h.strip()]
        self.timeout = timeout_seconds
        self._client = client

    def idempotency_class(self, args: dict[str, JSON]) -> IdempotencyClass:
        method = str(args.get("method", "")).upper()
        if method in SAFE_METHODS:
            return "safe"
        return "keyed" if args.get("idempotency_key") is True else "unsafe"

    async def run(self, args: dict[str, JSON], ctx: ToolContext) -> JSON:
        method = str(args.get("method", "")).upper()
        if method not in METHODS:
            raise PermanentToolError(f"method must be one of {', '.join(sorted(METHODS))}")
        url = args.get("url")
        if not isinstance(url, str):
            raise PermanentToolError("url must be a string")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PermanentToolError("url must be an absolute http(s) URL")
        host = parts.hostname.lower()
        address = await self._checked_address(
            host, parts.port or (443 if parts.scheme == "https" else 80)
        )
        headers = {str(k): str(v) for k, v in dict(args.get("headers") or {}).items()}
        headers["Host"] = parts.netloc.rsplit("@", 1)[-1]
        if ctx.idempotency_key is not None:
            headers["Idempotency-Key"] = ctx.idempotency_key
        netloc = f"[{address}]" if ":" in address else address
        if parts.port:
            netloc = f"{netloc}:{parts.port}"
        pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        client = self._client or httpx.AsyncClient()
        try:
            response = await client.request(
                method,
                pinned,
                headers=headers,
                json=args.get("json"),
                timeout=self.timeout,
                extensions=extensions,
            )
        except httpx.ConnectError as exc:
            raise TransientToolError(f"could not connect: {exc}", sent=False) from exc
        except httpx.ConnectTimeout as exc:
            raise TransientToolError("connect timed out", sent=False) from exc
        except httpx.TimeoutException as exc:
            raise TransientToolError(f"timed out: {type(exc).__name__}") from exc
        except httpx.TransportError as exc:
            raise TransientToolError(f"connection failed: {exc!r}") from exc
        finally:
            if self._client is None:
                await client.aclose()
        if response.status_code >= 500 or response.status_code == 429:
            raise TransientToolError(f"HTTP {response.status_code}")
        body: JSON
        try:
            body = response.json()
        except ValueError:
            body = response.text[:MAX_BODY_CHARS]
        return {
            "status": response.status_code,
            "body": body,
            "headers": {
                k: v
                for k, v in response.headers.items()
                if k.lower() in ("content-type", "location", "etag")
            },
        }

    # --- the allow-list -----------------------------------------------------------------------
    def _named(self, host: str) -> bool:
        """Listed by its exact name or address (which also opens private addresses)."""
        return host in self.allowed

    def _matches(self, host: str) -> bool:
        for pattern in self.allowed:
            if pattern == "*" or pattern == host:
                return True
            if pattern.startswith("*.") and host.endswith(pattern[1:]):
                return True
        return False

    async def _checked_address(self, host: str, port: int) -> str:
        if not self._matches(host):
            raise PermanentToolError(f"host {host!r} is not on the allow-list")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except socket.gaierror as exc:
            raise TransientToolError(f"cannot resolve {host!r}: {exc}", sent=False) from exc
        addresses = sorted({str(info[4][0]) for info in infos})
        if not addresses:
            raise TransientToolError(f"{host!r} resolved to nothing", sent=False)
        for text in addresses:
            address = ipaddress.ip_address(text.split("%", 1)[0])
            if _is_internal(address) and not self._named(host):
                raise PermanentToolError(
                    f"host {host!r} resolves to {address}, an internal address; list the host "
                    "by name in TURNSTILE_HTTP_ALLOWED_HOSTS to allow it"
                )
        return addresses[0]


def _is_internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _is_internal(address.ipv4_mapped)
    return (
        address in METADATA
        or address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_reserved
        or address.is_multicast
        or address.is_unspecified
    )
