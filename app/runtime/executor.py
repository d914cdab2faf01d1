"""The runtime's executor: runs a claimed run from its last checkpoint to its next resting
point (finished, waiting for the user, released, or failed), writing only through fenced
statements and stopping at the first `Fenced`.

For each tool call: journal `started` (fenced), run the tool, then record the outcome and the
checkpoint after it in one fenced statement. On recovery, a `started` entry without an outcome
is re-executed when the tool is safe, re-executed with the same key when keyed, and recorded as
`uncertain` when unsafe: the agent is told the outcome is unknown, never that it failed.

A model call that finds no room on its endpoint's budget (`CapacityWait`) gives the run back
until the budget has room, its attempt given back (docs/model-budgets.md).

Failures: transient tool errors are retried with bounded backoff (only when repeating is safe
or the request provably never left), then the lease is released early (requeued with backoff,
counted as an attempt); permanent errors fail the run at once; execution time while claimed is
limited per agent (`failure.kind = "timeout"`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.observability import tracing
from app.queue.model_budgets import ModelBudgets
from app.runtime.agents import Agent, AgentError, Ask, CallTool, Finish
from app.runtime.capacity import CapacityWait, ModelCapacity
from app.runtime.live import LiveOutput
from app.runtime.state import RunState, ToolRecord
from app.runtime.tools import (
    PermanentToolError,
    Tool,
    ToolContext,
    TransientToolError,
    derive_idempotency_key,
)
from app.vocabulary.approval_policy import REJECTED_MESSAGE, ApprovalPolicy, call_id_of, effective
from app.vocabulary.records import JSON, UNKNOWN_OUTCOME, JournalEntry, ToolCall
from app.worker.execution import ExecutionContext, StopExecution

log = logging.getLogger("turnstile.runtime")


class SimulatedCrash(BaseException):
    """Raised by a test's crash hook: the execution dies on the spot, like a killed process,
    writing nothing more (a BaseException, so no handler on the way out records anything)."""


@dataclass
class RuntimeLimits:
    transient_retries: int = 3
    retry_backoff_seconds: float = 0.2
    retry_backoff_max_seconds: float = 5.0
    default_time_limit_seconds: float = 600.0
    # How many of the session's earlier runs a run's history covers (the newest ones).
    history_runs: int = 100
    max_state_bytes: int = 1_048_576
    max_result_bytes: int = 262_144


@dataclass
class Registry:
    agents: dict[str, Agent]
    tools: dict[str, Tool]
    # Built-in agents that only the service itself enqueues (the `webhook` deliveries), each with
    # the tools only it may call: not submittable, and never shown to a model.
    internal_agents: dict[str, Agent] = field(default_factory=dict)
    internal_tools: dict[str, dict[str, Tool]] = field(default_factory=dict)

    def agent_names(self) -> frozenset[str]:
        """The agents a client may submit runs to."""
        return frozenset(self.agents)

    def agent(self, name: str) -> Agent | None:
        return self.agents.get(name) or self.internal_agents.get(name)

    def tool(self, agent: str, name: str) -> Tool | None:
        return self.internal_tools.get(agent, {}).get(name) or self.tools.get(name)


@dataclass
class RuntimeExecutor:
    registry: Registry
    limits: RuntimeLimits = field(default_factory=RuntimeLimits)
    # Which tool calls wait for a user's approval when neither the run's turn nor its session
    # says (TURNSTILE_APPROVAL_REQUIRED; docs/approvals.md). None: none.
    approval_default: ApprovalPolicy | None = None
    # Fault injection for tests: called with a boundary name; may raise SimulatedCrash.
    crash_hook: Callable[[str, int], None] | None = None
    # The model endpoints' budgets (docs/model-budgets.md); None: model calls reserve nothing.
    budgets: ModelBudgets | None = None

    async def execute(self, ctx: ExecutionContext) -> None:
        run = ctx.claimed.run
        agent = self.registry.agent(run.agent)
        if agent is None:
            await self._fail(ctx, "unknown_agent", f"no agent named {run.agent!r}")
            return
        # Checkpoint, inputs and journal in one read (none at all on a run's first claim).
        resume = await ctx.resume_state()
        checkpoint = resume.checkpoint
        state = RunState.from_json(checkpoint.state) if checkpoint else RunState(inputs=[run.input])
        state.inputs = resume.inputs  # answers delivered since the checkpoint
        if run.session_id is not None and len(resume.inputs) > 1:
            # Steered inputs are inputs too, but not answers: set apart again, wherever the
            # checkpoint was taken.
            steered = await ctx.steered_inputs()
            if steered:
                indexes = {index for _, index, _ in steered}
                state.inputs = [
                    value for index, value in enumerate(resume.inputs, 1) if index not in indexes
                ]
                state.steered = [{"input": value, "at_step": step} for value, _, step in steered]
        # The decision on the call the run waited for (docs/approvals.md), if it has come.
        state.take_approval()
        await self._load_history(ctx, state)
        state.output = LiveOutput(ctx)
        if self.budgets is not None:
            state.capacity = ModelCapacity(ctx, self.budgets)
        limit = agent.time_limit_seconds or self.limits.default_time_limit_seconds
        clock = _Budget(state.elapsed_seconds, limit)

        await self._recover(ctx, state, clock, resume.journal)
        while True:
            ctx.ensure_may_continue()
            await self._boundary(ctx, state)  # before the agent's next decision (a model call)
            if clock.exhausted():
                await self._fail(ctx, "timeout", f"execution time limit of {limit:g}s reached")
                return
            try:
                decision = await asyncio.wait_for(agent.decide(state), clock.remaining())
            except TimeoutError:
                await self._fail(ctx, "timeout", f"execution time limit of {limit:g}s reached")
                return
            except CapacityWait as wait:
                # No room on a model endpoint's budget: the slot goes back now, the run comes
                # back when the budget has room, its attempt given back.
                log.info(
                    "run waits for model capacity",
                    extra={"run_id": str(ctx.lease.run_id), "endpoint": wait.short.endpoint},
                )
                await ctx.wait_for_capacity(wait.short)
                return
            except AgentError as exc:
                if exc.permanent:
                    await self._fail(ctx, "agent_error", str(exc))
                else:
                    await self._release_early(ctx, f"agent error: {exc}")
                return
            if state.output.partial:
                # A message the agent left open ends before the run's next durable event.
                await state.output.complete()
            if isinstance(decision, Finish):
                if _too_big(decision.result, self.limits.max_result_bytes):
                    await self._fail(
                        ctx,
                        "result_too_large",
                        f"the result exceeds {self.limits.max_result_bytes} bytes",
                    )
                    return
                await ctx.complete(decision.result)
                return
            if isinstance(decision, Ask):
                if isinstance(decision.question, dict) and "approval_request" in decision.question:
                    # The runtime's own question shape: an agent's would pass for an approval.
                    await self._fail(
                        ctx, "agent_error", "a question may not have an 'approval_request' field"
                    )
                    return
                state.questions.append(decision.question)
                state.elapsed_seconds = clock.elapsed()
                await ctx.wait_for_user(
                    decision.question, step=state.next_step, state=state.to_json()
                )
                return
            for call in decision:
                if not await self._call(ctx, state, clock, call):
                    return

    @staticmethod
    async def _boundary(ctx: ExecutionContext, state: RunState) -> None:
        """A safe boundary (docs/turn-control.md): an interrupt stops the execution here
        (StopExecution); steered input joins the state, for the agent's next decision."""
        step = state.next_step
        for value in await ctx.at_boundary(step=step):
            state.steered.append({"input": value, "at_step": step})

    async def _load_history(self, ctx: ExecutionContext, state: RunState) -> None:
        """The session's earlier runs, as the agent sees them. The window is fixed by the
        first claim (the newest `history_runs` runs before this one) and checkpointed, so a
        recovered run reads the same entries: every run in it finished before this run was
        created (one active run per session), and retention keeps a session's runs while
        the session is active."""
        run = ctx.claimed.run
        if run.session_id is None or run.session_run_no is None:
            return
        if state.history_window is None:
            state.history_window = {
                "from_run_no": max(1, run.session_run_no - self.limits.history_runs),
                "through_run_no": run.session_run_no - 1,
            }
        window = state.history_window
        state.history = await ctx.session_history(
            from_run_no=int(window["from_run_no"]), through_run_no=int(window["through_run_no"])
        )

    # --- one tool call ----------------------------------------------------------------------
    async def _call(
        self, ctx: ExecutionContext, state: RunState, clock: _Budget, call: CallTool
    ) -> bool:
        """Run one tool call through the journal; False when the execution must end here."""
        tool = self.registry.tool(ctx.claimed.run.agent, call.tool)
        if tool is None:
            await self._fail(ctx, "unknown_tool", f"no tool named {call.tool!r}")
            return False
        step = state.next_step
        args = call.args
        klass = tool.idempotency_class(args)
        self._crash("before_started", step)
        ctx.ensure_may_continue()  # journal nothing this worker may not go on to run
        await self._boundary(ctx, state)  # before the tool call
        if (await self._approval_policy(ctx, state)).needs(tool.name, klass):
            call_id = call_id_of(ctx.lease.run_id, step)
            decided = state.decision_for(call_id)
            if decided is None:
                await self._ask_approval(ctx, state, clock, tool, call, klass, step, call_id)
                return False
            if decided.get("decision") == "reject":
                await self._reject(ctx, state, clock, tool, call, klass, step, decided)
                return True
            if decided.get("decision") == "edit" and isinstance(decided.get("args"), dict):
                args = dict(decided["args"])
                klass = tool.idempotency_class(args)
        key = derive_idempotency_key(str(ctx.lease.run_id), step) if klass == "keyed" else None
        record = ToolCall(
            step=step, tool=tool.name, idempotency_class=klass, idempotency_key=key, args=args
        )
        with tracing.tool(tool.name, klass, step):
            await ctx.tool_started(record)
            self._crash("after_started", step)
            return await self._run_and_record(ctx, state, clock, tool, record)

    # --- approval before a tool call (docs/approvals.md) --------------------------------------
    async def _approval_policy(self, ctx: ExecutionContext, state: RunState) -> ApprovalPolicy:
        """The run's own policy, else its session's (read once an execution, at its first
        tool call: a run that calls no tool pays nothing), else the process default."""
        if state.approval_policy is None:
            run = ctx.claimed.run
            session = None
            if run.approval is None and run.session_id is not None:
                session = await ctx.session_approval()
            state.approval_policy = effective(run.approval, session, self.approval_default)
        return state.approval_policy

    async def _ask_approval(
        self,
        ctx: ExecutionContext,
        state: RunState,
        clock: _Budget,
        tool: Tool,
        call: CallTool,
        klass: str,
        step: int,
        call_id: str,
    ) -> None:
        """Wait for the user's decision on this call, before it is journaled: nothing of it
        has happened yet. The waiting checkpoint names it (`pending_approval`)."""
        request: dict[str, JSON] = {
            "call_id": call_id,
            "tool": tool.name,
            "arguments": call.args,
            "idempotency_class": klass,
            "step": step,
            "description": tool.description,
            "parameters": tool.parameters,
        }
        state.pending_approval = request
        state.elapsed_seconds = clock.elapsed()
        await ctx.append_event("tool.approval_requested", request)
        await ctx.wait_for_user({"approval_request": request}, step=step, state=state.to_json())

    async def _reject(
        self,
        ctx: ExecutionContext,
        state: RunState,
        clock: _Budget,
        tool: Tool,
        call: CallTool,
        klass: str,
        step: int,
        decided: dict[str, JSON],
    ) -> None:
        """The user refused the call: it never runs; its outcome, what the model is told, is
        the refusal and its reason. One fenced statement (journal, tool.finished, checkpoint),
        so a recovered run never takes the step for an open call."""
        reason = decided.get("reason")
        outcome: dict[str, JSON] = {
            "rejected": True,
            "reason": reason,
            "message": REJECTED_MESSAGE + (f" Reason: {reason}" if reason else ""),
        }
        record = ToolCall(
            step=step, tool=tool.name, idempotency_class=klass, idempotency_key=None, args=call.args
        )
        state.tools.append(
            ToolRecord(
                step=step,
                tool=tool.name,
                args=call.args,
                idempotency_class=klass,
                status="rejected",
                outcome=outcome,
            )
        )
        state.elapsed_seconds = clock.elapsed()
        await ctx.tool_rejected(record, outcome, state.to_json())

    async def _run_and_record(
        self,
        ctx: ExecutionContext,
        state: RunState,
        clock: _Budget,
        tool: Tool,
        record: ToolCall,
    ) -> bool:
        args = record.args if isinstance(record.args, dict) else {}
        tool_ctx = ToolContext(
            str(ctx.lease.run_id),
            record.step,
            record.idempotency_key,
            attempt=ctx.claimed.run.attempts,
            max_attempts=ctx.claimed.run.max_attempts,
            emit=ctx.append_event,
        )
        repeatable = record.idempotency_class in ("safe", "keyed")
        # A tool may set its own number of retries inside the run (webhook deliveries: none,
        # each try is an attempt of the run, spaced by the delivery backoff).
        retries = getattr(tool, "transient_retries", None)
        if not isinstance(retries, int):
            retries = self.limits.transient_retries
        attempt = 0
        while True:
            # Self-fencing: never start an external call on a lease that may have lapsed.
            ctx.ensure_may_continue()
            attempt += 1
            try:
                outcome = await asyncio.wait_for(tool.run(args, tool_ctx), clock.remaining())
                status = "succeeded"
                break
            except TimeoutError:
                if clock.exhausted():
                    await self._fail(ctx, "timeout", "execution time limit reached in a tool")
                    return False
                raise
            except PermanentToolError as exc:
                tracing.note({"turnstile.tool.outcome": "failed"})
                await self._fail(ctx, "tool_error", f"{record.tool}: {exc}")
                return False
            except TransientToolError as exc:
                if not repeatable and exc.sent:
                    # An unsafe call may have taken effect: report it as unknown, never repeat.
                    outcome = {"error": str(exc), "message": UNKNOWN_OUTCOME}
                    status = "uncertain"
                    break
                if attempt > retries:
                    tracing.note({"turnstile.tool.outcome": "transient_error"})
                    if not repeatable:
                        # Provably never sent: close the entry as not sent, so that recovery
                        # neither takes the step as done nor reports it uncertain; the next
                        # attempt plans the call again.
                        await ctx.tool_not_sent(record, str(exc))
                    await self._release_early(
                        ctx, f"{record.tool} kept failing after {attempt} attempts: {exc}"
                    )
                    return False
                await asyncio.sleep(
                    min(
                        self.limits.retry_backoff_max_seconds,
                        self.limits.retry_backoff_seconds * 2 ** (attempt - 1),
                    )
                )
        tracing.note({"turnstile.tool.outcome": status, "turnstile.tool.attempts": attempt})
        self._crash("after_tool", record.step)
        await self._record(ctx, state, clock, record, status, outcome)
        self._crash("after_outcome", record.step)
        return True

    async def _record(
        self,
        ctx: ExecutionContext,
        state: RunState,
        clock: _Budget,
        record: ToolCall,
        status: str,
        outcome: JSON,
    ) -> None:
        state.tools.append(
            ToolRecord(
                step=record.step,
                tool=record.tool,
                args=record.args,
                idempotency_class=record.idempotency_class,
                status=status,  # type: ignore[arg-type]
                outcome=outcome,
            )
        )
        state.elapsed_seconds = clock.elapsed()
        snapshot = state.to_json()
        if _too_big(snapshot, self.limits.max_state_bytes):
            await self._fail(
                ctx,
                "checkpoint_too_large",
                f"the run's state exceeds {self.limits.max_state_bytes} bytes",
            )
            raise StopExecution("checkpoint too large")
        await ctx.tool_finished(record, status, outcome, snapshot)

    # --- recovery ---------------------------------------------------------------------------
    async def _recover(
        self,
        ctx: ExecutionContext,
        state: RunState,
        clock: _Budget,
        journal: list[JournalEntry],
    ) -> None:
        """Settle a tool call that started under an earlier claim but recorded no outcome."""
        # The last entry of the step decides: 'started' alone is open; 'finished' is done (the
        # checkpoint has it); 'not_sent' closed a call that never left, to be planned again.
        last = {e.step: e for e in journal}  # the journal comes in sequence order
        pending = last.get(state.next_step)
        if pending is None or pending.entry != "started":
            return
        record = ToolCall(
            step=pending.step,
            tool=pending.tool,
            idempotency_class=pending.idempotency_class,
            idempotency_key=pending.idempotency_key,
            args=pending.args,
        )
        recovered = {"turnstile.tool.recovered": True}
        if pending.idempotency_class == "unsafe":
            with tracing.tool(pending.tool, pending.idempotency_class, pending.step) as span:
                span.set({**recovered, "turnstile.tool.outcome": "uncertain"})
                await self._record(
                    ctx, state, clock, record, "uncertain", {"message": UNKNOWN_OUTCOME}
                )
            return
        tool = self.registry.tool(ctx.claimed.run.agent, pending.tool)
        if tool is None:
            await self._fail(ctx, "unknown_tool", f"no tool named {pending.tool!r}")
            raise StopExecution("unknown tool")
        # Safe: run it again. Keyed: again, with the key recorded in the journal.
        with tracing.tool(pending.tool, pending.idempotency_class, pending.step) as span:
            span.set(recovered)
            await ctx.tool_started(record)
            if not await self._run_and_record(ctx, state, clock, tool, record):
                raise StopExecution("recovery ended the run")

    # --- endings ------------------------------------------------------------------------------
    async def _fail(self, ctx: ExecutionContext, kind: str, message: str) -> None:
        log.info("run failed", extra={"run_id": str(ctx.lease.run_id), "kind": kind})
        await ctx.fail({"kind": kind, "message": message})

    async def _release_early(self, ctx: ExecutionContext, reason: str) -> None:
        await ctx.release_early(reason[:500])

    def _crash(self, boundary: str, step: int) -> None:
        if self.crash_hook is not None:
            self.crash_hook(boundary, step)


class _Budget:
    """Execution time while claimed: what earlier claims used plus this claim's monotonic time."""

    def __init__(self, used: float, limit: float) -> None:
        self.used = used
        self.limit = limit
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return self.used + (time.monotonic() - self.started)

    def remaining(self) -> float:
        return max(0.0, self.limit - self.elapsed())

    def exhausted(self) -> bool:
        return self.remaining() <= 0


def _too_big(value: JSON, limit: int) -> bool:
    return len(json.dumps(value, separators=(",", ":"), default=str)) > limit


def default_registry(allowed_hosts: list[str], http_timeout_seconds: float = 10.0) -> Registry:
    from app.runtime.agents import ScriptedAgent
    from app.runtime.http_tool import HttpRequestTool
    from app.runtime.tools import EchoTool, SleepTool

    tools: list[Tool] = [
        SleepTool(),
        EchoTool(),
        HttpRequestTool(allowed_hosts, timeout_seconds=http_timeout_seconds),
    ]
    return Registry(agents={"scripted": ScriptedAgent()}, tools={t.name: t for t in tools})
