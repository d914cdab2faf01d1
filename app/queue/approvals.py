"""Approval before a tool call (docs/approvals.md): the answer to a run that waits for a
user's approval of one of its tool calls, and the session's policy.

A run waits for an approval the way it waits for any answer (`waiting_for_user`, its question
`{"approval_request": {...}}`, written by the runtime). The answer is a turn of its own kind,
in one transaction:

1. with an `Idempotency-Key`, the key (`Submissions.take_key`): a retry replays the answer;
2. the session's row locked, then its active run's (the submission lock order). Two approvals
   of one call take turns here: the second finds the run no longer waiting and is refused
   (`NoApprovalPendingError`), so exactly one decides the call;
3. the run must wait for this call (`ApprovalCallMismatchError` otherwise); an edit's arguments
   must conform to the tool's schema the request carries (`InvalidApprovalError`);
4. the decision is delivered as the run's next input (`turnstile_deliver_input`: the run back
   to the queue, its `run.input_delivered` event), then its `tool.approved` or `tool.rejected`
   event, the next one: the transcript tells an approval from an answer by it.

The runtime reads the decision back from the run's inputs at its next claim (the checkpoint it
waited with names the call), so a worker that dies after the approval neither loses it nor,
the tool journal deciding as always, repeats an unsafe call. Any refusal rolls back whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncConnection

from app.queue.core import Queue, dump_json
from app.queue.errors import (
    ApprovalCallMismatchError,
    InvalidApprovalError,
    NoApprovalPendingError,
    RunNotFoundError,
    SessionNotFoundError,
)
from app.queue.turns import lock_visible_session
from app.store import approval_rows, turn_rows
from app.store.transactions import transaction
from app.vocabulary.approval_policy import schema_errors
from app.vocabulary.records import JSON, Run

if TYPE_CHECKING:
    from app.queue.submit import IdempotencyKey, Submissions, Submitted, Submitter


@dataclass(frozen=True)
class ApprovalAnswer:
    """A user's decision on a pending call: approve, reject (why: `reason`) or edit (`args`)."""

    call_id: str
    decision: str
    args: dict[str, JSON] | None = None
    reason: str | None = None


class Approvals:
    def __init__(self, submissions: Submissions) -> None:
        self.submissions = submissions
        self.queue: Queue = submissions.queue

    async def set_session_policy(
        self, who: Submitter, session_id: UUID, policy: JSON | None
    ) -> None:
        """Set a session's policy (None: back to the process default)."""
        found = await approval_rows.set_session_approval(
            self.queue.engine,
            session_id=session_id,
            tenant_id=who.tenant_id,
            principal=who.principal if who.own_sessions_only else None,
            approval=None if policy is None else dump_json(policy),
        )
        if not found:
            raise SessionNotFoundError(session_id)

    async def answer(
        self,
        who: Submitter,
        session_id: UUID,
        answer: ApprovalAnswer,
        idempotency: IdempotencyKey | None,
        *,
        traceparent: str | None = None,
    ) -> Submitted:
        """Decide the call the session's run waits for (the module's steps 1 to 4)."""
        async with transaction(self.queue.engine) as conn:
            if idempotency and (replay := await self.submissions.take_key(conn, who, idempotency)):
                return replay
            await self._lock_session(conn, who, session_id)
            active = await turn_rows.lock_active_run(conn, session_id)
            if active is None:
                raise NoApprovalPendingError(session_id, answer.call_id, None, "none")
            return await self._decide(
                conn, who, Run.from_row(active), answer, idempotency, traceparent
            )

    async def answer_run(
        self,
        who: Submitter,
        run_id: UUID,
        answer: ApprovalAnswer,
        idempotency: IdempotencyKey | None,
        *,
        traceparent: str | None = None,
    ) -> Submitted:
        """Decide the call a run waits for, named by the run (`POST /runs/{id}/approval`: a
        sessionless run has no session to take a turn). A run of a session takes its
        session's lock first, as every path that answers a session's run does."""
        principal = who.principal if who.own_sessions_only else None
        async with transaction(self.queue.engine) as conn:
            if idempotency and (replay := await self.submissions.take_key(conn, who, idempotency)):
                return replay
            seen = await self.queue.get_run(
                run_id, tenant_id=who.tenant_id, principal=principal, conn=conn
            )
            if seen is None:
                raise RunNotFoundError(run_id)
            if seen.session_id is not None:
                await self._lock_session(conn, who, seen.session_id)
            row = await approval_rows.lock_run(conn, run_id=run_id)
            if row is None:
                raise RunNotFoundError(run_id)
            return await self._decide(
                conn, who, Run.from_row(row), answer, idempotency, traceparent
            )

    async def _lock_session(self, conn: AsyncConnection, who: Submitter, session_id: UUID) -> None:
        await lock_visible_session(conn, who, session_id, self.queue.clock())

    async def _decide(
        self,
        conn: AsyncConnection,
        who: Submitter,
        run: Run,
        answer: ApprovalAnswer,
        idempotency: IdempotencyKey | None,
        traceparent: str | None,
    ) -> Submitted:
        """Steps 3 and 4 on the locked run."""
        request = run.approval_request
        if not isinstance(request, dict):
            raise NoApprovalPendingError(run.session_id, answer.call_id, run.id, run.status)
        pending = str(request.get("call_id"))
        if answer.call_id != pending:
            raise ApprovalCallMismatchError(
                run.id, answer.call_id, pending, str(request.get("tool"))
            )
        args: JSON = request.get("arguments")
        if answer.decision == "edit":
            errors = schema_errors(answer.args, request.get("parameters"))
            if errors:
                raise InvalidApprovalError(
                    f"the edited arguments do not fit {request.get('tool')}'s schema: "
                    + "; ".join(
                        f"{'.'.join(str(p) for p in e['loc'][3:]) or 'args'} {e['msg']}"
                        for e in errors[:5]
                    ),
                    errors,
                )
            args = answer.args
        decision: dict[str, JSON] = {
            "call_id": pending,
            "decision": answer.decision,
            "args": answer.args if answer.decision == "edit" else None,
            "reason": answer.reason,
        }
        delivered = await self.queue.deliver_input(
            run.id,
            {"approval": decision},
            principal=who.principal,
            traceparent=traceparent,
            conn=conn,
        )
        await turn_rows.turn_event(
            conn,
            run_id=run.id,
            type="tool.rejected" if answer.decision == "reject" else "tool.approved",
            data=dump_json(
                {
                    "call_id": pending,
                    "step": request.get("step"),
                    "tool": request.get("tool"),
                    "idempotency_class": request.get("idempotency_class"),
                    "decision": answer.decision,
                    "edited": answer.decision == "edit",
                    "args": args,
                    "reason": answer.reason,
                    "principal": who.principal,
                    "input_index": delivered.inputs_count,
                }
            ),
            now=self.queue.clock(),
        )
        return await self.submissions._finish(conn, who, idempotency, delivered, "approval")
