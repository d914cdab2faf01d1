"""Tenants' limits, for the platform team: `GET` and `PUT /tenants/{tenant}/limits` (admin
scope: the limits of one tenant bound what every other tenant is left with). Validation and
the upsert are the core's (app/queue/tenant_limits.py); these handlers authorize and render."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import AfterValidator

from app.api.auth import AdminDep
from app.api.problems import responses
from app.api.schemas import TenantLimitsDocument, TenantLimitsRequest
from app.api.services import state_of
from app.queue.tenant_limits import TenantLimits, Tenants
from app.vocabulary.names import MAX_NAME_LENGTH, InvalidNameError, tenant_name

router = APIRouter(tags=["tenants"])


def normalised_tenant(value: str) -> str:
    """The path's tenant as app/vocabulary/names.py normalises it; a 422 when it cannot be one."""
    try:
        return tenant_name(value)
    except InvalidNameError as exc:
        raise ValueError(exc.reason) from None


TenantPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="The tenant's name, in NFKC form (`acme` in fullwidth letters is `acme`); "
        "no control or invisible characters.",
    ),
    AfterValidator(normalised_tenant),
]


def limits_document(tenants: Tenants, tenant: str, limits: TenantLimits) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "overrides": limits.to_document(),
        "effective": tenants.effective(limits).to_document(),
        "updated_at": limits.updated_at,
    }


@router.get(
    "/tenants/{tenant}/limits",
    response_model=TenantLimitsDocument,
    summary="A tenant's limits: its own overrides and the values that apply",
    description=(
        "`overrides` are the tenant's own (null: the service's default); `effective` what "
        "applies (null: no limit). A tenant nobody set limits for has every override null."
    ),
    responses=responses("unauthorized", "forbidden", "invalid-request"),
)
async def get_limits(tenant: TenantPath, request: Request, caller: AdminDep) -> Any:
    tenants = state_of(request).tenants
    return limits_document(tenants, tenant, await tenants.get_limits(tenant))


@router.put(
    "/tenants/{tenant}/limits",
    response_model=TenantLimitsDocument,
    summary="Set a tenant's limits (its overrides of the service's defaults)",
    description=(
        "Replaces the tenant's overrides: a field left out or null, and a class left out of "
        "`max_running`, returns to the service's default. Takes effect at the next claim and "
        "submission in every process, without a restart. Running counts are per class "
        "(interactive, async, maintenance), whole numbers from 0; `submit_rate_per_second` "
        "is from 1/86400 (one a day) to 1,000,000, `submit_burst` at least 1; "
        "`max_schedules` and `max_webhook_endpoints` from 0, `min_schedule_interval_seconds` "
        "at least 1. The tenant's "
        "name is taken in NFKC form."
    ),
    responses=responses(
        "unauthorized",
        "forbidden",
        "invalid-request",
        "malformed-json",
        "body-too-large",
        "request-timeout",
    ),
)
async def put_limits(
    tenant: TenantPath, body: TenantLimitsRequest, request: Request, caller: AdminDep
) -> Any:
    tenants = state_of(request).tenants
    limits = await tenants.set_limits(
        tenant,
        max_running=body.max_running,
        replace_classes=True,
        max_queued=body.max_queued,
        submit_rate_per_second=body.submit_rate_per_second,
        submit_burst=body.submit_burst,
        max_schedules=body.max_schedules,
        max_webhook_endpoints=body.max_webhook_endpoints,
        min_schedule_interval_seconds=body.min_schedule_interval_seconds,
    )
    return limits_document(tenants, tenant, limits)
