"""Turn control: what a turn does when its session's run is queued or running (the multitask
policy; docs/turn-control.md). `reject` is ADR-0004's 409 and stays on the one-round-trip path
(`Submissions._submit`); the others come here, in one transaction:

1. with an `Idempotency-Key`, the key (`Submissions.take_key`): a retry replays the answer;
2. the session's row locked, then its active run's (sessions, then runs: the submission lock
   order). An ending transaction either committed first (the lock finds no active run, and a
   fresh read finds the run it promoted, if any) or waits for this one and then sees the turn
   this one adds: a pending turn is never left behind by a run that ended under it;
3. no active run: a new run, as `reject` would make; a run waiting for the user: the turn is its
   answer whatever the policy (the run is waiting for exactly that);
4. a run queued or running: a pending turn (at most `max_pending` per session, else
   `PendingTurnsFullError`), with a `turn.pending` event on the active run. Under `interrupt`
   a queued run is cancelled at once (reason `interrupted`) and the turn starts in the same
   transaction; a running one stops at its next boundary (the runtime asks, `turn_signals`),
   or is cancelled by the sweep once `interrupt_grace_seconds` have passed. Under `steer` the
   runtime takes the input at its next decision (`take_steered`); a run that ends first leaves
   it pending, and it becomes the next run like any other.

Pending turns become runs in the statements that end runs (turnstile_promote_turns), never
here: that is what keeps the partial unique index true and loses no turn across a crash.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from app.queue.core import Queue, dump_json
from app.queue.errors import (
    AnswerConflictError,
    ApprovalPendingError,
    InvalidApprovalError,
    InvalidStartDeadlineError,
    PendingTurnNotFoundError,
    PendingTurnsFullError,
    PendingTurnStartedError,
    SessionNotFoundError,
)
from app.store import approval_rows, turn_rows
from app.store.transactions import transaction
from app.vocabulary.classes import PriorityClass
from app.vocabulary.deadlines import START_BEFORE_TOLERANCE_SECONDS
from app.vocabulary.records import JSON, NewRun, Run

if TYPE_CHECKING:
    from app.queue.submit import IdempotencyKey, RunSpec, Submissions, Submitted, Submitter

POLICIES = ("reject", "enqueue", "interrupt", "steer")


@dataclass(frozen=True)
class PendingTurn:
    """A turn waiting for its session's active run (GET /sessions/{id}/pending-turns/{id})."""

    id: UUID
    session_id: UUID
    policy: str
    status: str  # pending, started (a run), delivered (steered into a run), cancelled
    position: int | None  # 1 is next; None once it is no longer pending
    active_run_id: UUID | None
    run_id: UUID | None
    created_at: Any
    interrupt_by: Any
    # Its deadline to start (docs/start-deadlines.md), which the run it becomes takes.
    start_before: Any = None
    # Not in its document (GET /sessions/{id}/pending-turns/{id} shows none of them): what an
    # A2A task made of it shows (docs/a2a.md).
    tenant_id: str = ""
    principal: str = ""  # the session's owner, as its run's will be
    agent: str = ""
    input: JSON = None
    updated_at: Any = None

    @classmethod
    def from_row(cls, row: RowMapping) -> PendingTurn:
        position = row.get("position")
        return cls(
            id=row["id"],
            session_id=row["session_id"],
            policy=row["policy"],
            status=row["status"],
            position=None if position is None or row["status"] != "pending" else int(position),
            active_run_id=row["active_run_id"],
            run_id=row["run_id"],
            created_at=row["created_at"],
            interrupt_by=row["interrupt_by"],
            start_before=row.get("start_before"),
            tenant_id=row["tenant_id"],
            principal=row["principal"],
            agent=row["agent"],
            input=row["input"],
            updated_at=row["updated_at"],
        )

    def to_document(self) -> dict[str, JSON]:
        return {
            "id": str(self.id),
            "kind": "pending_turn",
            "session_id": str(self.session_id),
            "policy": self.policy,
            "status": self.status,
            "position": self.position,
            "active_run_id": None if self.active_run_id is None else str(self.active_run_id),
            "run_id": None if self.run_id is None else str(self.run_id),
            "created_at": self.created_at.isoformat(),
            "interrupt_by": None if self.interrupt_by is None else self.interrupt_by.isoformat(),
            "start_before": None if self.start_before is None else self.start_before.isoformat(),
        }

    @property
    def location(self) -> str:
        return f"/sessions/{self.session_id}/pending-turns/{self.id}"


async def lock_visible_session(
    conn: AsyncConnection, who: Submitter, session_id: UUID, now: datetime | None
) -> RowMapping:
    """The session's row, locked for a routing decision (a turn, an approval), if `who` may
    see it; else `SessionNotFoundError`."""
    session = await turn_rows.lock_session(
        conn,
        session_id=session_id,
        tenant_id=who.tenant_id,
        principal=who.principal if who.own_sessions_only else None,
        now=now,
    )
    if session is None:
        raise SessionNotFoundError(session_id)
    return session


class TurnControl:
    """The multitask policies' side of a submission, and pending turns' reads and cancel."""

    def __init__(
        self,
        submissions: Submissions,
        *,
        max_pending: int = 20,
        interrupt_grace_seconds: float = 10.0,
    ) -> None:
        self.submissions = submissions
        self.queue: Queue = submissions.queue
        self.max_pending = max_pending
        self.interrupt_grace_seconds = interrupt_grace_seconds

    async def session_policy(self, who: Submitter, session_id: UUID) -> str | None:
        return await turn_rows.session_multitask(
            self.queue.engine,
            session_id=session_id,
            tenant_id=who.tenant_id,
            principal=who.principal if who.own_sessions_only else None,
        )

    async def set_session_policy(self, who: Submitter, session_id: UUID, policy: str) -> None:
        found = await turn_rows.set_session_multitask(
            self.queue.engine,
            session_id=session_id,
            tenant_id=who.tenant_id,
            principal=who.principal if who.own_sessions_only else None,
            multitask=policy,
        )
        if not found:
            raise SessionNotFoundError(session_id)

    async def submit(
        self,
        who: Submitter,
        session_id: UUID,
        spec: RunSpec,
        idempotency: IdempotencyKey | None,
        policy: str,
    ) -> Submitted:
        """A turn under `enqueue`, `interrupt` or `steer` (the module's steps 1 to 4)."""
        from app.queue.submit import ACCEPTED, Submitted

        subs = self.submissions
        # Checked before anything is written, as on the one-round-trip path; the deadline goes
        # to a run this makes, or to the pending turn, whose run takes it when it starts.
        start_within, start_before = subs._start_deadline(spec, PriorityClass.INTERACTIVE)
        async with transaction(self.queue.engine) as conn:
            if idempotency and (replay := await subs.take_key(conn, who, idempotency)):
                return replay
            session = await lock_visible_session(conn, who, session_id, self.queue.clock())
            owner = str(session["principal"])
            active: RowMapping | None = None
            for _ in range(3):
                active = await turn_rows.lock_active_run(conn, session_id)
                # Nothing locked: the run ended as this waited, or there was none. A new
                # statement sees the run that ending may have promoted.
                if active is not None or await turn_rows.active_run(conn, session_id) is None:
                    break
            if active is None:
                _check_not_past(start_before, self.queue.clock())
                new = self._new_run(who, owner, session_id, spec)
                new = replace(new, start_within=start_within, start_before=start_before)
                run = await self.queue.enqueue(new, conn=conn)
                run = await _with_approval(conn, run, spec)
                return await subs._finish(conn, who, idempotency, run, "created")
            current = Run.from_row(active)
            if current.status == "waiting_for_user":
                _check_answer(current, spec)
                run = await self.queue.deliver_input(
                    current.id,
                    spec.input,
                    principal=who.principal,
                    traceparent=spec.traceparent,
                    conn=conn,
                )
                run = await _with_approval(conn, run, spec)
                return await subs._finish(conn, who, idempotency, run, "delivered")
            if spec.approval is not None:
                # A pending turn keeps no policy of its own (docs/approvals.md): the run it
                # becomes works under the session's.
                raise InvalidApprovalError(
                    f"session {session_id}'s run is {current.status}: a turn that waits as a "
                    "pending turn cannot carry an approval policy; set the session's instead "
                    "(PATCH /sessions/{id})",
                    [
                        {
                            "loc": ["body", "approval"],
                            "msg": "not allowed on a pending turn",
                            "type": "approval_on_pending_turn",
                        }
                    ],
                )
            _check_not_past(start_before, self.queue.clock())
            turn = await self._add(
                conn, who, owner, session_id, spec, policy, current, start_within, start_before
            )
            if policy == "interrupt" and current.status == "queued":
                # A queued run has no boundary to wait for: it ends now, and its session's
                # next run (this turn, first in line) starts in the cancel's own statement.
                await self.queue.interrupt(
                    current.id, turn_id=turn.id, by="submission", actor=who.actor, conn=conn
                )
                started = await turn_rows.pending_turn(conn, session_id=session_id, turn_id=turn.id)
                assert started is not None  # the cancel promoted it, or it raised
                next_run = await self.queue.get_run(started["run_id"], conn=conn)
                assert next_run is not None
                return await subs._finish(conn, who, idempotency, next_run, "interrupted")
            if policy == "steer":
                # As an answer: the same run, which takes the input at its next decision.
                document: dict[str, JSON] = {
                    **current.to_document(),
                    "pending_turn": turn.to_document(),
                }
                location = f"/runs/{current.id}"
            else:
                document = turn.to_document()
                location = turn.location
            if idempotency is not None:
                # A steer's answer is the run's; a pending turn's names no run yet.
                stored_run = current.id if policy == "steer" else None
                await subs.store_key(conn, who, idempotency, document, stored_run)
            return Submitted(
                ACCEPTED, document, current.id, False, f"pending:{policy}", location=location
            )

    async def _add(
        self,
        conn: Any,
        who: Submitter,
        owner: str,
        session_id: UUID,
        spec: RunSpec,
        policy: str,
        active: Run,
        start_within: float | None,
        start_before: datetime | None,
    ) -> PendingTurn:
        row = await turn_rows.add_pending_turn(
            conn,
            {
                "id": uuid.uuid4(),
                "tenant_id": who.tenant_id,
                "session_id": session_id,
                "principal": owner,
                "submitted_by": who.principal,
                "actor": who.actor or None,
                "policy": policy,
                "agent": spec.agent or self.submissions.default_agent,
                "priority": (spec.priority or PriorityClass.INTERACTIVE).base,
                "input": dump_json(spec.input),
                "max_attempts": self.queue.config.max_attempts,
                "traceparent": spec.traceparent,
                "active_run_id": active.id,
                "interrupt_grace_seconds": self.interrupt_grace_seconds,
                "max_pending": self.max_pending,
                "scheduled_for": spec.scheduled_for,
                "start_within": start_within,
                "start_before": start_before,
                "now": self.queue.clock(),
            },
        )
        if row is None:
            raise PendingTurnsFullError(session_id, self.max_pending)
        turn = PendingTurn.from_row(row)
        await turn_rows.turn_event(
            conn,
            run_id=active.id,
            type="turn.pending",
            data=dump_json(
                {
                    "pending_turn_id": str(turn.id),
                    "policy": policy,
                    "position": turn.position,
                    "principal": who.principal,
                }
            ),
            now=self.queue.clock(),
        )
        return turn

    def _new_run(self, who: Submitter, owner: str, session_id: UUID, spec: RunSpec) -> NewRun:
        return NewRun(
            tenant_id=who.tenant_id,
            principal=owner,
            agent=spec.agent or self.submissions.default_agent,
            input=spec.input,
            priority=(spec.priority or PriorityClass.INTERACTIVE).base,
            session_id=session_id,
            scheduled_for=spec.scheduled_for,
            actor=who.actor or None,
            traceparent=spec.traceparent,
        )

    # --- pending turns ------------------------------------------------------------------------
    async def pending_turn(self, session_id: UUID, turn_id: UUID) -> PendingTurn:
        row = await turn_rows.pending_turn(
            self.queue.engine, session_id=session_id, turn_id=turn_id
        )
        if row is None:
            raise PendingTurnNotFoundError(turn_id)
        return PendingTurn.from_row(row)

    async def visible_pending_turn(
        self, turn_id: UUID, *, tenant_id: str | None, principal: str | None
    ) -> PendingTurn | None:
        """A pending turn by its id alone (an A2A task's), if the tenant and principal given
        may see it (None: any)."""
        row = await turn_rows.visible_pending_turn(
            self.queue.engine, turn_id=turn_id, tenant_id=tenant_id, principal=principal
        )
        return None if row is None else PendingTurn.from_row(row)

    async def waiting_turns(
        self, session_id: UUID, *, tenant_id: str | None, principal: str | None, limit: int
    ) -> list[PendingTurn]:
        """A session's pending turns, newest first (an A2A context's task list)."""
        rows = await turn_rows.waiting_turns_of_session(
            self.queue.engine,
            session_id=session_id,
            tenant_id=tenant_id,
            principal=principal,
            limit=limit,
        )
        return [PendingTurn.from_row(row) for row in rows]

    async def pending_turns(self, session_id: UUID) -> list[PendingTurn]:
        rows = await turn_rows.pending_turns_of_session(self.queue.engine, session_id)
        return [PendingTurn.from_row(row) for row in rows]

    async def cancel_pending(self, who: Submitter, session_id: UUID, turn_id: UUID) -> PendingTurn:
        """Withdraw a pending turn (idempotent: a cancelled one answers as it is); one that
        has started is `PendingTurnStartedError`, naming its run."""
        async with transaction(self.queue.engine) as conn:
            # The lock order of every path that touches pending turns: the session, its active
            # run, then the turn (an ending statement holds the run while it promotes the turn;
            # taking the turn first and the run after would deadlock with it).
            await turn_rows.lock_session(
                conn,
                session_id=session_id,
                tenant_id=who.tenant_id,
                principal=who.principal if who.own_sessions_only else None,
                now=self.queue.clock(),
            )
            active = await turn_rows.lock_active_run(conn, session_id)
            row = await turn_rows.cancel_pending_turn(
                conn, session_id=session_id, turn_id=turn_id, now=self.queue.clock()
            )
            if row is None:
                found = await turn_rows.pending_turn(conn, session_id=session_id, turn_id=turn_id)
                if found is None:
                    raise PendingTurnNotFoundError(turn_id)
                turn = PendingTurn.from_row(found)
                if turn.status == "cancelled":
                    return turn
                raise PendingTurnStartedError(turn_id, turn.status, turn.run_id)
            turn = PendingTurn.from_row(row)
            if active is not None:
                await turn_rows.turn_event(
                    conn,
                    run_id=active["id"],
                    type="turn.cancelled",
                    data=dump_json(
                        {"pending_turn_id": str(turn.id), "policy": turn.policy, "by": who.actor}
                    ),
                    now=self.queue.clock(),
                )
            return turn


async def _with_approval(conn: Any, run: Run, spec: RunSpec) -> Run:
    """The turn's approval policy, when it gives one, on the run it made or answered."""
    if spec.approval is None:
        return run
    row = await approval_rows.set_run_approval(
        conn, run_id=run.id, approval=dump_json(spec.approval)
    )
    return Run.from_row(row)


def _check_not_past(start_before: datetime | None, now: datetime | None) -> None:
    """A deadline to start long past is the client's mistake, as `turnstile_submit` judges it;
    checked after the idempotency key, so a late retry of an accepted turn replays it. Judged
    on this process's clock (the queue's, in tests): this path makes the run with the core's
    enqueue, which refuses nothing of the kind."""
    if start_before is None:
        return
    at = now or datetime.now(UTC)
    if start_before < at - timedelta(seconds=START_BEFORE_TOLERANCE_SECONDS):
        raise InvalidStartDeadlineError("start_before", f"is in the past (it is {at} now)")


def _check_answer(run: Run, spec: RunSpec) -> None:
    """An answer resumes the waiting run: the fields it sets must be the run's, and a run
    waiting for a tool call's approval takes only an approval (app/queue/approvals.py)."""
    request = run.approval_request
    if isinstance(request, dict) and run.session_id is not None:
        raise ApprovalPendingError(
            run.session_id, run.id, str(request.get("call_id")), str(request.get("tool"))
        )
    if spec.agent is not None and spec.agent != run.agent:
        raise AnswerConflictError("agent", run.agent, spec.agent)
    if spec.priority is not None and spec.priority.base // 10 != run.priority // 10:
        raise AnswerConflictError(
            "priority", PriorityClass.of(run.priority).value, spec.priority.value
        )
    if spec.scheduled_for is not None and spec.scheduled_for != run.scheduled_for:
        raise AnswerConflictError(
            "scheduled_for",
            None if run.scheduled_for is None else run.scheduled_for.isoformat(),
            spec.scheduled_for.isoformat(),
        )
