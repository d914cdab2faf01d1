"""The `http_request` tool against hostile answers and hostile addresses.

- A decompression bomb (a small gzip or deflate body that inflates to 64 MB), served by a real
  server on loopback: the tool inflates no more than its response cap, measured with
  tracemalloc.
- The internal-address check, as a function: IPv4 hidden in IPv6 (IPv4-compatible, -mapped,
  -translated, NAT64, 6to4, Teredo) and reserved ranges. Linux does not route those IPv6 forms to
  loopback, so no request is ever made to them: where the tool runs end to end, its client has a
  transport that records the address it would connect to and answers without connecting.
"""

from __future__ import annotations

import contextlib
import gzip
import ipaddress
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import ValidationError

from app.config import Settings
from app.queue.core import Queue
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, default_registry
from app.runtime.http_tool import (
    MAX_RESPONSE_BYTES,
    AllowedHost,
    HttpRequestTool,
    Resolver,
    address_reach,
    parse_allowed,
)
from app.runtime.tools import PermanentToolError, ToolContext
from app.vocabulary.records import NewRun
from tests.support.runtime import current, execute_once
from tests.support.servers import running_server

CTX = ToolContext(run_id="r", step=1, idempotency_key=None)
BOMB_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    zeros = bytes(BOMB_BYTES)
    return {"gzip": gzip.compress(zeros, 9), "deflate": zlib.compress(zeros, 9)}


@pytest.fixture
async def bomb_server(bombs: dict[str, bytes]) -> AsyncIterator[str]:
    app = FastAPI()

    @app.get("/bomb/{encoding}")
    async def bomb(encoding: str) -> Response:
        return Response(
            bombs[encoding], headers={"Content-Encoding": encoding, "Content-Type": "text/plain"}
        )

    @app.get("/small")
    async def small() -> Response:
        body = gzip.compress(b'{"ok": true, "pad": "' + b"x" * 5000 + b'"}')
        return Response(
            body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )

    async with running_server(app) as base:
        yield base


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_decompression_bomb_is_inflated_only_up_to_the_cap(
    bomb_server: str, bombs: dict[str, bytes], encoding: str
) -> None:
    assert len(bombs[encoding]) < 100_000  # small on the wire, 64 MB inflated
    tool = HttpRequestTool(["127.0.0.1"])
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        answer = await tool.run({"method": "GET", "url": f"{bomb_server}/bomb/{encoding}"}, CTX)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answer["truncated"] is True
    assert len(answer["body"]) == MAX_RESPONSE_BYTES
    # The answer itself (bytes, then text) is about twice the cap, and tracemalloc also counts
    # the in-process server's buffers of the compressed bomb as it sends them (their size
    # depends on the HTTP protocol implementation and timing: 2.1 MB once with httptools); a
    # whole inflated chunk of the bomb would be tens of megabytes.
    assert peak < 16 * MAX_RESPONSE_BYTES, f"peak {peak:,} bytes while reading the response"


async def test_a_compressed_answer_is_still_decoded(bomb_server: str) -> None:
    tool = HttpRequestTool(["127.0.0.1"])
    answer = await tool.run({"method": "GET", "url": f"{bomb_server}/small"}, CTX)
    assert answer["truncated"] is False
    assert answer["body"]["ok"] is True
    assert len(answer["body"]["pad"]) == 5000


# --- the internal-address check -----------------------------------------------------------------
# Each of these hides an internal IPv4 address (or is reserved); none may pass under `*`.
HIDDEN = [
    "::127.0.0.1",  # IPv4-compatible (::/96), loopback
    "::a9fe:a9fe",  # IPv4-compatible, metadata
    "::10.0.0.1",  # IPv4-compatible, private
    "::8.8.8.8",  # IPv4-compatible: deprecated, never a real destination
    "::ffff:0:7f00:1",  # IPv4-translated (::ffff:0:0:0/96), loopback
    "::ffff:0:a9fe:a9fe",  # IPv4-translated, metadata
    "::ffff:0:808:808",  # IPv4-translated, whatever it embeds
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:169.254.169.254",  # IPv4-mapped, metadata
    "64:ff9b::7f00:1",  # NAT64, loopback
    "64:ff9b::a9fe:a9fe",  # NAT64, metadata
    "64:ff9b:1::a00:1",  # local-use NAT64 (64:ff9b:1::/48)
    "2002:7f00:1::1",  # 6to4 around 127.0.0.1
    "2002:a9fe:a9fe::1",  # 6to4 around the metadata address
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "100::1",  # discard-only (reserved)
    "2001:db8::1",  # documentation
    "fec0::1",  # site-local
    "fe80::1",  # link-local
    "fd00:ec2::254",  # AWS metadata over IPv6
    "::",
    "::1",
    "0.0.0.0",
    "127.0.0.1",
    "10.1.2.3",
    "100.64.0.1",
    "100.100.100.200",  # Alibaba metadata
    "169.254.169.254",
    "192.168.0.1",
    "240.0.0.1",  # reserved
    "255.255.255.255",
    "224.0.0.1",
]
# Link-local and cloud-metadata addresses, directly or embedded: only a listed literal opens them.
SENSITIVE = {
    "::a9fe:a9fe",
    "::ffff:0:a9fe:a9fe",
    "::ffff:169.254.169.254",
    "64:ff9b::a9fe:a9fe",
    "2002:a9fe:a9fe::1",
    "fe80::1",
    "fd00:ec2::254",
    "100.100.100.200",
    "169.254.169.254",
}


@pytest.mark.parametrize("text", HIDDEN)
def test_internal_and_embedded_addresses_are_not_public(text: str) -> None:
    expected = "sensitive" if text in SENSITIVE else "internal"
    assert address_reach(ipaddress.ip_address(text)) == expected


@pytest.mark.parametrize("text", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450::1"])
def test_public_addresses_are_public(text: str) -> None:
    assert address_reach(ipaddress.ip_address(text)) == "public"


@dataclass
class Recording(httpx.AsyncBaseTransport):
    """Records where each request would go and answers 200 without connecting anywhere."""

    hosts: list[str] = field(default_factory=list)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.hosts.append(request.url.host)
        # A stream, as a real transport returns, for the tool to read raw.
        return httpx.Response(
            200,
            headers={"Content-Type": "application/json"},
            stream=httpx.ByteStream(b'{"ok": true}'),
        )


def resolver(names: dict[str, list[str]]) -> Resolver:
    async def resolve(host: str, port: int) -> list[str]:
        return names.get(host) or [host]

    return resolve


NAMES = {
    "metadata.internal": ["169.254.169.254"],
    "mapped-metadata.internal": ["::ffff:169.254.169.254"],
    "v6-metadata.internal": ["fd00:ec2::254"],
    "intranet.internal": ["10.0.0.5"],
    "compat.example.com": ["::127.0.0.1"],
}


async def tool_run(tool: HttpRequestTool, url: str) -> Any:
    return await tool.run({"method": "GET", "url": url}, CTX)


@pytest.mark.parametrize("text", HIDDEN)
async def test_the_tool_refuses_hidden_addresses_under_a_wildcard(text: str) -> None:
    transport = Recording()
    async with httpx.AsyncClient(transport=transport) as client:
        tool = HttpRequestTool(["*"], client=client)
        host = f"[{text}]" if ":" in text else text
        with pytest.raises(PermanentToolError, match=r"internal address|link-local"):
            await tool_run(tool, f"http://{host}/")
    assert transport.hosts == []


async def test_a_listed_name_never_opens_link_local_or_metadata() -> None:
    transport = Recording()
    async with httpx.AsyncClient(transport=transport) as client:
        listed = ["metadata.internal", "mapped-metadata.internal", "v6-metadata.internal"]
        tool = HttpRequestTool(
            [*listed, "intranet.internal", "*.example.com"], client=client, resolve=resolver(NAMES)
        )
        for name in listed:
            with pytest.raises(PermanentToolError, match="link-local or cloud-metadata"):
                await tool_run(tool, f"http://{name}/latest/meta-data")
        with pytest.raises(PermanentToolError, match="internal address"):
            await tool_run(tool, "http://compat.example.com/")  # a pattern opens nothing
        # A listed name still opens a private address (the intranet case).
        assert (await tool_run(tool, "http://intranet.internal/x"))["status"] == 200
    assert transport.hosts == ["10.0.0.5"]


async def test_only_a_listed_literal_opens_a_metadata_address() -> None:
    transport = Recording()
    async with httpx.AsyncClient(transport=transport) as client:
        tool = HttpRequestTool(
            ["169.254.169.254", "[FD00:EC2:0::254]", "metadata.internal"],
            client=client,
            resolve=resolver(NAMES),
        )
        assert (await tool_run(tool, "http://169.254.169.254/latest"))["status"] == 200
        assert (await tool_run(tool, "http://[fd00:ec2::254]/latest"))["status"] == 200
        # The literal is listed: the address is opened, whatever name led to it.
        assert (await tool_run(tool, "http://metadata.internal/latest"))["status"] == 200
    assert transport.hosts == ["169.254.169.254", "fd00:ec2::254", "169.254.169.254"]


@pytest.mark.parametrize(
    "url",
    [
        "http://turnstile.invalid:99999/",
        "http://turnstile.invalid:-1/",
        "http://turnstile.invalid:0/",
        "http://turnstile.invalid:port/",
        "http://[::1/",
        "http://[not-an-address]/",
    ],
)
async def test_a_malformed_url_is_a_permanent_tool_error(url: str) -> None:
    transport = Recording()
    async with httpx.AsyncClient(transport=transport) as client:
        tool = HttpRequestTool(["*"], client=client)
        with pytest.raises(PermanentToolError, match="url"):
            await tool_run(tool, url)
    assert transport.hosts == []


async def test_a_malformed_url_fails_the_run_at_once(queue: Queue) -> None:
    run = await queue.enqueue(
        NewRun(
            tenant_id="t",
            principal="p",
            agent="scripted",
            input={
                "script": [
                    {
                        "call": "http_request",
                        "args": {"method": "GET", "url": "http://turnstile.invalid:99999/"},
                    }
                ]
            },
        )
    )
    executor = RuntimeExecutor(
        default_registry(["*"], http_timeout_seconds=5), RuntimeLimits(retry_backoff_seconds=0.01)
    )
    assert await execute_once(queue, executor)
    failed = await current(queue, run.id)
    assert (failed.status, failed.failure["kind"], failed.attempts) == ("failed", "tool_error", 1)
    assert "port out of range" in failed.failure["message"].lower()


# --- host:port entries (issue 40, item 11) ------------------------------------------------------
@dataclass
class Counting:
    """A loopback server that counts the requests it is sent."""

    base: str
    port: int
    hits: list[str] = field(default_factory=list)


def counting_app(counting: Counting) -> FastAPI:
    app = FastAPI()

    @app.get("/{path:path}")
    async def answer(path: str) -> Response:
        counting.hits.append(path)
        return Response(b'{"ok": true}', media_type="application/json")

    return app


@pytest.fixture
async def two_servers() -> AsyncIterator[tuple[Counting, Counting]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for _ in range(2):
            counting = Counting(base="", port=0)
            base = await stack.enter_async_context(running_server(counting_app(counting)))
            counting.base, counting.port = base, int(base.rsplit(":", 1)[1])
            servers.append(counting)
        yield servers[0], servers[1]


async def test_a_host_port_entry_opens_that_port_only(
    two_servers: tuple[Counting, Counting],
) -> None:
    """Listing `127.0.0.1` opens every port on it (the API's, PostgreSQL's); `127.0.0.1:PORT`
    opens that one port. Names listed with a port likewise."""
    allowed, other = two_servers
    for entry in (f"127.0.0.1:{allowed.port}", f"localhost:{allowed.port}"):
        tool = HttpRequestTool([entry])
        host = entry.rsplit(":", 1)[0]
        answer = await tool_run(tool, f"http://{host}:{allowed.port}/yes")
        assert answer["status"] == 200
        with pytest.raises(PermanentToolError, match=f"port {other.port} of host"):
            await tool_run(tool, f"http://{host}:{other.port}/no")
        with pytest.raises(PermanentToolError, match="port 80 of host"):
            await tool_run(tool, f"http://{host}/no")  # the scheme's port is a port too
        await tool.check_url(f"http://{host}:{allowed.port}/hook")
        with pytest.raises(PermanentToolError, match="not on the allow-list"):
            await tool.check_url(f"http://{host}:{other.port}/hook")
    assert allowed.hits == ["yes", "yes"]
    assert other.hits == []
    # An entry without a port still opens every port, as before.
    open_tool = HttpRequestTool(["127.0.0.1"])
    assert (await tool_run(open_tool, f"{other.base}/any"))["status"] == 200
    assert other.hits == ["any"]


async def test_ports_apply_to_patterns_and_literal_addresses() -> None:
    transport = Recording()
    async with httpx.AsyncClient(transport=transport) as client:
        tool = HttpRequestTool(
            ["*.example.com:443", "[fd00::1]:8080", "10.0.0.5:9000"],
            client=client,
            resolve=resolver({"api.example.com": ["93.184.216.34"]}),
        )
        assert (await tool_run(tool, "https://api.example.com/"))["status"] == 200
        with pytest.raises(PermanentToolError, match="port 8443"):
            await tool_run(tool, "https://api.example.com:8443/")
        assert (await tool_run(tool, "http://[fd00::1]:8080/"))["status"] == 200
        with pytest.raises(PermanentToolError, match="port 80 of host"):
            await tool_run(tool, "http://[fd00::1]/")
        assert (await tool_run(tool, "http://10.0.0.5:9000/"))["status"] == 200
        with pytest.raises(PermanentToolError, match="port 5432 of host"):
            await tool_run(tool, "http://10.0.0.5:5432/")
    assert transport.hosts == ["93.184.216.34", "fd00::1", "10.0.0.5"]


@pytest.mark.parametrize(
    "entry",
    [
        "host:",
        "host:0",
        "host:65536",
        "host:http",
        "host:+80",
        "[::1",
        "[::1]x",
        "[nope]:80",
        ":80",
    ],
)
def test_a_malformed_allow_list_entry_is_refused_at_start(entry: str) -> None:
    with pytest.raises(ValueError, match="allow-list entry"):
        HttpRequestTool([entry])
    with pytest.raises(ValidationError, match="allow-list entry"):
        Settings(http_allowed_hosts=f"example.com,{entry}")


def test_allow_list_entries_parse() -> None:
    assert parse_allowed(" Intranet.Local:8443 ") == AllowedHost("intranet.local", 8443, None)
    assert parse_allowed("fd00::1").port is None  # a bare IPv6 address has no port
    assert parse_allowed("[FD00::1]:80") == AllowedHost(
        "fd00::1", 80, ipaddress.ip_address("fd00::1")
    )
    assert parse_allowed("*") == AllowedHost("*", None, None)
