"""The outbound HTTP client of model calls, sized to the worker's slots, and the bounded reads of
what a model endpoint answers.

A run awaiting a model holds an HTTP request open for seconds, so a process with N slots may
have N requests in flight at once, and its CPU per call decides how many runs a second one
process turns over. With httpx a 2,000-slot worker spent 3.9 ms of CPU per run, 80 % of its
profile in httpx and httpcore (whose pool scans every queued request against every connection
on each event, quadratic in the calls in flight); with aiohttp 0.6-0.9 ms per run, its
request path 16 % of the profile (docs/performance.md). So `ModelClient` is one
`aiohttp.ClientSession` whose connector allows as many connections as there are slots and
keeps them all when idle: a call reuses a connection a finished one left, and a steady load
opens no new ones.

An endpoint's answer is read within bounds, as `http_request` reads its bodies: at most
`max_bytes` in all (`read_body`, `lines`) and, for a stream, at most `max_line` per line. Past a
bound the reading stops, the connection is closed (never drained), and `TooLarge` says which
bound it was: a 150 MB answer no longer takes a worker's memory with it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp

KEEPALIVE_SECONDS = 60.0
"""How long an idle connection to the endpoint is kept (the endpoint may close it sooner)."""


class TooLarge(Exception):
    """An answer past a bound: its message says which, for the run's failure."""


class ModelClient:
    """One pooled aiohttp session for a process's model calls, `in_flight` connections at most
    (one per slot). The session is made on first use, inside the running event loop."""

    def __init__(self, in_flight: int) -> None:
        if in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        self.capacity = in_flight
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.capacity,
                limit_per_host=0,  # one endpoint usually: the overall limit is the slots
                keepalive_timeout=KEEPALIVE_SECONDS,
                ttl_dns_cache=300,
            )
            # No cookies: a model endpoint's are never sent back (each call stands alone).
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=True,
                raise_for_status=False,
            )
        return self._session

    @property
    def connections_held(self) -> int:
        """Connections held now (idle and busy), for benches and tests."""
        if self._session is None or self._session.closed:
            return 0
        connector = self._session.connector
        if not isinstance(connector, aiohttp.TCPConnector):
            return 0
        idle = sum(len(held) for held in connector._conns.values())
        return idle + len(connector._acquired)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def read_body(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The whole body, or `TooLarge` once it passes `max_bytes` (told by its Content-Length
    before anything is read, when it has one)."""
    if response.content_length is not None and response.content_length > max_bytes:
        raise TooLarge(f"the endpoint's answer is larger than {max_bytes} bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"the endpoint's answer is larger than {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)


async def read_excerpt(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """At most `max_bytes` of the body (what an error says, for its excerpt); the rest unread."""
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        parts.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


async def lines(
    response: aiohttp.ClientResponse, *, max_bytes: int, max_line: int
) -> AsyncIterator[bytes]:
    """The body's lines (without their line ends), within both bounds: `TooLarge` once the body
    passes `max_bytes` or a line `max_line`, before more of it is read."""
    pending = b""
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        pending += chunk
        start = 0
        while True:
            end = pending.find(b"\n", start)
            if end < 0:
                break
            if end - start > max_line:
                raise TooLarge(f"the endpoint streamed a line longer than {max_line} bytes")
            yield pending[start:end].rstrip(b"\r")
            start = end + 1
        pending = pending[start:]
        if len(pending) > max_line:
            raise TooLarge(f"the endpoint streamed a line longer than {max_line} bytes")
        # After the lines: a chunk that is one overlong line says so, whatever its size.
        if size > max_bytes:
            raise TooLarge(f"the endpoint's answer is larger than {max_bytes} bytes")
    if pending:
        yield pending.rstrip(b"\r")
