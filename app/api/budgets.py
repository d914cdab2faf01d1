"""Model endpoints' budgets, for the platform team (docs/model-budgets.md): `GET` and `PUT
/model-budgets` (admin scope: one endpoint's budget is every tenant's). Validation and the
upsert are the core's (app/queue/model_budgets.py); these handlers authorize and render."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.api.auth import AdminDep
from app.api.problems import responses
from app.api.schemas import ModelBudgetDocument, ModelBudgetRequest, ModelBudgetsDocument
from app.api.services import state_of
from app.queue.model_budgets import BudgetDefaults, ModelBudgets

router = APIRouter(tags=["model budgets"])


def budgets_of(request: Request) -> ModelBudgets:
    """The core's budgets on this process's queue, with the service's defaults."""
    state = state_of(request)
    settings = state.settings
    return ModelBudgets(
        state.queue,
        BudgetDefaults(
            requests_per_minute=settings.model_rpm,
            tokens_per_minute=settings.model_tpm,
            reservation_seconds=settings.model_reservation_seconds,
        ),
    )


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
        "default. Takes effect at the next model call in every process, without a restart."
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
