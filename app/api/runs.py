"""Runs: sessionless submission, reading a run (ETag, long poll), its events (JSON or
Server-Sent Events), and cancel. The operator runbook is app/api/runbook.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response

from app.api.auth import CHALLENGE, CallerDep, submitter_of, visible_principal, visible_tenant
from app.api.json_responses import FastJSONResponse
from app.api.problems import ApiProblem, responses
from app.api.schemas import (
    ApprovalDecisionBody,
    CancelRequest,
    EventPage,
    RunDocument,
    RunRequest,
)
from app.api.services import state_of
from app.api.sessions import (
    SUBMITTED_HEADERS,
    IdempotencyHeader,
    TraceparentHeader,
    idempotency_of,
    spec_from,
    submitted_attributes,
    submitted_response,
)
from app.api.streams import HeldStream, run_stream
from app.api.watch import (
    POLL_RECHECK_SECONDS,
    recheck_seconds,
    wait_for_change,
)
from app.observability import tracing
from app.queue.approvals import ApprovalAnswer
from app.queue.core import Queue
from app.queue.errors import RunNotFoundError
from app.security.api_keys import Caller
from app.vocabulary.records import Run
from app.vocabulary.statuses import TERMINAL, RunStatus

router = APIRouter(tags=["runs"])

MAX_WAIT_SECONDS = 60.0
MAX_SEQ = 2**63 - 1  # sequence numbers are bigint


def etag_of(document: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:32]
    return f'"{digest}"'


async def load_run(request: Request, run_id: UUID, caller: Caller) -> Run:
    """The run, if the caller may see it: its tenant (admin keys: any), and its principal unless
    the key has a scope; otherwise not found, as for a missing run."""
    queue: Queue = state_of(request).queue
    run = await queue.get_run(
        run_id, tenant_id=visible_tenant(caller), principal=visible_principal(caller)
    )
    if run is None:
        raise RunNotFoundError(run_id)
    return run


# --- runs ------------------------------------------------------------------------------------
@router.post(
    "/runs",
    status_code=202,
    response_model=RunDocument,
    summary="Submit a sessionless run (back-end work; async by default)",
    description=(
        "With a submission rate limit, a run over it is refused with 429 `rate-limited` and "
        "`Retry-After`, and every answer carries `RateLimit-Policy` and `RateLimit`."
    ),
    responses={
        **responses(
            "unauthorized",
            "forbidden",
            "invalid-request",
            "idempotency-key-reused",
            "idempotency-key-in-flight",
            "queue-quota",
            "malformed-json",
            "body-too-large",
            "request-timeout",
            "rate-limited",
        ),
        202: {"headers": SUBMITTED_HEADERS},
    },
)
async def submit_run(
    body: RunRequest,
    request: Request,
    caller: CallerDep,
    idempotency_key: IdempotencyHeader = None,
    traceparent: TraceparentHeader = None,
) -> Any:
    state = state_of(request)
    with tracing.submission("run", traceparent) as span:
        outcome = await state.submissions.submit_run(
            submitter_of(caller),
            spec_from(body, caller, state.agents, span.traceparent),
            await idempotency_of(request, idempotency_key),
        )
        span.set(submitted_attributes(outcome))
    return submitted_response(outcome)


@router.get(
    "/runs/{run_id}",
    response_model=RunDocument,
    summary="A run: status, class, attempts, result, failure, the pending question",
    description=(
        "Sends an `ETag`; `If-None-Match` with it answers 304 when nothing changed. "
        "`wait=N` long-polls up to N seconds (at most 60) until the run's status differs from "
        "`status` (default: its status when the request arrived); a finished run answers at "
        "once. Long polls and event streams are capped per key and per API process (429 "
        "`too-many-streams` with `Retry-After`)."
    ),
    responses={
        **responses("unauthorized", "not-found", "invalid-request", "too-many-streams"),
        304: {"description": "Not modified"},
    },
)
async def get_run(
    run_id: UUID,
    request: Request,
    caller: CallerDep,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_SECONDS)] = 0,
    status: Annotated[RunStatus | None, Query()] = None,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match", max_length=200)] = None,
) -> Any:
    state = state_of(request)
    run = await load_run(request, run_id, caller)
    known = status or run.status
    if wait > 0 and run.status == known and run.status not in TERMINAL:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        with (
            state.streams.acquire(caller.key_id, caller.tenant_id) as slot,
            state.watch.watching(str(run_id)) as changed,
        ):
            # Watch first, then read: a change between the two is never missed.
            run = await load_run(request, run_id, caller)
            while (
                run.status == known
                and run.status not in TERMINAL
                and not state.shutdown.is_set()
                and not slot.ended.is_set()
                and (remaining := deadline - loop.time()) > 0
            ):
                pause = recheck_seconds(
                    run.status, run.scheduled_for, active_seconds=POLL_RECHECK_SECONDS
                )
                await wait_for_change(changed, state.shutdown, min(pause, remaining), slot.ended)
                changed.clear()  # cleared before the read below, so a later change wakes us
                if slot.ended.is_set():
                    break
                run = await load_run(request, run_id, caller)
            if slot.ended.is_set():
                # Its key was revoked while it waited: no answer under that key any more.
                raise ApiProblem(
                    "unauthorized",
                    "the API key was revoked while this long poll waited",
                    headers=CHALLENGE,
                    reason=slot.reason,
                )
    document = run.to_document()
    etag = etag_of(document)
    if if_none_match is not None and etag in {t.strip() for t in if_none_match.split(",")}:
        return Response(status_code=304, headers={"ETag": etag})
    return FastJSONResponse(document, headers={"ETag": etag})


@router.get(
    "/runs/{run_id}/events",
    response_model=EventPage,
    summary="A run's events in order; Server-Sent Events with `Accept: text/event-stream`",
    description=(
        "JSON: the events after `after`, up to `limit`. With `Accept: text/event-stream`, a "
        "stream of the events (`id` is the sequence number), resuming after `Last-Event-ID` or "
        "`after`, that ends after the run's terminal event. While the run writes a message, "
        "`message.delta` events (no `id`; `{run_id, epoch, message, offset, text}`) carry its "
        "text live, then the durable `message.completed` has the whole text: a client drops "
        "partial text of an older epoch (the run was re-run). Event streams and long polls are "
        "capped per key and per API process (429 `too-many-streams` with `Retry-After`)."
    ),
    responses={
        **responses("unauthorized", "not-found", "invalid-request", "too-many-streams"),
        200: {"content": {"text/event-stream": {}}},
    },
)
async def run_events(
    run_id: UUID,
    request: Request,
    caller: CallerDep,
    after: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
    accept: Annotated[str | None, Header(max_length=500)] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=30)] = None,
) -> Any:
    state = state_of(request)
    run = await load_run(request, run_id, caller)
    if accept is not None and "text/event-stream" in accept:
        start = after
        if last_event_id is not None:
            if not re.fullmatch(r"[0-9]{1,18}", last_event_id.strip()):
                raise ApiProblem(
                    "invalid-request",
                    "Last-Event-ID must be an event sequence number",
                    errors=[
                        {
                            "loc": ["header", "Last-Event-ID"],
                            "msg": "not a sequence number",
                            "type": "last_event_id",
                        }
                    ],
                )
            start = int(last_event_id.strip())
        slot = state.streams.acquire(caller.key_id, caller.tenant_id)
        return HeldStream(slot, run_stream(request, run_id, caller, start, slot))
    events = await state.queue.events(run_id, after=after, limit=limit)
    return EventPage(
        events=[e.__dict__ for e in events],
        last_seq=events[-1].seq if events else after,
        finished=run.status in TERMINAL and (not events or events[-1].seq >= run.last_event_seq),
    )


@router.post(
    "/runs/{run_id}/approval",
    status_code=202,
    response_model=RunDocument,
    summary="Decide the tool call a run waits to have approved (approve, reject or edit)",
    description=(
        'The same answer as a session\'s turn `{"approval": {...}}` (docs/approvals.md), named '
        "by the run: the way to answer a sessionless run. 202 with the run, back in the queue. "
        "409 `no-approval-pending` when it waits for none (decided already), "
        "`approval-call-mismatch` for another call; 422 `invalid-approval` for edited "
        "arguments outside the tool's schema. With `Idempotency-Key`, a retry replays."
    ),
    responses={
        **responses(
            "unauthorized",
            "not-found",
            "invalid-request",
            "malformed-json",
            "no-approval-pending",
            "approval-call-mismatch",
            "invalid-approval",
            "idempotency-key-reused",
            "idempotency-key-in-flight",
        ),
        202: {"headers": SUBMITTED_HEADERS},
    },
)
async def decide_approval(
    run_id: UUID,
    body: ApprovalDecisionBody,
    request: Request,
    caller: CallerDep,
    idempotency_key: IdempotencyHeader = None,
    traceparent: TraceparentHeader = None,
) -> Any:
    state = state_of(request)
    with tracing.submission("turn", traceparent) as span:
        outcome = await state.submissions.approvals.answer_run(
            submitter_of(caller),
            run_id,
            ApprovalAnswer(
                call_id=body.call_id, decision=body.decision, args=body.args, reason=body.reason
            ),
            await idempotency_of(request, idempotency_key),
            traceparent=span.traceparent,
        )
        span.set(submitted_attributes(outcome))
    session_id = outcome.document.get("session_id")
    if isinstance(session_id, str):
        state.live.session_changed(UUID(session_id))
    return submitted_response(outcome)


@router.post(
    "/runs/{run_id}/cancel",
    response_model=RunDocument,
    summary="Cancel a run from any non-terminal status (a cancelled run answers 200 again)",
    description=(
        'An optional body `{"reason": ...}` says why, in the run\'s `run.cancelled` event and '
        "webhook. Calls the run left open get their outcome in the same transaction: an "
        "unsafe one `uncertain`, a safe or keyed one `abandoned`, each with its "
        "`tool.finished` event, so the transcript never holds a call without one."
    ),
    responses=responses(
        "unauthorized", "not-found", "run-finished", "invalid-request", "malformed-json"
    ),
)
async def cancel(
    run_id: UUID, request: Request, caller: CallerDep, body: CancelRequest | None = None
) -> Any:
    state = state_of(request)
    outcome = await state.queue.cancel(
        run_id,
        actor=caller.actor,
        reason=body.reason if body is not None and body.reason else "cancelled through the API",
        # Actions stay within the key's own tenant, admin keys included: the admin scope
        # widens what a key can see, not what it can change. A key without a scope cancels
        # only its own principal's runs.
        tenant_id=caller.tenant_id,
        principal=visible_principal(caller),
    )
    if outcome.changed:
        tracing.mark("turnstile.cancel", outcome.run.traceparent, {"turnstile.run.id": str(run_id)})
    return outcome.run.to_document()
