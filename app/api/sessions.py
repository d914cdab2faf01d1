"""Sessions and turns: `POST /sessions`, `GET /sessions/{id}`, `GET /sessions/{id}/runs`,
`GET /sessions/{id}/messages` (the transcript), `GET /sessions/{id}/events` (the conversation's
one event stream, app/api/streams.py), `POST /sessions/{id}/turns`. Routing and
idempotency are the core's (app/queue/submit.py); these handlers parse, authorize and render."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from app.api.auth import CallerDep, submitter_of, visible_principal
from app.api.json_responses import FastJSONResponse
from app.api.problems import ApiProblem, responses
from app.api.rate_limits import rate_limit_headers
from app.api.schemas import (
    ApprovalDecisionBody,
    ApprovalPolicyBody,
    MessagePage,
    PendingTurnDocument,
    PendingTurnList,
    RunDocument,
    RunPage,
    SessionDocument,
    SessionRequest,
    SessionTurnRequest,
    TurnRequest,
    message_page_document,
    run_page_document,
)
from app.api.services import state_of
from app.api.streams import HeldStream, session_stream
from app.observability import tracing
from app.queue.approvals import ApprovalAnswer
from app.queue.errors import SessionNotFoundError
from app.queue.reads import Reads, SessionView
from app.queue.submit import IdempotencyKey, RunSpec, Submitted, request_hash
from app.runtime.agents import unknown_agent
from app.security.api_keys import Caller
from app.vocabulary.classes import PriorityClass

router = APIRouter(tags=["sessions"])

IdempotencyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="Makes retries safe: the same key and body replay the first outcome.",
    ),
]
TraceparentHeader = Annotated[
    str | None,
    Header(
        alias="traceparent",
        description=(
            "W3C Trace Context: the run's work (every claim, tool and model call) joins this "
            "trace. An invalid value is ignored, as the W3C spec asks."
        ),
    ),
]


def spec_from(
    body: TurnRequest, caller: Caller, agents: frozenset[str], traceparent: str | None = None
) -> RunSpec:
    """Validate what the core cannot know (agents registered here, scopes) and build a spec."""
    if body.agent is not None and body.agent not in agents:
        raise ApiProblem(
            "invalid-request",
            f"body.agent: {unknown_agent(body.agent, agents)}",
            errors=[{"loc": ["body", "agent"], "msg": "unknown agent", "type": "unknown_agent"}],
        )
    priority = PriorityClass(body.priority) if body.priority else None
    if priority is PriorityClass.MAINTENANCE and not caller.is_operator:
        raise ApiProblem("forbidden", "maintenance runs need a key with the operator scope")
    return RunSpec(
        input=body.input,
        agent=body.agent,
        priority=priority,
        scheduled_for=body.scheduled_for,
        traceparent=traceparent,
        start_within=body.start_within,
        start_before=body.start_before,
        approval=body.approval.to_json() if isinstance(body.approval, ApprovalPolicyBody) else None,
    )


async def idempotency_of(request: Request, key: str | None) -> IdempotencyKey | None:
    if key is None:
        return None
    raw = await request.body()
    body: Any = json.loads(raw) if raw else None  # a bodiless action (resubmit) hashes as null
    return IdempotencyKey(
        key=key, request_hash=request_hash(request.method, request.url.path, body)
    )


async def visible_session(request: Request, session_id: UUID, caller: Caller) -> SessionView:
    """The session if the caller may see it: its own tenant, and its own principal's sessions
    unless the key has a scope; SessionNotFoundError otherwise."""
    reads: Reads = state_of(request).reads
    session = await reads.session(
        session_id, tenant_id=caller.tenant_id, principal=visible_principal(caller)
    )
    if session is None:
        raise SessionNotFoundError(session_id)
    return session


SUBMITTED_HEADERS: dict[str, Any] = {
    "Location": {"schema": {"type": "string"}},
    "RateLimit-Policy": {
        "schema": {"type": "string"},
        "description": "With a submission rate limit: the tenant's bucket, e.g. "
        '`"submit";q=10;w=5` (draft-ietf-httpapi-ratelimit-headers-11).',
    },
    "RateLimit": {
        "schema": {"type": "string"},
        "description": "With a submission rate limit: submissions left now and seconds to the "
        'next, e.g. `"submit";r=3;t=1`.',
    },
}


def submitted_attributes(outcome: Submitted) -> dict[str, str | None]:
    """What the submission's span records of its outcome."""
    return {
        "turnstile.run.id": str(outcome.run_id),
        "turnstile.submission.routed": outcome.routed,
        "turnstile.session.id": str(outcome.document.get("session_id") or "") or None,
    }


def submitted_response(outcome: Submitted) -> JSONResponse:
    location = outcome.location or f"/runs/{outcome.run_id}"
    headers = {"Location": location, **rate_limit_headers(outcome.allowance)}
    if outcome.replayed:
        headers["Idempotent-Replayed"] = "true"
    return FastJSONResponse(outcome.document, status_code=outcome.status_code, headers=headers)


def session_document(session: SessionView) -> SessionDocument:
    return SessionDocument(
        id=session.id,
        created_at=session.created_at,
        state=session.state,
        active_run_id=session.active_run_id,
        active_run_status=session.active_status,
        question=session.active_question,
        multitask=session.multitask,
        pending_turns=session.pending_turns,
        approval=session.approval,
        approval_request=session.approval_request,
    )


@router.post(
    "/sessions",
    status_code=201,
    response_model=SessionDocument,
    summary="Create a session (a conversation)",
    description="An optional body sets the session's multitask policy (default reject).",
    responses=responses(
        "unauthorized", "invalid-request", "malformed-json", "body-too-large", "request-timeout"
    ),
)
async def create_session(
    request: Request, caller: CallerDep, response: Response, body: SessionRequest | None = None
) -> Any:
    session = await state_of(request).reads.create_session(
        tenant_id=caller.tenant_id,
        principal=caller.principal,
        multitask=(body.multitask if body else None) or "reject",
        approval=body.approval.to_json() if body and body.approval else None,
    )
    response.headers["Location"] = f"/sessions/{session.id}"
    return session_document(session)


@router.get(
    "/sessions/{session_id}",
    response_model=SessionDocument,
    summary="A session and its state: idle, busy (with its active run), or waiting for the user",
    responses=responses("unauthorized", "not-found", "invalid-request"),
)
async def get_session(session_id: UUID, request: Request, caller: CallerDep) -> Any:
    return session_document(await visible_session(request, session_id, caller))


@router.patch(
    "/sessions/{session_id}",
    response_model=SessionDocument,
    summary="Change a session's multitask policy or approval policy",
    description="`multitask` applies to turns that arrive from now on; pending turns keep "
    "their own. `approval` (null: the process default) applies to the session's runs from "
    "their next execution's first tool call (docs/approvals.md).",
    responses=responses(
        "unauthorized",
        "not-found",
        "invalid-request",
        "malformed-json",
        "body-too-large",
        "request-timeout",
    ),
)
async def update_session(
    session_id: UUID, body: SessionRequest, request: Request, caller: CallerDep
) -> Any:
    state = state_of(request)
    await visible_session(request, session_id, caller)
    if body.multitask is not None:
        await state.submissions.turns.set_session_policy(
            submitter_of(caller), session_id, body.multitask
        )
    if "approval" in body.model_fields_set:
        # null sets the session back to the process default (docs/approvals.md).
        await state.submissions.approvals.set_session_policy(
            submitter_of(caller),
            session_id,
            body.approval.to_json() if body.approval is not None else None,
        )
    return session_document(await visible_session(request, session_id, caller))


@router.get(
    "/sessions/{session_id}/pending-turns",
    response_model=PendingTurnList,
    summary="A session's pending turns, in the order they will start",
    responses=responses("unauthorized", "not-found", "invalid-request"),
)
async def list_pending_turns(session_id: UUID, request: Request, caller: CallerDep) -> Any:
    await visible_session(request, session_id, caller)
    turns = await state_of(request).submissions.turns.pending_turns(session_id)
    return FastJSONResponse({"pending_turns": [turn.to_document() for turn in turns]})


@router.get(
    "/sessions/{session_id}/pending-turns/{turn_id}",
    response_model=PendingTurnDocument,
    summary="A pending turn: its position, or the run it became",
    responses=responses("unauthorized", "not-found", "invalid-request"),
)
async def get_pending_turn(
    session_id: UUID, turn_id: UUID, request: Request, caller: CallerDep
) -> Any:
    await visible_session(request, session_id, caller)
    turn = await state_of(request).submissions.turns.pending_turn(session_id, turn_id)
    return FastJSONResponse(turn.to_document())


@router.post(
    "/sessions/{session_id}/pending-turns/{turn_id}/cancel",
    response_model=PendingTurnDocument,
    summary="Withdraw a pending turn before it starts",
    description="200 with the cancelled turn (also when it already was); 409 `turn-started` "
    "when it became a run or reached one (cancel that run instead).",
    responses=responses("unauthorized", "not-found", "invalid-request", "turn-started"),
)
async def cancel_pending_turn(
    session_id: UUID, turn_id: UUID, request: Request, caller: CallerDep
) -> Any:
    await visible_session(request, session_id, caller)
    turn = await state_of(request).submissions.turns.cancel_pending(
        submitter_of(caller), session_id, turn_id
    )
    state_of(request).live.session_changed(session_id)
    return FastJSONResponse(turn.to_document())


@router.get(
    "/sessions/{session_id}/runs",
    response_model=RunPage,
    summary="A session's runs, newest first",
    responses=responses("unauthorized", "not-found", "invalid-request"),
)
async def session_runs(
    session_id: UUID,
    request: Request,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> Any:
    await visible_session(request, session_id, caller)
    page = await state_of(request).reads.session_runs_page(session_id, cursor=cursor, limit=limit)
    return run_page_document(page)


@router.get(
    "/sessions/{session_id}/messages",
    response_model=MessagePage,
    summary="A session's conversation, oldest first",
    description=(
        "The transcript: each run's user turns (its input, then every answer delivered to it), "
        "the assistant's questions and final message, its tool calls with their outcomes "
        "(`uncertain` included), and a `system` entry when a run failed or was cancelled (its "
        "user turns stay). Ordered by (`run_no`, `seq`); pass `next` as `cursor` for more. "
        "Entries of the active run appear as they commit."
    ),
    responses=responses("unauthorized", "not-found", "invalid-request"),
)
async def session_messages(
    session_id: UUID,
    request: Request,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> Any:
    await visible_session(request, session_id, caller)
    page = await state_of(request).reads.session_transcript_page(
        session_id, cursor=cursor, limit=limit
    )
    return message_page_document(page)


SESSION_EVENT_ID = re.compile(r"([0-9]{1,9})\.([0-9]{1,18})")


def session_cursor(value: str, where: list[str]) -> tuple[int, int]:
    """`<run number within the session>.<sequence number>`, as the stream's ids are."""
    found = SESSION_EVENT_ID.fullmatch(value.strip())
    if found is None:
        raise ApiProblem(
            "invalid-request",
            f"{where[1]} must be a session event id such as 3.7 (run number, then sequence)",
            errors=[{"loc": where, "msg": "not a session event id", "type": "session_event_id"}],
        )
    return int(found.group(1)), int(found.group(2))


@router.get(
    "/sessions/{session_id}/events",
    summary="The conversation's events: every run of the session, in order, with live text",
    description=(
        "Server-Sent Events (`Accept: text/event-stream`): the durable events of all the "
        "session's runs in order (their data as in `GET /runs/{id}/events`, plus `run_id` and "
        "`run_no`), each with the id `<run_no>.<seq>` (run number within the session, then "
        "the run's event sequence number), and `message.delta` events (no id) carrying a "
        "message's text while a run writes it. Resumes after `Last-Event-ID` (or `after`): "
        "missed durable events first, then live deltas. The stream stays open across runs "
        "until the client leaves. Capped like run streams (429 `too-many-streams`)."
    ),
    responses={
        **responses("unauthorized", "not-found", "invalid-request", "too-many-streams"),
        200: {"content": {"text/event-stream": {}}},
    },
)
async def session_events(
    session_id: UUID,
    request: Request,
    caller: CallerDep,
    after: Annotated[str | None, Query(max_length=30)] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=30)] = None,
) -> Any:
    await visible_session(request, session_id, caller)
    run_no, seq = 1, 0
    if last_event_id is not None:
        run_no, seq = session_cursor(last_event_id, ["header", "Last-Event-ID"])
    elif after is not None:
        run_no, seq = session_cursor(after, ["query", "after"])
    slot = state_of(request).streams.acquire(caller.key_id, caller.tenant_id)
    return HeldStream(slot, session_stream(request, session_id, run_no, seq, slot))


@router.post(
    "/sessions/{session_id}/turns",
    status_code=202,
    # A run (new, answered, or steered: then with its `pending_turn`), or a pending turn.
    response_model=RunDocument | PendingTurnDocument,
    summary="Submit a user's turn: starts a run, or answers the run waiting for the user",
    description=(
        "With no active run in the session, a new run is queued (202, `Location: /runs/{id}`). "
        "When the session's run is waiting for the user, the input is delivered to that same "
        "run, which goes back to the queue (202). When its run is queued or running, the "
        "multitask policy decides (the body's `multitask`, else the session's): reject is 409 "
        "`session-busy`; enqueue answers 202 with a pending turn (`Location: "
        "/sessions/{id}/pending-turns/{turn_id}`, its `position` and `active_run_id`); "
        "interrupt answers 202 with the new run when the active run was only queued, else with "
        "a pending turn that starts once the run stops; steer answers 202 with the active run "
        "(same id) and its `pending_turn`. Over TURNSTILE_MAX_PENDING_TURNS: 429 "
        "`too-many-pending-turns`. A run waiting for a tool call's approval takes only an "
        'approval (`{"approval": {"call_id", "decision": approve|reject|edit, '
        '"args", "reason"}}`, docs/approvals.md): any other turn is 409 '
        "`approval-pending`. With `Idempotency-Key`, a retry of the same "
        "request replays the first outcome (`Idempotent-Replayed: true`). With a submission "
        "rate limit, a turn over it is refused with 429 `rate-limited` and `Retry-After`, and "
        "every answer carries `RateLimit-Policy` and `RateLimit`."
    ),
    responses={
        **responses(
            "unauthorized",
            "forbidden",
            "not-found",
            "session-busy",
            "invalid-request",
            "answer-conflict",
            "idempotency-key-in-flight",
            "queue-quota",
            "malformed-json",
            "body-too-large",
            "request-timeout",
            "rate-limited",
            "too-many-pending-turns",
            "approval-pending",
            "no-approval-pending",
            "approval-call-mismatch",
            "invalid-approval",
        ),
        202: {"headers": SUBMITTED_HEADERS},
    },
)
async def submit_turn(
    session_id: UUID,
    body: SessionTurnRequest,
    request: Request,
    caller: CallerDep,
    idempotency_key: IdempotencyHeader = None,
    traceparent: TraceparentHeader = None,
) -> Any:
    state = state_of(request)
    if isinstance(body.approval, ApprovalDecisionBody):
        with tracing.submission("turn", traceparent) as span:
            outcome = await state.submissions.approvals.answer(
                submitter_of(caller),
                session_id,
                ApprovalAnswer(
                    call_id=body.approval.call_id,
                    decision=body.approval.decision,
                    args=body.approval.args,
                    reason=body.approval.reason,
                ),
                await idempotency_of(request, idempotency_key),
                traceparent=span.traceparent,
            )
            span.set(submitted_attributes(outcome))
        state.live.session_changed(session_id)
        return submitted_response(outcome)
    # The submission's span: the run keeps its context, so the run's work joins this trace.
    with tracing.submission("turn", traceparent) as span:
        spec = spec_from(body, caller, state.agents, span.traceparent)
        outcome = await state.submissions.submit_turn(
            submitter_of(caller),
            session_id,
            spec,
            await idempotency_of(request, idempotency_key),
            multitask=body.multitask,
        )
        span.set(submitted_attributes(outcome))
    # This process's streams of the session look again at once (others within their recheck).
    state.live.session_changed(session_id)
    return submitted_response(outcome)
