"""The base of every maintenance service: one instance at a time across all processes.

A service owns the lease row of its name (`maintenance_leases`): each tick it takes or renews
the lease (valid for a few intervals), runs `run_once()` only while it holds it, records the
time of its last successful tick, logs and carries on after a failed one, and gives the lease
up on `stop()`. A crashed holder stops renewing, its lease expires, and another process takes
over. `run_once()` is what tests call; `tick()` adds the lease; `run()` repeats `tick()` every
`interval` seconds (0: back to back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from app.queue.core import Queue
from app.store.housekeeping import Housekeeping

log = logging.getLogger("turnstile.maintenance")


class MaintenanceService:
    name = "maintenance"

    def __init__(
        self,
        queue: Queue,
        *,
        holder: str,
        interval: float,
        on_success: Callable[[str], None] | None = None,
    ) -> None:
        if interval < 0:
            raise ValueError(f"{self.name} interval must be >= 0")
        self.queue = queue
        self.housekeeping = Housekeeping(queue)
        self.holder = holder
        self.interval = interval
        # Long enough to survive a slow tick or two, short enough to fail over promptly.
        self.lease_seconds = max(3 * interval, 5.0)
        self._stopping = asyncio.Event()
        self.ticks = 0  # ticks this instance ran while holding the lease
        self.on_success = on_success

    async def run_once(self) -> Any:
        raise NotImplementedError

    async def acquire(self) -> bool:
        return await self.housekeeping.acquire(
            self.name, self.holder, ttl_seconds=self.lease_seconds
        )

    async def tick(self) -> bool:
        """One round: run if this instance holds the lease. True when it ran."""
        if not await self.acquire():
            return False
        await self.run_once()
        await self.housekeeping.succeeded(self.name, self.holder)
        self.ticks += 1
        if self.on_success is not None:
            self.on_success(self.name)
        return True

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.tick()
            except Exception:
                # A bad tick (database restarting, a timeout) must not end the service.
                log.exception("maintenance tick failed", extra={"service": self.name})
            if self.interval == 0:
                # Back to back (the race gate drives the sweeper so); yield, so a zero interval
                # cannot starve the event loop.
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=self.interval)

    async def stop(self) -> None:
        """Stop ticking and hand the lease over at once; safe to call more than once."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(Exception):
            await self.housekeeping.release(self.name, self.holder)
