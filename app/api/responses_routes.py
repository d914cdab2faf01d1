"""The OpenAI Responses API at `/v1` (issue 35, first step): `POST /v1/responses` (background,
waited for, or streamed), `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, driven by
the official `openai` SDK unchanged (`OpenAI(base_url=".../v1", api_key=<turnstile key>)`).

A stream (`stream: true`) is this request's own: events numbered from 0, live text from the
run's deltas, not resumable yet (`starting_after`); the run goes on if the caller leaves, and
`GET /v1/responses/{id}` has its outcome.

A thin surface: the mapping is app/protocols/openai_responses.py; submissions, reads and cancel
are the core's, as for `POST /runs` (idempotency with `Idempotency-Key`, which a caller passes
with the SDK's `extra_headers`; tenancy; rate limits). Every error under `/v1` is answered in
OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) by `OpenAIErrors`, which
rewrites our problem+json answers there, so the SDK raises its own exceptions for them. The
routes stay out of our OpenAPI document: their contract is OpenAI's, not ours.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Path, Query, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.auth import CHALLENGE, CallerDep, submitter_of, visible_principal
from app.api.json_responses import FastJSONResponse
from app.api.problems import ApiProblem
from app.api.rate_limits import rate_limit_headers
from app.api.runs import load_run
from app.api.schemas import storable_json
from app.api.services import state_of
from app.api.sessions import (
    IdempotencyHeader,
    TraceparentHeader,
    idempotency_of,
    submitted_attributes,
)
from app.api.streams import HeldStream
from app.api.streams import wait as stream_wait
from app.api.watch import (
    POLL_RECHECK_SECONDS,
    StreamSlot,
    recheck_seconds,
    wait_for_change,
)
from app.observability import tracing
from app.protocols.openai_responses import (
    CreateResponse,
    error_body,
    final_text,
    response_document,
    run_id_of,
    run_input,
    unsupported_field,
)
from app.queue.submit import RunSpec
from app.security.api_keys import Caller
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import Run
from app.vocabulary.statuses import TERMINAL

router = APIRouter(prefix="/v1", tags=["openai"], include_in_schema=False)

# How long `background: false` holds the request for the run's end; a run still going then is
# answered as it is (`queued` or `in_progress`), for the caller to poll.
SYNC_WAIT_SECONDS = 60.0
# Where a response stops for its caller: finished, or asking the user.
STOPPED = {*TERMINAL, "waiting_for_user"}
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


def agent_of(model: str, agents: frozenset[str]) -> str:
    if model.startswith("openai:"):
        raise invalid(
            "model",
            "choosing the upstream model (openai:<model>) is not supported yet; use 'openai'",
        )
    if model not in agents:
        raise invalid(
            "model",
            f"unknown model {model!r}: it names a Turnstile agent ({', '.join(sorted(agents))})",
        )
    return model


async def visible_run(request: Request, response: str, caller: Caller) -> Run:
    run_id = run_id_of(response)
    if run_id is None:
        raise ApiProblem("not-found", f"no response {response!r}")
    return await load_run(request, run_id, caller)


async def until_stopped(request: Request, run: Run, caller: Caller) -> Run:
    """The run once it stops (finished or asking the user), or as it is after
    `SYNC_WAIT_SECONDS`; held as a long poll is (capped per key and per process)."""
    state = state_of(request)
    if run.status in STOPPED:
        return run
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SYNC_WAIT_SECONDS
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


async def stream_events(
    request: Request, run: Run, caller: Caller, slot: StreamSlot
) -> AsyncIterator[bytes]:
    """The response's events in the Responses vocabulary, numbered by `sequence_number` from
    0: `response.created`, `response.in_progress` once a worker has it, the output item's
    `response.output_text.delta` events from the run's live text, its `.done` events with the
    final text, then `response.completed` (or `response.failed`, `response.incomplete`)."""
    state = state_of(request)
    loop = asyncio.get_running_loop()
    numbers = itertools.count()
    item_id = f"msg_{run.id.hex}"
    sent = ""  # the text streamed so far
    source: tuple[int, int] | None = None  # the (epoch, message) whose text is streamed
    opened = in_progress = False

    def event(kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def open_item() -> list[bytes]:
        item = {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            event("response.output_item.added", output_index=0, item=item),
            event(
                "response.content_part.added",
                item_id=item_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def text_delta(text: str) -> bytes:
        return event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def running(run: Run) -> dict[str, Any]:
        return {**response_document(run, background=False), "status": "in_progress"}

    yield event("response.created", response=response_document(run, background=False))
    with (
        state.watch.watching(str(run.id)) as changed,
        state.live.following(run_id=run.id) as inbox,
    ):
        next_check = loop.time()
        while not state.shutdown.is_set() and not slot.ended.is_set():
            if inbox.ready.is_set():
                for delta in inbox.take():
                    if delta.run_id != run.id:
                        continue
                    # One message of one claim is streamed live: a re-run after a crash (a
                    # later epoch) would repeat the abandoned claim's text, and a later message
                    # is not a continuation. Their text comes whole with `.done`.
                    source = source or (delta.epoch, delta.message)
                    if (delta.epoch, delta.message) != source:
                        continue
                    if delta.end <= len(sent) or delta.offset > len(sent):
                        continue  # already sent, or a gap: `.done` carries the whole text
                    if not in_progress:  # a delta is proof enough that a worker has it
                        in_progress = True
                        yield event("response.in_progress", response=running(run))
                    if not opened:
                        opened = True
                        for frame in open_item():
                            yield frame
                    piece = delta.text[len(sent) - delta.offset :]
                    sent += piece
                    yield text_delta(piece)
            if changed.is_set() or loop.time() >= next_check:
                changed.clear()
                run = await load_run(request, run.id, caller)
                if run.status == "running" and not in_progress:
                    in_progress = True
                    yield event("response.in_progress", response=running(run))
                if run.status in STOPPED:
                    break
                next_check = loop.time() + recheck_seconds(
                    run.status, run.scheduled_for, active_seconds=POLL_RECHECK_SECONDS
                )
            await stream_wait(inbox, changed, state.shutdown, next_check - loop.time(), slot)
    if not in_progress and run.started_at is not None:
        yield event("response.in_progress", response=running(run))
    document = response_document(run, background=False)
    final = final_text(run.result) if run.status == "succeeded" else None
    if final is not None:
        if not opened:
            for frame in open_item():
                yield frame
        if final.startswith(sent) and len(final) > len(sent):
            yield text_delta(final[len(sent) :])
        part = {"type": "output_text", "text": final, "annotations": [], "logprobs": []}
        yield event(
            "response.output_text.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            text=final,
            logprobs=[],
        )
        yield event(
            "response.content_part.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part=part,
        )
        yield event("response.output_item.done", output_index=0, item=document["output"][0])
    kind = {
        "completed": "response.completed",
        "failed": "response.failed",
        "incomplete": "response.incomplete",
    }.get(document["status"], "response.failed")
    yield event(kind, response=document)


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
    agent = agent_of(body.model, state.agents)
    values = run_input(body)
    try:
        storable_json(values)
    except ValueError as exc:
        raise invalid("input", str(exc)) from None
    background = bool(body.background)
    # A caller who waits for the answer is interactive; a background one is back-end work.
    priority = None if background else PriorityClass.INTERACTIVE
    # A stream's place is taken first, so a refusal (429) writes nothing.
    slot = state.streams.acquire(caller.key_id, caller.tenant_id) if body.stream else None
    try:
        with tracing.submission("run", traceparent) as span:
            outcome = await state.submissions.submit_run(
                submitter_of(caller),
                RunSpec(input=values, agent=agent, priority=priority, traceparent=span.traceparent),
                await idempotency_of(request, idempotency_key),
            )
            span.set(submitted_attributes(outcome))
        run = await load_run(request, outcome.run_id, caller)
    except BaseException:
        if slot is not None:
            slot.release()
        raise
    if slot is not None:
        return HeldStream(slot, stream_events(request, run, caller, slot))
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
) -> Any:
    if stream:
        raise ApiProblem(
            "invalid-request",
            "stream: streaming a response is not supported yet; poll it instead",
            errors=[{"loc": ["query", "stream"], "msg": "not supported", "type": "unsupported"}],
        )
    run = await visible_run(request, response_id, caller)
    return FastJSONResponse(response_document(run))


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


class OpenAIErrors:
    """Under `/v1`, every problem+json answer (from a handler, the auth dependency, validation,
    the body limit, an unknown route) becomes OpenAI's error shape, its headers (Retry-After,
    WWW-Authenticate, RateLimit) kept. Problems are small, so the body is read whole."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != "/v1" and not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def sending(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if content_type.startswith(b"application/problem+json"):
                    start = message
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._answer(start, b"".join(chunks), send)
                return
            await send(message)

        await self.app(scope, receive, sending)

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
