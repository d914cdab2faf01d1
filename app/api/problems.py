"""Errors as `application/problem+json` (RFC 9457), mapped in one place.

Every error class has a stable `type` (`/problems/<slug>`, served as a short description by
`GET /problems/{slug}`), a `title`, the HTTP status, and a `detail` for this occurrence. The
queue core raises its own exceptions; this module is the only place that turns them into HTTP.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.json_responses import FastJSONResponse
from app.api.rate_limits import rate_limit_headers
from app.queue.errors import (
    AnswerConflictError,
    ApprovalCallMismatchError,
    ApprovalPendingError,
    HoldingLimitError,
    IdempotencyKeyInFlightError,
    IdempotencyKeyReusedError,
    InvalidApprovalError,
    InvalidCursorError,
    InvalidLimitsError,
    InvalidScheduleError,
    InvalidStartDeadlineError,
    NoApprovalPendingError,
    PendingTurnNotFoundError,
    PendingTurnsFullError,
    PendingTurnStartedError,
    QueueQuotaError,
    RateLimitedError,
    RunFinishedError,
    RunNotFailedError,
    RunNotFoundError,
    RunNotWaitingError,
    ScheduleNotFoundError,
    SessionBusyError,
    SessionNotFoundError,
    TurnstileError,
)
from app.store.primary import READ_ONLY, DriverStateError

log = logging.getLogger("turnstile.api")
MEDIA_TYPE = "application/problem+json"

# slug -> (status, title, description served at /problems/<slug>)
PROBLEMS: dict[str, tuple[int, str, str]] = {
    "invalid-request": (
        422,
        "The request is not valid",
        "The body, a parameter or a header failed validation; `errors` lists "
        "each problem with its location.",
    ),
    "malformed-json": (400, "The body is not valid JSON", "Send a JSON object."),
    "body-too-large": (
        413,
        "The request body is too large",
        "Bodies are limited by TURNSTILE_MAX_BODY_BYTES.",
    ),
    "request-timeout": (
        408,
        "The request body took too long",
        "The whole body must arrive within TURNSTILE_HTTP_BODY_TIMEOUT_SECONDS of the service's "
        "first read of it. Nothing was written; send it again.",
    ),
    "unauthorized": (
        401,
        "Authentication required",
        "Send `Authorization: Bearer <api key>` with a valid, unrevoked key.",
    ),
    "forbidden": (
        403,
        "The key lacks a scope for this action",
        "Runbook actions need the operator scope; queue-wide views need admin.",
    ),
    "not-found": (
        404,
        "Not found",
        "No such resource is visible to this key (its tenant and, without a scope, its principal).",
    ),
    "method-not-allowed": (405, "Method not allowed", "See the OpenAPI document."),
    "session-busy": (
        409,
        "The session already has a run in progress",
        "A session holds one active run. Wait for it to finish or to ask the "
        "user, or cancel it; `active_run_id` names it.",
    ),
    "too-many-pending-turns": (
        429,
        "The session holds as many pending turns as it may",
        "Under the enqueue, interrupt and steer policies a turn that arrives while the session's "
        "run is active waits as a pending turn; a session holds at most "
        "TURNSTILE_MAX_PENDING_TURNS of them (`max_pending`). Nothing was written. Wait for its "
        "runs to finish, or cancel a pending turn (docs/turn-control.md).",
    ),
    "approval-pending": (
        409,
        "The session's run waits for a tool call's approval",
        "Its run decided a tool call that needs a user's approval (`call_id`, `tool`); only a "
        'turn `{"approval": {"call_id": ..., "decision": "approve" | "reject" | "edit"}}` '
        "answers it (docs/approvals.md). Nothing was written.",
    ),
    "no-approval-pending": (
        409,
        "No approval is pending for this call",
        "The session's run waits for no approval (it was decided already, by this or another "
        "request; `run_status` says where the run is). Nothing was written.",
    ),
    "approval-call-mismatch": (
        409,
        "The approval names another call",
        "The session's run waits for the approval of `pending_call_id` (`tool`); answer that "
        "call. Nothing was written.",
    ),
    "invalid-approval": (
        422,
        "The approval cannot be applied",
        "Edited arguments must conform to the tool's JSON schema (the request's `parameters`); "
        "`errors` says where they do not. Nothing was written.",
    ),
    "turn-started": (
        409,
        "The pending turn has already started",
        "A pending turn can be cancelled only while it waits; this one became a run, or was "
        "delivered to the active run (`run_id`). Cancel the run instead.",
    ),
    "run-finished": (
        409,
        "The run has already finished",
        "Succeeded and failed runs cannot be cancelled.",
    ),
    "run-not-waiting": (
        409,
        "The run is not waiting for the user",
        "Input can only be delivered to a run in waiting_for_user.",
    ),
    "run-not-failed": (
        409,
        "The run has not failed",
        "Resubmit and dismiss apply to failed runs only.",
    ),
    "answer-conflict": (
        422,
        "The answer would change the waiting run",
        "An answer resumes the same run; leave agent, priority and "
        "scheduled_for out, or send the run's own values.",
    ),
    "idempotency-key-reused": (
        422,
        "Idempotency-Key reused with a different request",
        "A key identifies one request; this key was used with another "
        "method, path or body. Use a new key for a new request.",
    ),
    "idempotency-key-in-flight": (
        409,
        "A request with this Idempotency-Key is in progress",
        "Retry after the `Retry-After` seconds; the first request's outcome will then be replayed.",
    ),
    "too-many-streams": (
        429,
        "Too many open event streams and long polls",
        "Event streams and long polls are capped per API key "
        "(TURNSTILE_MAX_STREAMS_PER_KEY) and per API process "
        "(TURNSTILE_MAX_STREAMS_PER_PROCESS). Close one, or retry after the `Retry-After` "
        "seconds.",
    ),
    "rate-limited": (
        429,
        "Too many submissions",
        "The tenant's submissions (POST /runs, POST /sessions/{id}/turns) are over its rate "
        "limit (TURNSTILE_SUBMIT_RATE_PER_SECOND and TURNSTILE_SUBMIT_BURST, or the tenant's "
        "own limits). Nothing was written. Retry after the `Retry-After` seconds; the "
        "`RateLimit-Policy` and `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers-11) "
        "describe the limit and what is left of it.",
    ),
    "queue-quota": (
        429,
        "The tenant's queued quota is full",
        "The tenant has as many queued runs as its quota allows (TURNSTILE_TENANT_MAX_QUEUED or "
        "its own limit); new runs are refused until some of them start. An answer to a run "
        "waiting for the user is never refused. `max_queued` and `queued` give the figures.",
    ),
    "limit-reached": (
        409,
        "The tenant holds as many as its limit allows",
        "A tenant holds at most TURNSTILE_TENANT_MAX_SCHEDULES schedules and "
        "TURNSTILE_TENANT_MAX_WEBHOOK_ENDPOINTS webhook endpoints, or its own limits. Nothing "
        "was written; delete one first. `kind`, `limit` and `held` give the figures.",
    ),
    "database-busy": (
        503,
        "The database is busy",
        "A lock or statement timeout cut the request short; nothing was written. Retry after the "
        "`Retry-After` seconds.",
    ),
    "database-unavailable": (
        503,
        "The database is unavailable",
        "Retry after the `Retry-After` seconds.",
    ),
    "destination-refused": (
        422,
        "The URL is not an allowed destination",
        "Webhook URLs pass the same allow-list and address checks as the http_request tool "
        "(TURNSTILE_HTTP_ALLOWED_HOSTS): an absolute http(s) URL whose host is listed and "
        "resolves to addresses the list opens.",
    ),
    "secret-key-missing": (
        # Not a 5xx: nothing failed, and retrying cannot help until an operator sets the key.
        409,
        "Webhooks need TURNSTILE_SECRET_KEY",
        "Signing secrets are stored encrypted under a key derived from TURNSTILE_SECRET_KEY "
        "(at least 32 characters). Set it on every process and restart.",
    ),
    "internal-error": (500, "Internal error", "Something unexpected happened; it was logged."),
}


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str = Field(examples=["/problems/session-busy"])
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    model_config = {"extra": "allow"}


class ProblemType(BaseModel):
    type: str
    title: str
    status: int
    description: str


def problem_response(
    slug: str,
    detail: str | None = None,
    *,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    status, title, _ = PROBLEMS[slug]
    body: dict[str, Any] = {"type": f"/problems/{slug}", "title": title, "status": status}
    if detail is not None:
        body["detail"] = detail
    if instance is not None:
        body["instance"] = instance
    body.update(extra)
    return FastJSONResponse(body, status_code=status, media_type=MEDIA_TYPE, headers=headers)


class ApiProblem(Exception):
    """Raised by handlers for errors that do not come from the core (auth, scopes, ...)."""

    def __init__(
        self,
        slug: str,
        detail: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or slug)
        self.slug = slug
        self.detail = detail
        self.headers = headers
        self.extra = extra


def responses(*slugs: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for the problems a route can answer."""
    out: dict[int | str, dict[str, Any]] = {}
    for slug in slugs:
        status, title, _ = PROBLEMS[slug]
        entry = out.setdefault(
            status,
            {
                "content": {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
                "description": title,
            },
        )
        if entry["description"] != title:
            entry["description"] = f"{entry['description']}; or: {title}"
    return out


def _core_problem(exc: TurnstileError, request: Request) -> JSONResponse:
    path = request.url.path
    if isinstance(exc, RunNotFoundError | SessionNotFoundError | ScheduleNotFoundError):
        return problem_response("not-found", str(exc), instance=path)
    if isinstance(exc, SessionBusyError):
        return problem_response(
            "session-busy",
            str(exc),
            instance=path,
            active_run_id=str(exc.active_run_id),
            active_run_status=exc.status,
        )
    if isinstance(exc, PendingTurnNotFoundError):
        return problem_response("not-found", str(exc), instance=path)
    if isinstance(exc, ApprovalPendingError):
        return problem_response(
            "approval-pending",
            str(exc),
            instance=path,
            run_id=str(exc.run_id),
            call_id=exc.call_id,
            tool=exc.tool,
        )
    if isinstance(exc, NoApprovalPendingError):
        return problem_response(
            "no-approval-pending",
            str(exc),
            instance=path,
            call_id=exc.call_id,
            run_id=None if exc.run_id is None else str(exc.run_id),
            run_status=exc.status,
        )
    if isinstance(exc, ApprovalCallMismatchError):
        return problem_response(
            "approval-call-mismatch",
            str(exc),
            instance=path,
            run_id=str(exc.run_id),
            call_id=exc.given,
            pending_call_id=exc.pending,
            tool=exc.tool,
        )
    if isinstance(exc, InvalidApprovalError):
        return problem_response("invalid-approval", str(exc), instance=path, errors=exc.errors)
    if isinstance(exc, PendingTurnsFullError):
        return problem_response(
            "too-many-pending-turns", str(exc), instance=path, max_pending=exc.max_pending
        )
    if isinstance(exc, PendingTurnStartedError):
        return problem_response(
            "turn-started",
            str(exc),
            instance=path,
            turn_status=exc.status,
            run_id=None if exc.run_id is None else str(exc.run_id),
        )
    if isinstance(exc, RunFinishedError):
        return problem_response("run-finished", str(exc), instance=path, run_status=exc.status)
    if isinstance(exc, RunNotWaitingError):
        return problem_response("run-not-waiting", str(exc), instance=path)
    if isinstance(exc, RunNotFailedError):
        return problem_response("run-not-failed", str(exc), instance=path, run_status=exc.status)
    if isinstance(exc, AnswerConflictError):
        return problem_response("answer-conflict", str(exc), instance=path, field=exc.field)
    if isinstance(exc, IdempotencyKeyReusedError):
        return problem_response("idempotency-key-reused", str(exc), instance=path)
    if isinstance(exc, QueueQuotaError):
        return problem_response(
            "queue-quota", str(exc), instance=path, max_queued=exc.max_queued, queued=exc.queued
        )
    if isinstance(exc, HoldingLimitError):
        return problem_response(
            "limit-reached", str(exc), instance=path, kind=exc.kind, limit=exc.limit, held=exc.held
        )
    if isinstance(exc, IdempotencyKeyInFlightError):
        return problem_response(
            "idempotency-key-in-flight",
            str(exc),
            instance=path,
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, InvalidCursorError):
        return problem_response(
            "invalid-request",
            str(exc),
            instance=path,
            errors=[{"loc": ["query", "cursor"], "msg": "invalid cursor", "type": "cursor"}],
        )
    if isinstance(exc, RateLimitedError):
        return problem_response(
            "rate-limited",
            str(exc),
            instance=path,
            headers={"Retry-After": str(exc.retry_after)},
            retry_after_seconds=exc.retry_after,
        )
    if isinstance(exc, InvalidLimitsError):
        where = "path" if exc.field == "tenant" else "body"
        return problem_response(
            "invalid-request",
            f"{where}.{exc.field}: {exc.message}",
            instance=path,
            errors=[
                {
                    "loc": [where, *exc.field.split(".")],
                    "msg": exc.message,
                    "type": "invalid_limit",
                }
            ],
        )
    if isinstance(exc, InvalidScheduleError | InvalidStartDeadlineError):
        return problem_response(
            "invalid-request",
            f"body.{exc.field}: {exc.message}",
            instance=path,
            errors=[
                {"loc": ["body", exc.field], "msg": exc.message, "type": f"invalid_{exc.field}"}
            ],
        )
    log.error("unmapped core error", exc_info=exc)
    return problem_response("internal-error", instance=path)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into problem+json, the `Problem` schema in
    the OpenAPI document, and `GET /problems/{slug}` describing each problem type."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["Problem"] = Problem.model_json_schema()
            # FastAPI documents its own validation errors as HTTPValidationError JSON; ours are
            # problem+json, so point every 422 at the Problem schema instead.
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    response = operation.get("responses", {}).get("422")
                    if response is not None:
                        response["content"] = {
                            MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}
                        }
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get(
        "/problems/{slug}",
        tags=["health"],
        summary="What a problem type means",
        response_model=ProblemType,
        responses=responses("not-found"),
    )
    async def problem_type(slug: str) -> ProblemType:
        if slug not in PROBLEMS:
            raise ApiProblem("not-found", f"no problem type {slug!r}")
        status, title, description = PROBLEMS[slug]
        return ProblemType(
            type=f"/problems/{slug}", title=title, status=status, description=description
        )

    @app.exception_handler(TurnstileError)
    async def core_error(request: Request, exc: TurnstileError) -> JSONResponse:
        response = _core_problem(exc, request)
        # A refused submission shows its tenant's rate limit too, like an accepted one.
        response.headers.update(rate_limit_headers(exc.allowance))
        return response

    @app.exception_handler(ApiProblem)
    async def api_problem(request: Request, exc: ApiProblem) -> JSONResponse:
        return problem_response(
            exc.slug, exc.detail, instance=request.url.path, headers=exc.headers, **exc.extra
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type")}
            for e in exc.errors()
        ]
        if any(e["type"] == "json_invalid" for e in errors):
            return problem_response(
                "malformed-json", "the body is not valid JSON", instance=request.url.path
            )
        first = errors[0] if errors else {"loc": [], "msg": "invalid"}
        where = ".".join(str(p) for p in first["loc"])
        return problem_response(
            "invalid-request",
            f"{where}: {first['msg']}",
            instance=request.url.path,
            errors=errors,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers 400 when it cannot read the body at all (not UTF-8, say).
        slug = {
            400: "malformed-json",
            401: "unauthorized",
            403: "forbidden",
            404: "not-found",
            405: "method-not-allowed",
            408: "request-timeout",
            413: "body-too-large",
        }.get(exc.status_code)
        if slug is None:
            return JSONResponse(
                {"type": "about:blank", "title": str(exc.detail), "status": exc.status_code},
                status_code=exc.status_code,
                media_type=MEDIA_TYPE,
            )
        detail = exc.detail if isinstance(exc.detail, str) else None
        if exc.status_code == 400:
            detail = "the body could not be read as JSON; send UTF-8 encoded JSON text"
        return problem_response(
            slug, detail, instance=request.url.path, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(OSError)
    # A failover (app/store/primary.py): no host takes writes yet, or the driver's connection
    # was left unusable by its server's death, on a path that did not translate it.
    @app.exception_handler(DriverStateError)
    async def database_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable", exc_info=exc)
        return problem_response(
            "database-unavailable", instance=request.url.path, headers={"Retry-After": "2"}
        )

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        # Lock timeout, statement timeout, deadlock, serialization failure: transient.
        if getattr(exc.orig, "sqlstate", None) in ("55P03", "57014", "40P01", "40001"):
            return problem_response(
                "database-busy", instance=request.url.path, headers={"Retry-After": "1"}
            )
        state = str(getattr(exc.orig, "sqlstate", "") or "")
        # Connection failures and a server shutting down or starting up: unavailable for now.
        if (
            exc.connection_invalidated
            or state.startswith("08")
            or state in ("57P01", "57P02", "57P03")
            # A session on an old primary that became a standby: nothing was written.
            or state == READ_ONLY
        ):
            return problem_response(
                "database-unavailable",
                instance=request.url.path,
                headers={"Retry-After": "2"},
            )
        log.error("database error", exc_info=exc)
        return problem_response("internal-error", instance=request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return problem_response("internal-error", instance=request.url.path)
