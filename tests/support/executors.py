"""Executors for the worker pool's own tests, where the runtime's would only add noise."""

from __future__ import annotations

import asyncio

from app.worker.execution import ExecutionContext


class CompletingExecutor:
    """Completes every run it is given, optionally after a pause."""

    def __init__(self, pause_seconds: float = 0.0) -> None:
        self.pause_seconds = pause_seconds

    async def execute(self, ctx: ExecutionContext) -> None:
        if self.pause_seconds:
            await asyncio.sleep(self.pause_seconds)
        ctx.ensure_may_continue()
        await ctx.complete({"completed": True})
