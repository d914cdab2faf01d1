"""The OpenAI Responses API at `/v1` (issue 35): `POST /v1/responses` (background, waited for,
or streamed; alone, or a turn of a conversation), `GET /v1/responses/{id}` (or its stream),
`POST /v1/responses/{id}/cancel`, `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items`, driven by the official `openai` SDK unchanged
(`OpenAI(base_url=".../v1", api_key=<turnstile key>)`). The conversations are
app/api/conversation_routes.py; the whole mapping is docs/responses-api.md.

`previous_response_id` continues the session of the response it names (its conversation's,
or the chain a stored response of its own started: `placement_of`), from its latest response
only, since a session's history has no branches; `store: false` makes a sessionless run that
nothing continues.

A stream (`stream: true`) is resumable: `GET /v1/responses/{id}?stream=true&starting_after=N`
sends the same events numbered after N (app/api/responses_stream.py); the run goes on if the
caller leaves, and `GET /v1/responses/{id}` has its outcome.

A thin surface: the mapping is app/protocols/openai_responses.py; submissions, reads and cancel
are the core's, as for `POST /runs` (idempotency with `Idempotency-Key`, which a caller passes
with the SDK's `extra_headers`; tenancy; rate limits). Every error under `/v1` is answered in
OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) by `OpenAIErrors`, which
rewrites our problem+json answers there, so the SDK raises its own exceptions for them. The
routes stay out of our OpenAPI document: their contract is OpenAI's, not ours.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from uuid import UUID

from fastapi import APIRouter, FastAPI, Path, Query, Request
from starlette.types import Message, Send

from app.api.auth import CHALLENGE, CallerDep, submitter_of, visible_principal
from app.api.json_responses import FastJSONResponse
from app.api.problem_rewrite import ProblemRewrite
from app.api.problems import ApiProblem
from app.api.rate_limits import rate_limit_headers
from app.api.responses_stream import STOPPED, stream_events
from app.api.runs import load_run
from app.api.schemas import storable_json
from app.api.services import state_of
from app.api.sessions import (
    IdempotencyHeader,
    TraceparentHeader,
    idempotency_of,
    submitted_attributes,
    visible_session,
)
from app.api.streams import HeldStream
from app.api.watch import (
    POLL_RECHECK_SECONDS,
    recheck_seconds,
    wait_for_change,
)
from app.observability import tracing
from app.protocols.openai_conversations import conversation_id, session_id_of
from app.protocols.openai_responses import (
    CHAIN,
    NOT_STORED,
    CreateResponse,
    approval_request_id,
    approval_responses,
    call_id,
    call_outputs,
    conversation_of,
    error_body,
    input_items,
    list_page,
    response_document,
    response_id,
    run_id_of,
    run_input,
    unsupported_field,
)
from app.queue.approvals import ApprovalAnswer
from app.queue.errors import RunNotFoundError, SessionNotFoundError, TurnstileError
from app.queue.submit import IdempotencyKey, RunSpec, Submitted
from app.security.api_keys import Caller
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Run

router = APIRouter(prefix="/v1", tags=["openai"], include_in_schema=False)

# How long `background: false` holds the request for the run's end; a run still going then is
# answered as it is (`queued` or `in_progress`), for the caller to poll.
SYNC_WAIT_SECONDS = 60.0
MAX_SEQUENCE = 2**62  # beyond any number a stream gives (app/protocols: block_base)
ResponseId = Annotated[str, Path(max_length=100)]

# Our problem statuses that OpenAI's API answers differently: bad input is 400 there, and a
# cancel of a finished response too (a 409 would also make the SDK retry it).
STATUS_UNDER_V1 = {"invalid-request": 400, "run-finished": 400}


def invalid(param: str, message: str) -> ApiProblem:
    return ApiProblem(
        "invalid-request",
        f"{param}: {message}",
        errors=[{"loc": ["body", param], "msg": message, "type": "invalid_value"}],
    )


def agent_of(model: str, agents: frozenset[str]) -> tuple[str, str | None]:
    """The Turnstile agent `model` names, and the upstream model it chooses: `openai:<model>`
    is the `openai` agent asking `<model>` instead of its configured one."""
    agent, colon, upstream = model.partition(":")
    if agent not in agents:
        raise invalid(
            "model",
            f"unknown model {model!r}: it names a Turnstile agent ({', '.join(sorted(agents))})",
        )
    if not colon:
        return agent, None
    if agent != "openai":
        raise invalid("model", f"only the openai agent takes an upstream model, not {agent!r}")
    if not upstream.strip() or not upstream.isprintable():
        raise invalid("model", "openai:<model> needs the upstream model's name after the colon")
    return agent, upstream


async def visible_run(request: Request, response: str, caller: Caller) -> Run:
    run_id = run_id_of(response)
    if run_id is None:
        raise ApiProblem("not-found", f"no response {response!r}")
    return await load_run(request, run_id, caller)


async def until_stopped(
    request: Request, run: Run, caller: Caller, *, seconds: float = SYNC_WAIT_SECONDS
) -> Run:
    """The run once it stops (finished or asking the user), or as it is after `seconds`
    (`SYNC_WAIT_SECONDS`); held as a long poll is (capped per key and per process)."""
    state = state_of(request)
    if run.status in STOPPED:
        return run
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    with (
        state.streams.acquire(caller.key_id, caller.tenant_id) as slot,
        state.watch.watching(str(run.id)) as changed,
    ):
        run = await load_run(request, run.id, caller)  # watch first, then read
        while (
            run.status not in STOPPED
            and not state.shutdown.is_set()
            and not slot.ended.is_set()
            and (remaining := deadline - loop.time()) > 0
        ):
            pause = recheck_seconds(
                run.status, run.scheduled_for, active_seconds=POLL_RECHECK_SECONDS
            )
            await wait_for_change(changed, state.shutdown, min(pause, remaining), slot.ended)
            changed.clear()
            if slot.ended.is_set():
                raise ApiProblem(
                    "unauthorized",
                    "the API key was revoked while this request waited",
                    headers=CHALLENGE,
                )
            run = await load_run(request, run.id, caller)
    return run


@dataclass(frozen=True)
class Placement:
    """Where a create's run goes: the session it is a turn of (None: a sessionless run, or,
    with `new_chain`, a session made for it), whether that session is a chain of responses
    (no conversation: `previous_response_id` continues it) and whether the create answers the
    run waiting there (it takes that run's class then)."""

    session_id: UUID | None
    chain: bool
    new_chain: bool = False
    answers: bool = False


NOT_FORKABLE = (
    "that response is not the latest of its {what}: OpenAI's API would branch a new history "
    "from it, but Turnstile keeps one history per session, turn after turn, with no branches; "
    "continue from the latest response ({latest}), or start a new one without "
    "previous_response_id"
)


async def placement_of(request: Request, body: CreateResponse, caller: Caller) -> Placement:
    """The session a create goes to: its `conversation`'s; or that of its
    `previous_response_id`, which must be its session's latest response (a session's history
    has no branches); or, for a response of its own stored (`store` left out or true), a
    session of its own, the first turn of a chain; `store: false` is a sessionless run."""
    conversation = conversation_of(body)
    if conversation is not None and body.previous_response_id is not None:
        raise invalid(
            "previous_response_id", "give either conversation or previous_response_id, not both"
        )
    if body.store is False and (conversation is not None or body.previous_response_id):
        raise invalid(
            "store",
            "store=false: a response of a conversation, or one continuing another with "
            "previous_response_id, is kept in its session's history; leave store out (or true)",
        )
    if conversation is not None:
        session_id = session_id_of(conversation)
        if session_id is None:
            raise ApiProblem("not-found", f"no conversation {conversation!r}")
        try:
            await visible_session(request, session_id, caller)
        except SessionNotFoundError:
            raise ApiProblem("not-found", f"no conversation {conversation!r}") from None
        return Placement(session_id, chain=False)
    if body.previous_response_id is None:
        if body.store is False:
            return Placement(None, chain=False)
        return Placement(None, chain=True, new_chain=True)
    try:
        previous = await visible_run(request, body.previous_response_id, caller)
    except (ApiProblem, RunNotFoundError):  # both mean not found (or not the caller's)
        message = f"no response {body.previous_response_id!r}"
        raise ApiProblem(
            "not-found",
            message,
            errors=[{"loc": ["body", "previous_response_id"], "msg": message, "type": "missing"}],
        ) from None
    values = previous.input if isinstance(previous.input, dict) else {}
    if previous.session_id is None:
        raise invalid(
            "previous_response_id",
            "that response was created with store=false, so it keeps no history to continue"
            if values.get(NOT_STORED) is True
            else "that response is a run outside any session (not created through this API "
            "with store): it keeps no history to continue",
        )
    chain = values.get(CHAIN) is True
    page = await state_of(request).reads.session_runs_page(
        previous.session_id, cursor=None, limit=1
    )
    if page.runs and page.runs[0].id != previous.id:
        raise invalid(
            "previous_response_id",
            NOT_FORKABLE.format(
                what="chain of responses" if chain else "conversation",
                latest=response_id(page.runs[0].id),
            ),
        )
    return Placement(
        previous.session_id, chain=chain, answers=previous.status == "waiting_for_user"
    )


async def check_answer(
    request: Request, body: CreateResponse, session_id: UUID | None, caller: Caller
) -> ApprovalAnswer | None:
    """A `function_call_output` answers the question the conversation's run is waiting on, an
    `mcp_approval_response` the tool call it waits to have approved: the id it names must be
    that wait's (checked here; the core delivers it, and takes its locks before it decides, so
    a wait answered meanwhile is still refused there). An approval's decision is returned, for
    the core's approval path (docs/approvals.md)."""
    outputs = call_outputs(body)
    decisions = approval_responses(body)
    if not outputs and not decisions:
        return None
    kind = "mcp_approval_response" if decisions else "function_call_output"
    if session_id is None:
        raise invalid("input", f"a {kind} answers a response of a conversation: pass it")
    if decisions and (
        len(decisions) > 1 or not isinstance(body.input, list) or len(body.input) > 1
    ):
        # A run waits for one call at a time, and a decision carries no message: a user's text
        # beside it would be dropped unseen (a rejection's words go in its `reason`).
        raise invalid(
            "input",
            "an mcp_approval_response comes alone: one decision on the one call waiting "
            "(say why in its reason)",
        )
    session = await visible_session(request, session_id, caller)
    run = None
    if session.active_status == "waiting_for_user" and session.active_run_id is not None:
        run = await load_run(request, session.active_run_id, caller)
    pending = run.approval_request if run is not None else None
    if decisions:
        [decision] = decisions
        expected = (
            approval_request_id(run.id, run.inputs_count)
            if run is not None and isinstance(pending, dict)
            else None
        )
        if decision.approval_request_id != expected or not isinstance(pending, dict):
            raise invalid(
                "input",
                f"no approval request {decision.approval_request_id!r} is waiting in this "
                "conversation" + (f" (the waiting one is {expected!r})" if expected else ""),
            )
        return ApprovalAnswer(
            call_id=str(pending.get("call_id")),
            decision="approve" if decision.approve else "reject",
            reason=decision.reason,
        )
    if run is not None and isinstance(pending, dict):
        raise invalid(
            "input",
            f"the waiting response asks for the approval of a {pending.get('tool')} call, not "
            "an answer: send an mcp_approval_response naming "
            f"{approval_request_id(run.id, run.inputs_count)!r}",
        )
    waiting = call_id(run.id, run.inputs_count) if run is not None else None
    given = outputs[-1].call_id
    if given != waiting:
        raise invalid(
            "input",
            f"no question with call_id {given!r} is waiting in this conversation"
            + (f" (the waiting one is {waiting!r})" if waiting else ""),
        )
    return None


def priority_of(place: Placement, background: bool) -> PriorityClass | None:
    """A caller who waits for the answer is interactive; a background one is back-end work.
    A turn of a conversation is interactive, as every session's turn is (None: the turn's
    default); a chain's turns keep the class a response of its own has; an answer takes its
    run's (None: given no class, it conflicts with none)."""
    if place.answers or (background and not place.chain):
        return None
    return PriorityClass.ASYNC if background else PriorityClass.INTERACTIVE


async def submit(
    request: Request,
    caller: Caller,
    place: Placement,
    spec: RunSpec,
    idempotency: IdempotencyKey | None,
) -> Submitted:
    """The run, where `place` says. A chain's first response makes its session first, as an
    A2A message with no context does (its caller looked for a stored outcome of its key
    before): a refused submission, or a twin with the same key that won meanwhile, removes the
    session made for it again, so nothing is left behind."""
    state = state_of(request)
    who = submitter_of(caller)
    if place.session_id is None and not place.new_chain:
        return await state.submissions.submit_run(who, spec, idempotency)
    session_id = place.session_id
    made = None
    if session_id is None:
        made = await state.reads.create_session(
            tenant_id=caller.tenant_id, principal=caller.principal
        )
        session_id = made.id
    try:
        # A busy conversation is refused whatever the session's multitask policy: a pending
        # turn has no Responses API shape yet (docs/responses-api.md).
        outcome = await state.submissions.submit_turn(
            who, session_id, spec, idempotency, multitask="reject"
        )
    except TurnstileError:
        if made is not None:
            await state.reads.discard_empty_session(made.id, tenant_id=caller.tenant_id)
        raise
    if made is not None and outcome.replayed:
        # A twin of this create won meanwhile: its response, in its session; ours goes.
        await state.reads.discard_empty_session(made.id, tenant_id=caller.tenant_id)
    state.live.session_changed(session_id)
    return outcome


@router.post("/responses")
async def create_response(
    body: CreateResponse,
    request: Request,
    caller: CallerDep,
    idempotency_key: IdempotencyHeader = None,
    traceparent: TraceparentHeader = None,
) -> Any:
    state = state_of(request)
    unsupported = unsupported_field(body)
    if unsupported is not None:
        raise invalid(unsupported, "not supported yet by Turnstile's Responses API")
    agent, upstream = agent_of(body.model, state.agents)
    values = run_input(body)
    if upstream is not None:
        values["upstream_model"] = upstream  # the openai agent's model for this run
    try:
        storable_json(values)
    except ValueError as exc:
        raise invalid("input", str(exc)) from None
    background = bool(body.background)
    idempotency = await idempotency_of(request, idempotency_key)
    # A create sent again with its key is answered from what the first one stored before its
    # place is looked at again: the first has moved its chain on since (its previous response
    # is no longer the latest), or answered the question it names.
    replay = None
    if idempotency is not None:
        replay = await state.submissions.stored_outcome(submitter_of(caller), idempotency)
    place = Placement(None, chain=False)
    approval = None
    if replay is None:
        place = await placement_of(request, body, caller)
        approval = await check_answer(request, body, place.session_id, caller)
        if place.chain:
            values[CHAIN] = True
        if body.store is False:
            values[NOT_STORED] = True
    # A stream's place is taken first, so a refusal (429) writes nothing.
    slot = state.streams.acquire(caller.key_id, caller.tenant_id) if body.stream else None
    try:
        if replay is not None:
            outcome = replay
        elif approval is not None and place.session_id is not None:
            # The decision on the call the run waits for: the same run resumes (or is told the
            # call was refused), the same response answers, as a question's answer does.
            with tracing.submission("turn", traceparent) as span:
                outcome = await state.submissions.approvals.answer(
                    submitter_of(caller),
                    place.session_id,
                    approval,
                    idempotency,
                    traceparent=span.traceparent,
                )
                span.set(submitted_attributes(outcome))
            state.live.session_changed(place.session_id)
        else:
            kind = "run" if place.session_id is None and not place.new_chain else "turn"
            with tracing.submission(kind, traceparent) as span:
                spec = RunSpec(
                    input=values,
                    agent=agent,
                    priority=priority_of(place, background),
                    traceparent=span.traceparent,
                )
                outcome = await submit(request, caller, place, spec, idempotency)
                span.set(submitted_attributes(outcome))
        run = await load_run(request, outcome.run_id, caller)
    except BaseException:
        if slot is not None:
            slot.release()
        raise
    if slot is not None:
        return HeldStream(slot, stream_events(request, run, caller, slot, background=background))
    if not background:
        run = await until_stopped(request, run, caller)
    headers = rate_limit_headers(outcome.allowance)
    if outcome.replayed:
        headers["Idempotent-Replayed"] = "true"
    return FastJSONResponse(response_document(run, background=background), headers=headers)


@router.get("/responses/{response_id}")
async def get_response(
    response_id: ResponseId,
    request: Request,
    caller: CallerDep,
    stream: Annotated[bool, Query()] = False,
    starting_after: Annotated[int | None, Query(ge=0, le=MAX_SEQUENCE)] = None,
) -> Any:
    """The response; with `stream=true`, its events (from the first, or after
    `starting_after`), in the same numbering as the stream its create sent."""
    run = await visible_run(request, response_id, caller)
    if not stream:
        return FastJSONResponse(response_document(run))
    slot = state_of(request).streams.acquire(caller.key_id, caller.tenant_id)
    return HeldStream(slot, stream_events(request, run, caller, slot, after=starting_after))


@router.delete("/responses/{response_id}")
async def delete_response(response_id: ResponseId, request: Request, caller: CallerDep) -> Any:
    """A finished response outside a conversation is deleted with its run; one still going
    is cancelled first, and one of a conversation goes with its conversation."""
    run = await visible_run(request, response_id, caller)
    values = run.input if isinstance(run.input, dict) else {}
    reads = state_of(request).reads
    whole = f"DELETE /v1/conversations/{conversation_id(run.session_id)}" if run.session_id else ""
    if run.session_id is not None and values.get(CHAIN) is not True:
        raise invalid(
            "response_id",
            f"this response is part of a conversation: delete the conversation instead ({whole})",
        )
    if run.session_id is not None:
        # A chain's response goes with its session while it is the chain's only one; a
        # longer chain's history is kept whole.
        deleted = await reads.delete_idle_session(
            run.session_id,
            tenant_id=caller.tenant_id,
            principal=visible_principal(caller),
            only_run=run.id,
        )
        if deleted == "in_session":
            raise invalid(
                "response_id",
                "this response is one of a chain continued with previous_response_id, and "
                f"Turnstile keeps a chain's history whole: delete the whole chain ({whole})",
            )
    else:
        deleted = await reads.delete_finished_run(
            run.id, tenant_id=caller.tenant_id, principal=visible_principal(caller)
        )
    if deleted == "missing":
        raise ApiProblem("not-found", f"no response {response_id!r}")
    if deleted == "active":
        raise invalid("response_id", "this response is still going: cancel it first")
    if deleted == "dead_letter":
        raise invalid(
            "response_id",
            "this response failed and is in the dead letter: an operator dismisses it first",
        )
    if deleted == "in_session":
        raise invalid("response_id", "this response is part of a conversation")
    return FastJSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: ResponseId,
    request: Request,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    after: Annotated[str | None, Query(max_length=100)] = None,
) -> Any:
    run = await visible_run(request, response_id, caller)
    return FastJSONResponse(list_page(input_items(run), order=order, after=after, limit=limit))


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: ResponseId, request: Request, caller: CallerDep) -> Any:
    run = await visible_run(request, response_id, caller)
    outcome = await state_of(request).queue.cancel(
        run.id,
        actor=caller.actor,
        reason="cancelled through the OpenAI Responses API",
        tenant_id=caller.tenant_id,
        principal=visible_principal(caller),
    )
    if outcome.changed:
        tracing.mark("turnstile.cancel", outcome.run.traceparent, {"turnstile.run.id": str(run.id)})
    return FastJSONResponse(response_document(outcome.run))


class OpenAIErrors(ProblemRewrite):
    """Under `/v1`, every problem+json answer (from a handler, the auth dependency, validation,
    the body limit, an unknown route) becomes OpenAI's error shape, its headers (Retry-After,
    WWW-Authenticate, RateLimit) kept. Problems are small, so the body is read whole."""

    def covers(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/")

    async def answer(self, start: Message, raw: bytes, send: Send, path: str) -> None:
        await self._answer(start, raw, send)

    @staticmethod
    async def _answer(start: Message, raw: bytes, send: Send) -> None:
        try:
            problem = json.loads(raw)
        except ValueError:
            problem = {}
        if not isinstance(problem, dict):
            problem = {}
        slug = str(problem.get("type", "")).rsplit("/", 1)[-1]
        status = STATUS_UNDER_V1.get(slug, int(start["status"]))
        body = json.dumps(error_body(status, problem), ensure_ascii=False).encode()
        headers = [
            (name, value)
            for name, value in start.get("headers", [])
            if name.lower() not in (b"content-type", b"content-length")
        ]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def install(app: FastAPI) -> None:
    """The `/v1` routes and their error shape."""
    app.include_router(router)
    app.add_middleware(OpenAIErrors)
