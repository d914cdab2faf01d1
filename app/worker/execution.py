"""The executor interface: what a slot hands a claimed run to.

The runtime (agents, tools, checkpoints) implements `Executor`; the pool only claims, holds
leases and stops executions. `ExecutionContext` is the executor's view of its hold on the run:
the lease to present on every fenced write, whether the pool still believes in that lease, and
`stop_fenced()` to call when a write came back `Fenced`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.queue.core import Queue
from app.queue.models import ClaimedRun, Fenced, Lease, WriteOutcome, Written
from app.worker.completions import CompletionBatcher


class StopExecution(Exception):
    """Raised inside an executor to end the execution at once (fenced or self-fenced)."""


@dataclass
class ExecutionContext:
    queue: Queue
    claimed: ClaimedRun
    slot_group: str
    lease_seconds: float
    # Monotonic time up to which this process may trust its lease without hearing back from
    # the database: the send time of the last successful heartbeat (or claim) plus the lease.
    trusted_until: float = field(default_factory=lambda: time.monotonic())
    fenced: bool = False
    self_fenced: bool = False
    # Set just before the write that ends this hold (complete, fail, wait, release): from then
    # on that write's own fence decides, and a heartbeat that no longer sees the run (because
    # the write already committed) must not take it for a lost lease.
    finishing: bool = False
    # The write that ends this hold committed: nothing is left to release, and a drain that
    # stops the execution now must write nothing more (a release would come back fenced and
    # record a spurious run.fenced after the run's own ending).
    ended: bool = False
    # The slot group's group commit of completions; None completes with a statement of its own.
    completions: CompletionBatcher | None = None
    _fenced_recorded: bool = False
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def lease(self) -> Lease:
        return self.claimed.lease

    def may_continue(self) -> bool:
        """False once the run is lost or the lease may have lapsed (self-fencing): start no new
        tool call and make no further write."""
        if self.fenced or self.self_fenced:
            return False
        if time.monotonic() >= self.trusted_until:
            self.self_fenced = True
            return False
        return True

    def ensure_may_continue(self) -> None:
        if not self.may_continue():
            raise StopExecution("lease lost" if self.fenced else "lease may have lapsed")

    async def complete(self, result: Any) -> WriteOutcome:
        """The fenced completion of this run, batched with its slot group's when it has one."""
        if self.completions is not None:
            return await self.completions.complete(self.lease, result)
        return await self.queue.complete(self.lease, result)

    async def finish(self, during: str, write: Awaitable[WriteOutcome]) -> WriteOutcome:
        """Make the write that ends this hold (complete, fail, wait for the user, release):
        marked finishing before it is sent, `ended` once it committed, and on `Fenced` the one
        stop path (`checked`)."""
        self.finishing = True
        outcome = await write
        if isinstance(outcome, Written):
            self.ended = True
        return await self.checked(outcome, during)

    async def stop_fenced(self, during: str) -> None:
        """The run is someone else's: record `run.fenced` (once) and stop writing."""
        self.fenced = True
        async with self._lock:
            if self._fenced_recorded:
                return
            self._fenced_recorded = True
        await self.queue.record_fenced(self.lease, during=during)

    async def checked(self, outcome: WriteOutcome, during: str) -> WriteOutcome:
        """Pass a fenced write's outcome through; on `Fenced`, record it and stop."""
        if isinstance(outcome, Fenced):
            await self.stop_fenced(during)
            raise StopExecution(f"fenced during {during}")
        return outcome


class Executor(Protocol):
    async def execute(self, ctx: ExecutionContext) -> None:
        """Run the claimed run to its next resting point: finished, waiting, or released."""
