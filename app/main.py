"""The app factory and its lifespan: what `turnstile serve` runs.

Nothing starts at import. `create_app()` returns a FastAPI app whose lifespan resolves the
database (DATABASE_URL or the embedded server), builds the engine, the queue, the LISTEN
notifier, the worker pool and the sweeper, and stops them in reverse order on the way out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import RedirectResponse
from fastapi_offline import FastAPIOffline
from sqlalchemy.ext.asyncio import AsyncEngine

from app.api.auth import KeyCache
from app.api.services import ServiceState
from app.api.watch import KeyRecheck, LiveWatch, RunWatch, StreamLimits
from app.assembly import budget_defaults, limit_defaults, queue_config, submissions_for
from app.config import Settings, get_settings
from app.maintenance.maintainer import Maintainer
from app.observability import tracing
from app.observability.metrics import HttpMetrics, Metrics
from app.queue.core import Clock, Queue
from app.queue.holdings import Holdings
from app.queue.model_budgets import ModelBudgets
from app.queue.reads import Reads
from app.queue.scheduling import Schedules
from app.queue.submit import Submissions
from app.queue.tenant_limits import Tenants
from app.queue.webhook_endpoints import Webhooks
from app.runtime.executor import RuntimeExecutor, RuntimeLimits, default_registry
from app.runtime.http_tool import HttpRequestTool
from app.runtime.openai_agent import OpenAIAgent
from app.runtime.outbound import ModelClient
from app.runtime.plugins import load_plugins
from app.runtime.webhook_delivery import AGENT as WEBHOOK_AGENT
from app.runtime.webhook_delivery import TOOL as WEBHOOK_TOOL
from app.runtime.webhook_delivery import WebhookAgent, WebhookDeliveryTool
from app.security.api_keys import active_keys
from app.security.secret_box import SecretBox
from app.store.engine import create_claim_engine, create_engine
from app.store.resolve import ResolvedDatabase, resolve_database
from app.vocabulary.approval_policy import parse_default
from app.worker.backpressure import Backpressure
from app.worker.deltas import DeltaPublisher
from app.worker.execution import Executor
from app.worker.notifier import Notifier
from app.worker.pool import WorkerPool


@dataclass
class AppState:
    """Everything the lifespan built, reachable from request handlers via `app.state.turnstile`."""

    settings: Settings
    database: ResolvedDatabase
    engine: AsyncEngine
    queue: Queue
    notifier: Notifier
    pool: WorkerPool | None
    submissions: Submissions
    reads: Reads
    schedules: Schedules
    tenants: Tenants
    agents: frozenset[str]
    metrics: Metrics
    webhooks: Webhooks
    secret_box: SecretBox | None
    egress: HttpRequestTool
    streams: StreamLimits
    watch: RunWatch = field(default_factory=RunWatch)
    live: LiveWatch = field(default_factory=LiveWatch)
    deltas: DeltaPublisher | None = None
    # Set when the process is asked to stop, before uvicorn waits for open connections:
    # long polls and event streams watch it so they end promptly.
    shutdown: asyncio.Event = field(default_factory=asyncio.Event)
    key_cache: KeyCache = field(default_factory=KeyCache)


def _serves_the_api(state: AppState) -> ServiceState:
    """Never called: mypy checks here that AppState offers every service the handlers reach
    through `state_of` (app/api/services.py), so the two cannot drift apart."""
    return state


@asynccontextmanager
async def services(
    settings: Settings,
    executor: Executor | None = None,
    *,
    role: str = "serve",
    metrics: Metrics | None = None,
    clock: Clock | None = None,
) -> AsyncIterator[AppState]:
    """Start the database, queue, notifier, worker pool and sweeper; stop them in reverse.

    Shared by the HTTP service's lifespan and by `turnstile worker`, which runs no HTTP server.
    """
    database = await asyncio.to_thread(resolve_database, settings)
    # A worker's writes wait up to half a lease for a primary (a failover: docs/deployment.md),
    # rather than give up the runs they were for; the API answers 503 at once instead.
    patience = settings.lease_seconds / 2 if role == "worker" else 0.0
    engine = create_engine(
        settings,
        database.url,
        pool_size=settings.pool_size,
        application_name=f"turnstile {role}",
        connect_patience_seconds=patience,
    )
    claim_engine = create_claim_engine(
        settings,
        database.url,
        application_name=f"turnstile {role} claims",
        connect_patience_seconds=patience,
    )
    metrics = metrics or Metrics()
    queue = Queue(
        engine, queue_config(settings), clock=clock, observer=metrics, claim_engine=claim_engine
    )

    def succeeded(service: str) -> None:
        metrics.maintenance_success.labels(service).set(time.time())

    allowed_hosts = [h for h in settings.http_allowed_hosts.split(",") if h.strip()]
    registry = default_registry(allowed_hosts, settings.http_timeout_seconds)
    # Webhooks: the endpoints in the core, the secrets' box (None without TURNSTILE_SECRET_KEY)
    # and the `webhook` agent that delivers, through the same egress checks as http_request,
    # each delivery within its total deadline. Endpoints are capped per tenant (holdings).
    egress = HttpRequestTool(
        allowed_hosts,
        timeout_seconds=settings.http_timeout_seconds,
        deadline_seconds=settings.webhook_timeout_seconds,
    )
    secret_box = SecretBox(settings.secret_key.get_secret_value()) if settings.secret_key else None
    holdings = Holdings(limit_defaults(settings))
    webhooks = Webhooks(queue, disable_after=settings.webhook_disable_after, holdings=holdings)
    registry.internal_agents[WEBHOOK_AGENT] = WebhookAgent()
    registry.internal_tools[WEBHOOK_AGENT] = {
        WEBHOOK_TOOL: WebhookDeliveryTool(
            webhooks,
            egress,
            secret_box,
            on_attempt=metrics.webhook_attempt,
            on_disabled=metrics.webhook_endpoint_disabled,
        )
    }
    # Shared, and sized so every slot can have its model call in flight at once.
    http_client = ModelClient(max(settings.total_slots, 1))
    if settings.openai_base_url:
        registry.agents["openai"] = OpenAIAgent(
            base_url=settings.openai_base_url,
            model=settings.openai_model,
            api_key=(
                settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
            ),
            tools=lambda: registry.tools,
            timeout_seconds=settings.openai_timeout_seconds,
            retries=settings.transient_retries,
            system_prompt=settings.openai_system_prompt,
            client=http_client,
            history_max_messages=settings.history_max_messages,
            history_max_chars=settings.history_max_chars,
            stream=settings.openai_stream,
            max_response_bytes=settings.openai_max_response_bytes,
            max_line_bytes=settings.openai_max_line_bytes,
            max_output_tokens=settings.openai_max_output_tokens,
            budget_endpoint=settings.openai_budget_endpoint,
        )
    load_plugins(settings.plugins, registry)
    runtime = RuntimeExecutor(
        registry,
        RuntimeLimits(
            transient_retries=settings.transient_retries,
            default_time_limit_seconds=settings.agent_time_limit_seconds,
        ),
        budgets=ModelBudgets(queue, budget_defaults(settings)) if settings.model_budgets else None,
        approval_default=parse_default(settings.approval_required),
    )
    notifier = Notifier(
        settings.listen_database_url or database.url,
        application_name=f"turnstile {role} listen",
        # Only processes that hold streams hear the live output (docs/adr/0007).
        listen_deltas=role != "worker",
    )
    # The live output of this process's runs: its own connection, never the pool's (a direct
    # one, like LISTEN's, since PgBouncer in transaction mode would share it).
    deltas = (
        DeltaPublisher(
            settings.listen_database_url or database.url,
            metrics=metrics,
            application_name=f"turnstile {role} deltas",
        )
        if settings.run_workers
        else None
    )
    pool: WorkerPool | None = None
    maintainer: Maintainer | None = None
    key_recheck: KeyRecheck | None = None
    # Traces, when the standard OTEL_* settings ask for them (off by default, nothing imported).
    stop_tracing = tracing.configure_from_env(role)
    try:
        await notifier.start()
        if deltas is not None:
            await deltas.start()
        # Every process registers in `workers`; an API-only one with no slot groups.
        pool = WorkerPool(
            queue,
            executor or runtime,
            settings.slot_groups if settings.run_workers else (),
            lease_seconds=settings.lease_seconds,
            heartbeat_seconds=settings.heartbeat_seconds,
            poll_interval_seconds=settings.poll_interval_seconds,
            notifier=notifier,
            role=role if settings.run_workers else "api",
            deltas=deltas,
            claim_batch_max=settings.claim_batch_max,
            backpressure=Backpressure(
                max_lag_seconds=settings.backpressure_max_lag_ms / 1000,
                max_cpu=settings.backpressure_max_cpu,
            ),
            metrics=metrics,
            # Its own connection, with every setting of the process's (timeouts, PgBouncer's).
            heartbeat_engine=lambda: create_engine(
                settings,
                database.url,
                pool_size=1,
                application_name=f"turnstile {role} heartbeat",
            ),
        )
        await pool.start()
        if pool.groups:
            metrics.watch_slots(pool.occupancy)
        if settings.run_workers:
            maintainer = Maintainer(
                queue, settings, metrics, holder=pool.worker_id, on_success=succeeded
            )
            notifier.on_deadlines(maintainer.expirer.deadline_submitted)
            maintainer.start()
        submissions = submissions_for(queue, settings)
        state = AppState(
            settings=settings,
            database=database,
            engine=engine,
            queue=queue,
            notifier=notifier,
            pool=pool,
            submissions=submissions,
            reads=Reads(queue),
            schedules=Schedules(queue, keys=submissions, holdings=holdings),
            tenants=Tenants(queue, limit_defaults(settings)),
            agents=registry.agent_names(),
            metrics=metrics,
            webhooks=webhooks,
            secret_box=secret_box,
            egress=egress,
            streams=StreamLimits(
                per_key=settings.max_streams_per_key,
                per_tenant=settings.stream_tenant_limit,
                per_process=settings.max_streams_per_process,
            ),
            deltas=deltas,
        )
        # Read at each scrape: the places held now (the event loop's own count).
        metrics.open_streams.set_function(lambda: state.streams.open)
        notifier.on_runs(state.watch.notify)
        notifier.on_deltas(state.live.deliver)
        notifier.on_sessions(state.live.sessions_notified)
        # Streams and long polls of keys revoked while they are open end (app/api/watch.py).
        key_recheck = KeyRecheck(
            state.streams,
            lambda key_ids: active_keys(engine, key_ids),
            interval=settings.stream_key_recheck_seconds,
            forget=state.key_cache.forget,
        )
        key_recheck.start()
        yield state
    finally:
        if key_recheck is not None:
            await key_recheck.stop()
        if maintainer is not None:
            await maintainer.stop()
        if pool is not None:
            await pool.stop(settings.drain_grace_seconds)
        if deltas is not None:
            await deltas.stop()
        await notifier.stop()
        await http_client.aclose()
        await engine.dispose()
        if claim_engine is not None:
            await claim_engine.dispose()
        if stop_tracing is not None:
            # Last, so the drain's spans go too; the flush sends, so off the event loop.
            await asyncio.to_thread(stop_tracing)


def create_app(
    settings: Settings | None = None,
    executor: Executor | None = None,
    *,
    clock: Clock | None = None,
) -> FastAPI:
    """The app: routes, error handlers, and a lifespan that builds and stops the services.
    `clock` (tests) replaces the database's now() in every queue statement."""
    settings = settings or get_settings()
    shutdown = asyncio.Event()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with services(settings, executor, metrics=metrics, clock=clock) as state:
            state.shutdown = shutdown
            app.state.turnstile = state
            yield

    # /docs loads Swagger UI from files the fastapi-offline package ships, served under
    # /static/docs: it works with no internet (air-gapped sites). No /redoc: ReDoc still fetches
    # its logo from a CDN.
    app = FastAPIOffline(
        redoc_url=None,
        title="Turnstile",
        summary="A durable run queue for AI-agent turns, on PostgreSQL.",
        description=API_DESCRIPTION,
        version="0.1.0",
        lifespan=lifespan,
        static_url="/static/docs",
        # Swagger UI would otherwise ask validator.swagger.io to check the document.
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.state.shutdown = shutdown
    from app.api import (
        a2a_routes,
        budgets,
        conversation_routes,
        health,
        problems,
        responses_routes,
        runbook,
        runs,
        schedules,
        sessions,
        tenants,
        webhooks,
    )
    from app.api.forwarded import ForwardedProto
    from app.api.limits import BodyLimit

    problems.install(app)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        timeout_seconds=settings.http_body_timeout_seconds,
    )
    if settings.trust_forwarded_headers:
        app.add_middleware(ForwardedProto)
    if settings.cors_origin_list:
        # Outside the body limit and the error handlers, so a browser can read every answer
        # (a 413 or a problem+json 4xx included); inside the metrics, which count preflights.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origin_list),
            allow_methods=CORS_METHODS,
            allow_headers=CORS_REQUEST_HEADERS,
            expose_headers=CORS_EXPOSED_HEADERS,
            # Bearer keys only: the dashboard's cookie must never ride along on another
            # origin's request, so no Access-Control-Allow-Credentials.
            allow_credentials=False,
            max_age=600,
        )
    app.add_middleware(HttpMetrics, metrics=metrics)
    app.include_router(health.router)
    app.include_router(sessions.router)
    # The runbook's fixed paths (/runs/stuck, /runs/failed) before /runs/{run_id}.
    app.include_router(runbook.runbook)
    app.include_router(runs.router)
    app.include_router(schedules.router)
    app.include_router(webhooks.router)
    app.include_router(tenants.router)
    app.include_router(budgets.router)
    # The OpenAI Responses API at /v1, with its own error shape there (issue 35).
    responses_routes.install(app)
    app.include_router(conversation_routes.router)
    # The Agent2Agent protocol: the agent card and JSON-RPC at /a2a, its own error shape there.
    a2a_routes.install(app)
    from app.ui import routes as ui

    ui.install(app)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        # A person who opens the bare address lands on the API's interactive reference.
        return RedirectResponse("/docs", status_code=307)

    return app


# CORS (TURNSTILE_CORS_ORIGINS): what a page on an allowed origin may send and read. Request
# headers beyond the CORS-safelisted ones: the key, submissions' idempotency, a stream's resume
# point, a conditional read, trace context. Response headers its script may read: where a new
# run is, whether an answer was replayed, the rate limit, when to retry, a run's version.
CORS_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
CORS_REQUEST_HEADERS = [
    "Authorization",
    "Content-Type",
    "Idempotency-Key",
    "Last-Event-ID",
    "If-None-Match",
    "traceparent",
    "tracestate",
]
CORS_EXPOSED_HEADERS = [
    "Location",
    "Idempotent-Replayed",
    "RateLimit",
    "RateLimit-Policy",
    "Retry-After",
    "ETag",
]

API_DESCRIPTION = """
Chat clients post a user's turn to a session (`POST /sessions/{id}/turns`, with an
`Idempotency-Key`) and poll the run (`GET /runs/{id}?wait=30`) or follow its events
(`GET /runs/{id}/events` with `Accept: text/event-stream`). Back-end services submit
sessionless runs (`POST /runs`) and schedules of them (`POST /schedules`). Operators use the
runbook endpoints. Every error is
`application/problem+json` with a stable `type`. Authenticate with `Authorization: Bearer <key>`
(`turnstile keys create`).
"""
