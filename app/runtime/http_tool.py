"""The `http_request` tool, with a destination allow-list that a tenant cannot talk around.

Hosts must match `TURNSTILE_HTTP_ALLOWED_HOSTS` (names, `*.suffix` patterns, `*`, or literal
addresses), each entry optionally with a port (`intranet.local:8443`, `127.0.0.1:9000`,
`[fd00::1]:8080`, `*.example.com:443`): an entry with a port allows that port only (the URL's,
or 80 and 443 by scheme when it names none); one without allows every port. Every address the
name resolves to is checked, and the request goes to that checked address (the name is pinned,
so DNS cannot change between the check and the connection). Patterns never open a non-public
address, so a tenant cannot reach the service's neighbours:
- internal addresses (loopback, private, shared, reserved, multicast, and IPv4 written in IPv6:
  IPv4-compatible, -mapped, -translated, NAT64, 6to4, Teredo) need the host listed by its exact
  name, or the address listed literally;
- link-local and cloud-metadata addresses, also when embedded in one of those IPv6 forms, need
  the address itself listed literally: a listed name never opens them, since whoever controls
  that name's DNS could point it at the metadata service.

Idempotency: GET, HEAD, PUT and DELETE are safe to repeat; POST and PATCH are unsafe, or keyed
when the call asks for `"idempotency_key": true` (sent as the `Idempotency-Key` header).

Answers are read raw and inflated here, never past `MAX_RESPONSE_BYTES` of decoded body: a
small compressed body can expand a thousandfold, so the cap applies to what is produced, as it
is produced, and reading stops at the cap.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal
from urllib.parse import SplitResult, urlsplit, urlunsplit

import httpx

from app.runtime.tools import (
    IdempotencyClass,
    PermanentToolError,
    ToolContext,
    TransientToolError,
)
from app.vocabulary.allowed_hosts import AllowedHost, IPAddress, literal_address, parse_allowed
from app.vocabulary.records import JSON

SAFE_METHODS = {"GET", "HEAD", "PUT", "DELETE"}
METHODS = SAFE_METHODS | {"POST", "PATCH"}
METADATA = {
    ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, ...
    ipaddress.ip_address("fd00:ec2::254"),  # AWS over IPv6
    ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
}
MAX_RESPONSE_BYTES = 256_000
# How far an address is from the public internet; see the module's docstring.
Reach = Literal["public", "internal", "sensitive"]
# host, port -> the addresses it resolves to, in the resolver's order.
Resolver = Callable[[str, int], Awaitable[list[str]]]
# Headers the HTTP client must own; a caller's copy would corrupt or smuggle the request, or
# ask for an encoding the tool cannot inflate within its cap.
RESERVED_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}
ACCEPT_ENCODING = "gzip, deflate"


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
        deadline_seconds: float | None = None,
        client: httpx.AsyncClient | None = None,
        resolve: Resolver | None = None,
    ) -> None:
        """`allowed_hosts`: the allow-list's entries; ValueError names one that is malformed
        (a bad port, a broken `[IPv6]` literal), which would otherwise never match.
        `timeout_seconds` bounds each step (connect, each read, each write); `deadline_seconds`,
        when given, the whole request: a peer trickling its answer a byte at a time never
        trips a per-read timeout, so only a total deadline bounds it."""
        self.allowed = [parse_allowed(h) for h in allowed_hosts if h.strip()]
        self.timeout = timeout_seconds
        self.deadline = deadline_seconds
        self._client = client
        self._resolve = resolve or _resolve

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
        given = dict(args.get("headers") or {})
        headers = {
            str(k): str(v)
            for k, v in given.items()
            if str(k).lower() not in RESERVED_HEADERS | {"idempotency-key"}
        }
        if ctx.idempotency_key is not None:
            headers["Idempotency-Key"] = ctx.idempotency_key
        return await self.request(method, url, headers, json_body=args.get("json"))

    async def check_url(self, url: str) -> None:
        """Refuse (PermanentToolError) a URL the tool would not send to: not absolute http(s),
        a host off the allow-list, or one resolving to an address the list does not open.
        Webhook endpoints pass this at creation and again at every delivery."""
        await self._destination(url)

    async def _destination(self, url: str) -> tuple[SplitResult, str, list[str]]:
        try:
            parts = urlsplit(url)
            port = parts.port
            hostname = parts.hostname
        except ValueError as exc:  # a port out of range, a broken [IPv6] literal
            raise PermanentToolError(f"url is not valid: {exc}") from None
        if parts.scheme not in ("http", "https") or not hostname:
            raise PermanentToolError("url must be an absolute http(s) URL")
        if port == 0:
            raise PermanentToolError("url is not valid: port 0")
        host = hostname.lower()
        addresses = await self._checked_addresses(
            host, port or (443 if parts.scheme == "https" else 80)
        )
        return parts, host, addresses

    async def request(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        *,
        json_body: JSON = None,
        content: bytes | None = None,
    ) -> JSON:
        """Send to a checked, pinned address (see the module's docstring): `headers` as given
        (the caller filters them), the body as `json_body` or as exact bytes in `content`.
        Past the deadline (if any) the request is abandoned as a transient failure that may
        have been sent."""
        if self.deadline is None:
            return await self._request(method, url, headers, json_body, content)
        try:
            async with asyncio.timeout(self.deadline):
                return await self._request(method, url, headers, json_body, content)
        except TimeoutError:
            raise TransientToolError(
                f"no complete answer within the deadline of {self.deadline:g} s"
            ) from None

    async def _request(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        json_body: JSON,
        content: bytes | None,
    ) -> JSON:
        parts, host, addresses = await self._destination(url)
        headers = dict(headers)
        headers["Host"] = parts.netloc.rsplit("@", 1)[-1]
        headers["Accept-Encoding"] = ACCEPT_ENCODING
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        client = self._client or httpx.AsyncClient()
        try:
            # In resolver order; a refused connection sent nothing, so the next address is safe.
            for index, address in enumerate(addresses):
                netloc = f"[{address}]" if ":" in address else address
                if parts.port:
                    netloc = f"{netloc}:{parts.port}"
                pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
                try:
                    return await self._send(
                        client, method, pinned, headers, json_body, content, extensions
                    )
                except TransientToolError as exc:
                    if exc.sent or index == len(addresses) - 1:
                        raise
            raise TransientToolError(f"no address of {host!r} answered", sent=False)
        finally:
            if self._client is None:
                await client.aclose()

    async def _send(
        self,
        client: httpx.AsyncClient,
        method: str,
        url: str,
        headers: dict[str, str],
        json_body: JSON,
        content: bytes | None,
        extensions: dict[str, Any],
    ) -> JSON:
        request = client.build_request(
            method,
            url,
            headers=headers,
            json=json_body if content is None else None,
            content=content,
            timeout=self.timeout,
            extensions=extensions,
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            raise TransientToolError(f"could not connect: {exc}", sent=False) from exc
        except httpx.ConnectTimeout as exc:
            raise TransientToolError("connect timed out", sent=False) from exc
        except httpx.LocalProtocolError as exc:
            raise PermanentToolError(f"the request is not valid HTTP: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise TransientToolError(f"timed out: {type(exc).__name__}") from exc
        except httpx.TransportError as exc:
            raise TransientToolError(f"connection failed: {exc!r}") from exc
        try:
            if response.status_code >= 500 or response.status_code == 429:
                raise TransientToolError(f"HTTP {response.status_code}")
            decoded = BoundedBody(response.headers.get("content-encoding", ""), MAX_RESPONSE_BYTES)
            try:
                async for chunk in response.aiter_raw():
                    decoded.feed(chunk)
                    if decoded.truncated:
                        break
            except httpx.TransportError as exc:
                raise TransientToolError(f"the response broke off: {exc!r}") from exc
        finally:
            await response.aclose()
        truncated = decoded.truncated
        text = bytes(decoded.body).decode(response.encoding or "utf-8", "replace")
        body: JSON = text
        if not truncated:
            try:
                body = json.loads(text)
            except ValueError:
                body = text
        return {
            "status": response.status_code,
            "body": body,
            "truncated": truncated,
            "headers": {
                k: v
                for k, v in response.headers.items()
                if k.lower() in ("content-type", "location", "etag")
            },
        }

    # --- the allow-list -----------------------------------------------------------------------
    def _on_port(self, port: int) -> list[AllowedHost]:
        return [entry for entry in self.allowed if entry.port in (None, port)]

    def _matches(self, host: str, port: int) -> bool:
        literal = literal_address(host)
        return any(entry.names(host, literal) for entry in self._on_port(port))

    def _opens(self, host: str, address: IPAddress, port: int) -> bool:
        """Whether the allow-list opens this non-public address for this host on this port."""
        for entry in self._on_port(port):
            if entry.address is not None:
                if entry.address == address:
                    return True
            # A name listed exactly opens internal addresses (an intranet service), never
            # link-local or metadata ones.
            elif entry.host == host and address_reach(address) == "internal":
                return True
        return False

    async def _checked_addresses(self, host: str, port: int) -> list[str]:
        if not self._matches(host, port):
            literal = literal_address(host)
            if any(entry.names(host, literal) for entry in self.allowed):
                raise PermanentToolError(f"port {port} of host {host!r} is not on the allow-list")
            raise PermanentToolError(f"host {host!r} is not on the allow-list")
        addresses = await self._resolve(host, port)
        if not addresses:
            raise TransientToolError(f"{host!r} resolved to nothing", sent=False)
        for text in addresses:
            try:
                address = ipaddress.ip_address(text.split("%", 1)[0])
            except ValueError:
                raise PermanentToolError(f"{host!r} resolved to {text!r}, not an address") from None
            reach = address_reach(address)
            if reach == "public" or self._opens(host, address, port):
                continue
            if reach == "sensitive":
                raise PermanentToolError(
                    f"host {host!r} resolves to {address}, a link-local or cloud-metadata "
                    "address; only that address listed literally in "
                    "TURNSTILE_HTTP_ALLOWED_HOSTS allows it"
                )
            raise PermanentToolError(
                f"host {host!r} resolves to {address}, an internal address; list the host "
                "by name in TURNSTILE_HTTP_ALLOWED_HOSTS to allow it"
            )
        return addresses


async def _resolve(host: str, port: int) -> list[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TransientToolError(f"cannot resolve {host!r}: {exc}", sent=False) from exc
    return list(dict.fromkeys(str(info[4][0]) for info in infos))  # resolver order


class BoundedBody:
    """A response body decoded as its raw bytes arrive, holding at most `limit` decoded bytes.

    Inflation asks zlib for no more output than the room left (plus one byte, which says the
    body went on), so a compressed chunk never expands past the cap in memory. Encodings other
    than gzip and deflate (which the tool does not ask for) are kept as they came, as httpx
    does; a stack of several encodings is refused rather than inflated layer by layer.
    """

    def __init__(self, content_encoding: str, limit: int) -> None:
        self.limit = limit
        self.body = bytearray()
        self.truncated = False
        codings = [
            c.strip().lower()
            for c in content_encoding.split(",")
            if c.strip().lower() not in ("", "identity")
        ]
        if len(codings) > 1:
            raise PermanentToolError(
                f"the answer's Content-Encoding {content_encoding!r} stacks encodings; not read"
            )
        coding = codings[0] if codings else "identity"
        self._inflater: Any = None
        self._raw_deflate_fallback = False
        if coding in ("gzip", "x-gzip"):
            self._inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding == "deflate":
            # "deflate" should be zlib-wrapped, but some servers send a raw stream.
            self._inflater = zlib.decompressobj(zlib.MAX_WBITS)
            self._raw_deflate_fallback = True

    def feed(self, raw: bytes) -> None:
        room = self.limit - len(self.body) + 1
        produced = raw[:room] if self._inflater is None else self._inflate(raw, room)
        self.body.extend(produced)
        if len(self.body) > self.limit:
            del self.body[self.limit :]
            self.truncated = True

    def _inflate(self, raw: bytes, room: int) -> bytes:
        try:
            # Output stops at `room`: the rest stays unread in unconsumed_tail, and a full
            # `room` means the cap is reached, so the caller stops reading.
            out: bytes = self._inflater.decompress(raw, room)
        except zlib.error as exc:
            if not self._raw_deflate_fallback:
                raise TransientToolError(f"the answer's body is corrupt: {exc}") from exc
            self._raw_deflate_fallback = False
            self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            return self._inflate(raw, room)
        if raw:
            self._raw_deflate_fallback = False  # the header was read: the format is settled
        return out


# IPv6 ranges that carry an IPv4 address in their last 32 bits. Each is refused as a whole (none
# is a real destination for this tool, and "*" must not open a path to an IPv4 neighbour);
# the IPv4 inside decides whether it is only internal or link-local/metadata.
_IPV4_IN_LOW_BITS = (
    ipaddress.ip_network("::/96"),  # IPv4-compatible (deprecated)
    ipaddress.ip_network("::ffff:0:0/96"),  # IPv4-mapped
    ipaddress.ip_network("::ffff:0:0:0/96"),  # IPv4-translated (SIIT)
    ipaddress.ip_network("64:ff9b::/96"),  # NAT64, well-known prefix
)
_IPV6_INTERNAL = (
    ipaddress.ip_network("64:ff9b:1::/48"),  # NAT64, local use: where the IPv4 sits varies
    ipaddress.ip_network("2002::/16"),  # 6to4
    ipaddress.ip_network("2001::/32"),  # Teredo
    ipaddress.ip_network("fec0::/10"),  # site-local: deprecated, still routed inside networks
)


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries, in any of the forms that embed one."""
    found: list[ipaddress.IPv4Address] = []
    if any(address in net for net in _IPV4_IN_LOW_BITS):
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    return found


def address_reach(address: IPAddress) -> Reach:
    """`public` for a globally routable unicast address; `sensitive` for link-local and
    cloud-metadata addresses, also hidden in IPv6; `internal` for everything else."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if address.is_link_local or address in METADATA:
            return "sensitive"
        if any(address_reach(v4) == "sensitive" for v4 in inner):
            return "sensitive"
        if inner or any(address in net for net in _IPV6_INTERNAL):
            return "internal"
    elif address.is_link_local or address in METADATA:
        return "sensitive"
    if (
        not address.is_global
        or address.is_reserved
        or address.is_multicast
        or address.is_unspecified
    ):
        return "internal"
    return "public"
