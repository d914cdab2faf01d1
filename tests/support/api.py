"""An API under test: the real app in a real uvicorn server on loopback, with keys made
through the same code as `turnstile keys create`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.main import create_app
from app.queue.core import Clock, Queue
from app.roles import server_config
from app.security.api_keys import create_key
from app.store.embedded import free_port
from app.worker.execution import Executor
from tests.support.servers import running_server


@dataclass
class Api:
    base: str
    engine: AsyncEngine
    queue: Queue
    app: FastAPI | None = None  # the app under test, for tests that look inside its process
    clients: list[httpx.AsyncClient] = field(default_factory=list)

    async def key(self, tenant: str = "acme", principal: str = "alice", *scopes: str) -> str:
        return (
            await create_key(
                self.engine, tenant_id=tenant, principal=principal, scopes=tuple(scopes)
            )
        ).secret

    async def client(
        self, tenant: str = "acme", principal: str = "alice", *scopes: str
    ) -> httpx.AsyncClient:
        secret = await self.key(tenant, principal, *scopes)
        client = httpx.AsyncClient(
            base_url=self.base, headers={"Authorization": f"Bearer {secret}"}, timeout=30
        )
        self.clients.append(client)
        return client


@asynccontextmanager
async def running_api(
    database_url: str,
    engine: AsyncEngine,
    *,
    workers: bool = False,
    executor: Executor | None = None,
    clock: Clock | None = None,
    as_served: bool = False,
    **settings: object,
) -> AsyncIterator[Api]:
    """The app under test in uvicorn; `as_served`: with `turnstile serve`'s server settings
    (app/roles.py: the head deadline, the connection cap), not the tests' plain ones."""
    configured = Settings(database_url=database_url, run_workers=workers, **settings)  # type: ignore[arg-type]
    app = create_app(configured, executor, clock=clock)
    config = None
    if as_served:
        served = configured.model_copy(
            update={"host": "127.0.0.1", "port": free_port(), "log_level": "warning"}
        )
        config = server_config(served, app)
    async with running_server(app, config) as base:
        api = Api(base=base, engine=engine, queue=Queue(engine, clock=clock), app=app)
        try:
            yield api
        finally:
            for client in api.clients:
                await client.aclose()
