"""Model endpoints' budgets, for the platform team (docs/model-budgets.md): `GET` and `PUT
/model-budgets` (admin scope: one endpoint's budget is every tenant's), and a tenant's own
limits on them, `GET` and `PUT /tenants/{tenant}/model-budgets` (admin scope too: one
tenant's limit bounds what it takes of a budget every tenant shares). Validation and the
upserts are the core's (app/queue/model_budgets.py); these handlers authorize and render."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.api.auth import AdminDep
from app.api.problems import responses
from app.api.schemas import (
    ModelBudgetDocument,
    ModelBudgetRequest,
    ModelBudgetsDocument,
    TenantModelBudget,
    TenantModelBudgetRequest,
    TenantModelBudgetsDocument,
)
from app.api.services import state_of
from app.api.tenants import TenantPath
from app.assembly import budget_defaults
from app.queue.model_budgets import ModelBudgets

router = APIRouter(tags=["model budgets"])


def budgets_of(request: Request) -> ModelBudgets:
    """The core's budgets on this process's queue, with the service's defaults."""
    state = state_of(request)
    return ModelBudgets(state.queue, budget_defaults(state.settings))


@router.get(
    "/model-budgets",
    response_model=ModelBudgetsDocument,
    summary="Every model endpoint's budget and figures",
    description=(
        "The service's defaults, and each endpoint that was used or given a budget: its "
        "overrides (null: the default), what applies (null: unlimited), its pause, and its "
        "figures (calls and tokens settled, waits, pauses, reservations in flight)."
    ),
    responses=responses("unauthorized", "forbidden"),
)
async def list_budgets(request: Request, caller: AdminDep) -> Any:
    budgets = budgets_of(request)
    defaults = budgets.defaults
    return {
        "defaults": {
            "requests_per_minute": defaults.requests_per_minute,
            "tokens_per_minute": defaults.tokens_per_minute,
        },
        "budgets": [b.to_document(defaults) for b in await budgets.budgets()],
    }


@router.put(
    "/model-budgets",
    response_model=ModelBudgetDocument,
    summary="Set a model endpoint's budget (its overrides of the service's defaults)",
    description=(
        "Replaces the endpoint's overrides: a field left out or null returns to the service's "
        "default. Every process's model calls use it within a second, without a restart."
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
async def put_budget(body: ModelBudgetRequest, request: Request, caller: AdminDep) -> Any:
    budgets = budgets_of(request)
    budget = await budgets.set_budget(
        body.endpoint,
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
    )
    return budget.to_document(budgets.defaults)


@router.get(
    "/tenants/{tenant}/model-budgets",
    response_model=TenantModelBudgetsDocument,
    summary="A tenant's own limits on model endpoints, and its use of each",
    description=(
        "Its limits on every endpoint (`endpoint` null) and on each endpoint it used or was "
        "given a limit on: requests and tokens a minute (null: none of its own), the calls "
        "and tokens it used there and how often its limit made a call wait."
    ),
    responses=responses("unauthorized", "forbidden", "invalid-request"),
)
async def get_tenant_budgets(tenant: TenantPath, request: Request, caller: AdminDep) -> Any:
    budgets = budgets_of(request)
    return {
        "tenant": tenant,
        "budgets": [entry.to_document() for entry in await budgets.tenant_budgets(tenant)],
    }


@router.put(
    "/tenants/{tenant}/model-budgets",
    response_model=TenantModelBudget,
    summary="Set a tenant's own limits on a model endpoint (or on every endpoint)",
    description=(
        "Replaces the tenant's limits on `endpoint` (null: on every endpoint where it has "
        "none of its own): a field left out or null is no limit of its own there. Its calls "
        "then take from buckets of their own as well as the endpoint's: a call over the "
        "tenant's limit waits for its turn within it, holding nothing of the endpoint's. Takes "
        "effect in every process within a second, without a restart. Values are whole "
        "numbers from 1."
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
async def put_tenant_budget(
    tenant: TenantPath, body: TenantModelBudgetRequest, request: Request, caller: AdminDep
) -> Any:
    budgets = budgets_of(request)
    limits = await budgets.set_tenant_budget(
        tenant,
        body.endpoint,
        requests_per_minute=body.requests_per_minute,
        tokens_per_minute=body.tokens_per_minute,
    )
    return limits.to_document()
