"""The operator dashboard's routes under `/ui`: sign-in, the overview (the fragment its script
refreshes, and charts of the last hour), the runs list, a run's page, a session's page (its
conversation and its runs), schedules, webhook endpoints, API keys, the model budgets (admin
keys: each endpoint's budget, pause, calls in flight and booked, and per tenant its holds,
use and limits), the search by run or session id, and the dead letter with its actions.

Thin like the API's handlers: reads are the queue's read models (`Reads`, app/queue/reads.py;
the dashboard's own statements are app/store/sql/dashboard.sql), actions are the queue core's
`Submissions.resubmit` and `.dismiss` that the API's runbook routes call, so they record the
same `operator.*` events, and `Schedules.pause`/`.resume`, `Webhooks.enable`/`.disable` and
`revoke_key`, as the API and the CLI. Scoping is the API's: `visible_tenant` and
`visible_principal` for reads (keys without a scope see their own principal's runs, admin
keys the whole queue), the key's own tenant for actions. Pages are Jinja2 templates with
autoescaping on; errors render as pages with a clear message, never a traceback.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode
from uuid import UUID

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader

from app.api.auth import submitter_of, visible_principal, visible_tenant
from app.api.budgets import budgets_of
from app.api.services import state_of
from app.queue.errors import (
    InvalidCursorError,
    RunNotFailedError,
    RunNotFoundError,
    ScheduleNotFoundError,
    SessionBusyError,
)
from app.queue.reads import Reads
from app.queue.scheduling import Schedules
from app.queue.webhook_endpoints import WebhookNotFoundError, Webhooks
from app.security.api_keys import Caller, list_keys, revoke_key
from app.ui import session, views

STATIC = Path(__file__).parent / "static"
SEQUENCE = re.compile(r"[0-9]{1,18}")  # an event sequence number (bigint), ASCII digits only
PAGE_SIZE = 50
EVENTS_PER_PAGE = 1000
TRANSCRIPT_PAGE = 200
WINDOW_MINUTES = 15
CHART_MINUTES = 60
REFRESH_SECONDS = 5
MAX_FORM_BYTES = 4096
# Nothing but this server: scripts, styles and images are served from /ui/static.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/ui", include_in_schema=False)
templates = Jinja2Templates(
    env=Environment(loader=PackageLoader("app.ui", "templates"), autoescape=True)
)
templates.env.filters["when"] = views.when
templates.env.filters["age"] = views.age
templates.env.filters["compact"] = views.compact_json
templates.env.filters["pretty"] = views.pretty_json

UiCaller = Annotated[Caller, Depends(session.signed_in)]


def install(app: FastAPI) -> None:
    """Mount the dashboard and its static files on `app`."""
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
    app.include_router(router)

    @app.exception_handler(session.SignInRequired)
    async def sign_in_first(request: Request, exc: session.SignInRequired) -> Response:
        if request.url.path.endswith("/fragment") or request.method != "GET":
            return error_page(request, None, 401, "Sign in again: the session ended or expired.")
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(
            f"/ui/sign-in?{urlencode({'next': target})}", status_code=303, headers=SECURITY_HEADERS
        )


# --- rendering -------------------------------------------------------------------------------
def render(
    request: Request,
    caller: Caller | None,
    name: str,
    status_code: int = 200,
    **context: Any,
) -> HTMLResponse:
    token = session.token_of(request)
    return templates.TemplateResponse(
        request,
        name,
        {
            "caller": caller,
            "csrf": session.csrf_token(token) if token and caller else "",
            "refresh_seconds": REFRESH_SECONDS,
            **context,
        },
        status_code=status_code,
        headers=SECURITY_HEADERS,
    )


def error_page(request: Request, caller: Caller | None, status: int, message: str) -> HTMLResponse:
    return render(request, caller, "error.html", status, status=status, message=message)


def local_target(raw: str | None, default: str) -> str:
    """Where to go after a form: only a path of this dashboard, never another site."""
    if raw and raw.startswith("/ui") and not raw.startswith("//") and "\\" not in raw:
        return raw
    return default


async def form_of(request: Request) -> dict[str, str] | HTMLResponse:
    """The POSTed form's fields; an error page for a cross-site or malformed post."""
    if not session.same_origin(request):
        return error_page(request, None, 403, "Refused: this form was posted from another site.")
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/x-www-form-urlencoded":
        return error_page(request, None, 415, "Send the form as application/x-www-form-urlencoded.")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return error_page(request, None, 413, "The form is too large.")
    try:
        fields = parse_qs(body.decode(), max_num_fields=20, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        return error_page(request, None, 400, "The form could not be read.")
    return {name: values[-1] for name, values in fields.items()}


def parse_run_id(raw: str) -> UUID | None:
    try:
        return UUID(raw)
    except ValueError:
        return None


# --- sign-in ---------------------------------------------------------------------------------
@router.get("/sign-in")
async def sign_in_form(request: Request) -> HTMLResponse:
    return render(
        request, None, "sign_in.html", next=local_target(request.query_params.get("next"), "")
    )


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    form = await form_of(request)
    if isinstance(form, HTMLResponse):
        return form
    key = form.get("key", "").strip()
    target = form.get("next", "")
    opened = await session.start(request, key)
    if opened is None:
        return render(
            request,
            None,
            "sign_in.html",
            401,
            next=local_target(target, ""),
            error="Unknown or revoked API key.",
        )
    token, caller = opened
    default = "/ui" if caller.is_operator else "/ui/runs"
    response = RedirectResponse(
        local_target(target, default), status_code=303, headers=SECURITY_HEADERS
    )
    session.remember(response, request, token)
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    form = await form_of(request)
    if isinstance(form, HTMLResponse):
        return form
    if not session.csrf_valid(request, form.get("csrf")):
        return error_page(request, None, 403, "Refused: the form's CSRF token is not valid.")
    await session.end(request)
    response = RedirectResponse("/ui/sign-in", status_code=303, headers=SECURITY_HEADERS)
    session.forget(response, request)
    return response


# --- the overview ----------------------------------------------------------------------------
async def overview_context(request: Request, caller: Caller) -> dict[str, Any]:
    state = state_of(request)
    tenant = visible_tenant(caller)
    reads: Reads = state.reads
    seen = await reads.overview(
        tenant_id=tenant,
        window_minutes=WINDOW_MINUTES,
        # A process not seen for a lease period has stopped beating: not live.
        stale_seconds=state.settings.lease_seconds,
    )
    return {
        "scope": "whole queue" if tenant is None else f"tenant {tenant}",
        "classes": views.class_rows(seen.depth, seen.throughput),
        "recoveries": seen.recoveries,
        "dead_letter": seen.dead_letter,
        "slots": seen.slot_groups,
        "coverage": {klass.value: entry for klass, entry in seen.coverage.items()},
        "unserved": [klass.value for klass in seen.unserved],
        "tenants": views.tenant_rows(seen.tenants),
        "window_minutes": WINDOW_MINUTES,
        "generated": views.when(datetime.now(UTC)),
    }


@router.get("")
async def overview(request: Request, caller: UiCaller) -> Response:
    if not caller.is_operator:
        # The overview is runbook data (the API's /queue/stats needs the operator scope too):
        # other keys land on their tenant's runs.
        return RedirectResponse("/ui/runs", status_code=303, headers=SECURITY_HEADERS)
    context = await overview_context(request, caller)
    reads: Reads = state_of(request).reads
    # Read once with the page, not with each refresh of the fragment: an hour of minutes is a
    # heavier read than the fragment's, and a trend needs no five-second updates.
    minutes = await reads.minutes(tenant_id=visible_tenant(caller), minutes=CHART_MINUTES)
    return render(request, caller, "overview.html", charts=views.charts(minutes), **context)


@router.get("/overview/fragment")
async def overview_fragment(request: Request, caller: UiCaller) -> HTMLResponse:
    if not caller.is_operator:
        return error_page(request, caller, 403, "The overview needs the operator scope.")
    return render(request, caller, "_overview.html", **await overview_context(request, caller))


# --- runs ------------------------------------------------------------------------------------
@router.get("/runs")
async def runs(request: Request, caller: UiCaller) -> HTMLResponse:
    query = dict(request.query_params.items())
    try:
        filters = views.parse_filters(query)
    except views.FilterError as exc:
        return render(
            request,
            caller,
            "runs.html",
            400,
            error=str(exc),
            runs=[],
            query={k: v[: views.MAX_FILTER_LENGTH] for k, v in query.items()},
            statuses=views.STATUSES,
            classes=views.CLASSES,
            next_link=None,
        )
    state = state_of(request)
    reads: Reads = state.reads
    try:
        found = await reads.runs_page(
            tenant_id=visible_tenant(caller),
            principal=visible_principal(caller),
            filters=filters.params(),
            cursor=query.get("cursor") or None,
            limit=PAGE_SIZE,
        )
    except InvalidCursorError:
        return error_page(request, caller, 400, "cursor: not a link this dashboard made.")
    page = found.runs
    next_link = None
    if found.next_cursor is not None:
        next_link = "/ui/runs?" + urlencode({**filters.query(), "cursor": found.next_cursor})
    return render(
        request,
        caller,
        "runs.html",
        runs=page,
        query=filters.query(),
        statuses=views.STATUSES,
        classes=views.CLASSES,
        next_link=next_link,
        scope=scope_label(caller),
    )


def scope_label(caller: Caller) -> str:
    """What the runs list shows, in the API's terms (see `visible_tenant`)."""
    if visible_tenant(caller) is None:
        return "whole queue"
    if visible_principal(caller) is not None:
        return f"tenant {caller.tenant_id}, principal {caller.principal}"
    return f"tenant {caller.tenant_id}"


@router.get("/runs/{run_id}")
async def run_page(run_id: str, request: Request, caller: UiCaller) -> HTMLResponse:
    parsed = parse_run_id(run_id)
    state = state_of(request)
    run = (
        await state.queue.get_run(
            parsed, tenant_id=visible_tenant(caller), principal=visible_principal(caller)
        )
        if parsed
        else None
    )
    if run is None:
        return error_page(request, caller, 404, f"No run {run_id!r} is visible to this key.")
    raw_after = request.query_params.get("after", "0")
    # ASCII digits only: str.isdigit() also accepts '²' or '①', which int() refuses.
    after = int(raw_after) if SEQUENCE.fullmatch(raw_after) else 0
    events = await state.queue.events(run.id, after=after, limit=EVENTS_PER_PAGE)
    reads: Reads = state.reads
    inputs = await reads.inputs_by_event(run.id)
    hosts: dict[str, str] = {}
    if caller.is_operator:
        # Worker ids are opaque; the operator's runbook needs the machine behind them.
        owners = views.worker_owners(events) | ({run.lease_owner} if run.lease_owner else set())
        hosts = await reads.worker_hosts(owners)
    more = events[-1].seq if events and events[-1].seq < run.last_event_seq else None
    return render(
        request,
        caller,
        "run.html",
        run=run,
        cancel_reason=(await reads.cancel_reasons([run])).get(run.id),
        lease_holder=views.worker_label(run.lease_owner, hosts),
        timeline=views.timeline(events, inputs, hosts),
        more_after=more,
        may_act=caller.is_operator and run.tenant_id == caller.tenant_id,
        notice=notice_of(request),
    )


# --- a session --------------------------------------------------------------------------------
@router.get("/sessions/{session_id}")
async def session_page(session_id: str, request: Request, caller: UiCaller) -> HTMLResponse:
    """A session as a conversation: its transcript (oldest first, a page at a time) beside its
    multitask policy, the turns waiting for its active run (in start order) and its runs
    (newest first, a cancelled one with why), under the API's visibility rules for sessions:
    the key's own tenant, admin keys included (they read any run, not any conversation), and
    its own principal's sessions unless the key has a scope."""
    parsed = parse_run_id(session_id)
    reads: Reads = state_of(request).reads
    found = (
        await reads.session(parsed, tenant_id=caller.tenant_id, principal=visible_principal(caller))
        if parsed
        else None
    )
    if found is None:
        message = f"No session {session_id!r} is visible to this key."
        return error_page(request, caller, 404, message)
    try:
        transcript = await reads.session_transcript_page(
            found.id, cursor=request.query_params.get("cursor") or None, limit=TRANSCRIPT_PAGE
        )
        runs = await reads.session_runs_page(
            found.id, cursor=request.query_params.get("runs_cursor") or None, limit=PAGE_SIZE
        )
    except InvalidCursorError:
        return error_page(request, caller, 400, "cursor: not a link this dashboard made.")
    # The turns waiting for its active run (at most the bound of pending turns, so one page).
    pending = await reads.session_pending_turns(
        found.id, tenant_id=caller.tenant_id, limit=PAGE_SIZE
    )
    return render(
        request,
        caller,
        "session.html",
        session=found,
        pending_turns=pending,
        cancel_reasons=await reads.cancel_reasons(runs.runs),
        messages=[views.message(entry) for entry in transcript.entries],
        next_messages=(
            f"/ui/sessions/{found.id}?{urlencode({'cursor': transcript.next_cursor})}"
            if transcript.next_cursor
            else None
        ),
        runs=runs.runs,
        older_runs=(
            f"/ui/sessions/{found.id}?{urlencode({'runs_cursor': runs.next_cursor})}"
            if runs.next_cursor
            else None
        ),
    )


# --- search ----------------------------------------------------------------------------------
@router.get("/search")
async def search(request: Request, caller: UiCaller) -> Response:
    """The header's search box: an exact run id goes to the run's page, a session id to the
    session's, each under the same visibility rules as those pages (so a search reveals
    nothing the pages would not); anything else is a page saying so, never a 500."""
    raw = request.query_params.get("q", "").strip()[:100]
    if not raw:
        return search_miss(request, caller, 400, raw, "Type a run id or a session id to search.")
    parsed = parse_run_id(raw)
    if parsed is None:
        message = f"{raw!r} is not a run or session id (a UUID like {UUID(int=0)})."
        return search_miss(request, caller, 400, raw, message)
    state = state_of(request)
    run = await state.queue.get_run(
        parsed, tenant_id=visible_tenant(caller), principal=visible_principal(caller)
    )
    if run is not None:
        return RedirectResponse(f"/ui/runs/{run.id}", status_code=303, headers=SECURITY_HEADERS)
    reads: Reads = state.reads
    found = await reads.session(
        parsed, tenant_id=caller.tenant_id, principal=visible_principal(caller)
    )
    if found is not None:
        return RedirectResponse(
            f"/ui/sessions/{found.id}", status_code=303, headers=SECURITY_HEADERS
        )
    message = f"Not found: no run or session {raw!r} is visible to this key."
    return search_miss(request, caller, 404, raw, message)


def search_miss(
    request: Request, caller: Caller, status: int, raw: str, message: str
) -> HTMLResponse:
    return render(
        request, caller, "error.html", status, status=status, message=message, search_query=raw
    )


# --- the dead letter -------------------------------------------------------------------------
@router.get("/dead-letter")
async def dead_letter(request: Request, caller: UiCaller) -> HTMLResponse:
    if not caller.is_operator:
        return error_page(request, caller, 403, "The dead letter needs the operator scope.")
    cursor = request.query_params.get("cursor")
    reads: Reads = state_of(request).reads
    try:
        found = await reads.failed_page(
            tenant_id=visible_tenant(caller),
            cursor=cursor[:200] if cursor else None,
            limit=PAGE_SIZE,
        )
    except InvalidCursorError:
        return error_page(request, caller, 400, "cursor: not a link this dashboard made.")
    page = found.runs
    next_link = None
    if found.next_cursor is not None:
        next_link = "/ui/dead-letter?" + urlencode({"cursor": found.next_cursor})
    return render(
        request,
        caller,
        "dead_letter.html",
        runs=page,
        next_link=next_link,
        notice=notice_of(request),
        scope="whole queue" if visible_tenant(caller) is None else f"tenant {caller.tenant_id}",
    )


NOTICES = {
    "resubmitted": "Resubmitted run {run} as new run {new}.",
    "dismissed": "Dismissed run {run} from the dead letter.",
    "not-failed": "Run {run} is not failed: nothing to do.",
    "not-found": "Run {run} is not visible to this key.",
    "session-busy": "Run {run}'s session already has an active run ({new}); try again later.",
}


def notice_of(request: Request) -> str | None:
    code = request.query_params.get("notice")
    if code not in NOTICES:
        return None
    run = parse_run_id(request.query_params.get("run", ""))
    new = parse_run_id(request.query_params.get("new", ""))
    return NOTICES[code].format(run=run or "?", new=new or "?")


async def operator_action(request: Request, caller: Caller, run_id: str, action: str) -> Response:
    form = await form_of(request)
    if isinstance(form, HTMLResponse):
        return form
    if not session.csrf_valid(request, form.get("csrf")):
        return error_page(request, caller, 403, "Refused: the form's CSRF token is not valid.")
    if not caller.is_operator:
        return error_page(request, caller, 403, "This action needs a key with the operator scope.")
    parsed = parse_run_id(run_id)
    if parsed is None:
        return error_page(request, caller, 404, f"No run {run_id!r} is visible to this key.")
    state = state_of(request)
    who = submitter_of(caller)
    notice: dict[str, str] = {"run": str(parsed)}
    try:
        # Actions stay within the key's own tenant, admin keys included, as in the API.
        if action == "resubmit":
            outcome = await state.submissions.resubmit(who, parsed, tenant_id=caller.tenant_id)
            notice |= {"notice": "resubmitted", "new": str(outcome.run_id)}
        else:
            await state.submissions.dismiss(who, parsed, tenant_id=caller.tenant_id)
            notice |= {"notice": "dismissed"}
    except RunNotFoundError:
        notice |= {"notice": "not-found"}
    except RunNotFailedError:
        notice |= {"notice": "not-failed"}
    except SessionBusyError as exc:
        notice |= {"notice": "session-busy", "new": str(exc.active_run_id)}
    back = local_target(form.get("back"), "/ui/dead-letter").split("?")[0]
    return RedirectResponse(
        f"{back}?{urlencode(notice)}", status_code=303, headers=SECURITY_HEADERS
    )


@router.post("/runs/{run_id}/resubmit")
async def resubmit(run_id: str, request: Request, caller: UiCaller) -> Response:
    return await operator_action(request, caller, run_id, "resubmit")


@router.post("/runs/{run_id}/dismiss")
async def dismiss(run_id: str, request: Request, caller: UiCaller) -> Response:
    return await operator_action(request, caller, run_id, "dismiss")


# --- schedules, webhook endpoints, API keys --------------------------------------------------
# Reads as the API's (visible_tenant: admin keys see every tenant's); every write needs the
# operator scope, a valid CSRF token and stays within the key's own tenant, admin keys
# included, as the dead letter's actions and the API's schedule and webhook routes do.
SCHEDULES_PER_PAGE = 20
UPCOMING_FIRES = 3
RECENT_TICKS = 5
DELIVERIES_SHOWN = 5
DELIVERY_HOURS = 24

DONE = {
    "paused": "Paused schedule {id}: its tick queued ahead was removed.",
    "resumed": "Resumed schedule {id}: it fires again from now on.",
    "enabled": "Enabled webhook endpoint {id}: its failure count starts again from zero.",
    "disabled": "Disabled webhook endpoint {id}: no deliveries until it is enabled again.",
    "revoked": "Revoked key {id}: it and its dashboard sessions stop working at once.",
    "not-found": "{id} is not visible to this key, or not in its own tenant: nothing changed.",
    "admin-key": "Key {id} has the admin scope: only an admin key may revoke it.",
}


def done_of(request: Request) -> str | None:
    code = request.query_params.get("done")
    if code not in DONE:
        return None
    subject = parse_run_id(request.query_params.get("id", ""))
    return DONE[code].format(id=subject or "?")


async def operator_form(request: Request, caller: Caller) -> dict[str, str] | HTMLResponse:
    """The posted form of an operator's write, or the page refusing it."""
    form = await form_of(request)
    if isinstance(form, HTMLResponse):
        return form
    if not session.csrf_valid(request, form.get("csrf")):
        return error_page(request, caller, 403, "Refused: the form's CSRF token is not valid.")
    if not caller.is_operator:
        return error_page(request, caller, 403, "This action needs a key with the operator scope.")
    return form


def done(page: str, code: str, subject: UUID | str) -> Response:
    return RedirectResponse(
        f"{page}?{urlencode({'done': code, 'id': str(subject)})}",
        status_code=303,
        headers=SECURITY_HEADERS,
    )


@router.get("/schedules")
async def schedules_page(request: Request, caller: UiCaller) -> HTMLResponse:
    if not caller.is_operator:
        return error_page(request, caller, 403, "Schedules need the operator scope.")
    schedules: Schedules = state_of(request).schedules
    tenant = visible_tenant(caller)
    cursor = request.query_params.get("cursor")
    try:
        page = await schedules.page(
            tenant_id=tenant, cursor=cursor[:200] if cursor else None, limit=SCHEDULES_PER_PAGE
        )
    except InvalidCursorError:
        return error_page(request, caller, 400, "cursor: not a link this dashboard made.")
    details = []
    for schedule in page.schedules:
        try:
            details.append(
                await schedules.detail(
                    schedule.id, tenant_id=tenant, upcoming=UPCOMING_FIRES, recent=RECENT_TICKS
                )
            )
        except ScheduleNotFoundError:
            continue  # deleted since the page was read
    return render(
        request,
        caller,
        "schedules.html",
        schedules=details,
        next_link=(
            "/ui/schedules?" + urlencode({"cursor": page.next_cursor}) if page.next_cursor else None
        ),
        notice=done_of(request),
        scope="whole queue" if tenant is None else f"tenant {caller.tenant_id}",
    )


async def schedule_action(
    request: Request, caller: Caller, schedule_id: str, pause: bool
) -> Response:
    form = await operator_form(request, caller)
    if isinstance(form, HTMLResponse):
        return form
    parsed = parse_run_id(schedule_id)
    schedules: Schedules = state_of(request).schedules
    if parsed is None:
        return done("/ui/schedules", "not-found", schedule_id[:40])
    try:
        if pause:
            await schedules.pause(parsed, tenant_id=caller.tenant_id)
        else:
            await schedules.resume(parsed, tenant_id=caller.tenant_id)
    except ScheduleNotFoundError:
        return done("/ui/schedules", "not-found", parsed)
    return done("/ui/schedules", "paused" if pause else "resumed", parsed)


@router.post("/schedules/{schedule_id}/pause")
async def pause_schedule(schedule_id: str, request: Request, caller: UiCaller) -> Response:
    return await schedule_action(request, caller, schedule_id, pause=True)


@router.post("/schedules/{schedule_id}/resume")
async def resume_schedule(schedule_id: str, request: Request, caller: UiCaller) -> Response:
    return await schedule_action(request, caller, schedule_id, pause=False)


@router.get("/webhooks")
async def webhooks_page(request: Request, caller: UiCaller) -> HTMLResponse:
    if not caller.is_operator:
        return error_page(request, caller, 403, "Webhook endpoints need the operator scope.")
    state = state_of(request)
    tenant = visible_tenant(caller)
    webhooks: Webhooks = state.webhooks
    endpoints = await webhooks.list(tenant)
    reads: Reads = state.reads
    ids = [endpoint.id for endpoint in endpoints]
    return render(
        request,
        caller,
        "webhooks.html",
        endpoints=endpoints,
        deliveries=await reads.webhook_deliveries(ids, per_endpoint=DELIVERIES_SHOWN),
        counts=await reads.webhook_delivery_counts(ids, hours=DELIVERY_HOURS),
        hours=DELIVERY_HOURS,
        disable_after=webhooks.disable_after,
        notice=done_of(request),
        scope="whole queue" if tenant is None else f"tenant {caller.tenant_id}",
    )


async def webhook_action(
    request: Request, caller: Caller, webhook_id: str, enable: bool
) -> Response:
    form = await operator_form(request, caller)
    if isinstance(form, HTMLResponse):
        return form
    parsed = parse_run_id(webhook_id)
    if parsed is None:
        return done("/ui/webhooks", "not-found", webhook_id[:40])
    webhooks: Webhooks = state_of(request).webhooks
    try:
        if enable:
            await webhooks.enable(tenant_id=caller.tenant_id, endpoint_id=parsed)
        else:
            await webhooks.disable(tenant_id=caller.tenant_id, endpoint_id=parsed)
    except WebhookNotFoundError:
        return done("/ui/webhooks", "not-found", parsed)
    return done("/ui/webhooks", "enabled" if enable else "disabled", parsed)


@router.post("/webhooks/{webhook_id}/enable")
async def enable_webhook(webhook_id: str, request: Request, caller: UiCaller) -> Response:
    return await webhook_action(request, caller, webhook_id, enable=True)


@router.post("/webhooks/{webhook_id}/disable")
async def disable_webhook(webhook_id: str, request: Request, caller: UiCaller) -> Response:
    return await webhook_action(request, caller, webhook_id, enable=False)


@router.get("/model-budgets")
async def model_budgets_page(request: Request, caller: UiCaller) -> HTMLResponse:
    """Every model endpoint's budget, read-only (an admin changes them with PUT /model-budgets
    and PUT /tenants/{t}/model-budgets, or the CLI): admin keys only, as the API's, since one
    budget is every tenant's."""
    if not caller.is_admin:
        return error_page(request, caller, 403, "Model budgets need the admin scope.")
    budgets = budgets_of(request)
    defaults = budgets.defaults
    now = state_of(request).queue.clock() or datetime.now(UTC)
    return render(
        request,
        caller,
        "model_budgets.html",
        budgets=[
            {
                "doc": budget.to_document(defaults),
                "paused_until": budget.paused_until,
                "paused": budget.paused_until is not None and budget.paused_until > now,
            }
            for budget in await budgets.budgets()
        ],
        defaults=defaults,
    )


@router.get("/keys")
async def keys_page(request: Request, caller: UiCaller) -> HTMLResponse:
    if not caller.is_operator:
        return error_page(request, caller, 403, "API keys need the operator scope.")
    tenant = visible_tenant(caller)
    keys = await list_keys(state_of(request).engine, tenant)
    return render(
        request,
        caller,
        "keys.html",
        keys=keys,
        notice=done_of(request),
        scope="whole queue" if tenant is None else f"tenant {caller.tenant_id}",
    )


@router.post("/keys/{key_id}/revoke")
async def revoke(key_id: str, request: Request, caller: UiCaller) -> Response:
    """Revoke a key of the caller's own tenant. An admin key can be revoked by an admin key
    only: an operator must not be able to take the platform team's access away."""
    form = await operator_form(request, caller)
    if isinstance(form, HTMLResponse):
        return form
    parsed = parse_run_id(key_id)
    if parsed is None:
        return done("/ui/keys", "not-found", key_id[:40])
    engine = state_of(request).engine
    own = {key.id: key for key in await list_keys(engine, caller.tenant_id)}
    target = own.get(parsed)
    if target is None or target.revoked_at is not None:
        return done("/ui/keys", "not-found", parsed)
    if "admin" in target.scopes and not caller.is_admin:
        return done("/ui/keys", "admin-key", parsed)
    if not await revoke_key(engine, parsed):
        return done("/ui/keys", "not-found", parsed)
    if parsed == caller.key_id:
        # Its own sessions ended with it, this one included: back to the sign-in form.
        response = RedirectResponse("/ui/sign-in", status_code=303, headers=SECURITY_HEADERS)
        session.forget(response, request)
        return response
    return done("/ui/keys", "revoked", parsed)
