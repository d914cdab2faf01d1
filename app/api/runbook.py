"""The operator runbook over HTTP: queue depth, stuck runs, the dead letter, resubmit and
dismiss. Operator keys see and act on their tenant; admin keys see the whole queue but act only
on their own tenant. Reads are the queue's read models; actions the core's submissions."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Query, Request

from app.api.auth import OperatorDep, submitter_of, visible_tenant
from app.api.budgets import budgets_of
from app.api.problems import responses
from app.api.schemas import (
    ClassDepth,
    QueueStats,
    RunDocument,
    RunPage,
    StuckRun,
    StuckRuns,
    TenantClassCounts,
    TenantDepth,
    run_document,
    run_page_document,
)
from app.api.services import state_of
from app.api.sessions import IdempotencyHeader, idempotency_of, submitted_response
from app.queue.reads import coverage_of
from app.queue.tenant_limits import MAX_TOP_TENANTS, TOP_TENANTS

runbook = APIRouter(tags=["runbook"])


@runbook.get(
    "/queue/stats",
    response_model=QueueStats,
    summary="Queue depth per class and status, the oldest eligible age, the live slots, and "
    "running and queued runs per tenant, and the model budgets' figures",
    description=(
        "Operator keys see their tenant; admin keys see the whole queue, and in `tenants` the "
        "`top` busiest tenants by queued runs with the rest summed (`tenant: null`). The "
        "per-tenant figures are kept by the transitions themselves: reading them counts no runs."
    ),
    responses=responses("unauthorized", "forbidden", "invalid-request"),
)
async def queue_stats(
    request: Request,
    caller: OperatorDep,
    top: Annotated[int, Query(ge=1, le=MAX_TOP_TENANTS)] = TOP_TENANTS,
) -> Any:
    tenant = visible_tenant(caller)
    state = state_of(request)
    depth = await state.reads.depth(tenant_id=tenant)
    tenants = await state.tenants.depth(tenant_id=tenant, top=top)
    # A worker process not seen for a lease period has stopped beating: not live.
    slots = await state.reads.live_slots(stale_seconds=state.settings.lease_seconds)
    return QueueStats(
        scope="all" if tenant is None else f"tenant:{tenant}",
        classes={
            klass.value: ClassDepth(
                **dataclasses.asdict(entry),
                live_slots=slots[klass],
                unserved=coverage_of(entry, slots[klass]).unserved,
            )
            for klass, entry in depth.items()
        },
        tenants=[
            TenantDepth(
                tenant=entry.tenant_id,
                running=entry.running,
                queued=entry.queued,
                classes={
                    klass: TenantClassCounts(running=counts.running, queued=counts.queued)
                    for klass, counts in entry.classes.items()
                },
            )
            for entry in tenants
        ],
        model_budgets=await _model_budgets(request, admin=tenant is None),
    )


async def _model_budgets(request: Request, *, admin: bool) -> list[dict[str, Any]]:
    """Every model endpoint's budget and figures, for admin keys only: a budget is shared by
    every tenant, so its figures are the service's, not one tenant's."""
    if not admin:
        return []
    budgets = budgets_of(request)
    return [b.to_document(budgets.defaults) for b in await budgets.budgets()]


@runbook.get(
    "/runs/stuck",
    response_model=StuckRuns,
    summary="Runs whose lease expired unswept, queued too long, or waiting too long",
    responses=responses("unauthorized", "forbidden", "invalid-request"),
)
async def stuck_runs(
    request: Request,
    caller: OperatorDep,
    queued_seconds: Annotated[float, Query(ge=0, le=10**7)] = 300,
    waiting_seconds: Annotated[float, Query(ge=0, le=10**8)] = 86_400,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Any:
    stuck = await state_of(request).reads.stuck(
        tenant_id=visible_tenant(caller),
        queued_seconds=queued_seconds,
        waiting_seconds=waiting_seconds,
        limit=limit,
    )
    return StuckRuns(
        runs=[
            StuckRun(reason=item.reason, run=run_document(item.run.to_document())) for item in stuck
        ]
    )


@runbook.get(
    "/runs/failed",
    response_model=RunPage,
    summary="The dead letter: failed runs not yet dismissed, newest first, with their failure",
    responses=responses("unauthorized", "forbidden", "invalid-request"),
)
async def failed_runs(
    request: Request,
    caller: OperatorDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> Any:
    page = await state_of(request).reads.failed_page(
        tenant_id=visible_tenant(caller), cursor=cursor, limit=limit
    )
    return run_page_document(page)


@runbook.post(
    "/runs/{run_id}/resubmit",
    status_code=202,
    response_model=RunDocument,
    summary="A new run with a failed run's input; the failed run stays failed",
    responses=responses(
        "unauthorized",
        "forbidden",
        "not-found",
        "run-not-failed",
        "session-busy",
        "invalid-request",
        "idempotency-key-reused",
        "idempotency-key-in-flight",
        "queue-quota",
    ),
    description=(
        "One new run per failed run: resubmitting it again, concurrently or later, answers "
        "with the run the first resubmission created (`Idempotent-Replayed: true`). "
        "`Idempotency-Key` is honoured as on every submission."
    ),
)
async def resubmit(
    run_id: UUID,
    request: Request,
    caller: OperatorDep,
    idempotency_key: IdempotencyHeader = None,
) -> Any:
    state = state_of(request)
    outcome = await state.submissions.resubmit(
        submitter_of(caller),
        run_id,
        # Actions stay within the key's own tenant, admin keys included: the admin scope
        # widens what a key can see, not what it can change.
        tenant_id=caller.tenant_id,
        idempotency=await idempotency_of(request, idempotency_key),
    )
    return submitted_response(outcome)


@runbook.post(
    "/runs/{run_id}/dismiss",
    response_model=RunDocument,
    summary="Dismiss a failed run: it leaves the dead letter and retention may prune it",
    responses=responses(
        "unauthorized", "forbidden", "not-found", "run-not-failed", "invalid-request"
    ),
)
async def dismiss(run_id: UUID, request: Request, caller: OperatorDep) -> Any:
    state = state_of(request)
    run = await state.submissions.dismiss(
        submitter_of(caller),
        run_id,
        # Actions stay within the key's own tenant, admin keys included: the admin scope
        # widens what a key can see, not what it can change.
        tenant_id=caller.tenant_id,
    )
    return run.to_document()
