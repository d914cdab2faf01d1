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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.queue.classes import PriorityClass
from app.queue.core import Queue, dump_json, failed_with
from app.queue.errors import (
    AnswerConflictError,
    IdempotencyKeyInFlightError,
    IdempotencyKeyReusedError,
    RunNotFailedError,
    RunNotFoundError,
    RunNotWaitingError,
    SessionBusyError,
    SessionNotFoundError,
)
from app.queue.models import JSON, NewRun, Run
from app.queue.sql import q

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
    routed: str  # "created", "delivered", or "replayed"


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
    ) -> None:
        self.queue = queue
        self.default_agent = default_agent
        self.ttl = idempotency_ttl_seconds
        self.wait_ms = int(idempotency_wait_seconds * 1000)
        self.lock_timeout_ms = lock_timeout_ms

    # --- public -------------------------------------------------------------------------------
    async def submit_turn(
        self,
        who: Submitter,
        session_id: UUID,
        spec: RunSpec,
        idempotency: IdempotencyKey | None = None,
    ) -> Submitted:
        async with self.queue.engine.begin() as conn:
            if idempotency and (replay := await self._take_key(conn, who, idempotency)):
                return replay
            locked = await conn.execute(
                q("lock_session"),
                {
                    "session_id": session_id,
                    "tenant_id": who.tenant_id,
                    "principal": who.principal if who.own_sessions_only else None,
                    "now": self.queue.clock(),
                },
            )
            session = locked.one_or_none()
            if session is None:
                raise SessionNotFoundError(session_id)
            # The run belongs to the session's owner; the key that posted it is its actor.
            owner = Submitter(who.tenant_id, str(session.principal), who.actor)
            # Routing reads the active run, then acts on it. The session lock keeps every other
            # submission out, but a cancel takes the run row alone: one that commits between
            # the read and a delivery leaves the delivery nothing to update. Then the session
            # has no active run, and routing again (a fresh statement, a fresh snapshot) gives
            # the turn the new run it should get, not a 409.
            for routing in range(2):
                active = (
                    (await conn.execute(q("active_run_of_session"), {"session_id": session_id}))
                    .mappings()
                    .one_or_none()
                )
                if active is None:
                    run = await self._create(
                        conn, owner, spec, session_id, PriorityClass.INTERACTIVE
                    )
                    routed = "created"
                elif active["status"] == "waiting_for_user":
                    waiting = Run.from_row(active)
                    self._check_answer(waiting, spec)
                    try:
                        run = await self.queue.deliver_input(
                            waiting.id, spec.input, principal=who.principal, conn=conn
                        )
                    except RunNotWaitingError:
                        if routing == 0:
                            continue
                        raise
                    routed = "delivered"
                else:
                    raise SessionBusyError(session_id, active["id"], active["status"])
                return await self._finish(conn, who, idempotency, run, routed)
            raise AssertionError("unreachable: the second routing returns or raises")

    async def submit_run(
        self, who: Submitter, spec: RunSpec, idempotency: IdempotencyKey | None = None
    ) -> Submitted:
        """A sessionless run for back-end services (async by default)."""
        async with self.queue.engine.begin() as conn:
            if idempotency and (replay := await self._take_key(conn, who, idempotency)):
                return replay
            run = await self._create(conn, who, spec, None, PriorityClass.ASYNC)
            return await self._finish(conn, who, idempotency, run, "created")

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
        async with self.queue.engine.begin() as conn:
            if idempotency and (replay := await self._take_key(conn, who, idempotency)):
                return replay
            seen = await self.queue.get_run(run_id, tenant_id=tenant_id, conn=conn)
            if seen is None:
                raise RunNotFoundError(run_id)
            if seen.session_id is not None:
                await conn.execute(
                    q("lock_session"),
                    {
                        "session_id": seen.session_id,
                        "tenant_id": seen.tenant_id,
                        "principal": None,
                        "now": self.queue.clock(),
                    },
                )
            locked = (
                (
                    await conn.execute(
                        q("lock_failed_run"), {"run_id": run_id, "tenant_id": tenant_id}
                    )
                )
                .mappings()
                .one()
            )
            failed = Run.from_row(locked)
            if failed.status != "failed":
                raise RunNotFailedError(run_id, failed.status)
            earlier = (
                (await conn.execute(q("resubmission_of"), {"run_id": run_id}))
                .mappings()
                .one_or_none()
            )
            if earlier is not None:
                again = Run.from_row(earlier)
                replay = Submitted(ACCEPTED, again.to_document(), again.id, True, "replayed")
                if idempotency is not None:
                    await self._store_key(conn, who, idempotency, replay.document, again.id)
                return replay
            if failed.session_id is not None:
                active = (
                    (
                        await conn.execute(
                            q("active_run_of_session"), {"session_id": failed.session_id}
                        )
                    )
                    .mappings()
                    .one_or_none()
                )
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
                ),
                conn=conn,
            )
            await conn.execute(
                q("operator_event"),
                {
                    "run_id": failed.id,
                    "type": "operator.resubmitted",
                    "data": dump_json({"by": who.actor, "new_run_id": str(new.id)}),
                    "now": self.queue.clock(),
                },
            )
            return await self._finish(conn, who, idempotency, new, "created")

    async def dismiss(self, who: Submitter, run_id: UUID, *, tenant_id: str | None) -> Run:
        """Mark a failed run dismissed (retention may then prune it); idempotent."""
        async with self.queue.engine.begin() as conn:
            row = (
                (
                    await conn.execute(
                        q("dismiss"),
                        {
                            "run_id": run_id,
                            "tenant_id": tenant_id,
                            "actor": who.actor,
                            "now": self.queue.clock(),
                        },
                    )
                )
                .mappings()
                .one_or_none()
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
    async def _create(
        self,
        conn: AsyncConnection,
        who: Submitter,
        spec: RunSpec,
        session_id: UUID | None,
        default_class: PriorityClass,
    ) -> Run:
        new = NewRun(
            tenant_id=who.tenant_id,
            principal=who.principal,
            agent=spec.agent or self.default_agent,
            input=spec.input,
            priority=(spec.priority or default_class).base,
            session_id=session_id,
            scheduled_for=spec.scheduled_for,
            actor=who.actor or None,
        )
        savepoint = await conn.begin_nested()
        try:
            run = await self.queue.enqueue(new, conn=conn)
        except IntegrityError as exc:
            # The backstop: another active run in this session got past the routing.
            await savepoint.rollback()
            if "uq_runs_session_id_active" not in str(exc.orig) or session_id is None:
                raise
            active = (
                (await conn.execute(q("active_run_of_session"), {"session_id": session_id}))
                .mappings()
                .one()
            )
            raise SessionBusyError(session_id, active["id"], active["status"]) from None
        await savepoint.commit()
        return run

    @staticmethod
    def _check_answer(waiting: Run, spec: RunSpec) -> None:
        """An answer resumes the waiting run: fields it sets must match the run's."""
        if spec.agent is not None and spec.agent != waiting.agent:
            raise AnswerConflictError("agent", waiting.agent, spec.agent)
        if spec.priority is not None and spec.priority != waiting.priority_class:
            raise AnswerConflictError("priority", waiting.priority_class.value, spec.priority.value)
        if spec.scheduled_for is not None and spec.scheduled_for != waiting.scheduled_for:
            raise AnswerConflictError(
                "scheduled_for",
                waiting.scheduled_for.isoformat() if waiting.scheduled_for else None,
                spec.scheduled_for.isoformat(),
            )

    async def _take_key(
        self, conn: AsyncConnection, who: Submitter, idempotency: IdempotencyKey
    ) -> Submitted | None:
        """Own the key (None), or return the stored outcome of an identical request."""
        params: dict[str, Any] = {
            "tenant_id": who.tenant_id,
            "principal": who.principal,
            "key": idempotency.key,
            "request_hash": idempotency.request_hash,
            "ttl_seconds": self.ttl,
            "now": self.queue.clock(),
        }
        # Waiting for a twin is bounded separately from the usual lock timeout.
        await conn.execute(
            text("SELECT set_config('lock_timeout', :ms, true)"), {"ms": str(self.wait_ms)}
        )
        try:
            taken = (await conn.execute(q("idempotency_claim"), params)).one_or_none()
        except DBAPIError as exc:
            if failed_with(exc, "55P03", "lock timeout"):
                raise IdempotencyKeyInFlightError(idempotency.key) from None
            raise
        await conn.execute(
            text("SELECT set_config('lock_timeout', :ms, true)"),
            {"ms": str(self.lock_timeout_ms)},
        )
        if taken is not None:
            return None
        stored = (await conn.execute(q("idempotency_stored"), params)).mappings().one()
        if stored["request_hash"] != idempotency.request_hash:
            raise IdempotencyKeyReusedError(idempotency.key)
        return Submitted(
            status_code=int(stored["response_status"]),
            document=stored["response_body"],
            run_id=stored["run_id"],
            replayed=True,
            routed="replayed",
        )

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
            await self._store_key(conn, who, idempotency, document, run.id)
        return Submitted(ACCEPTED, document, run.id, False, routed)

    async def _store_key(
        self,
        conn: AsyncConnection,
        who: Submitter,
        idempotency: IdempotencyKey,
        document: dict[str, JSON],
        run_id: UUID,
    ) -> None:
        await conn.execute(
            q("idempotency_store"),
            {
                "tenant_id": who.tenant_id,
                "principal": who.principal,
                "key": idempotency.key,
                "response_status": ACCEPTED,
                "response_body": dump_json(document),
                "run_id": run_id,
            },
        )
