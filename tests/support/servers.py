"""Real HTTP servers on loopback for tests: uvicorn serving our app, with its lifespan.

httpx's ASGI transport does not run the lifespan, so tests that depend on startup and shutdown
(the worker pool, the embedded default) run a real uvicorn server on 127.0.0.1 instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from app.store.embedded import free_port


@asynccontextmanager
async def running_server(app: FastAPI) -> AsyncIterator[str]:
    """Serve `app` on a free loopback port for the duration of the block; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        lifespan="on",
        log_level="warning",
        proxy_headers=False,  # as `turnstile serve`: only the app's setting trusts a proxy
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    # Signals belong to pytest, not to the server under test.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited before it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown = getattr(app.state, "shutdown", None)
        if shutdown is not None:
            shutdown.set()  # what the serve command's signal handler does
        server.should_exit = True
        await asyncio.wait_for(task, timeout=30)
