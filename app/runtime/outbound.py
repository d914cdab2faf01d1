"""Outbound HTTP clients for model calls, sized to the worker's slots.

A run awaiting a model holds an HTTP request open for seconds, so a process with N slots may
have N requests in flight at once. One `httpx.AsyncClient` cannot carry that: its default limit
of 100 connections queues the rest (a 500-slot worker never had more than 100 model calls in
flight), and raising the limit makes it worse, because httpcore's pool scans every queued
request against every connection each time a request starts or ends, which is quadratic in the
number in flight (a 2,000-slot worker spent 45 s at 100 % CPU in
`_assign_requests_to_connections` before its first model call; see docs/performance.md).

`ClientShards` keeps several clients of at most `SHARD_CONNECTIONS` connections each, enough of
them for every slot to have its own request, and hands them out in turn: each scan stays
bounded by one shard's size whatever the slot count.
"""

from __future__ import annotations

import itertools
import math

import httpx

SHARD_CONNECTIONS = 64
"""Connections per client: small enough that httpcore's per-event scan stays cheap."""


class ClientShards:
    def __init__(self, in_flight: int, *, per_shard: int = SHARD_CONNECTIONS) -> None:
        if in_flight < 1 or per_shard < 1:
            raise ValueError("in_flight and per_shard must be at least 1")
        count = math.ceil(in_flight / per_shard)
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        # One TLS context for all of them: building one loads the CA bundle (about 30 ms).
        tls = httpx.create_ssl_context()  # what each client would build for itself
        self.clients = [httpx.AsyncClient(limits=limits, verify=tls) for _ in range(count)]
        self.capacity = count * per_shard
        self._turn = itertools.cycle(self.clients)

    def next(self) -> httpx.AsyncClient:
        """The client for the next request (round robin)."""
        return next(self._turn)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
