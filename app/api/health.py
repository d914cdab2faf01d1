"""Liveness and readiness probes for load balancers and orchestrators."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError

from app.api.auth import bearer, current_caller
from app.api.problems import ApiProblem, responses
from app.api.services import state_of
from app.store.migrate import head_revision
from app.store.primary import DriverStateError, primary_answers
from app.store.resolve import schema_state

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: database reachable and schema at the revision this code expects",
    responses={503: {"description": "Not ready; the body says which check failed"}},
)
async def readyz(request: Request) -> JSONResponse:
    state = state_of(request)
    checks: dict[str, Any] = {}
    ready = True
    try:
        schema = await schema_state(state.engine)
        # A standby answers reads but refuses every write (a single-host URL naming a node
        # that was demoted, or a failover under way): not ready until a primary answers.
        primary = await primary_answers(state.engine)
        checks["database"] = "ok" if primary else "read-only: a standby, no primary"
        checks["schema"] = {"current": schema.revision, "expected": head_revision()}
        # A newer schema whose migrations keep this release working (a rolling upgrade).
        ready = primary and schema.problem() is None
        if state.pool is not None and state.pool.groups:
            checks["workers"] = "up" if state.pool.started else "stopped"
            ready = ready and state.pool.started
    except (SQLAlchemyError, OSError, DriverStateError) as exc:
        checks["database"] = f"unreachable: {type(exc).__name__}"
        ready = False
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )


async def metrics_access(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    """Open by default (a scraper on the private network); with TURNSTILE_METRICS_REQUIRE_KEY,
    admin keys only, since the figures are queue-wide: every tenant's runs together."""
    if not state_of(request).settings.metrics_require_key:
        return
    caller = await current_caller(request, credentials)
    if not caller.is_admin:
        raise ApiProblem("forbidden", "metrics are queue-wide: they need a key with admin scope")


@router.get(
    "/metrics",
    summary="Prometheus metrics of this process",
    description="Needs an admin key when TURNSTILE_METRICS_REQUIRE_KEY is set.",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}},
        **responses("unauthorized", "forbidden"),
    },
    dependencies=[Depends(metrics_access)],
)
async def metrics(request: Request) -> Response:
    registry = state_of(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
