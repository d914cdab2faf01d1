"""The executor interface: what a slot hands a claimed run to.

The runtime (agents, tools, checkpoints) implements `Executor`; the pool only claims, holds
leases and stops executions. `ExecutionContext` is the executor's hold on the run: it offers the
fenced writes themselves (tool started, finished or not sent; a live message completed;
complete, wait for the user, fail, release, wait for model capacity; a model call's
reservation), each presenting the lease, marking the execution
finishing when it ends the hold, and turning a zero-row answer into the one stop path. The
runtime writes only through it, and hands its live text to `deltas` (never a write).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol
from uuid import UUID

from app.observability import tracing
from app.queue.core import Queue, ResumeState
from app.queue.model_budgets import CapacityShort, ModelBudgets, Reservation
from app.vocabulary.live_deltas import Delta
from app.vocabulary.records import JSON, ClaimedRun, Fenced, Lease, ToolCall, WriteOutcome, Written
from app.worker.completions import CompletionBatcher


class DeltaSink(Protocol):
    """Where a run's live output goes (app/worker/deltas.py: the process's publisher)."""

    def offer(self, delta: Delta) -> bool: ...

    async def settle(self, run_id: UUID, within: float | None = None) -> bool: ...


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
    # The process's delta publisher; None: this process shows no live output.
    deltas: DeltaSink | None = None
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

    # --- the fenced writes of this hold -------------------------------------------------------
    # Each presents this execution's lease; a zero-row answer takes the one stop path
    # (`checked`: record run.fenced once, raise StopExecution). The writes that end the hold go
    # through `finish`, which marks the execution finishing first and ended once committed.
    async def resume_state(self) -> ResumeState:
        """What this run resumes from: checkpoint, inputs, tool journal (a plain read)."""
        return await self.queue.resume_state(self.claimed.run)

    async def session_history(self, *, from_run_no: int, through_run_no: int) -> list[JSON]:
        """The transcript of this run's session, runs `from_run_no` through `through_run_no`
        (a plain read), as JSON entries."""
        session_id = self.claimed.run.session_id
        if session_id is None:
            return []
        entries = await self.queue.session_history(
            session_id, from_run_no=from_run_no, through_run_no=through_run_no
        )
        return [entry.to_json() for entry in entries]

    async def append_event(self, type_: str, data: JSON) -> None:
        await self.checked(await self.queue.append_event(self.lease, type_, data), "append_event")

    async def tool_started(self, call: ToolCall) -> None:
        await self.checked(await self.queue.tool_started(self.lease, call), "tool_started")

    async def tool_finished(
        self, call: ToolCall, outcome_status: str, outcome: JSON, state: JSON
    ) -> None:
        await self.checked(
            await self.queue.tool_finished(self.lease, call, outcome_status, outcome, state),
            "tool_finished",
        )

    async def tool_rejected(self, call: ToolCall, outcome: JSON, state: JSON) -> None:
        """A call the user refused (docs/approvals.md): its outcome and the checkpoint, fenced."""
        await self.checked(
            await self.queue.tool_rejected(self.lease, call, outcome, state), "tool_rejected"
        )

    async def session_approval(self) -> JSON:
        """The approval policy of this run's session as it stands (a plain read)."""
        session_id = self.claimed.run.session_id
        if session_id is None:
            return None
        return await self.queue.session_approval(session_id)

    async def tool_not_sent(self, call: ToolCall, error: str) -> None:
        await self.checked(await self.queue.tool_not_sent(self.lease, call, error), "tool_not_sent")

    async def message_completed(self, text: str, message: int) -> None:
        """The durable end of a live message (`message.completed`, the whole text), fenced."""
        await self.checked(
            await self.queue.append_event(
                self.lease, "message.completed", {"text": text, "message": message}
            ),
            "message_completed",
        )

    async def at_boundary(self, *, step: int) -> list[JSON]:
        """A safe boundary (before a model or tool call) of a run of a session: a pending
        interrupt ends the run here (`Queue.interrupt`: run.interrupted, then the cancel that
        starts the interrupting turn) and stops the execution; steered turns are taken into
        the run (fenced) and their inputs returned. A sessionless run pays nothing."""
        run = self.claimed.run
        if run.session_id is None:
            return []
        interrupt, steered = await self.queue.turn_signals(run.session_id)
        if interrupt is not None:
            self.finishing = True  # the cancel's new epoch is not a lost lease
            with tracing.transition("interrupt"):
                await self.queue.interrupt(
                    self.lease.run_id, turn_id=interrupt, by="worker", actor=self.lease.owner
                )
            self.ended = True
            raise StopExecution("interrupted")
        if not steered:
            return []
        taken = await self.queue.take_steered(self.lease, at_step=step)
        if isinstance(taken, Fenced):
            await self.checked(taken, "take_steered")
            return []
        return taken

    async def steered_inputs(self) -> list[tuple[JSON, int, int]]:
        """The steered inputs this run took before (a plain read, for a recovered run)."""
        return await self.queue.steered_inputs(self.lease.run_id)

    async def complete(self, result: JSON) -> None:
        """Complete the run, batched with its slot group's completions when it has a batcher."""
        await self.finish("complete", self._completion_write(result))

    async def _completion_write(self, result: JSON) -> WriteOutcome:
        """The completion's write alone, its outcome unchecked (for `finish`)."""
        if self.completions is not None:
            return await self.completions.complete(self.lease, result)
        return await self.queue.complete(self.lease, result)

    async def wait_for_user(self, question: JSON, *, step: int, state: JSON) -> None:
        await self.finish(
            "wait_for_user", self.queue.wait_for_user(self.lease, question, step=step, state=state)
        )

    async def fail(self, failure: JSON) -> None:
        await self.finish("fail", self.queue.fail(self.lease, failure))

    async def release_early(self, reason: str) -> None:
        """Transient retries ran out: requeued with backoff, counted as an attempt."""
        await self.finish("release", self.queue.release(self.lease, graceful=False, reason=reason))

    async def wait_for_capacity(self, short: CapacityShort) -> None:
        """A model endpoint's budget has no room: give the run back until it has, the attempt
        given back (docs/model-budgets.md). The slot is free at once; the run is claimed
        again, in its priority's order, from `short.ready_at`."""
        await self.finish(
            "wait_for_capacity",
            self.queue.wait_for_capacity(
                self.lease, short.reason(), until=short.ready_at, endpoint=short.endpoint
            ),
            # The span of the give-back carries the wait it begins (one process cannot hold
            # a span open across it: the run comes back in any process).
            attributes={
                "turnstile.capacity.endpoint": short.endpoint,
                "turnstile.capacity.short_of": short.short_of,
                "turnstile.capacity.wait_seconds": round(short.wait_seconds, 3),
                "turnstile.capacity.ready_at": short.ready_at.isoformat(),
            },
        )

    # --- model budgets (app/queue/model_budgets.py) --------------------------------------------
    async def reserve_model(
        self, budgets: ModelBudgets, endpoint: str, tokens: int
    ) -> Reservation | CapacityShort:
        """Reserve one request and `tokens` on the endpoint's budget, fenced on this lease: a
        lost lease takes the one stop path, having taken nothing."""
        outcome = await budgets.reserve(
            self.lease, endpoint, tokens, tenant_id=self.claimed.run.tenant_id
        )
        if isinstance(outcome, Fenced):
            await self.stop_fenced("reserve_model")
            raise StopExecution("fenced during reserve_model")
        return outcome

    async def settle_model(
        self, budgets: ModelBudgets, reservation: Reservation, used_tokens: int
    ) -> None:
        """The call is over: the provider's usage in its estimate's place (no fence: it
        records what was spent, whoever holds the run now)."""
        await budgets.settle(reservation, used_tokens)

    async def pause_model(self, budgets: ModelBudgets, endpoint: str, seconds: float) -> None:
        """The provider answered 429: pause the endpoint for every process."""
        await budgets.pause(endpoint, seconds)

    async def finish(
        self,
        during: str,
        write: Awaitable[WriteOutcome],
        attributes: tracing.Attributes | None = None,
    ) -> WriteOutcome:
        """Make the write that ends this hold (complete, fail, wait for the user, release):
        marked finishing before it is sent, `ended` once it committed, and on `Fenced` the one
        stop path (`checked`)."""
        self.finishing = True
        with tracing.transition(during, attributes) as span:
            outcome = await write
            if isinstance(outcome, Written):
                self.ended = True
            span.set({"turnstile.transition.written": self.ended})
            return await self.checked(outcome, during)

    # --- what the pool tells the execution, and the releases it asks of it ---------------------
    def lost(self) -> None:
        """A heartbeat found the lease gone: the run is someone else's."""
        self.fenced = True

    def lapsed(self) -> None:
        """Heartbeats failed until the lease deadline: it may have lapsed (self-fencing)."""
        self.self_fenced = True

    def renewed(self, *, until: float) -> None:
        """A heartbeat extended the lease: it may be trusted up to `until` (monotonic)."""
        self.trusted_until = until

    async def release_after_error(self, reason: str) -> None:
        """The executor failed unexpectedly: give the run back early (backoff, counted as an
        attempt), unless its hold already ended or may have lapsed."""
        if self.ended or not self.may_continue():
            return
        await self._release(graceful=False, reason=reason)

    async def release_for_drain(self) -> None:
        """The process is stopping: give the run back at once, the attempt given back."""
        if self.ended:
            return  # its completion, failure or question committed: nothing to give back
        await self._release(graceful=True, reason="worker shutting down")

    async def _release(self, *, graceful: bool, reason: str) -> None:
        # An ending write that failed with an error or was interrupted may still have
        # committed: a release that then finds the run gone is no lost lease, and records
        # nothing. Marked finishing first, so a heartbeat does not take it for one either.
        outcome_unknown = self.finishing
        self.finishing = True
        with tracing.transition("release", {"turnstile.release.graceful": graceful}) as span:
            outcome = await self.queue.release(self.lease, graceful=graceful, reason=reason)
            span.set({"turnstile.transition.written": isinstance(outcome, Written)})
            if isinstance(outcome, Fenced) and not outcome_unknown:
                await self.stop_fenced("release")

    async def stop_fenced(self, during: str) -> None:
        """The run is someone else's: record `run.fenced` (once) and stop writing."""
        self.fenced = True
        async with self._lock:
            if self._fenced_recorded:
                return
            self._fenced_recorded = True
        tracing.event(
            "turnstile.fenced",
            {"turnstile.fenced.during": during, "turnstile.lease.epoch": self.lease.epoch},
        )
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
