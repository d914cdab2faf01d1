"""Submitting work: turn routing, sessionless runs, idempotency keys, and operator actions.

A submission is one transaction:
1. with an `Idempotency-Key`, take the key (`idempotency_claim`). A twin still in flight makes
   this wait on the unique index, bounded by `idempotency_wait_seconds`, then replay its stored
   outcome; past the bound the caller is told to retry (`IdempotencyKeyInFlightError`). Same key
   with another request hash is `IdempotencyKeyReusedError`, never a second run.
2. for a turn, lock the session row, then route: no active run -> a new run; a run waiting for
   the user -> the input is delivered to it (same run, back to queued); a queued or running run
   -> `SessionBusyError`. The partial unique index is the backstop for anything that slips past.
3. store the 2xx outcome under the key. Any refusal raises, and the transaction rolls back with
   everything it wrote, the key included: only successful outcomes are remembered.

Turns and sessionless runs are rate limited per tenant when a rate is set (the process default,
or the tenant's override): between steps 1 and 2 the submission takes a token from its
tenant's bucket, in the same call (migration 0012); over the limit it is refused
(`RateLimitedError`) before it writes a run. A replay spends no token, and a refusal leaves the
bucket as it was. Every outcome, refusals included, carries the tenant's allowance for the
RateLimit headers. Resubmissions (an operator's action) and the Python queue API
(`Queue.enqueue`, for back-end services in the same deployment) are not rate limited.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.queue.approvals import Approvals
from app.queue.core import Queue, dump_json, failed_with
from app.queue.errors import (
    AnswerConflictError,
    ApprovalPendingError,
    IdempotencyKeyInFlightError,
    IdempotencyKeyReusedError,
    InvalidStartDeadlineError,
    QueueQuotaError,
    RateLimitedError,
    RunNotFailedError,
    RunNotFoundError,
    RunNotWaitingError,
    SessionBusyError,
    SessionNotFoundError,
    TurnstileError,
)
from app.queue.submit_batches import Submission, SubmissionBatcher
from app.queue.turns import TurnControl
from app.queue.webhook_endpoints import WEBHOOK_AGENT
from app.store import submission_rows
from app.store.transactions import transaction
from app.vocabulary.classes import PriorityClass
from app.vocabulary.deadlines import start_deadline_problem
from app.vocabulary.records import JSON, NewRun, Run, SubmitAllowance

ACCEPTED = 202


@dataclass(frozen=True)
class Submitter:
    """Who submits: every run records its tenant and principal. `own_sessions_only` (a key
    without a scope) limits turns to sessions of this principal; operator keys clear it."""

    tenant_id: str
    principal: str
    actor: str = ""
    own_sessions_only: bool = True


@dataclass(frozen=True)
class RunSpec:
    """A turn or a sessionless run. None means the client left the field out."""

    input: JSON
    agent: str | None = None
    priority: PriorityClass | None = None
    scheduled_for: datetime | None = None
    # The W3C trace context the run's work joins; not part of the request's hash (a retry
    # from another span of the caller is the same request).
    traceparent: str | None = None
    # A new run's deadline to start (docs/start-deadlines.md): seconds after it becomes
    # eligible, or a time; neither, the class's default (Submissions' start_within).
    start_within: float | None = None
    start_before: datetime | None = None
    # Which of the run's tool calls wait for a user's approval (docs/approvals.md), as JSON
    # ({"tools", "classes"}); None: the session's, else the process default.
    approval: JSON = None


@dataclass(frozen=True)
class IdempotencyKey:
    key: str
    request_hash: str


@dataclass(frozen=True)
class Submitted:
    status_code: int
    document: dict[str, JSON]
    run_id: UUID
    replayed: bool
    routed: str  # "created", "delivered", "replayed", "interrupted", or "pending:<policy>"
    # The tenant's submission rate limit and what is left of it (None: no limit).
    allowance: SubmitAllowance | None = None
    # Where to follow it, when not the run (`/runs/{run_id}`): a pending turn's own address.
    location: str | None = None


def request_hash(method: str, path: str, body: JSON) -> str:
    """SHA-256 of the method, the path and the canonical JSON body (key order and whitespace
    do not matter; values do)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{method.upper()}\n{path}\n{canonical}".encode()).hexdigest()


class Submissions:
    def __init__(
        self,
        queue: Queue,
        *,
        default_agent: str,
        idempotency_ttl_seconds: float,
        idempotency_wait_seconds: float,
        lock_timeout_ms: int,
        submit_rate_per_second: float | None = None,
        submit_burst: int | None = None,
        start_within: dict[PriorityClass, float] | None = None,
        max_pending_turns: int = 20,
        interrupt_grace_seconds: float = 10.0,
        group_commit: bool = True,
    ) -> None:
        self.queue = queue
        self.default_agent = default_agent
        self.ttl = idempotency_ttl_seconds
        self.wait_ms = int(idempotency_wait_seconds * 1000)
        self.lock_timeout_ms = lock_timeout_ms
        # The process defaults of the submission rate limit (None: no limit unless the
        # tenant's own limits set one).
        self.submit_rate = submit_rate_per_second
        self.submit_burst = submit_burst
        # The process defaults of a new run's deadline to start, by class (a class left out:
        # none), for a submission that gives neither start_within nor start_before.
        self.start_within = dict(start_within or {})
        # Answers to runs waiting for a tool call's approval (app/queue/approvals.py).
        self.approvals = Approvals(self)
        # The multitask policies other than reject (app/queue/turns.py).
        self.turns = TurnControl(
            self,
            max_pending=max_pending_turns,
            interrupt_grace_seconds=interrupt_grace_seconds,
        )
        # Submissions that arrive together share a statement and a commit
        # (app/queue/submit_batches.py); None: each is sent alone.
        self.batcher = SubmissionBatcher(queue.db, _refusal) if group_commit else None

    # --- public -------------------------------------------------------------------------------
    async def submit_turn(
        self,
        who: Submitter,
        session_id: UUID,
        spec: RunSpec,
        idempotency: IdempotencyKey | None = None,
        multitask: str | None = None,
    ) -> Submitted:
        """A user's turn: routed to a new run or to the session's waiting run, in one call.
        When the session is busy, its multitask policy decides (`multitask`, the turn's own,
        overrides the session's): reject is the 409; the others are app/queue/turns.py's. A turn
        that names no policy pays nothing for them until it finds its session busy."""
        if multitask not in (None, "reject"):
            return await self.turns.submit(who, session_id, spec, idempotency, multitask)
        try:
            return await self._submit(who, spec, session_id, PriorityClass.INTERACTIVE, idempotency)
        except SessionBusyError:
            if multitask == "reject":
                raise
            policy = await self.turns.session_policy(who, session_id)
            if policy in (None, "reject"):
                raise
            return await self.turns.submit(who, session_id, spec, idempotency, policy)

    async def submit_run(
        self, who: Submitter, spec: RunSpec, idempotency: IdempotencyKey | None = None
    ) -> Submitted:
        """A sessionless run for back-end services (async by default)."""
        return await self._submit(who, spec, None, PriorityClass.ASYNC, idempotency)

    async def resubmit(
        self,
        who: Submitter,
        run_id: UUID,
        *,
        tenant_id: str | None,
        idempotency: IdempotencyKey | None = None,
    ) -> Submitted:
        """A new run with the failed run's first input; the failed run stays failed. One per
        failed run: a second resubmission, concurrent or later, answers with the first's new
        run (replayed), and `Idempotency-Key` is honoured as on any submission."""
        async with transaction(self.queue.engine) as conn:
            if idempotency and (replay := await self.take_key(conn, who, idempotency)):
                return replay
            seen = await self.queue.get_run(run_id, tenant_id=tenant_id, conn=conn)
            if seen is None:
                raise RunNotFoundError(run_id)
            if seen.session_id is not None:
                await submission_rows.lock_session(
                    conn,
                    session_id=seen.session_id,
                    tenant_id=seen.tenant_id,
                    principal=None,
                    now=self.queue.clock(),
                )
            locked = await submission_rows.lock_failed_run(conn, run_id, tenant_id)
            failed = Run.from_row(locked)
            if failed.status != "failed":
                raise RunNotFailedError(run_id, failed.status)
            earlier = await submission_rows.resubmission_of(conn, run_id)
            if earlier is not None:
                again = Run.from_row(earlier)
                replay = Submitted(ACCEPTED, again.to_document(), again.id, True, "replayed")
                if idempotency is not None:
                    await self.store_key(conn, who, idempotency, replay.document, again.id)
                return replay
            if failed.session_id is not None:
                active = await submission_rows.active_run_of_session(conn, failed.session_id)
                if active is not None:
                    raise SessionBusyError(failed.session_id, active["id"], active["status"])
            new = await self.queue.enqueue(
                NewRun(
                    tenant_id=failed.tenant_id,
                    principal=failed.principal,
                    agent=failed.agent,
                    input=failed.input,
                    priority=failed.priority,
                    session_id=failed.session_id,
                    resubmitted_from=failed.id,
                    # A resubmitted webhook delivery keeps a delivery's attempts.
                    max_attempts=(
                        self.queue.config.webhook_max_attempts
                        if failed.agent == WEBHOOK_AGENT
                        else None
                    ),
                ),
                conn=conn,
            )
            await submission_rows.operator_event(
                conn,
                run_id=failed.id,
                type="operator.resubmitted",
                data=dump_json({"by": who.actor, "new_run_id": str(new.id)}),
                now=self.queue.clock(),
            )
            return await self._finish(conn, who, idempotency, new, "created")

    async def dismiss(self, who: Submitter, run_id: UUID, *, tenant_id: str | None) -> Run:
        """Mark a failed run dismissed (retention may then prune it); idempotent."""
        async with transaction(self.queue.engine) as conn:
            row = await submission_rows.dismiss(
                conn, run_id=run_id, tenant_id=tenant_id, actor=who.actor, now=self.queue.clock()
            )
            if row is not None:
                return Run.from_row(row)
            current = await self.queue.get_run(run_id, tenant_id=tenant_id, conn=conn)
            if current is None:
                raise RunNotFoundError(run_id)
            if current.status != "failed":
                raise RunNotFailedError(run_id, current.status)
            return current  # already dismissed

    # --- internals ----------------------------------------------------------------------------
    async def _submit(
        self,
        who: Submitter,
        spec: RunSpec,
        session_id: UUID | None,
        default_class: PriorityClass,
        idempotency: IdempotencyKey | None,
    ) -> Submitted:
        """One round trip to `turnstile_submit` (app/store/functions/turnstile_submit.sql says
        what it does, step by step), alone or with the submissions that arrived with it
        (app/queue/submit_batches.py). A refusal comes back as SQLSTATE TS404/TS409/TS429 and
        rolls the whole call back; a refusal other than the rate limit's then reads the
        tenant's allowance (one more round trip, on refusals only) so that its answer shows it
        too. Within a batch, a refusal rolls back only its own block and comes back as its
        row, the allowance read by the batch."""
        start_within, start_before = self._start_deadline(spec, default_class)
        args = (
            self.queue.clock(),
            who.tenant_id,
            who.principal,
            who.own_sessions_only,
            who.actor or None,
            session_id,
            idempotency.key if idempotency else None,
            idempotency.request_hash if idempotency else None,
            self.ttl,
            self.wait_ms,
            self.lock_timeout_ms,
            uuid.uuid4(),
            spec.agent,
            self.default_agent,
            spec.priority.base if spec.priority else None,
            default_class.base,
            spec.scheduled_for,
            dump_json(spec.input),
            self.queue.config.max_attempts,
            spec.traceparent,
            # The tenant's queued quota when it has no override (docs/adr/0006).
            self.queue.config.tenant_max_queued,
            self.submit_rate,
            self.submit_burst,
            start_within,
            start_before,
            None if spec.approval is None else dump_json(spec.approval),
        )
        # A keyed submission may be sent again after its connection died mid-call: the key
        # makes a second call a replay of whatever the first committed.
        keyed = idempotency is not None
        try:
            if self.batcher is None:
                row = await self.queue.db.call(
                    "submit", args, retry_on_disconnect=keyed, refusals=_refusal
                )
            else:
                row = await self.batcher.submit(Submission(args, keyed))
        except RateLimitedError:
            raise
        except TurnstileError as refused:
            refused.allowance = await self.allowance(who.tenant_id)
            raise
        allowance = SubmitAllowance.of(row["rate_limit"], row["rate_burst"], row["rate_tokens"])
        if row.get("refusal") is not None:
            # Refused within a batch: its own refusal, with the allowance the batch read.
            batch_refusal = _refusal(str(row["refusal"]), dict(row["refusal_detail"] or {}))
            if isinstance(batch_refusal, TurnstileError) and not isinstance(
                batch_refusal, RateLimitedError
            ):
                batch_refusal.allowance = allowance
            raise batch_refusal
        outcome = row["outcome"]
        if outcome == "replayed":
            return _replayed(
                row["stored_status"], row["stored_body"], row["stored_run_id"], allowance
            )
        run = Run.from_row(row)
        if outcome == "created":
            self.queue.observer.transition("enqueued", run.priority)
        return Submitted(ACCEPTED, run.to_document(), run.id, False, outcome, allowance)

    def _start_deadline(
        self, spec: RunSpec, default_class: PriorityClass
    ) -> tuple[float | None, datetime | None]:
        """The deadline to start the submission gives a new run: the spec's, else its class's
        default. Checked here against the queue's clock (the database's runs close to this
        process's), but for one in the past: `turnstile_submit` refuses that after the
        idempotency key, so a late retry of an accepted submission replays it. The database
        computes the time from start_within on its own clock."""
        now = self.queue.clock() or datetime.now(UTC)
        problem = start_deadline_problem(
            start_within=spec.start_within,
            start_before=spec.start_before,
            scheduled_for=spec.scheduled_for,
            now=now,
        )
        if problem is not None:
            raise InvalidStartDeadlineError(*problem)
        if spec.start_within is None and spec.start_before is None:
            return self.start_within.get(spec.priority or default_class), None
        within = None if spec.start_within is None else float(spec.start_within)
        return within, spec.start_before

    async def allowance(self, tenant_id: str) -> SubmitAllowance | None:
        """The tenant's submission rate limit and its bucket as they stand, without spending
        (None: no limit). A failure to read it is not the caller's problem: None."""
        try:
            row = await submission_rows.allowance_row(
                self.queue.engine,
                tenant_id=tenant_id,
                now=self.queue.clock(),
                default_rate=self.submit_rate,
                default_burst=self.submit_burst,
            )
        except (DBAPIError, OSError):
            return None
        return SubmitAllowance.of(row["rate"], row["burst"], row["tokens"])

    async def take_key(
        self, conn: AsyncConnection, who: Submitter, idempotency: IdempotencyKey
    ) -> Submitted | None:
        """Own the key (None), or return the stored outcome of an identical request. Public
        for the other creations that honour `Idempotency-Key` (schedules)."""
        params: dict[str, Any] = {
            "tenant_id": who.tenant_id,
            "principal": who.principal,
            "key": idempotency.key,
            "request_hash": idempotency.request_hash,
            "ttl_seconds": self.ttl,
            "now": self.queue.clock(),
        }
        # Waiting for a twin is bounded separately from the usual lock timeout.
        await submission_rows.set_lock_timeout(conn, self.wait_ms)
        try:
            taken = await submission_rows.claim_key(conn, params)
        except DBAPIError as exc:
            if failed_with(exc, "55P03", "lock timeout"):
                raise IdempotencyKeyInFlightError(idempotency.key) from None
            raise
        await submission_rows.set_lock_timeout(conn, self.lock_timeout_ms)
        if taken:
            return None
        stored = await submission_rows.stored_key(conn, params)
        if stored["request_hash"] != idempotency.request_hash:
            raise IdempotencyKeyReusedError(idempotency.key)
        return _replayed(stored["response_status"], stored["response_body"], stored["run_id"])

    async def stored_outcome(self, who: Submitter, idempotency: IdempotencyKey) -> Submitted | None:
        """The outcome kept for an identical request made before with this key (replayed), or
        None; IdempotencyKeyReusedError when the key was used with another request. Takes
        nothing: a caller that finds None submits with the key as usual."""
        stored = await submission_rows.peek_key(
            self.queue.engine,
            {
                "tenant_id": who.tenant_id,
                "principal": who.principal,
                "key": idempotency.key,
                "now": self.queue.clock(),
            },
        )
        if stored is None:
            return None
        if stored["request_hash"] != idempotency.request_hash:
            raise IdempotencyKeyReusedError(idempotency.key)
        return _replayed(stored["response_status"], stored["response_body"], stored["run_id"])

    async def _finish(
        self,
        conn: AsyncConnection,
        who: Submitter,
        idempotency: IdempotencyKey | None,
        run: Run,
        routed: str,
    ) -> Submitted:
        document = run.to_document()
        if idempotency is not None:
            await self.store_key(conn, who, idempotency, document, run.id)
        return Submitted(ACCEPTED, document, run.id, False, routed)

    async def store_key(
        self,
        conn: AsyncConnection,
        who: Submitter,
        idempotency: IdempotencyKey,
        document: dict[str, JSON],
        run_id: UUID | None,
        *,
        status: int = ACCEPTED,
    ) -> None:
        """Keep a 2xx outcome for the key taken with `take_key`, in the same transaction."""
        await submission_rows.store_key(
            conn,
            {
                "tenant_id": who.tenant_id,
                "principal": who.principal,
                "key": idempotency.key,
                "response_status": status,
                "response_body": dump_json(document),
                "run_id": run_id,
            },
        )


def _replayed(
    status: int,
    body: dict[str, JSON],
    run_id: UUID,
    allowance: SubmitAllowance | None = None,
) -> Submitted:
    """A stored answer, replayed. `turnstile_submit` keeps the run row it answered with (the
    document is rendered from it, as it was the first time); resubmissions and answers stored
    before migration 0007 keep the document itself."""
    document = Run.from_json(body["run"]).to_document() if set(body) == {"run"} else body
    # A pending turn (app/queue/turns.py) is followed at its own address, not a run's.
    location = None
    if document.get("kind") == "pending_turn":
        location = f"/sessions/{document['session_id']}/pending-turns/{document['id']}"
    return Submitted(int(status), document, run_id, True, "replayed", allowance, location=location)


def _refusal(name: str, detail: dict[str, Any]) -> Exception:
    """The core error for a refusal `turnstile_submit` raised (its message names it)."""
    if name == "rate-limited":
        return RateLimitedError(
            SubmitAllowance(
                rate=float(detail["rate"]),
                burst=int(detail["burst"]),
                tokens=float(detail["tokens"]),
            )
        )
    if name == "session-not-found":
        return SessionNotFoundError(UUID(detail["session_id"]))
    if name == "session-busy":
        return SessionBusyError(
            UUID(detail["session_id"]), UUID(detail["active_run_id"]), detail["status"]
        )
    if name == "idempotency-key-in-flight":
        return IdempotencyKeyInFlightError(detail["key"])
    if name == "idempotency-key-reused":
        return IdempotencyKeyReusedError(detail["key"])
    if name == "approval-pending":
        return ApprovalPendingError(
            UUID(detail["session_id"]),
            UUID(detail["run_id"]),
            str(detail["call_id"]),
            str(detail["tool"]),
        )
    if name == "run-not-waiting":
        return RunNotWaitingError(UUID(detail["run_id"]), "not waiting")
    if name == "start-deadline-passed":
        now = _iso_utc(detail["now"])
        return InvalidStartDeadlineError("start_before", f"is in the past (it is {now} now)")
    if name == "queue-quota":
        return QueueQuotaError(detail["tenant_id"], detail["max_queued"], int(detail["queued"]))
    if name == "answer-conflict":
        if detail["field"] == "priority":
            return AnswerConflictError(
                "priority",
                PriorityClass.of(detail["run_priority"]).value,
                PriorityClass.of(detail["given_priority"]).value,
            )
        run_value, given = detail["run_value"], detail["given"]
        if detail["field"] == "scheduled_for":
            run_value = _iso_utc(run_value)
            given = _iso_utc(given)
        return AnswerConflictError(detail["field"], run_value, given)
    raise ValueError(f"turnstile_submit raised an unknown refusal {name!r}")


def _iso_utc(value: str | None) -> str | None:
    """A timestamp as PostgreSQL's JSON spelled it, in the API's spelling (UTC isoformat)."""
    if value is None:
        return None
    return datetime.fromisoformat(value).astimezone(UTC).isoformat()
