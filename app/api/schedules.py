"""Schedules over HTTP: create, list, show (next fire times and latest runs), pause, resume,
delete, and a schedule's runs. Operator scope; a schedule belongs to its creator's tenant, and
another tenant's is not found. Admin keys see every tenant's but act only on their own. The
rules (one run per tick, catch-up, daylight saving) are the core's: app/queue/scheduling.py."""

from __future__ import annotations

from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from app.api.auth import OperatorDep, visible_tenant
from app.api.problems import ApiProblem, responses
from app.api.schemas import (
    RunPage,
    ScheduleDeleted,
    ScheduleDetailDocument,
    ScheduleDocument,
    SchedulePageDocument,
    ScheduleRequest,
    run_page_document,
)
from app.api.services import state_of
from app.api.sessions import IdempotencyHeader, idempotency_of
from app.queue.scheduling import NewSchedule
from app.runtime.agents import unknown_agent

router = APIRouter(tags=["schedules"])


@router.post(
    "/schedules",
    status_code=201,
    response_model=ScheduleDocument,
    summary="Create a schedule: one sessionless run per tick of a cron expression",
    description=(
        "Exactly one run per tick, whatever the number of processes: the next tick is queued "
        "ahead (`scheduled_for` = its fire time) and unique in the database. After downtime a "
        "schedule fires once for the ticks it missed, not once per missed tick. A bad `cron` "
        "or `timezone` is 422 naming the field, as is one firing more often than the tenant's "
        "minimum interval (TURNSTILE_SCHEDULE_MIN_INTERVAL_SECONDS); a tenant at its cap of "
        "schedules gets 409 limit-reached. With `Idempotency-Key`, a retry of the same "
        "request replays the first answer (`Idempotent-Replayed: true`), never a second schedule."
    ),
    responses={
        **responses(
            "unauthorized",
            "forbidden",
            "invalid-request",
            "malformed-json",
            "body-too-large",
            "request-timeout",
            "idempotency-key-reused",
            "idempotency-key-in-flight",
            "limit-reached",
        ),
        201: {"headers": {"Location": {"schema": {"type": "string"}}}},
    },
)
async def create_schedule(
    body: ScheduleRequest,
    request: Request,
    caller: OperatorDep,
    idempotency_key: IdempotencyHeader = None,
) -> Any:
    state = state_of(request)
    agent = body.agent or state.settings.default_agent
    if agent not in state.agents:
        raise ApiProblem(
            "invalid-request",
            f"body.agent: {unknown_agent(agent, state.agents)}",
            errors=[{"loc": ["body", "agent"], "msg": "unknown agent", "type": "unknown_agent"}],
        )
    new = NewSchedule(
        tenant_id=caller.tenant_id,
        principal=caller.principal,
        cron=body.cron,
        timezone=body.timezone,
        agent=agent,
        input=body.input,
        priority=body.class_.base,
    )
    idempotency = await idempotency_of(request, idempotency_key)
    if idempotency is None:
        document = (await state.schedules.create(new)).to_document()
        replayed = False
    else:
        document, replayed = await state.schedules.create_once(new, idempotency)
    headers = {"Location": f"/schedules/{document['id']}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(document, status_code=201, headers=headers)


@router.get(
    "/schedules",
    response_model=SchedulePageDocument,
    summary="Schedules, newest first",
    responses=responses("unauthorized", "forbidden", "invalid-request"),
)
async def list_schedules(
    request: Request,
    caller: OperatorDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> Any:
    page = await state_of(request).schedules.page(
        tenant_id=visible_tenant(caller), cursor=cursor, limit=limit
    )
    return SchedulePageDocument(
        schedules=[ScheduleDocument.model_validate(s.to_document()) for s in page.schedules],
        next_cursor=page.next_cursor,
    )


@router.get(
    "/schedules/{schedule_id}",
    response_model=ScheduleDetailDocument,
    summary="A schedule, its next fire times and its latest runs",
    responses=responses("unauthorized", "forbidden", "not-found", "invalid-request"),
)
async def get_schedule(schedule_id: UUID, request: Request, caller: OperatorDep) -> Any:
    detail = await state_of(request).schedules.detail(schedule_id, tenant_id=visible_tenant(caller))
    return {
        **detail.schedule.to_document(),
        "next_fire_times": [t.isoformat() for t in detail.next_fire_times],
        "runs": [run.to_document() for run in detail.runs],
    }


@router.get(
    "/schedules/{schedule_id}/runs",
    response_model=RunPage,
    summary="A schedule's runs, newest fire time first",
    responses=responses("unauthorized", "forbidden", "not-found", "invalid-request"),
)
async def schedule_runs(
    schedule_id: UUID,
    request: Request,
    caller: OperatorDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> Any:
    page = await state_of(request).schedules.runs_page(
        schedule_id, tenant_id=visible_tenant(caller), cursor=cursor, limit=limit
    )
    return run_page_document(page)


@router.post(
    "/schedules/{schedule_id}/pause",
    response_model=ScheduleDocument,
    summary="Pause: no more ticks; the tick queued ahead is removed (a paused one answers 200)",
    responses=responses("unauthorized", "forbidden", "not-found", "invalid-request"),
)
async def pause_schedule(schedule_id: UUID, request: Request, caller: OperatorDep) -> Any:
    # Actions stay within the key's own tenant, admin keys included.
    schedule = await state_of(request).schedules.pause(schedule_id, tenant_id=caller.tenant_id)
    return schedule.to_document()


@router.post(
    "/schedules/{schedule_id}/resume",
    response_model=ScheduleDocument,
    summary="Resume from now on: ticks skipped while paused never fire (an active one: 200)",
    responses=responses("unauthorized", "forbidden", "not-found", "invalid-request"),
)
async def resume_schedule(schedule_id: UUID, request: Request, caller: OperatorDep) -> Any:
    schedule = await state_of(request).schedules.resume(schedule_id, tenant_id=caller.tenant_id)
    return schedule.to_document()


@router.delete(
    "/schedules/{schedule_id}",
    response_model=ScheduleDeleted,
    summary="Delete a schedule and its ticks not started yet; started runs go on",
    responses=responses("unauthorized", "forbidden", "not-found", "invalid-request"),
)
async def delete_schedule(schedule_id: UUID, request: Request, caller: OperatorDep) -> Any:
    dropped = await state_of(request).schedules.delete(schedule_id, tenant_id=caller.tenant_id)
    return ScheduleDeleted(id=schedule_id, dropped_runs=dropped)
