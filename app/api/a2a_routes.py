"""The Agent2Agent protocol (A2A 1.0) inside `turnstile serve` (issue 34): the agent card at
`/.well-known/agent-card.json`, the JSON-RPC binding at `POST /a2a` (`SendMessage`, blocking
or not, `SendStreamingMessage`, `GetTask`, `ListTasks`, `CancelTask`, `SubscribeToTask`, the
four push-configuration methods, `GetExtendedAgentCard`) and
the HTTP+JSON binding under `/a2a/rest` (the same operations, one `invoke` behind both),
driven by the official `a2a-sdk` client unchanged (docs/a2a.md).

A message to a busy context follows its session's multitask policy (docs/turn-control.md):
`reject` is an error; `enqueue` and `interrupt` answer with a pending task, a pending turn
whose id its run takes when it starts (migration 0024), so every operation on a task (get,
list, cancel, stream, subscribe, push configurations) reads the pending turn until the run
exists (`find_task`); `steer` answers with the active task.

A thin surface: the mapping is app/protocols/a2a.py; sessions, submissions (routing,
idempotency, rate limits, quotas), reads and cancel are the core's, exactly as for
`POST /sessions/{id}/turns`, with the caller's tenant and principal. Every error is a JSON-RPC
error object with the A2A code (HTTP 200, as the binding answers them; a missing or bad key is
HTTP 401 with `WWW-Authenticate`, as the specification asks of authentication), never a 5xx:
`A2AErrors` rewrites our problem+json answers under `/a2a` (auth, body limit, timeouts). On
HTTP+JSON an error is a google.rpc.Status body with its HTTP status.

Streams (`SendStreamingMessage`, `SubscribeToTask`) are built from the run's durable events
and live deltas, as `GET /runs/{id}/events` is: each SSE frame of a durable event carries its
sequence number as its `id:` and in the item's `metadata.turnstile.eventId`; a subscriber that
sends it back as `Last-Event-ID` gets every event after it, once. A stream ends when the task
is finished or asks for input. The routes stay out of our OpenAPI document: their contract is
A2A's.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.sse import KEEPALIVE_COMMENT
from pydantic import ValidationError
from starlette.types import Message, Send

from app.api.auth import (
    CHALLENGE,
    CallerDep,
    submitter_of,
    visible_principal,
    visible_tenant,
)
from app.api.json_responses import FastJSONResponse
from app.api.problem_rewrite import ProblemRewrite
from app.api.problems import ApiProblem
from app.api.responses_routes import SYNC_WAIT_SECONDS, until_stopped
from app.api.runs import load_run
from app.api.schemas import ApprovalDecisionBody, storable_json
from app.api.services import state_of
from app.api.streams import KEEPALIVE_SECONDS, STREAM_PAGE, DeltaFilter, HeldStream, wait
from app.api.watch import (
    POLL_RECHECK_SECONDS,
    STREAM_RECHECK_SECONDS,
    StreamSlot,
    recheck_seconds,
)
from app.observability import tracing
from app.protocols import a2a
from app.protocols.a2a import A2AError
from app.queue.approvals import ApprovalAnswer
from app.queue.errors import (
    AnswerConflictError,
    ApprovalCallMismatchError,
    ApprovalPendingError,
    HoldingLimitError,
    IdempotencyKeyInFlightError,
    IdempotencyKeyReusedError,
    InvalidApprovalError,
    InvalidCursorError,
    NoApprovalPendingError,
    PendingTurnsFullError,
    PendingTurnStartedError,
    QueueQuotaError,
    RateLimitedError,
    RunFinishedError,
    RunNotFoundError,
    RunNotWaitingError,
    SessionBusyError,
    SessionNotFoundError,
    TurnstileError,
)
from app.queue.submit import IdempotencyKey, RunSpec, Submitted, Submitter, request_hash
from app.queue.turns import PendingTurn
from app.queue.webhook_endpoints import TaskPushConfig, TaskPushNotFoundError
from app.runtime.webhook_delivery import (
    DestinationRefusedError,
    check_push_destination,
    register_task_push,
)
from app.security.api_keys import Caller
from app.security.secret_box import SecretKeyMissingError
from app.vocabulary.records import JSON, Run
from app.vocabulary.statuses import TERMINAL

router = APIRouter(tags=["a2a"], include_in_schema=False)

RPC_PATH = "/a2a"
REST_PATH = "/a2a/rest"
CARD_PATH = "/.well-known/agent-card.json"
VERSION = "0.1.0"
# Where a stream (and a blocking send) stops: the task finished, or asking for input.
STOPPED = {*TERMINAL, "waiting_for_user"}
# What the hash of a message's idempotency key names as its request (both send methods).
SEND_PATH = "/a2a/message"


def public_card(request: Request) -> dict[str, Any]:
    base = str(request.base_url).rstrip("/")
    state = state_of(request)
    return a2a.agent_card(base, state.agents, VERSION, push=state.secret_box is not None)


@router.get(CARD_PATH)
async def agent_card(request: Request) -> Any:
    return FastJSONResponse(public_card(request))


async def get_extended_card(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    """The extended card (the route's key dependency has refused a caller without one): the
    caller's own tenant's limits that apply and its runs now, read as the admin's
    `GET /tenants/{tenant}/limits` and the runbook read them."""
    tenants = state_of(request).tenants
    limits = tenants.effective(await tenants.get_limits(caller.tenant_id))
    depth = await tenants.depth(tenant_id=caller.tenant_id)
    return a2a.extended_agent_card(
        public_card(request),
        tenant=caller.tenant_id,
        principal=caller.principal,
        scopes=caller.scopes,
        limits=limits.to_document(),
        running=sum(d.running for d in depth),
        queued=sum(d.queued for d in depth),
    )


# --- errors ------------------------------------------------------------------------------------
def core_error(exc: TurnstileError) -> A2AError:
    """A refusal of the core in A2A's terms."""
    if isinstance(exc, RunNotFoundError):
        return a2a.task_not_found(str(exc.run_id))
    if isinstance(exc, TaskPushNotFoundError):
        return A2AError(
            a2a.TASK_NOT_FOUND,
            f"push notification configuration {exc.config_id[:100]!r} not found",
            "PUSH_CONFIG_NOT_FOUND",
        )
    if isinstance(exc, HoldingLimitError):
        return A2AError(a2a.INVALID_REQUEST, str(exc), "TOO_MANY_PUSH_CONFIGS")
    if isinstance(exc, SessionNotFoundError):
        return A2AError(
            a2a.INVALID_PARAMS,
            f"message.contextId: no context {str(exc.session_id)!r}",
            "CONTEXT_NOT_FOUND",
            violations=[("message.contextId", "no such context")],
        )
    if isinstance(exc, SessionBusyError):
        return A2AError(
            a2a.UNSUPPORTED_OPERATION,
            f"the context's task {exc.active_run_id} is {a2a.STATE.get(exc.status, exc.status)}: "
            "it cannot take a message until it finishes or asks for input",
            "CONTEXT_BUSY",
            {"activeTaskId": str(exc.active_run_id), "contextId": str(exc.session_id)},
        )
    if isinstance(exc, ApprovalPendingError):
        return A2AError(
            a2a.UNSUPPORTED_OPERATION,
            f"task {exc.run_id} waits for the approval of its {exc.tool} call {exc.call_id}: "
            f'reply with a data part {{"approval": {{"call_id": "{exc.call_id}", '
            '"decision": "approve"|"reject"|"edit"}}',
            "APPROVAL_PENDING",
            {"taskId": str(exc.run_id), "callId": exc.call_id, "tool": exc.tool},
        )
    if isinstance(exc, NoApprovalPendingError):
        return A2AError(
            a2a.UNSUPPORTED_OPERATION,
            f"no call waits for approval there: {exc}",
            "NO_APPROVAL_PENDING",
            {"callId": exc.call_id},
        )
    if isinstance(exc, ApprovalCallMismatchError):
        return A2AError(
            a2a.INVALID_PARAMS,
            str(exc),
            "APPROVAL_CALL_MISMATCH",
            {"taskId": str(exc.run_id), "pendingCallId": exc.pending},
            violations=[
                ("message.parts.data.approval.call_id", f"the pending call is {exc.pending}")
            ],
        )
    if isinstance(exc, InvalidApprovalError):
        return A2AError(
            a2a.INVALID_PARAMS,
            str(exc),
            "INVALID_APPROVAL",
            violations=[
                ("message.parts.data.approval.args", str(e.get("msg", "invalid")))
                for e in exc.errors[:20]
            ],
        )
    if isinstance(exc, RunNotWaitingError):
        return A2AError(
            a2a.UNSUPPORTED_OPERATION,
            f"task {exc.run_id} is not waiting for input",
            "TASK_NOT_WAITING",
            {"taskId": str(exc.run_id)},
        )
    if isinstance(exc, RunFinishedError):
        return A2AError(
            a2a.TASK_NOT_CANCELABLE,
            f"task {exc.run_id} is {a2a.STATE.get(exc.status, exc.status)}",
            "TASK_NOT_CANCELABLE",
            {"taskId": str(exc.run_id)},
        )
    if isinstance(exc, IdempotencyKeyReusedError):
        return A2AError(
            a2a.INVALID_PARAMS,
            "message.messageId: this message id was already sent with another message",
            "MESSAGE_ID_REUSED",
            violations=[("message.messageId", "already used with another message")],
        )
    if isinstance(exc, IdempotencyKeyInFlightError):
        return A2AError(
            a2a.INTERNAL_ERROR,
            "a message with this id is still being processed; retry shortly",
            "MESSAGE_IN_FLIGHT",
            {"retryAfterSeconds": str(exc.retry_after)},
            retry_after=exc.retry_after,
        )
    if isinstance(exc, RateLimitedError):
        return A2AError(
            a2a.INTERNAL_ERROR,
            str(exc),
            "RATE_LIMITED",
            {"retryAfterSeconds": str(exc.retry_after)},
            retry_after=exc.retry_after,
        )
    if isinstance(exc, QueueQuotaError):
        return A2AError(
            a2a.INTERNAL_ERROR,
            str(exc),
            "QUEUE_QUOTA",
            {"maxQueued": str(exc.max_queued), "queued": str(exc.queued)},
            retry_after=1,
        )
    if isinstance(exc, PendingTurnsFullError):
        return A2AError(
            a2a.INTERNAL_ERROR,
            str(exc),
            "TOO_MANY_PENDING_TASKS",
            {"maxPending": str(exc.max_pending)},
            retry_after=1,
        )
    if isinstance(exc, AnswerConflictError):
        return A2AError(
            a2a.INVALID_PARAMS,
            str(exc),
            "ANSWER_CONFLICT",
            violations=[("metadata.skill", str(exc))],
        )
    return A2AError(a2a.INVALID_PARAMS, str(exc), "INVALID_PARAMS")


def problem_error(exc: ApiProblem) -> A2AError:
    if exc.slug == "not-found":
        return A2AError(a2a.TASK_NOT_FOUND, exc.detail or "not found", "TASK_NOT_FOUND")
    if exc.slug == "too-many-streams":
        return A2AError(
            a2a.INTERNAL_ERROR, exc.detail or "too many open streams", "TOO_MANY_STREAMS"
        )
    return A2AError(a2a.INVALID_REQUEST, exc.detail or exc.slug, exc.slug.upper().replace("-", "_"))


@dataclass(frozen=True)
class Framing:
    """How a result travels: in a JSON-RPC response object (its request's id), or bare
    (HTTP+JSON)."""

    rpc_id: JSON = None
    rest: bool = False

    def wrap(self, item: dict[str, Any]) -> dict[str, Any]:
        return item if self.rest else a2a.rpc_result(self.rpc_id, item)


Handler = Callable[[Request, Caller, Framing, dict[str, Any]], Awaitable[Any]]


def error_response(framing: Framing, error: A2AError) -> JSONResponse:
    """The error as the binding answers it: a JSON-RPC error object (HTTP 200), or a
    google.rpc.Status with the error's HTTP status (HTTP+JSON)."""
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
    if framing.rest:
        return FastJSONResponse(
            error.status_object(), status_code=error.http_status, headers=headers
        )
    return FastJSONResponse(a2a.rpc_error(framing.rpc_id, error), headers=headers)


def version_error(request: Request) -> A2AError | None:
    """VersionNotSupported for an `A2A-Version` other than 1.0 (none given: taken as 1.0)."""
    version = request.headers.get("A2A-Version")
    if version is None or not version.strip() or re.fullmatch(r"1\.0(\.\d+)?", version.strip()):
        return None
    return A2AError(
        a2a.VERSION_NOT_SUPPORTED,
        f"A2A-Version {version[:20]!r} is not supported; this agent speaks 1.0",
        "VERSION_NOT_SUPPORTED",
        {"supported": a2a.PROTOCOL_VERSION},
    )


async def invoke(
    method: str, request: Request, caller: Caller, framing: Framing, params: dict[str, Any]
) -> Any:
    """One A2A operation, by its method name, in either binding; every refusal answered in
    the binding's error shape."""
    handler = HANDLERS.get(method)
    try:
        refused = version_error(request)
        if refused is not None:
            raise refused
        if handler is None:
            raise A2AError(
                a2a.METHOD_NOT_FOUND, f"Method not found: {method[:100]!r}", "METHOD_NOT_FOUND"
            )
        result = await handler(request, caller, framing, params)
    except A2AError as error:
        return error_response(framing, error)
    except ValidationError as invalid:
        violations = a2a.pydantic_violations(
            [dict(e) for e in invalid.errors(include_url=False, include_input=False)]
        )
        return error_response(
            framing,
            A2AError(
                a2a.INVALID_PARAMS,
                "Invalid parameters: "
                + "; ".join(f"{field}: {text}" for field, text in violations[:3]),
                "INVALID_PARAMS",
                violations=violations,
            ),
        )
    except TurnstileError as refused_by_core:
        return error_response(framing, core_error(refused_by_core))
    except ApiProblem as problem:
        if problem.slug == "unauthorized":
            raise
        return error_response(framing, problem_error(problem))
    if isinstance(result, HeldStream):
        return result
    return FastJSONResponse(framing.wrap(result))


@router.post(RPC_PATH)
async def json_rpc(request: Request, caller: CallerDep) -> Any:
    raw = await request.body()
    try:
        envelope = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return error_response(Framing(), A2AError(a2a.PARSE_ERROR, "Invalid JSON payload", "PARSE"))
    if a2a.too_deep(envelope):
        return error_response(Framing(), nested_error())
    rpc_id: JSON = None
    if isinstance(envelope, dict):
        given = envelope.get("id")
        if isinstance(given, str | int) and not isinstance(given, bool):
            rpc_id = given
    if (
        not isinstance(envelope, dict)
        or envelope.get("jsonrpc") != "2.0"
        or not isinstance(envelope.get("method"), str)
        or not isinstance(envelope.get("params", {}), dict)
        or ("id" in envelope and envelope["id"] is not None and rpc_id is None)
    ):
        return error_response(
            Framing(rpc_id),
            A2AError(
                a2a.INVALID_REQUEST,
                "Request payload validation error: a JSON-RPC 2.0 request object with a "
                "method and object params",
                "INVALID_REQUEST",
            ),
        )
    params: dict[str, Any] = envelope.get("params") or {}
    return await invoke(envelope["method"], request, caller, Framing(rpc_id), params)


# --- the HTTP+JSON binding ---------------------------------------------------------------------
REST = Framing(rest=True)


async def rest_body(request: Request) -> dict[str, Any] | JSONResponse:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = None
    if not isinstance(body, dict):
        return error_response(
            REST, A2AError(a2a.PARSE_ERROR, "the body must be a JSON object", "PARSE")
        )
    if a2a.too_deep(body):
        return error_response(REST, nested_error())
    return body


def nested_error() -> A2AError:
    return A2AError(
        a2a.INVALID_REQUEST,
        f"the request nests deeper than {a2a.MAX_DEPTH} levels",
        "TOO_DEEP",
    )


@router.post(f"{REST_PATH}/message:send")
async def rest_send(request: Request, caller: CallerDep) -> Any:
    body = await rest_body(request)
    if isinstance(body, JSONResponse):
        return body
    return await invoke("SendMessage", request, caller, REST, body)


@router.post(f"{REST_PATH}/message:stream")
async def rest_stream(request: Request, caller: CallerDep) -> Any:
    body = await rest_body(request)
    if isinstance(body, JSONResponse):
        return body
    return await invoke("SendStreamingMessage", request, caller, REST, body)


@router.get(f"{REST_PATH}/tasks")
async def rest_list(request: Request, caller: CallerDep) -> Any:
    return await invoke("ListTasks", request, caller, REST, dict(request.query_params))


@router.get(REST_PATH + "/tasks/{task_id}:subscribe")
@router.post(REST_PATH + "/tasks/{task_id}:subscribe")
async def rest_subscribe(task_id: str, request: Request, caller: CallerDep) -> Any:
    return await invoke("SubscribeToTask", request, caller, REST, {"id": task_id})


@router.post(REST_PATH + "/tasks/{task_id}:cancel")
async def rest_cancel(task_id: str, request: Request, caller: CallerDep) -> Any:
    body = await rest_body(request)
    if isinstance(body, JSONResponse):
        return body
    return await invoke("CancelTask", request, caller, REST, {**body, "id": task_id})


@router.get(REST_PATH + "/tasks/{task_id}")
async def rest_get(task_id: str, request: Request, caller: CallerDep) -> Any:
    return await invoke("GetTask", request, caller, REST, {**request.query_params, "id": task_id})


@router.api_route(
    REST_PATH + "/tasks/{task_id}/pushNotificationConfigs{rest:path}",
    methods=["GET", "POST", "DELETE"],
)
async def rest_push(task_id: str, rest: str, request: Request, caller: CallerDep) -> Any:
    """`POST .../pushNotificationConfigs` creates, `GET` lists; `GET` and `DELETE` of
    `.../pushNotificationConfigs/{id}` read and delete one."""
    config_id = rest.removeprefix("/")
    if request.method == "POST" and not rest:
        body = await rest_body(request)
        if isinstance(body, JSONResponse):
            return body
        params = {**body, "taskId": task_id}
        return await invoke("CreateTaskPushNotificationConfig", request, caller, REST, params)
    if request.method == "GET" and not rest:
        params = {**request.query_params, "taskId": task_id}
        return await invoke("ListTaskPushNotificationConfigs", request, caller, REST, params)
    if config_id and "/" not in config_id and request.method in ("GET", "DELETE"):
        method = (
            "GetTaskPushNotificationConfig"
            if request.method == "GET"
            else "DeleteTaskPushNotificationConfig"
        )
        params = {"taskId": task_id, "id": config_id}
        return await invoke(method, request, caller, REST, params)
    return error_response(
        REST, A2AError(a2a.METHOD_NOT_FOUND, "no such push configuration route", "NOT_FOUND")
    )


@router.get(f"{REST_PATH}/extendedAgentCard")
async def rest_extended_card(request: Request, caller: CallerDep) -> Any:
    return await invoke("GetExtendedAgentCard", request, caller, REST, {})


async def visible_task(request: Request, task_id: str, caller: Caller) -> Run:
    run_id = a2a.uuid_of(task_id)
    if run_id is None:
        raise a2a.task_not_found(task_id)
    try:
        return await load_run(request, run_id, caller)
    except RunNotFoundError:
        raise a2a.task_not_found(task_id) from None


Found = Run | PendingTurn
"""What a task id names: a run, or a turn waiting for its context's active task (a pending
turn, docs/turn-control.md): the run it becomes has its id."""


async def find_task(request: Request, task_id: str, caller: Caller) -> Found:
    """The task, if the caller may see it (as `load_run` decides for runs); not found
    otherwise. A steer delivered into a run is part of that run's task, not a task."""
    wanted = a2a.uuid_of(task_id)
    if wanted is None:
        raise a2a.task_not_found(task_id)
    run_id = wanted
    for _ in range(2):
        try:
            return await load_run(request, run_id, caller)
        except RunNotFoundError:
            pass
        turn = await state_of(request).submissions.turns.visible_pending_turn(
            wanted, tenant_id=visible_tenant(caller), principal=visible_principal(caller)
        )
        if turn is None or turn.status == "delivered":
            break
        if turn.status != "started":
            return turn
        # Started between the two reads (its run exists now), or before migration 0024, when
        # a promoted run took an id of its own: pending_turns.run_id names it.
        run_id = turn.run_id or wanted
    raise a2a.task_not_found(task_id)


def task_document(
    found: Found, *, history_length: int | None = None, artifacts: bool = True
) -> dict[str, Any]:
    if isinstance(found, Run):
        return a2a.task_of(found, history_length=history_length, artifacts=artifacts)
    return a2a.pending_task(
        task_id=found.id,
        context_id=found.session_id,
        status=found.status,
        updated_at=found.updated_at or found.created_at,
        input=found.input,
        policy=found.policy,
        position=found.position,
        active_run_id=found.active_run_id,
        agent=found.agent,
        history_length=history_length,
        artifacts=artifacts,
    )


def pending_of(outcome: Submitted) -> tuple[str, UUID] | None:
    """The pending turn a submission made, as (its policy, its id), or None for a run: the
    first answer's routing, or a replay's stored document (a pending turn's own, or under
    steer the active run's with its `pending_turn`)."""
    document = outcome.document
    turn = document if document.get("kind") == "pending_turn" else document.get("pending_turn")
    if not isinstance(turn, dict):
        return None
    return str(turn.get("policy")), UUID(str(turn["id"]))


def answered_task_id(outcome: Submitted) -> UUID:
    """The task a send answers with: the pending turn's under enqueue and interrupt (the run it
    becomes has its id), else the run's (the steered one, under steer)."""
    pending = pending_of(outcome)
    if pending is not None and pending[0] != "steer":
        return pending[1]
    return outcome.run_id


async def until_task_stops(request: Request, found: Found, caller: Caller) -> Found:
    """A blocking send's wait, as for any task: until it finishes or asks for input, or as it
    is after `SYNC_WAIT_SECONDS` in all. A pending task is waited for to start first (its
    session's notifications wake the wait; a read a second is the safety net)."""
    if isinstance(found, Run):
        return await until_stopped(request, found, caller)
    state = state_of(request)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SYNC_WAIT_SECONDS
    idle = asyncio.Event()  # nothing sets it: the inbox and the timeout wake this wait
    with (
        state.streams.acquire(caller.key_id, caller.tenant_id) as slot,
        state.live.following(session_id=found.session_id) as inbox,
    ):
        while True:
            found = await find_task(request, str(found.id), caller)
            remaining = deadline - loop.time()
            if isinstance(found, Run) or found.status != "pending" or remaining <= 0:
                break
            if state.shutdown.is_set():
                return found
            await wait(inbox, idle, state.shutdown, min(POLL_RECHECK_SECONDS, remaining), slot)
            inbox.take()
            if slot.ended.is_set():
                raise ApiProblem(
                    "unauthorized",
                    "the API key was revoked while this request waited",
                    headers=CHALLENGE,
                )
    remaining = deadline - loop.time()
    if isinstance(found, Run) and remaining > 0:
        return await until_stopped(request, found, caller, seconds=remaining)
    return found


async def submit_message(
    request: Request, caller: Caller, params: a2a.SendMessageParams
) -> Submitted:
    """The message as a turn: to the task it names (the answer to its question), to the context
    it names (while its task is submitted or working, as the multitask policy says: the
    request's `metadata.multitask`, else the session's), or to a new context. The message id is
    the idempotency key: a retried send, whatever has happened since, answers with the first
    send's task."""
    state = state_of(request)
    message = params.message
    if message.role != "ROLE_USER":
        raise a2a.invalid_params("message.role", "a client sends ROLE_USER messages")
    agent = a2a.skill_of(params)
    if agent is not None and agent not in state.agents:
        raise a2a.invalid_params(
            "metadata.skill",
            f"unknown skill {agent[:100]!r}: one of {', '.join(sorted(state.agents))}",
        )
    values = a2a.run_input(message)
    try:
        storable_json(values)
    except ValueError as exc:
        raise a2a.invalid_params("message.parts", str(exc)) from None
    who = submitter_of(caller)
    key = IdempotencyKey(
        key=a2a.KEY_PREFIX + message.message_id,
        request_hash=request_hash("POST", SEND_PATH, a2a.message_fingerprint(params)),
    )
    replay = await state.submissions.stored_outcome(who, key)
    if replay is not None:
        return replay
    session_id: UUID | None = None
    multitask = a2a.multitask_of(params)
    if message.task_id is not None:
        named = await find_task(request, message.task_id, caller)
        if isinstance(named, PendingTurn):
            raise A2AError(
                a2a.UNSUPPORTED_OPERATION,
                f"task {named.id} is {a2a.PENDING_STATE.get(named.status, named.status)}: "
                "it takes no message until it has started and asks for input",
                "TASK_NOT_WAITING",
                {"taskId": str(named.id)},
            )
        run = named
        if run.session_id is None:
            raise A2AError(
                a2a.UNSUPPORTED_OPERATION,
                f"task {run.id} is not a conversation's task: it takes no messages",
                "TASK_HAS_NO_CONTEXT",
            )
        if message.context_id is not None and a2a.uuid_of(message.context_id) != run.session_id:
            raise a2a.invalid_params("message.contextId", "it is not the task's context")
        if run.status in TERMINAL:
            raise A2AError(
                a2a.UNSUPPORTED_OPERATION,
                f"task {run.id} is {a2a.STATE[run.status]}: it takes no more messages",
                "TASK_TERMINAL",
                {"taskId": str(run.id)},
            )
        if run.status != "waiting_for_user":
            raise core_error(RunNotWaitingError(run.id, run.status))
        session_id = run.session_id
        # The answer to that task, or nothing: never a pending task of its context (a run
        # that stopped waiting meanwhile is refused, not queued behind).
        multitask = "reject"
    elif message.context_id is not None:
        session_id = a2a.uuid_of(message.context_id)
        if session_id is None:
            raise a2a.invalid_params("message.contextId", "not a context this agent gave out")
    approval = a2a.approval_of(message)
    if approval is not None:
        if session_id is None:
            raise a2a.invalid_params(
                "message.taskId", "an approval decides the call a task waits for: name the task"
            )
        return await answer_approval(request, who, session_id, *approval, key)
    made = None
    if session_id is None:
        made = await state.reads.create_session(
            tenant_id=caller.tenant_id, principal=caller.principal
        )
        session_id = made.id
    try:
        with tracing.submission("turn", request.headers.get("traceparent")) as span:
            outcome = await state.submissions.submit_turn(
                who,
                session_id,
                RunSpec(input=values, agent=agent, traceparent=span.traceparent),
                key,
                # The request's own policy (metadata.multitask), else the session's: a busy
                # context's message may wait as a pending task (docs/a2a.md).
                multitask=multitask,
            )
    except TurnstileError:
        if made is not None:  # a refusal leaves nothing behind, not even the new context
            await state.reads.discard_empty_session(made.id, tenant_id=caller.tenant_id)
        raise
    if made is not None and outcome.replayed:
        # A twin of this message won meanwhile: its task, in its context; ours goes.
        await state.reads.discard_empty_session(made.id, tenant_id=caller.tenant_id)
    state.live.session_changed(session_id)
    return outcome


async def answer_approval(
    request: Request,
    who: Submitter,
    session_id: UUID,
    decision: dict[str, JSON],
    text: str,
    key: IdempotencyKey,
) -> Submitted:
    """A message's decision on the call its context's run waits for, through the core's
    approval path as the native turn's (docs/approvals.md): validated as the native body is
    (an edit's arguments against the tool's schema there), the message's text the reason of a
    decision that gives none. The message id stays its idempotency key."""
    if decision.get("reason") is None and text.strip():
        decision = {**decision, "reason": text[:2000]}
    try:
        body = ApprovalDecisionBody.model_validate(decision)
    except ValidationError as exc:
        violations = [
            (f"message.parts.data.approval.{field}", text)
            for field, text in a2a.pydantic_violations(
                [dict(e) for e in exc.errors(include_url=False, include_input=False)]
            )
        ]
        raise A2AError(
            a2a.INVALID_PARAMS,
            "an approval: " + "; ".join(f"{f}: {t}" for f, t in violations[:3]),
            "INVALID_APPROVAL",
            violations=violations,
        ) from None
    state = state_of(request)
    with tracing.submission("turn", request.headers.get("traceparent")) as span:
        outcome = await state.submissions.approvals.answer(
            who,
            session_id,
            ApprovalAnswer(
                call_id=body.call_id, decision=body.decision, args=body.args, reason=body.reason
            ),
            key,
            traceparent=span.traceparent,
        )
    state.live.session_changed(session_id)
    return outcome


async def send_message(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    params = a2a.SendMessageParams.model_validate(raw)
    outcome = await submit_with_push(request, caller, params)
    configuration = params.configuration or a2a.SendConfiguration()
    history = configuration.history_length
    pending = pending_of(outcome)
    found = await find_task(request, str(answered_task_id(outcome)), caller)
    if not configuration.return_immediately:
        found = await until_task_stops(request, found, caller)
    task = task_document(found, history_length=history)
    if pending is not None and pending[0] == "steer" and isinstance(found, Run):
        task = a2a.steered_task(task, params.message, pending[1], history)
    return {"task": task}


async def send_streaming_message(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> HeldStream:
    params = a2a.SendMessageParams.model_validate(raw)
    state = state_of(request)
    # The stream's place is taken first, so a refusal writes nothing.
    slot = state.streams.acquire(caller.key_id, caller.tenant_id)
    try:
        outcome = await submit_with_push(request, caller, params)
        found = await find_task(request, str(answered_task_id(outcome)), caller)
    except BaseException:
        slot.release()
        raise
    if isinstance(found, PendingTurn):
        return HeldStream(slot, pending_stream(request, found, caller, framing, 0, slot))
    return HeldStream(
        slot, task_stream(request, found, caller, framing, found.last_event_seq, slot)
    )


async def get_task(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    params = a2a.TaskParams.model_validate(raw)
    found = await find_task(request, params.id, caller)
    return task_document(found, history_length=params.history_length)


async def cancel_task(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    params = a2a.TaskParams.model_validate(raw)
    state = state_of(request)
    run = await find_task(request, params.id, caller)
    if isinstance(run, PendingTurn):
        if run.tenant_id != caller.tenant_id:  # writes stay within the caller's own tenant
            raise a2a.task_not_found(params.id)
        try:
            withdrawn = await state.submissions.turns.cancel_pending(
                submitter_of(caller), run.session_id, run.id
            )
        except PendingTurnStartedError:
            run = await find_task(request, params.id, caller)  # its run now: cancel that
        else:
            state.live.session_changed(run.session_id)
            return task_document(withdrawn)
        if isinstance(run, PendingTurn):  # withdrawn meanwhile by another cancel
            return task_document(run)
    outcome = await state.queue.cancel(
        run.id,
        actor=caller.actor,
        reason="cancelled through A2A",
        tenant_id=caller.tenant_id,
        principal=visible_principal(caller),
    )
    if outcome.changed:
        tracing.mark("turnstile.cancel", outcome.run.traceparent, {"turnstile.run.id": str(run.id)})
    return a2a.task_of(outcome.run)


async def list_tasks(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    """The caller's tasks (its runs, as `GET /runs/{id}` shows them), newest first."""
    params = a2a.ListTasksParams.model_validate(raw)
    if params.status_timestamp_after:
        raise a2a.invalid_params("statusTimestampAfter", "not supported yet")
    session_id = None
    if params.context_id:
        session_id = a2a.uuid_of(params.context_id)
        if session_id is None:
            return {"tasks": [], "nextPageToken": "", "pageSize": 0, "totalSize": 0}
    size = params.page_size or 50
    status = a2a.status_filter(params.status)
    try:
        page = await state_of(request).reads.runs_page(
            tenant_id=caller.tenant_id,
            principal=visible_principal(caller),
            filters={
                "status": status,
                "min_priority": None,
                "max_priority": None,
                "session_id": session_id,
                "since": None,
                "until": None,
            },
            cursor=params.page_token or None,
            limit=size,
        )
    except InvalidCursorError:
        raise a2a.invalid_params("pageToken", "not a page token this agent gave out") from None
    found: list[Found] = []
    if session_id is not None and not params.page_token and status in (None, "queued"):
        # The context's tasks not started yet (submitted, waiting for its active task) come
        # first on the first page: they are not runs, so not in the runs' page.
        found.extend(
            await state_of(request).submissions.turns.waiting_turns(
                session_id,
                tenant_id=caller.tenant_id,
                principal=visible_principal(caller),
                limit=100,
            )
        )
    found.extend(page.runs)
    tasks = [
        task_document(
            item, history_length=params.history_length, artifacts=params.include_artifacts
        )
        for item in found
    ]
    return {
        "tasks": tasks,
        "nextPageToken": page.next_cursor or "",
        "pageSize": size,
        "totalSize": len(tasks),
    }


def last_event_id(request: Request) -> int | None:
    value = request.headers.get("Last-Event-ID")
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]{1,18}", value.strip()):
        raise a2a.invalid_params("Last-Event-ID", "an eventId this agent sent (a number)")
    return int(value.strip())


async def subscribe_to_task(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> HeldStream:
    params = a2a.TaskParams.model_validate(raw)
    found = await find_task(request, params.id, caller)
    resume = last_event_id(request)
    if isinstance(found, PendingTurn):
        if found.status != "pending":
            raise A2AError(
                a2a.UNSUPPORTED_OPERATION,
                f"task {found.id} is {a2a.PENDING_STATE.get(found.status, found.status)}: "
                "there is nothing to subscribe to",
                "TASK_TERMINAL",
                {"taskId": str(found.id)},
            )
        slot = state_of(request).streams.acquire(caller.key_id, caller.tenant_id)
        return HeldStream(slot, pending_stream(request, found, caller, framing, resume or 0, slot))
    run = found
    if run.status in TERMINAL and (resume is None or resume >= run.last_event_seq):
        raise A2AError(
            a2a.UNSUPPORTED_OPERATION,
            f"task {run.id} is {a2a.STATE[run.status]}: there is nothing to subscribe to",
            "TASK_TERMINAL",
            {"taskId": str(run.id)},
        )
    slot = state_of(request).streams.acquire(caller.key_id, caller.tenant_id)
    after = run.last_event_seq if resume is None else resume
    return HeldStream(slot, task_stream(request, run, caller, framing, after, slot))


# --- push notifications ------------------------------------------------------------------------
def push_refusal(exc: SecretKeyMissingError | DestinationRefusedError, field: str) -> A2AError:
    if isinstance(exc, SecretKeyMissingError):
        return A2AError(a2a.PUSH_NOT_SUPPORTED, str(exc), "PUSH_NOTIFICATION_NOT_SUPPORTED")
    return a2a.invalid_params(field, str(exc).removeprefix("url: "))


async def store_push(
    request: Request,
    caller: Caller,
    run: Found,
    config: a2a.PushConfigParams,
    field: str,
    *,
    catch_up: bool = False,
) -> dict[str, Any]:
    """Store a push configuration of the caller's task; its document. A configuration
    without a token gets one of ours, answered here (it keys the signature too). A pending
    task's is stored under its id, which its run will have: the run's transitions push it."""
    state = state_of(request)
    token = config.token or secrets.token_urlsafe(32)
    stored = a2a.push_secret(token, config.authentication)
    try:
        made = await register_task_push(
            state.webhooks,
            state.egress,
            state.secret_box,
            tenant_id=run.tenant_id,  # an admin's view of another tenant's task: the run's
            principal=run.principal,
            run_id=run.id,
            url=config.url,
            secret=stored,
        )
    except (SecretKeyMissingError, DestinationRefusedError) as exc:
        raise push_refusal(exc, field) from None
    if catch_up:  # the new task may have asked or ended before the configuration existed
        await state.webhooks.catch_up_task_push(made)
    return a2a.push_config_document(str(made.id), str(run.id), made.url, stored)


def push_document(request: Request, config: TaskPushConfig) -> dict[str, Any]:
    box = state_of(request).secret_box
    if box is None:
        raise push_refusal(
            SecretKeyMissingError("push notifications need TURNSTILE_SECRET_KEY"), ""
        )
    try:
        stored = box.decrypt(config.secret_ciphertext)
    except RuntimeError:  # the key changed: the token cannot be shown
        stored = a2a.push_secret("", None)
    return a2a.push_config_document(str(config.id), str(config.run_id), config.url, stored)


async def submit_with_push(
    request: Request, caller: Caller, params: a2a.SendMessageParams
) -> Submitted:
    """The message, and the push configuration its `configuration` gives, checked before
    anything is written. A message naming its task stores the configuration first (so the
    turn's transitions are all pushed; a refused turn takes it away again); a new task's is
    stored as soon as the task exists, with the delivery of a transition made meanwhile, and
    a retried send does not store it twice."""
    wanted = params.configuration.push_config if params.configuration else None
    if not wanted:
        return await submit_message(request, caller, params)
    field = "configuration.taskPushNotificationConfig"
    config = a2a.PushConfigParams.model_validate(wanted)
    state = state_of(request)
    try:
        await check_push_destination(state.egress, state.secret_box, config.url)
    except (SecretKeyMissingError, DestinationRefusedError) as exc:
        raise push_refusal(exc, f"{field}.url") from None
    task_id = params.message.task_id
    if task_id is None:
        outcome = await submit_message(request, caller, params)
        if not outcome.replayed:
            task = await find_task(request, str(answered_task_id(outcome)), caller)
            await store_push(request, caller, task, config, f"{field}.url", catch_up=True)
        return outcome
    run = await visible_task(request, task_id, caller)
    document = await store_push(request, caller, run, config, f"{field}.url")
    try:
        outcome = await submit_message(request, caller, params)
    except BaseException:
        await state.webhooks.delete_task_push(
            tenant_id=run.tenant_id, run_id=run.id, config_id=document["id"], actor=caller.actor
        )
        raise
    if outcome.replayed:  # the first send's turn: this configuration came too late for it
        await state.webhooks.delete_task_push(
            tenant_id=run.tenant_id, run_id=run.id, config_id=document["id"], actor=caller.actor
        )
    return outcome


async def create_push_config(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    config = a2a.PushConfigParams.model_validate(raw)
    if not config.task_id:
        raise a2a.invalid_params("taskId", "the task to push notifications of")
    run = await find_task(request, config.task_id, caller)
    return await store_push(request, caller, run, config, "url")


async def get_push_config(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    params = a2a.PushConfigRef.model_validate(raw)
    run = await find_task(request, params.task_id, caller)
    found = await state_of(request).webhooks.task_push(
        tenant_id=run.tenant_id, run_id=run.id, config_id=params.id
    )
    return push_document(request, found)


async def list_push_configs(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    params = a2a.ListPushConfigsParams.model_validate(raw)
    run = await find_task(request, params.task_id, caller)
    after = a2a.uuid_of(params.page_token) if params.page_token else None
    if params.page_token and after is None:
        raise a2a.invalid_params("pageToken", "not a page token this agent gave out")
    size = params.page_size or 100
    found = await state_of(request).webhooks.task_pushes(
        tenant_id=run.tenant_id, run_id=run.id, after=after, limit=size + 1
    )
    more = len(found) > size
    page = found[:size]
    return {
        "configs": [push_document(request, config) for config in page],
        "nextPageToken": str(page[-1].id) if more else "",
    }


async def delete_push_config(
    request: Request, caller: Caller, framing: Framing, raw: dict[str, Any]
) -> dict[str, Any]:
    params = a2a.PushConfigRef.model_validate(raw)
    run = await find_task(request, params.task_id, caller)
    await state_of(request).webhooks.delete_task_push(
        tenant_id=run.tenant_id, run_id=run.id, config_id=params.id, actor=caller.actor
    )
    return {}


HANDLERS: dict[str, Handler] = {
    "SendMessage": send_message,
    "SendStreamingMessage": send_streaming_message,
    "GetTask": get_task,
    "CancelTask": cancel_task,
    "ListTasks": list_tasks,
    "SubscribeToTask": subscribe_to_task,
    "CreateTaskPushNotificationConfig": create_push_config,
    "GetTaskPushNotificationConfig": get_push_config,
    "ListTaskPushNotificationConfigs": list_push_configs,
    "DeleteTaskPushNotificationConfig": delete_push_config,
    "GetExtendedAgentCard": get_extended_card,
}


# --- streams -----------------------------------------------------------------------------------
def sse(framing: Framing, item: dict[str, Any], event_id: int | None = None) -> bytes:
    """One StreamResponse as an SSE frame of a JSON-RPC result; a durable event's carries its
    sequence number, as `id:` and as `metadata.turnstile.eventId` (which the SDK shows)."""
    if event_id is not None:
        for value in item.values():
            value.setdefault("metadata", {}).setdefault("turnstile", {})["eventId"] = str(event_id)
    data = json.dumps(framing.wrap(item), ensure_ascii=False, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {data}\n\n".encode()


async def pending_stream(
    request: Request,
    turn: PendingTurn,
    caller: Caller,
    framing: Framing,
    after: int,
    slot: StreamSlot,
) -> AsyncIterator[bytes]:
    """A pending task's stream: the task as it stands (`submitted`), then, once it has started,
    its run's events after `after` (0: every one, from `run.created`; the run has the task's
    id) as `task_stream` follows a run. A task withdrawn first ends it `canceled`. What wakes
    the wait is its session's notifications (the promotion's, a withdrawal's event on the
    active run); a read a second is the safety net."""
    state = state_of(request)
    loop = asyncio.get_running_loop()
    yield sse(framing, {"task": task_document(turn)})
    last_sent = loop.time()
    found: Found = turn
    idle = asyncio.Event()  # nothing sets it: the inbox and the timeout wake the wait
    with state.live.following(session_id=turn.session_id) as inbox:
        while not state.shutdown.is_set() and not slot.ended.is_set():
            try:
                found = await find_task(request, str(turn.id), caller)
            except A2AError:
                return  # gone (its session deleted) or no longer visible: the stream ends
            if isinstance(found, Run):
                break
            if found.status != "pending":
                status = task_document(found, history_length=0)["status"]
                yield sse(
                    framing,
                    {
                        "statusUpdate": {
                            "taskId": str(found.id),
                            "contextId": str(found.session_id),
                            "status": status,
                        }
                    },
                )
                return
            if loop.time() - last_sent >= KEEPALIVE_SECONDS:
                yield KEEPALIVE_COMMENT
                last_sent = loop.time()
            await wait(inbox, idle, state.shutdown, POLL_RECHECK_SECONDS, slot)
            inbox.take()
    if isinstance(found, Run):
        async for frame in task_stream(request, found, caller, framing, after, slot, opening=False):
            yield frame


async def task_stream(
    request: Request,
    run: Run,
    caller: Caller,
    framing: Framing,
    after: int,
    slot: StreamSlot,
    *,
    opening: bool = True,
) -> AsyncIterator[bytes]:
    """The task as it stands (unless not `opening`: a pending task's stream said it), then its
    events after `after` and its live text, until it finishes or asks for input (or the key is
    revoked, or the server stops)."""
    state = state_of(request)
    loop = asyncio.get_running_loop()
    if opening:
        yield sse(framing, {"task": a2a.task_of(run)}, after)
    last_sent = loop.time()
    next_check = loop.time()
    known = DeltaFilter(run.id)
    streamed: dict[tuple[int, int], int] = {}  # live text sent, per (epoch, message)
    caught_up = False
    with (
        state.watch.watching(str(run.id)) as changed,
        state.live.following(run_id=run.id) as inbox,
    ):
        while not state.shutdown.is_set() and not slot.ended.is_set():
            if caught_up and inbox.ready.is_set():
                for delta in inbox.take():
                    if not known.news(delta):
                        continue
                    where = (delta.epoch, delta.message)
                    have = streamed.get(where, 0)
                    if delta.end <= have or delta.offset > have:
                        continue  # sent already, or a gap: the message's end brings it whole
                    piece = delta.text[have - delta.offset :]
                    streamed[where] = have + len(piece)
                    yield sse(
                        framing,
                        a2a.live_piece(run, delta.epoch, delta.message, piece, first=have == 0),
                    )
                    last_sent = loop.time()
            if changed.is_set() or loop.time() >= next_check:
                changed.clear()
                progress, events = await state.queue.watch_events(
                    run.id,
                    after=after,
                    limit=STREAM_PAGE,
                    tenant_id=visible_tenant(caller),
                    principal=visible_principal(caller),
                )
                if progress is None:
                    return  # deleted by retention meanwhile
                if any(e.type in ("run.succeeded", "run.failed", "run.waiting") for e in events):
                    run = await load_run(request, run.id, caller)  # its result or question
                for event in events:
                    known.saw(event)
                    items = a2a.stream_items(event, run)
                    for index, item in enumerate(items):
                        last = index == len(items) - 1
                        yield sse(framing, item, event.seq if last else None)
                    after = event.seq
                    last_sent = loop.time()
                if len(events) == STREAM_PAGE:
                    continue
                caught_up = True
                if progress.status in STOPPED and after >= progress.last_event_seq:
                    return
                next_check = loop.time() + recheck_seconds(
                    progress.status, progress.scheduled_for, active_seconds=STREAM_RECHECK_SECONDS
                )
            if loop.time() - last_sent >= KEEPALIVE_SECONDS:
                yield KEEPALIVE_COMMENT
                last_sent = loop.time()
            pause = min(next_check, last_sent + KEEPALIVE_SECONDS) - loop.time()
            await wait(inbox, changed, state.shutdown, pause, slot)


# --- problem+json under /a2a -------------------------------------------------------------------
class A2AErrors(ProblemRewrite):
    """Under `/a2a`, a problem+json answer (from the auth dependency, the body limit, a
    timeout) becomes a JSON-RPC error object with id null: HTTP 200, except a missing or bad
    key, which stays 401 with its `WWW-Authenticate`. Problems are small: the body is read
    whole."""

    def covers(self, path: str) -> bool:
        return path == RPC_PATH or path.startswith(REST_PATH + "/")

    async def answer(self, start: Message, raw: bytes, send: Send, path: str) -> None:
        await self._answer(start, raw, send, rest=path != RPC_PATH)

    @staticmethod
    async def _answer(start: Message, raw: bytes, send: Send, *, rest: bool) -> None:
        try:
            problem = json.loads(raw)
        except (ValueError, RecursionError):
            problem = {}
        if not isinstance(problem, dict):
            problem = {}
        slug = str(problem.get("type", "")).rsplit("/", 1)[-1] or "invalid-request"
        detail = str(problem.get("detail") or problem.get("title") or slug)
        status = int(start["status"])
        if status == 401:
            error = A2AError(a2a.INVALID_REQUEST, detail, "UNAUTHENTICATED")
            error.rpc_status = "UNAUTHENTICATED"  # google.rpc's code for it (HTTP+JSON)
        elif status == 429 or status >= 500:
            error = A2AError(a2a.INTERNAL_ERROR, detail, slug.upper().replace("-", "_"))
        elif slug == "malformed-json":
            error = A2AError(a2a.PARSE_ERROR, "Invalid JSON payload", "PARSE")
        else:
            error = A2AError(a2a.INVALID_REQUEST, detail, slug.upper().replace("-", "_"))
        if rest:  # the HTTP+JSON binding keeps the status (our 5xx too: a real fault)
            error.http_status = status
            body = json.dumps(error.status_object(), ensure_ascii=False).encode()
        else:
            body = json.dumps(a2a.rpc_error(None, error), ensure_ascii=False).encode()
        headers = [
            (name, value)
            for name, value in start.get("headers", [])
            if name.lower() not in (b"content-type", b"content-length")
        ]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send(
            {
                "type": "http.response.start",
                "status": status if rest or status == 401 else 200,
                "headers": headers,
            }
        )
        await send({"type": "http.response.body", "body": body})


def install(app: FastAPI) -> None:
    """The agent card, the JSON-RPC endpoint and its error shape."""
    app.include_router(router)
    app.add_middleware(A2AErrors)
