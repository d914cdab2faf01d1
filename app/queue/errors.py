"""The queue core's exceptions: one root class, one subclass per outcome a caller must tell
apart. The HTTP layer maps each to a problem+json response in one place (`app/api/problems.py`);
nothing here knows about HTTP."""

from __future__ import annotations

from typing import TYPE_CHECKING
from uuid import UUID

if TYPE_CHECKING:
    from app.vocabulary.records import SubmitAllowance


class TurnstileError(Exception):
    """Root of every error the core raises on purpose. A refused submission also carries the
    submitter's rate allowance as it stands (`allowance`, None when its tenant has no rate
    limit), so every answer to a submission can show it."""

    allowance: SubmitAllowance | None = None


class RunNotFoundError(TurnstileError):
    def __init__(self, run_id: UUID) -> None:
        super().__init__(f"run {run_id} not found")
        self.run_id = run_id


class SessionNotFoundError(TurnstileError):
    def __init__(self, session_id: UUID) -> None:
        super().__init__(f"session {session_id} not found")
        self.session_id = session_id


class RunFinishedError(TurnstileError):
    """The run already succeeded or failed; the requested change does not apply."""

    def __init__(self, run_id: UUID, status: str) -> None:
        super().__init__(f"run {run_id} is {status}")
        self.run_id = run_id
        self.status = status


class RunNotWaitingError(TurnstileError):
    """Input was delivered to a run that is not waiting for the user."""

    def __init__(self, run_id: UUID, status: str) -> None:
        super().__init__(f"run {run_id} is {status}, not waiting_for_user")
        self.run_id = run_id
        self.status = status


class SessionBusyError(TurnstileError):
    """A turn was submitted while the session's run is queued or running."""

    def __init__(self, session_id: UUID, active_run_id: UUID, status: str) -> None:
        super().__init__(f"session {session_id} has a {status} run {active_run_id}")
        self.session_id = session_id
        self.active_run_id = active_run_id
        self.status = status


class AnswerConflictError(TurnstileError):
    """An answer to a waiting run set a field to another value than the run's."""

    def __init__(self, field: str, run_value: object, given: object) -> None:
        super().__init__(
            f"{field} is {given!r} but the waiting run's is {run_value!r}: an answer resumes the "
            f"same run and cannot change it"
        )
        self.field = field


class IdempotencyKeyReusedError(TurnstileError):
    """The key was used before with a different request (ADR-0004's ConflictError)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"Idempotency-Key {key!r} was already used with a different request")
        self.key = key


class IdempotencyKeyInFlightError(TurnstileError):
    """A request with the same key is still being processed; retry shortly."""

    def __init__(self, key: str, retry_after: int = 1) -> None:
        super().__init__(f"a request with Idempotency-Key {key!r} is still in flight")
        self.key = key
        self.retry_after = retry_after


class RunNotFailedError(TurnstileError):
    """Resubmit and dismiss apply to failed runs only."""

    def __init__(self, run_id: UUID, status: str) -> None:
        super().__init__(f"run {run_id} is {status}, not failed")
        self.run_id = run_id
        self.status = status


class InvalidCursorError(TurnstileError):
    """A page cursor that this service did not hand out (or that was tampered with)."""

    def __init__(self) -> None:
        super().__init__("cursor: not a cursor this API returned")


class ScheduleNotFoundError(TurnstileError):
    def __init__(self, schedule_id: UUID) -> None:
        super().__init__(f"schedule {schedule_id} not found")
        self.schedule_id = schedule_id


class InvalidScheduleError(TurnstileError):
    """A schedule's cron expression or time zone is refused; `field` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RateLimitedError(TurnstileError):
    """The tenant's submissions are over its rate limit: no token in its bucket. Retry after
    `retry_after` seconds (a whole token by then)."""

    def __init__(self, allowance: SubmitAllowance) -> None:
        self.allowance = allowance
        self.retry_after = allowance.next_token_seconds or 1
        super().__init__(
            f"over the submission rate limit ({allowance.rate:g} a second, bursts of "
            f"{allowance.burst}); retry after {self.retry_after} s"
        )


class InvalidLimitsError(TurnstileError):
    """A tenant limit refused; `field` names which (`max_running.async`, `submit_burst`...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class QueueQuotaError(TurnstileError):
    """The tenant has as many queued runs as its quota allows (docs/adr/0006); new runs are
    refused until some start. Delivering an answer to a waiting run is never refused."""

    def __init__(self, tenant_id: str, max_queued: int | None, queued: int) -> None:
        super().__init__(
            f"tenant {tenant_id!r} has {queued} queued runs, its quota is {max_queued}: "
            f"retry once some of them have started"
        )
        self.tenant_id = tenant_id
        self.max_queued = max_queued
        self.queued = queued


class HoldingLimitError(TurnstileError):
    """The tenant holds as many schedules (or webhook endpoints) as its limit allows; a new one
    is refused until one is deleted. `kind` is "schedules" or "webhook_endpoints"."""

    def __init__(self, tenant_id: str, kind: str, limit: int, held: int) -> None:
        noun = kind.replace("_", " ")
        super().__init__(
            f"tenant {tenant_id!r} holds {held} {noun}, its limit is {limit}: delete one first"
        )
        self.tenant_id = tenant_id
        self.kind = kind
        self.limit = limit
        self.held = held


class InvalidStartDeadlineError(TurnstileError):
    """A run's deadline to start is refused (docs/start-deadlines.md); `field` names which
    (`start_within` or `start_before`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PendingTurnsFullError(TurnstileError):
    """A turn under `enqueue`, `interrupt` or `steer` would pass the session's bound of
    pending turns (docs/turn-control.md)."""

    def __init__(self, session_id: UUID, max_pending: int) -> None:
        super().__init__(
            f"session {session_id} already holds {max_pending} pending turns; wait for its "
            f"runs to finish, or cancel a pending turn"
        )
        self.session_id = session_id
        self.max_pending = max_pending


class PendingTurnNotFoundError(TurnstileError):
    def __init__(self, turn_id: UUID) -> None:
        super().__init__(f"pending turn {turn_id} not found")
        self.turn_id = turn_id


class PendingTurnStartedError(TurnstileError):
    """A pending turn cannot be cancelled any more: it became a run, or reached one."""

    def __init__(self, turn_id: UUID, status: str, run_id: UUID | None) -> None:
        super().__init__(
            f"pending turn {turn_id} is {status}" + (f" (run {run_id})" if run_id else "")
        )
        self.turn_id = turn_id
        self.status = status
        self.run_id = run_id


class ApprovalPendingError(TurnstileError):
    """A turn that is not an approval reached a run waiting for a tool call's approval
    (docs/approvals.md): only an approval naming `call_id` answers it."""

    def __init__(self, session_id: UUID, run_id: UUID, call_id: str, tool: str) -> None:
        super().__init__(
            f"run {run_id} waits for approval of {tool} (call {call_id}); answer with "
            f'{{"approval": {{"call_id": "{call_id}", "decision": "approve"|"reject"|"edit"}}}}'
        )
        self.session_id = session_id
        self.run_id = run_id
        self.call_id = call_id
        self.tool = tool


class NoApprovalPendingError(TurnstileError):
    """An approval reached a session whose run waits for no approval (decided already, by a
    twin; or there is no such run)."""

    def __init__(
        self, session_id: UUID | None, call_id: str, run_id: UUID | None, status: str
    ) -> None:
        if session_id is None:
            text = f"run {run_id} is {status}, waiting for no approval"
        elif run_id is None:
            text = f"session {session_id} has no active run, waiting for no approval"
        else:
            text = f"session {session_id}'s run {run_id} is {status}, waiting for no approval"
        super().__init__(f"{text}; call {call_id} is not pending")
        self.session_id = session_id
        self.call_id = call_id
        self.run_id = run_id
        self.status = status


class ApprovalCallMismatchError(TurnstileError):
    """An approval named another call than the one the run waits for."""

    def __init__(self, run_id: UUID, given: str, pending: str, tool: str) -> None:
        super().__init__(f"run {run_id} waits for approval of call {pending} ({tool}), not {given}")
        self.run_id = run_id
        self.given = given
        self.pending = pending
        self.tool = tool


class InvalidApprovalError(TurnstileError):
    """An approval the core cannot take: edited arguments outside the tool's schema, or a
    decision whose fields do not fit it. `errors` are problem+json items; nothing is written."""

    def __init__(self, message: str, errors: list[dict[str, object]]) -> None:
        super().__init__(message)
        self.errors = errors
