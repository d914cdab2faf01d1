"""Webhooks over HTTP: create (the signing secret shown once), list, rotate the secret,
re-enable one that failed deliveries disabled, delete.
Operator scope; an endpoint belongs to its creator's tenant and receives that tenant's run
transitions only; another tenant's is not found. The URL passes the `http_request` tool's
allow-list and address checks here (422 when refused) and again at every delivery. Delivery
itself is the queue's and the runtime's (app/store/sql/runs.sql,
app/runtime/webhook_delivery.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from app.api.auth import OperatorDep
from app.api.problems import ApiProblem, responses
from app.api.services import ServiceState, state_of
from app.queue.webhook_endpoints import EVENTS, Endpoint, WebhookNotFoundError
from app.runtime.webhook_delivery import DestinationRefusedError, register_endpoint
from app.security.secret_box import SecretBox, SecretKeyMissingError, new_signing_secret

router = APIRouter(tags=["webhooks"])

EventName = Literal["run.succeeded", "run.failed", "run.cancelled", "run.waiting"]


class WebhookRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=2048, description="An absolute http(s) URL on the allow-list.")
    events: list[EventName] = Field(
        default_factory=list, description=f"Some of {', '.join(EVENTS)}; empty: all of them."
    )


class WebhookDocument(BaseModel):
    id: UUID
    url: str
    events: list[str]
    enabled: bool
    consecutive_failures: int
    disabled_at: datetime | None
    created_at: datetime

    @classmethod
    def of(cls, endpoint: Endpoint) -> WebhookDocument:
        return cls(
            id=endpoint.id,
            url=endpoint.url,
            events=endpoint.events,
            enabled=endpoint.disabled_at is None,
            consecutive_failures=endpoint.consecutive_failures,
            disabled_at=endpoint.disabled_at,
            created_at=endpoint.created_at,
        )


class WebhookCreated(WebhookDocument):
    secret: str = Field(description="`whsec_` + base64: shown once, keep it to verify signatures.")


class WebhookList(BaseModel):
    webhooks: list[WebhookDocument]


class WebhookSecret(BaseModel):
    id: UUID
    secret: str = Field(description="The new secret, shown once; the old one stops at once.")


class WebhookDeleted(BaseModel):
    id: UUID
    deleted: bool = True
    cancelled_deliveries: int


def _box(state: ServiceState) -> SecretBox:
    if state.secret_box is None:
        raise ApiProblem(
            "secret-key-missing",
            "webhooks need TURNSTILE_SECRET_KEY (at least 32 characters) to store their "
            "signing secrets encrypted; set it and restart",
        )
    return state.secret_box


@router.post(
    "/webhooks",
    status_code=201,
    response_model=WebhookCreated,
    summary="Create a webhook endpoint: signed deliveries of this tenant's run transitions",
    responses=responses(
        "unauthorized",
        "forbidden",
        "invalid-request",
        "destination-refused",
        "secret-key-missing",
        "limit-reached",
        "malformed-json",
        "body-too-large",
        "request-timeout",
    ),
)
async def create_webhook(body: WebhookRequest, request: Request, caller: OperatorDep) -> Any:
    state = state_of(request)
    try:
        endpoint, shown = await register_endpoint(
            state.webhooks,
            state.egress,
            state.secret_box,
            tenant_id=caller.tenant_id,
            principal=caller.principal,
            url=body.url,
            events=list(body.events),
        )
    except SecretKeyMissingError as exc:
        raise ApiProblem("secret-key-missing", str(exc)) from None
    except DestinationRefusedError as exc:
        raise ApiProblem("destination-refused", f"body.{exc}") from None
    return WebhookCreated(**WebhookDocument.of(endpoint).model_dump(), secret=shown)


@router.get(
    "/webhooks",
    response_model=WebhookList,
    summary="This tenant's webhook endpoints (secrets are never shown again)",
    responses=responses("unauthorized", "forbidden"),
)
async def list_webhooks(request: Request, caller: OperatorDep) -> Any:
    endpoints = await state_of(request).webhooks.list(caller.tenant_id)
    return WebhookList(webhooks=[WebhookDocument.of(e) for e in endpoints])


@router.post(
    "/webhooks/{webhook_id}/rotate-secret",
    response_model=WebhookSecret,
    summary="Replace an endpoint's signing secret (the new one is shown once)",
    responses=responses("unauthorized", "forbidden", "not-found", "secret-key-missing"),
)
async def rotate_secret(webhook_id: UUID, request: Request, caller: OperatorDep) -> Any:
    state = state_of(request)
    box = _box(state)
    shown, raw = new_signing_secret()
    try:
        await state.webhooks.rotate(
            tenant_id=caller.tenant_id, endpoint_id=webhook_id, secret=box.encrypt(raw)
        )
    except WebhookNotFoundError as exc:
        raise ApiProblem("not-found", str(exc)) from None
    return WebhookSecret(id=webhook_id, secret=shown)


@router.post(
    "/webhooks/{webhook_id}/enable",
    response_model=WebhookDocument,
    summary="Re-enable an endpoint that failed deliveries disabled (its count starts again)",
    responses=responses("unauthorized", "forbidden", "not-found"),
)
async def enable_webhook(webhook_id: UUID, request: Request, caller: OperatorDep) -> Any:
    try:
        endpoint = await state_of(request).webhooks.enable(
            tenant_id=caller.tenant_id, endpoint_id=webhook_id
        )
    except WebhookNotFoundError as exc:
        raise ApiProblem("not-found", str(exc)) from None
    return WebhookDocument.of(endpoint)


@router.delete(
    "/webhooks/{webhook_id}",
    response_model=WebhookDeleted,
    summary="Delete an endpoint and cancel its pending deliveries",
    responses=responses("unauthorized", "forbidden", "not-found"),
)
async def delete_webhook(webhook_id: UUID, request: Request, caller: OperatorDep) -> Any:
    try:
        cancelled = await state_of(request).webhooks.delete(
            tenant_id=caller.tenant_id, endpoint_id=webhook_id, actor=caller.principal
        )
    except WebhookNotFoundError as exc:
        raise ApiProblem("not-found", str(exc)) from None
    return WebhookDeleted(id=webhook_id, cancelled_deliveries=cancelled)
