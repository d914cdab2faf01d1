"""Runs: sessionless submission, reading a run (ETag, long poll), its events (JSON or
Server-Sent Events), and cancel. The operator runbook is app/api/runbook.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.api.auth import CallerDep, submitter_of, visible_principal, visible_tenant
from app.api.json_responses import FastJSONResponse
from app.api.problems import ApiProblem, responses
from app.api.schemas import (
    EventPage,
    RunDocument,
    RunRequest,
)
from app.api.services import state_of
from app.api.sessions import (
    IdempotencyHeader,
    TraceparentHeader,
    idempotency_of,
    spec_from,
    submitted_attributes,
    submitted_response,
)
from app.api.watch import (
    POLL_RECHECK_SECONDS,
    STREAM_RECHECK_SECONDS,
    StreamSlot,
    recheck_seconds,
    wait_for_change,
)
from app.observability import tracing
from app.queue.core import Queue
from app.queue.errors import RunNotFoundError
from app.queue.models import Run
from app.queue.statuses import TERMINAL, RunStatus
from app.security.api_keys import Caller

router = APIRouter(tags=["runs"])

MAX_WAIT_SECONDS = 60.0
KEEPALIVE_SECONDS = 15.0  # proxies close connections that stay silent much longer
STREAM_PAGE = 500
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
        ),
        202: {"headers": {"Location": {"schema": {"type": "string"}}}},
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
            state.streams.acquire(caller.key_id),
            state.watch.watching(str(run_id)) as changed,
        ):
            # Watch first, then read: a change between the two is never missed.
            run = await load_run(request, run_id, caller)
            while (
                run.status == known
                and run.status not in TERMINAL
                and not state.shutdown.is_set()
                and (remaining := deadline - loop.time()) > 0
            ):
                pause = recheck_seconds(
                    run.status, run.scheduled_for, active_seconds=POLL_RECHECK_SECONDS
                )
                await wait_for_change(changed, state.shutdown, min(pause, remaining))
                changed.clear()  # cleared before the read below, so a later change wakes us
                run = await load_run(request, run_id, caller)
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
        "`after`, that ends after the run's terminal event. Event streams and long polls are "
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
        slot = state.streams.acquire(caller.key_id)
        return HeldStream(
            slot,
            stream_events(request, run_id, caller, start),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    events = await state.queue.events(run_id, after=after, limit=limit)
    return EventPage(
        events=[e.__dict__ for e in events],
        last_seq=events[-1].seq if events else after,
        finished=run.status in TERMINAL and (not events or events[-1].seq >= run.last_event_seq),
    )


class HeldStream(StreamingResponse):
    """A streaming response that gives its place back however it ends: finished, client gone,
    server stopping, or never started (the place is taken before the response exists)."""

    def __init__(self, slot: StreamSlot, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()


async def stream_events(
    request: Request, run_id: UUID, caller: Caller, after: int
) -> AsyncIterator[str]:
    """The run's events as Server-Sent Events. Each recheck is one statement (where the run
    stands and what is new), run when a notification wakes the stream or its recheck is due
    (`recheck_seconds`); keep-alive comments in between cost the database nothing."""
    state = state_of(request)
    loop = asyncio.get_running_loop()
    last_sent = loop.time()
    next_check = loop.time()  # at once: the first page
    with state.watch.watching(str(run_id)) as changed:
        while not state.shutdown.is_set():
            if changed.is_set() or loop.time() >= next_check:
                changed.clear()  # before the read, so a change during it wakes us again
                progress, events = await state.queue.watch_events(
                    run_id,
                    after=after,
                    limit=STREAM_PAGE,
                    tenant_id=visible_tenant(caller),
                    principal=visible_principal(caller),
                )
                if progress is None:
                    return  # deleted by retention meanwhile
                for event in events:
                    data = json.dumps(
                        {
                            "seq": event.seq,
                            "type": event.type,
                            "epoch": event.epoch,
                            "data": event.data,
                            "created_at": event.created_at.isoformat(),
                        }
                    )
                    yield f"id: {event.seq}\nevent: {event.type}\ndata: {data}\n\n"
                    after = event.seq
                    last_sent = loop.time()
                if len(events) == STREAM_PAGE:
                    continue  # more are waiting: next page at once
                if progress.status in TERMINAL and after >= progress.last_event_seq:
                    return
                next_check = loop.time() + recheck_seconds(
                    progress.status,
                    progress.scheduled_for,
                    active_seconds=STREAM_RECHECK_SECONDS,
                )
            if loop.time() - last_sent >= KEEPALIVE_SECONDS:
                yield ": keep-alive\n\n"
                last_sent = loop.time()
            pause = min(next_check, last_sent + KEEPALIVE_SECONDS) - loop.time()
            await wait_for_change(changed, state.shutdown, max(pause, 0.0))


@router.post(
    "/runs/{run_id}/cancel",
    response_model=RunDocument,
    summary="Cancel a run from any non-terminal status (a cancelled run answers 200 again)",
    responses=responses("unauthorized", "not-found", "run-finished", "invalid-request"),
)
async def cancel(run_id: UUID, request: Request, caller: CallerDep) -> Any:
    state = state_of(request)
    outcome = await state.queue.cancel(
        run_id,
        actor=caller.actor,
        reason="cancelled through the API",
        # Actions stay within the key's own tenant, admin keys included: the admin scope
        # widens what a key can see, not what it can change. A key without a scope cancels
        # only its own principal's runs.
        tenant_id=caller.tenant_id,
        principal=visible_principal(caller),
    )
    if outcome.changed:
        tracing.mark("turnstile.cancel", outcome.run.traceparent, {"turnstile.run.id": str(run_id)})
    return outcome.run.to_document()
