"""The queue's Python face: one method per transition of `runs.sql` and per read of `reads.sql`.

Every method runs its statement in a transaction of its own, or on the connection it is given
(so the submit path can enqueue or deliver inside the transaction that locked the session).
Fenced methods return `Written | Fenced`, heartbeats return a bool; neither raises on a lost
lease. A lost connection is sent again only where that is provably safe (app/store/outcomes.py):
any statement nothing of which committed, and a fenced write of unknown outcome through a
replay that recognises its own earlier commit. Time is the database's unless a `clock` (tests)
or an explicit `now` says otherwise.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.queue.errors import (
    QueueQuotaError,
    RunFinishedError,
    RunNotFoundError,
    RunNotWaitingError,
)
from app.store import turn_rows
from app.store.database import (
    Clock,
    Database,
    database_clock,
    dump_json,
    failed_with,
    refusal,
)
from app.store.outcomes import OutcomeUnknown
from app.store.statements import q, statements
from app.store.transactions import transaction
from app.vocabulary.classes import PriorityClass, priorities_of
from app.vocabulary.records import (
    JSON,
    UNKNOWN_OUTCOME,
    CancelOutcome,
    Checkpoint,
    ClaimedRun,
    Event,
    Fenced,
    HoldEnd,
    JournalEntry,
    Lease,
    NewRun,
    Run,
    RunProgress,
    SessionProgress,
    SweepReport,
    ToolCall,
    TranscriptEntry,
    UndecodableRun,
    WriteOutcome,
    Written,
)

__all__ = ["Clock", "Queue", "QueueConfig", "database_clock", "dump_json", "failed_with"]

log = logging.getLogger("turnstile.queue")

_TRANSITION = {"succeeded": "succeeded", "failed": "failed", "queued": "released"}
"""The observer's name of an ended hold, by the status it ended in (`waiting_for_user` is not
a transition the metrics count)."""

EXPIRER = "expirer"
EXPIRED = "expired"
"""Who ends a run past its deadline to start, and the reason its run.cancelled event and its
webhook give (docs/start-deadlines.md)."""

INTERRUPTED = "interrupted"
"""The reason of a run cancelled by an interrupt (`run.cancelled`'s `reason`)."""

PASSED_OVER_RETRIES = 3
"""How many times a fair claim that claimed nothing, having passed over runs of a tenant that a
concurrent claim had just brought to its limit, is asked again at once (docs/adr/0006)."""


class Observer(Protocol):
    """Told about transitions after they commit (metrics); must not raise or block."""

    def transition(self, name: str, priority: int, count: int = 1) -> None: ...

    def claimed(self, priority: int, waited_seconds: float) -> None: ...


class _Unobserved:
    def transition(self, name: str, priority: int, count: int = 1) -> None:
        pass

    def claimed(self, priority: int, waited_seconds: float) -> None:
        pass


@dataclass(frozen=True)
class ResumeState:
    """What a claimed run resumes from (`Queue.resume_state`)."""

    checkpoint: Checkpoint | None
    inputs: list[JSON]
    journal: list[JournalEntry]


@dataclass(frozen=True)
class QueueConfig:
    lease_seconds: float = 30.0
    max_attempts: int = 3
    backoff_base_seconds: float = 5.0
    backoff_max_seconds: float = 300.0
    # Webhook deliveries (runs of the `webhook` agent, inserted by the transitions they report):
    # their own attempts and backoff, spread over hours by default (about 5 h in all).
    webhook_max_attempts: int = 12
    webhook_backoff_base_seconds: float = 30.0
    webhook_backoff_max_seconds: float = 3600.0
    # The hot submission runs on the driver's own connection, outside SQLAlchemy's
    # transaction handling (Queue.call). Behind PgBouncer in transaction mode, where a
    # transaction must set its own timeouts, it goes through an ordinary transaction.
    direct_calls: bool = True
    # Fair shares between tenants (docs/adr/0006). The process defaults of every tenant's
    # limits, which a tenant's tenant_limits row overrides: at most this many running runs
    # per class (by class band: interactive, async, maintenance; None for no limit), and at
    # most this many queued runs (None for no quota).
    tenant_max_running: tuple[int | None, int | None, int | None] = (None, None, None)
    tenant_max_queued: int | None = None
    # Test-only: off, claims take runs by priority then eligibility across all tenants, as
    # before fair shares, and apply no limits (so a test can show what the fair order changes).
    fair_claim: bool = True


class Queue:
    def __init__(
        self,
        engine: AsyncEngine,
        config: QueueConfig | None = None,
        clock: Clock | None = None,
        observer: Observer | None = None,
        claim_engine: AsyncEngine | None = None,
    ) -> None:
        self.config = config or QueueConfig()
        self.db = Database(
            engine,
            clock=clock,
            direct_calls=self.config.direct_calls,
            claim_engine=claim_engine,
        )
        self.engine = engine
        self.claim_engine = claim_engine
        self.clock: Clock = self.db.clock
        self.observer: Observer = observer or _Unobserved()

    # --- plumbing -----------------------------------------------------------------------------
    @property
    def _hooks(self) -> dict[str, Any]:
        """The webhook parameters of every transition that may enqueue deliveries."""
        return {
            "hook_attempts": self.config.webhook_max_attempts,
            "hook_backoff_base": self.config.webhook_backoff_base_seconds,
            "hook_backoff_max": self.config.webhook_backoff_max_seconds,
        }

    def _hook_attempts(self) -> dict[str, Any]:
        return {"hook_attempts": self.config.webhook_max_attempts}

    def _limits(self) -> dict[str, Any]:
        """The claim's process defaults of the tenants' concurrency limits, by class band."""
        return {"max_running": list(self.config.tenant_max_running)}

    async def _creating(
        self, name: str, params: dict[str, Any], conn: AsyncConnection | None
    ) -> list[RowMapping]:
        """A statement that creates runs through turnstile_create_runs, its quota refusal
        (TS429 queue-quota, nothing written) raised as QueueQuotaError."""
        try:
            return await self.db.rows(name, params, conn)
        except DBAPIError as exc:
            refused = refusal(exc)
            if refused is None or refused[0] != "queue-quota":
                raise
            fields = refused[1]
            raise QueueQuotaError(
                str(fields["tenant_id"]), fields["max_queued"], int(fields["queued"])
            ) from None

    async def _fenced(
        self,
        name: str,
        lease: Lease,
        params: dict[str, Any],
        conn: AsyncConnection | None = None,
        *,
        transition: str | None = None,
    ) -> WriteOutcome:
        """A single-run fenced write: `Written` or `Fenced`. One whose connection was lost
        after it was sent is replayed, recognising its own earlier commit (`_replay`)."""
        params = {"run_id": lease.run_id, "epoch": lease.epoch, **params}
        try:
            rows = await self.db.rows(name, params, conn)
        except OutcomeUnknown:
            if f"recognise_{name}" not in statements():
                raise  # a write that cannot recognise itself is not sent again
            rows = await self.db.replay(name, params)
        if not rows:
            return Fenced(lease)
        row = rows[0]
        if transition is not None:
            # release_early ends in 'failed' on the last attempt.
            ended = "failed" if row.get("status") == "failed" else transition
            self.observer.transition(ended, int(row["priority"]))
        return Written(seq=int(row["seq"]))

    # --- enqueue ------------------------------------------------------------------------------
    async def enqueue(
        self, new: NewRun, *, conn: AsyncConnection | None = None, run_id: UUID | None = None
    ) -> Run:
        """A new queued run. For back-end services in the deployment and the core's own
        callers: not rate limited (the submission rate limit is the API's, in
        `turnstile_submit`)."""
        rows = await self._creating(
            "enqueue",
            {
                "id": run_id or uuid.uuid4(),
                "tenant_id": new.tenant_id,
                "principal": new.principal,
                "session_id": new.session_id,
                "priority": new.priority,
                "agent": new.agent,
                "input": dump_json(new.input),
                "max_attempts": new.max_attempts or self.config.max_attempts,
                "scheduled_for": new.scheduled_for,
                "resubmitted_from": new.resubmitted_from,
                "actor": new.actor,
                "traceparent": new.traceparent,
                "max_queued": self.config.tenant_max_queued,
                "start_before": new.start_before,
                "start_within": new.start_within,
            },
            conn,
        )
        run = Run.from_row(rows[0])
        self.observer.transition("enqueued", run.priority)
        return run

    async def enqueue_many(
        self,
        *,
        tenant_id: str,
        principal: str,
        runs: Sequence[tuple[str, JSON, int, datetime | None]],
        max_attempts: int | None = None,
        conn: AsyncConnection | None = None,
    ) -> list[UUID]:
        """Sessionless runs in bulk: each item is (agent, input, priority, scheduled_for)."""
        ids = [uuid.uuid4() for _ in runs]
        if not ids:
            return []
        await self._creating(
            "enqueue_many",
            {
                "ids": ids,
                "priorities": [priority for _, _, priority, _ in runs],
                "agents": [agent for agent, _, _, _ in runs],
                "inputs": [dump_json(value) for _, value, _, _ in runs],
                "scheduled": [when for _, _, _, when in runs],
                "tenant_id": tenant_id,
                "principal": principal,
                "max_attempts": max_attempts or self.config.max_attempts,
                "max_queued": self.config.tenant_max_queued,
            },
            conn,
        )
        for priority in {priority for _, _, priority, _ in runs}:
            count = sum(1 for _, _, p, _ in runs if p == priority)
            self.observer.transition("enqueued", priority, count)
        return ids

    # --- claim --------------------------------------------------------------------------------
    async def claim(
        self,
        owner: str,
        classes: Sequence[PriorityClass],
        *,
        limit: int = 1,
        lease_seconds: float | None = None,
    ) -> list[ClaimedRun]:
        """Claim up to `limit` runs of `classes`, by priority then eligibility time."""
        if limit < 1:
            return []
        params: dict[str, Any] = {
            "owner": owner,
            "priorities": priorities_of(classes),
            "lease_seconds": lease_seconds or self.config.lease_seconds,
        }
        engine = self.claim_engine
        if not self.config.fair_claim:
            rows = await self.db.rows("claim_fifo", {**params, "limit": limit}, engine=engine)
        else:
            fair = {**params, **self._limits(), "limit": limit}
            for _ in range(PASSED_OVER_RETRIES + 1):
                found = await self._claim_once(dict(fair, claim=uuid.uuid4()), engine)
                rows = [row for row in found if row["id"] is not None]
                # Nothing claimed, but runs were passed over because a concurrent claim took
                # their tenant's last room under its limit: other tenants' runs may be waiting
                # behind them, so ask again now rather than after the caller's poll interval.
                if rows or not any(row["passed_over"] for row in found):
                    break
        # The claim has committed: from here on, nothing about one run may keep the others of
        # its batch from their executions (they would sit under a lease nobody serves).
        claimed: list[ClaimedRun] = []
        for row in rows:
            lease = Lease(run_id=row["id"], epoch=int(row["lease_epoch"]), owner=owner)
            try:
                claimed.append(ClaimedRun(run=Run.from_row(row), lease=lease))
            except UndecodableRun as exc:
                await self._fail_undecodable(lease, exc)
        lease_for = timedelta(seconds=params["lease_seconds"])
        for item in claimed:
            if item.run.lease_expires_at is not None:
                waited = item.run.lease_expires_at - lease_for - item.run.eligible_at
                self.observer.claimed(item.run.priority, waited.total_seconds())
        return sorted(claimed, key=lambda c: (c.run.priority, c.run.eligible_at))

    async def _claim_once(
        self, params: dict[str, Any], engine: AsyncEngine | None
    ) -> list[RowMapping]:
        """One fair claim. When its answer was lost after it may have committed, it is not sent
        again (it would take other runs): the runs its id took are read back instead
        (`recognise_claim`), so they start now rather than wait for their leases to lapse."""
        try:
            return await self.db.rows("claim", params, engine=engine)
        except OutcomeUnknown:
            found = await self.db.recognise("recognise_claim", params)
            log.warning(
                "claim of unknown outcome recognised",
                extra={"claim": str(params["claim"]), "runs": len(found)},
            )
            return found

    async def _fail_undecodable(self, lease: Lease, exc: UndecodableRun) -> None:
        """A claimed run the code cannot read fails at once (it would fail on every attempt);
        if even that cannot be written, its lease lapses and the sweeper takes it."""
        log.error(
            "claimed run cannot be decoded; failing it",
            extra={"run_id": str(lease.run_id), "reason": exc.reason},
        )
        try:
            await self.fail(lease, {"kind": "undecodable", "message": str(exc)})
        except Exception:
            log.exception("could not fail an undecodable run", extra={"run_id": str(lease.run_id)})

    async def next_due(self, classes: Sequence[PriorityClass]) -> float | None:
        """Seconds until the earliest queued run of `classes` that is not eligible yet becomes
        eligible (scheduled, a schedule's tick, backed off); None when there is none."""
        rows = await self.db.rows("next_due", {"priorities": priorities_of(classes)})
        if not rows or rows[0]["seconds"] is None:
            return None
        return max(float(rows[0]["seconds"]), 0.0)

    # --- fenced writes ------------------------------------------------------------------------
    async def heartbeat(self, lease: Lease, *, lease_seconds: float | None = None) -> bool:
        """Extend one lease. False means fenced: the run is someone else's now (decision 4).
        The batched statement with one lease: the pool beats all its leases at once."""
        held = await self.heartbeat_many([lease], lease_seconds=lease_seconds)
        return lease.key in held

    async def heartbeat_many(
        self, leases: Sequence[Lease], *, lease_seconds: float | None = None
    ) -> set[tuple[UUID, int]]:
        """Extend many leases in one statement; returns the (run id, epoch) pairs still held
        (`Lease.key`): a stale execution of a run must not be renewed by its fresh one's."""
        if not leases:
            return set()
        rows = await self.db.batch_rows(
            "heartbeat_many",
            {
                "run_ids": [lease.run_id for lease in leases],
                "epochs": [lease.epoch for lease in leases],
                "lease_seconds": lease_seconds or self.config.lease_seconds,
            },
        )
        return {(row["id"], int(row["lease_epoch"])) for row in rows}

    async def append_event(self, lease: Lease, type_: str, data: JSON) -> WriteOutcome:
        return await self._fenced("append_event", lease, {"type": type_, "data": dump_json(data)})

    async def tool_started(self, lease: Lease, call: ToolCall) -> WriteOutcome:
        return await self._fenced(
            "tool_started",
            lease,
            {
                "step": call.step,
                "tool": call.tool,
                "idempotency_class": call.idempotency_class,
                "idempotency_key": call.idempotency_key,
                "args": dump_json(call.args),
            },
        )

    async def tool_finished(
        self, lease: Lease, call: ToolCall, outcome_status: str, outcome: JSON, state: JSON
    ) -> WriteOutcome:
        """Record a tool's outcome and the checkpoint after it, in one fenced statement."""
        return await self._fenced(
            "tool_finished",
            lease,
            {
                "step": call.step,
                "tool": call.tool,
                "idempotency_class": call.idempotency_class,
                "idempotency_key": call.idempotency_key,
                "outcome_status": outcome_status,
                "outcome": dump_json(outcome),
                "state": dump_json(state),
            },
        )

    async def tool_rejected(
        self, lease: Lease, call: ToolCall, outcome: JSON, state: JSON
    ) -> WriteOutcome:
        """Record a call the user refused (docs/approvals.md): never run, it is closed in the
        journal with its arguments, its tool.finished event and the checkpoint, in one fenced
        statement."""
        return await self._fenced(
            "tool_rejected",
            lease,
            {
                "step": call.step,
                "tool": call.tool,
                "idempotency_class": call.idempotency_class,
                "args": dump_json(call.args),
                "outcome": dump_json(outcome),
                "state": dump_json(state),
            },
        )

    async def session_approval(self, session_id: UUID) -> JSON:
        """A session's approval policy (docs/approvals.md), None when it has none."""
        rows = await self.db.rows("session_approval", {"session_id": session_id})
        return rows[0]["approval"] if rows else None

    async def tool_not_sent(self, lease: Lease, call: ToolCall, error: str) -> WriteOutcome:
        """Close a started call that provably never left: the next attempt plans it again."""
        return await self._fenced(
            "tool_not_sent",
            lease,
            {
                "step": call.step,
                "tool": call.tool,
                "idempotency_class": call.idempotency_class,
                "idempotency_key": call.idempotency_key,
                "error": error[:500],
            },
        )

    async def save_checkpoint(self, lease: Lease, step: int, state: JSON) -> WriteOutcome:
        return await self._fenced(
            "save_checkpoint", lease, {"step": step, "state": dump_json(state)}
        )

    async def wait_for_user(
        self, lease: Lease, question: JSON, *, step: int, state: JSON
    ) -> WriteOutcome:
        """A question is not a failure: the lease is given up and attempts restart from 0."""
        return (await self.end_holds([HoldEnd.waiting(lease, question, step=step, state=state)]))[0]

    async def complete(self, lease: Lease, result: JSON) -> WriteOutcome:
        return (await self.end_holds([HoldEnd.succeeded(lease, result)]))[0]

    async def complete_many(self, completions: Sequence[tuple[Lease, JSON]]) -> list[WriteOutcome]:
        """Complete many runs in one fenced statement (a group commit). Each run is fenced on its
        own lease; the outcomes come back in the order given, `Fenced` for every run whose fence
        did not match (nothing was written for it)."""
        return await self.end_holds(
            [HoldEnd.succeeded(lease, result) for lease, result in completions]
        )

    async def fail(self, lease: Lease, failure: JSON) -> WriteOutcome:
        """Fail permanently: never requeued, whatever attempts remain."""
        return (await self.end_holds([HoldEnd.failed(lease, failure)]))[0]

    async def release(self, lease: Lease, *, graceful: bool, reason: str = "") -> WriteOutcome:
        """Give the run back. Graceful (drain): requeued at once, attempt given back. Early
        (transient retries ran out): backoff, counted like a lost lease, failed on the last."""
        end = HoldEnd.released(lease, reason) if graceful else HoldEnd.retry(lease, reason)
        return (await self.end_holds([end]))[0]

    async def wait_for_capacity(
        self, lease: Lease, reason: str, *, until: datetime, endpoint: str
    ) -> WriteOutcome:
        """Give the run back until a model endpoint's budget has room (docs/model-budgets.md):
        requeued for `until`, the attempt given back, its place kept (its priority and age)."""
        end = HoldEnd.capacity(lease, reason[:500], until=until, endpoint=endpoint)
        return (await self.end_holds([end]))[0]

    async def end_holds(self, ends: Sequence[HoldEnd]) -> list[WriteOutcome]:
        """End many holds in one fenced statement (`end_holds`): each fenced on its own lease,
        the outcomes in the order given, `Fenced` for every hold whose fence did not match.
        One whose outcome is unknown is replayed, recognising what its first sending wrote."""
        if not ends:
            return []
        rows = await self.db.batch_rows("end_holds", {**self._end_params(ends), **self._hooks})
        row = rows[0]
        written = {
            (run_id, int(epoch)): (int(seq), str(status), int(priority))
            for run_id, epoch, seq, status, priority in zip(
                row["ids"],
                row["epochs"],
                row["seqs"],
                row["statuses"],
                row["priorities"],
                strict=True,
            )
        }
        outcomes: list[WriteOutcome] = []
        for end in ends:
            hit = written.get(end.lease.key)
            if hit is None:
                outcomes.append(Fenced(end.lease))
                continue
            seq, status, priority = hit
            if end.outcome != "waiting":
                self.observer.transition(_TRANSITION.get(status, "released"), priority)
            outcomes.append(Written(seq=seq))
        return outcomes

    def _end_params(self, ends: Sequence[HoldEnd]) -> dict[str, Any]:
        return {
            "run_ids": [end.lease.run_id for end in ends],
            "epochs": [end.lease.epoch for end in ends],
            "outcomes": [end.outcome for end in ends],
            "values": [dump_json(end.value) for end in ends],
            "steps": [end.step for end in ends],
            "states": [None if end.state is None else dump_json(end.state) for end in ends],
            "backoff_base": self.config.backoff_base_seconds,
            "backoff_max": self.config.backoff_max_seconds,
            "unknown": UNKNOWN_OUTCOME,
        }

    async def record_fenced(self, lease: Lease, *, during: str) -> int | None:
        """Write `run.fenced` with the stale epoch: the one write exempt from the fence."""
        rows = await self.db.rows(
            "record_fenced",
            {"run_id": lease.run_id, "epoch": lease.epoch, "owner": lease.owner, "during": during},
        )
        if not rows:
            return None
        self.observer.transition("fenced", int(rows[0]["priority"]))
        return int(rows[0]["seq"])

    # --- maintenance and operator transitions -------------------------------------------------
    async def sweep(self, *, limit: int = 500) -> SweepReport:
        """Requeue (with backoff) or dead-letter every run whose lease has expired, a batch of
        `limit` per transaction: `lock_expired` takes the rows, then `end_holds` ends them
        ('expired') with a snapshot taken after the lock."""
        requeued = failed = 0
        while True:
            async with self.engine.begin() as conn:
                now = self.clock()
                locked = (await conn.execute(q("lock_expired"), {"limit": limit, "now": now})).all()
                if not locked:
                    return SweepReport(requeued=requeued, failed=failed)
                ends = [
                    HoldEnd(Lease(run_id=row.id, epoch=int(row.lease_epoch), owner=""), "expired")
                    for row in locked
                ]
                params = {**self._end_params(ends), **self._hooks, "now": now}
                row = (await conn.execute(q("end_holds"), params)).mappings().one()
            for status, priority in zip(row["statuses"], row["priorities"], strict=True):
                if status == "queued":
                    requeued += 1
                    self.observer.transition("requeued", int(priority))
                else:
                    failed += 1
                    self.observer.transition("failed", int(priority))
            if len(locked) < limit:
                return SweepReport(requeued=requeued, failed=failed)

    async def interrupt(
        self,
        run_id: UUID,
        *,
        turn_id: UUID | None,
        by: str,
        actor: str | None = None,
        conn: AsyncConnection | None = None,
    ) -> bool:
        """End an active run for an interrupt (docs/turn-control.md): `run.interrupted`, then
        the cancel (reason `interrupted`) that settles its open calls by idempotency class and
        starts its session's next turn (the interrupting one, first in line), in one
        transaction (the caller's, when given). False when the run was no longer active."""
        if conn is None:
            async with transaction(self.engine) as own:
                return await self.interrupt(run_id, turn_id=turn_id, by=by, actor=actor, conn=own)
        seq = await turn_rows.turn_event(
            conn,
            run_id=run_id,
            type="run.interrupted",
            data=dump_json(
                {
                    "policy": "interrupt",
                    "pending_turn_id": None if turn_id is None else str(turn_id),
                    "by": by,
                }
            ),
            now=self.clock(),
        )
        if seq is None:
            return False
        await self.cancel(run_id, actor=actor or by, reason=INTERRUPTED, conn=conn)
        return True

    async def turn_signals(self, session_id: UUID) -> tuple[UUID | None, bool]:
        """What a running run of the session asks at a decision boundary: the interrupting
        pending turn waiting for it (or None), and whether steered input waits."""
        rows = await self.db.rows("turn_signals", {"session_id": session_id})
        return rows[0]["interrupt_turn_id"], bool(rows[0]["steered"])

    async def take_steered(self, lease: Lease, *, at_step: int) -> list[JSON] | Fenced:
        """Take the session's steered turns into the running run, as its next inputs, in one
        fenced statement: their inputs in order ([] when none waited), or Fenced."""
        rows = await self.db.rows(
            "take_steered", {"run_id": lease.run_id, "epoch": lease.epoch, "at_step": at_step}
        )
        if not rows:
            return Fenced(lease)
        return list(rows[0]["inputs"])

    async def steered_inputs(self, run_id: UUID) -> list[tuple[JSON, int, int]]:
        """The steered inputs a run took: (input, its index among the inputs, the step)."""
        rows = await self.db.rows("steered_inputs", {"run_id": run_id})
        return [(row["input"], int(row["input_idx"]), int(row["at_step"])) for row in rows]

    async def sweep_turns(self, *, limit: int = 500) -> int:
        """The turn control's part of the sweep: interrupts whose bound passed end their runs
        now, whatever the run is doing or whether its worker lives (a long tool call, a dead
        worker); pending turns stranded without an active run (a run an older release ended)
        start. How many runs it interrupted or started."""
        done = 0
        for row in await turn_rows.overdue_interrupts(self.engine, limit=limit, now=self.clock()):
            if await self.interrupt(row["run_id"], turn_id=row["turn_id"], by="deadline"):
                done += 1
        return done + await turn_rows.promote_stranded_turns(
            self.engine, limit=limit, now=self.clock()
        )

    async def deliver_input(
        self,
        run_id: UUID,
        value: JSON,
        *,
        principal: str,
        traceparent: str | None = None,
        conn: AsyncConnection | None = None,
    ) -> Run:
        """Store the user's answer as the run's next input and requeue the same run (joining
        the answer's trace, when it names one)."""
        rows = await self.db.rows(
            "deliver_input",
            {
                "run_id": run_id,
                "input": dump_json(value),
                "principal": principal,
                "traceparent": traceparent,
            },
            conn,
        )
        if rows:
            return Run.from_row(rows[0])
        current = await self.get_run(run_id, conn=conn)
        if current is None:
            raise RunNotFoundError(run_id)
        raise RunNotWaitingError(run_id, current.status)

    async def cancel(
        self,
        run_id: UUID,
        *,
        actor: str,
        reason: str = "",
        tenant_id: str | None = None,
        principal: str | None = None,
        conn: AsyncConnection | None = None,
    ) -> CancelOutcome:
        """Cancel from any non-terminal status; a no-op on a cancelled run; refused on a
        succeeded or failed one (RunFinishedError). `tenant_id` and `principal` limit which
        runs the caller may cancel (None: any); another's run is not found."""
        rows = await self.db.rows(
            "cancel_runs",
            {
                "run_ids": [run_id],
                "actor": actor,
                "reason": reason,
                "tenant_id": tenant_id,
                "principal": principal,
                "unknown": UNKNOWN_OUTCOME,
                "overdue": False,
                **self._hook_attempts(),
            },
            conn,
        )
        if rows:
            cancelled = Run.from_row(rows[0])
            self.observer.transition("cancelled", cancelled.priority)
            return CancelOutcome(run=cancelled, changed=True)
        current = await self.get_run(run_id, tenant_id=tenant_id, principal=principal, conn=conn)
        if current is None:
            raise RunNotFoundError(run_id)
        if current.status == "cancelled":
            return CancelOutcome(run=current, changed=False)
        # Terminal statuses are final, so reading after the failed update cannot race.
        raise RunFinishedError(run_id, current.status)

    async def cancel_many(
        self,
        run_ids: Sequence[UUID],
        *,
        actor: str,
        reason: str,
        tenant_id: str | None = None,
    ) -> int:
        """Cancel a batch of runs in one statement (those not finished and visible to
        `tenant_id`); how many were cancelled."""
        rows = await self.db.rows(
            "cancel_runs",
            {
                "run_ids": list(run_ids),
                "actor": actor,
                "reason": reason,
                "tenant_id": tenant_id,
                "principal": None,
                "unknown": UNKNOWN_OUTCOME,
                "overdue": False,
                **self._hook_attempts(),
            },
        )
        for row in rows:
            self.observer.transition("cancelled", int(row["priority"]))
        return len(rows)

    async def expire_overdue(self, *, limit: int = 500) -> list[Run]:
        """End every queued run never claimed whose deadline to start has passed: cancelled,
        reason 'expired' (docs/start-deadlines.md), through the cancel's own statement, so its
        event, webhook deliveries and freed session are a cancel's; no attempt is used. A
        batch of `limit` at a time; `cancel_runs` checks each run again on its locked row, so
        one a claim took meanwhile is left alone."""
        expired: list[Run] = []
        while True:
            now = self.clock()
            found = await self.db.rows("overdue_runs", {"limit": limit, "now": now})
            if not found:
                return expired
            rows = await self.db.rows(
                "cancel_runs",
                {
                    "run_ids": [row["id"] for row in found],
                    "actor": EXPIRER,
                    "reason": EXPIRED,
                    "tenant_id": None,
                    "principal": None,
                    "unknown": UNKNOWN_OUTCOME,
                    "overdue": True,
                    "now": now,
                    **self._hook_attempts(),
                },
            )
            for row in rows:
                self.observer.transition("cancelled", int(row["priority"]))
                self.observer.transition("expired", int(row["priority"]))
            expired.extend(Run.from_row(row) for row in rows)
            if len(found) < limit:
                return expired

    async def next_start_deadline(self) -> float | None:
        """Seconds until the earliest deadline to start of a queued run never claimed (at most
        0 when one has passed); None when no such run has one."""
        rows = await self.db.rows("next_start_deadline", {})
        return float(rows[0]["seconds"]) if rows else None

    # --- reads --------------------------------------------------------------------------------
    async def get_run(
        self,
        run_id: UUID,
        *,
        tenant_id: str | None = None,
        principal: str | None = None,
        conn: AsyncConnection | None = None,
    ) -> Run | None:
        """The run, if `tenant_id` and `principal` (None: any) may see it."""
        rows = await self.db.rows(
            "get_run", {"run_id": run_id, "tenant_id": tenant_id, "principal": principal}, conn
        )
        return Run.from_row(rows[0]) if rows else None

    async def events(self, run_id: UUID, *, after: int = 0, limit: int = 1000) -> list[Event]:
        rows = await self.db.rows("run_events", {"run_id": run_id, "after": after, "limit": limit})
        return [Event(**dict(row)) for row in rows]

    async def watch_events(
        self,
        run_id: UUID,
        *,
        after: int,
        limit: int,
        tenant_id: str | None = None,
        principal: str | None = None,
    ) -> tuple[RunProgress | None, list[Event]]:
        """One round trip for an event stream: where the run stands and the events after
        `after`; (None, []) when the run is gone or not visible to `tenant_id`/`principal`."""
        rows = await self.db.rows(
            "watch_events",
            {
                "run_id": run_id,
                "after": after,
                "limit": limit,
                "tenant_id": tenant_id,
                "principal": principal,
            },
        )
        if not rows:
            return None, []
        first = rows[0]
        progress = RunProgress(
            status=first["status"],
            last_event_seq=first["last_event_seq"],
            scheduled_for=first["scheduled_for"],
        )
        return progress, _watched_events(rows)

    async def watch_session_events(
        self, session_id: UUID, *, from_run_no: int, after: int, limit: int
    ) -> tuple[SessionProgress | None, list[Event]]:
        """One round trip for a session stream: the session's first run numbered `from_run_no`
        or later, where it stands, and its events after `after` (after 0 when it is a later
        run); (None, []) when the session has no such run yet."""
        rows = await self.db.rows(
            "watch_session_events",
            {"session_id": session_id, "from_run_no": from_run_no, "after": after, "limit": limit},
        )
        if not rows:
            return None, []
        first = rows[0]
        progress = SessionProgress(
            run_id=first["run_id"],
            run_no=first["run_no"],
            status=first["status"],
            last_event_seq=first["last_event_seq"],
            scheduled_for=first["scheduled_for"],
            has_next=first["has_next"],
        )
        return progress, _watched_events(rows)

    async def latest_checkpoint(self, run_id: UUID) -> Checkpoint | None:
        rows = await self.db.rows("latest_checkpoint", {"run_id": run_id})
        return Checkpoint(**dict(rows[0])) if rows else None

    async def resume_state(self, run: Run) -> ResumeState:
        """What a claimed run resumes from: latest checkpoint, inputs, tool journal.

        A run whose claim was its second event (`run.created`, then `run.claimed`) has none of
        them to read: every checkpoint and journal row is written with an event of its own, and
        so is every delivered input, so its only input is the one it was created with. That is
        every run's first claim, and it costs no round trip; any other run reads all three in
        one statement."""
        if run.last_event_seq == 2 and run.inputs_count == 1:
            return ResumeState(checkpoint=None, inputs=[run.input], journal=[])
        rows = await self.db.rows("resume_state", {"run_id": run.id})
        row = rows[0]
        return ResumeState(
            checkpoint=Checkpoint(**row["checkpoint"]) if row["checkpoint"] else None,
            inputs=list(row["inputs"]),
            journal=[JournalEntry(**entry) for entry in row["journal"]],
        )

    async def session_history(
        self, session_id: UUID, *, from_run_no: int, through_run_no: int
    ) -> list[TranscriptEntry]:
        """The transcript of a session's runs `from_run_no` through `through_run_no`, oldest
        first: what a run of the session is given as its history (a plain read; every run in
        that window is terminal before the reader's run was created, so it no longer changes)."""
        if through_run_no < from_run_no:
            return []
        rows = await self.db.rows(
            "session_transcript",
            {
                "session_id": session_id,
                "after_run_no": 0,
                "after_seq": 0,
                "from_run_no": from_run_no,
                "through_run_no": through_run_no,
                # The window of runs is the bound; this only has to exceed its entries.
                "limit": 2_147_483_647 - through_run_no,
            },
        )
        return [TranscriptEntry.from_row(row) for row in rows]

    async def journal(self, run_id: UUID) -> list[JournalEntry]:
        rows = await self.db.rows("tool_journal", {"run_id": run_id})
        return [JournalEntry(**dict(row)) for row in rows]

    async def inputs(self, run_id: UUID) -> list[JSON]:
        rows = await self.db.rows("run_inputs", {"run_id": run_id})
        return [row["input"] for row in rows]


def _watched_events(rows: Sequence[RowMapping]) -> list[Event]:
    """The events of a watch statement's rows (`watch_events`, `watch_session_events`): every
    row carries where the run stands, and a row without a seq carries no event."""
    return [
        Event(
            seq=row["seq"],
            type=row["type"],
            epoch=row["epoch"],
            data=row["data"],
            created_at=row["created_at"],
        )
        for row in rows
        if row["seq"] is not None
    ]
