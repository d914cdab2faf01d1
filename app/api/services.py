"""The services a request handler reaches, typed: `state_of(request)` is the one way the API
and the dashboard get at what the lifespan built (`app/main.py: AppState`), so mypy checks
every use. A read-only view: handlers never replace a service."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from app.api.watch import LiveWatch, RunWatch, StreamLimits
from app.config import Settings
from app.observability.metrics import Metrics
from app.queue.core import Queue
from app.queue.reads import Reads
from app.queue.scheduling import Schedules
from app.queue.submit import Submissions
from app.queue.tenant_limits import Tenants
from app.queue.webhook_endpoints import Webhooks
from app.runtime.http_tool import HttpRequestTool
from app.security.secret_box import SecretBox

if TYPE_CHECKING:
    from app.api.auth import KeyCache  # auth reaches the state through this module


class PoolStatus(Protocol):
    """What readiness needs of the process's worker pool (the API imports no worker code)."""

    @property
    def groups(self) -> Sequence[object]: ...

    @property
    def started(self) -> bool: ...


class ServiceState(Protocol):
    @property
    def settings(self) -> Settings: ...

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def queue(self) -> Queue: ...

    @property
    def submissions(self) -> Submissions: ...

    @property
    def reads(self) -> Reads: ...

    @property
    def schedules(self) -> Schedules: ...

    @property
    def tenants(self) -> Tenants: ...

    @property
    def agents(self) -> frozenset[str]: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def webhooks(self) -> Webhooks: ...

    @property
    def secret_box(self) -> SecretBox | None: ...

    @property
    def egress(self) -> HttpRequestTool: ...

    @property
    def streams(self) -> StreamLimits: ...

    @property
    def watch(self) -> RunWatch: ...

    @property
    def live(self) -> LiveWatch: ...

    @property
    def shutdown(self) -> asyncio.Event: ...

    @property
    def key_cache(self) -> KeyCache: ...

    @property
    def pool(self) -> PoolStatus | None: ...


def state_of(request: Request) -> ServiceState:
    """The running service's state (set by the lifespan before the first request)."""
    return cast(ServiceState, request.app.state.turnstile)
