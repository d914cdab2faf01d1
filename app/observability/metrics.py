"""Prometheus metrics, one registry per process (nothing global, nothing shared across
machines).

Counters of run transitions per class are fed by the queue core through its `observer` hook
(the core knows nothing of Prometheus); slot occupancy is read from the pool at scrape time;
HTTP requests are counted by a middleware; queue depth, oldest eligible age and stuck runs come
from the database and are computed by one process at a time (`QueueMetrics`, a maintenance
service), so replicas do not all run the same aggregate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.vocabulary.classes import PriorityClass

TRANSITIONS = (
    "enqueued",
    "claimed",
    "succeeded",
    "failed",
    "cancelled",
    "expired",  # of the cancelled, those past their deadline to start (docs/start-deadlines.md)
    "requeued",
    "released",
    "fenced",
)
# Label values must come from fixed sets: a client controls the method and the path, and every
# distinct label value is a new series kept for the life of the process (and every scrape).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def class_of(priority: int) -> str:
    return PriorityClass.of(priority).value


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.transitions = {
            name: Counter(
                f"turnstile_runs_{name}",
                f"Runs {name}, per priority class.",
                ["class"],
                registry=self.registry,
            )
            for name in TRANSITIONS
        }
        self.claim_wait = Histogram(
            "turnstile_claim_wait_seconds",
            "From the time a run became eligible to its claim, per class.",
            ["class"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
            registry=self.registry,
        )
        self.http_requests = Counter(
            "turnstile_http_requests",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "turnstile_http_request_duration_seconds",
            "HTTP request latency by route.",
            ["route", "method"],
            registry=self.registry,
        )
        self.maintenance_success = Gauge(
            "turnstile_maintenance_last_success_timestamp_seconds",
            "Unix time of each maintenance service's last successful run in this process.",
            ["service"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "turnstile_queue_depth",
            "Non-terminal runs per class and status (from the "
            "database, by the process holding the queue-metrics lease).",
            ["class", "status"],
            registry=self.registry,
        )
        self.oldest_age = Gauge(
            "turnstile_queue_oldest_eligible_age_seconds",
            "Age of the longest-eligible queued run per class.",
            ["class"],
            registry=self.registry,
        )
        self.live_slots = Gauge(
            "turnstile_class_live_slots",
            "Slots of the live worker processes that can claim each class (every process, "
            "from the worker registry).",
            ["class"],
            registry=self.registry,
        )
        self.unserved = Gauge(
            "turnstile_class_unserved",
            "1 when a class has queued runs and no live slot anywhere (a fleet of partial "
            "layouts that leaves it out, or no worker at all): its runs wait for a process "
            "that serves it.",
            ["class"],
            registry=self.registry,
        )
        self.tenant_runs = Gauge(
            "turnstile_tenant_runs",
            "Running and queued runs per tenant and class, for the busiest tenants by queued "
            'runs (20 by default) one by one and every other tenant summed as tenant="other", '
            "so the number of series does not grow with the number of tenants (from the "
            "per-tenant counts the transitions keep, by the process holding the queue-metrics "
            "lease).",
            ["tenant", "class", "status"],
            registry=self.registry,
        )
        # Model budgets (docs/model-budgets.md), from the budgets' rows, which every process's
        # calls keep, by the process holding the queue-metrics lease.
        self.model_requests = Gauge(
            "turnstile_model_requests",
            "Model calls per endpoint: used (settled since the endpoint's first use), "
            "reserved (in flight now, holding a reservation) and booked (waiting for their "
            "turn now).",
            ["endpoint", "state"],
            registry=self.registry,
        )
        self.model_tokens = Gauge(
            "turnstile_model_tokens",
            "Model tokens per endpoint: used (as the provider reported them, since the "
            "endpoint's first use), reserved (estimates held by the calls in flight now) and "
            "booked (estimates the calls waiting for their turn have taken).",
            ["endpoint", "state"],
            registry=self.registry,
        )
        self.model_tenant_requests = Gauge(
            "turnstile_model_tenant_requests",
            "Model calls per endpoint and tenant: used (settled, since the tenant's first call "
            "there), and now reserved (in flight), booked (waiting for their turn on the "
            "endpoint) and tenant_booked (waiting for their turn within the tenant's own "
            "limit).",
            ["endpoint", "tenant", "state"],
            registry=self.registry,
        )
        self.model_tenant_tokens = Gauge(
            "turnstile_model_tenant_tokens",
            "Model tokens per endpoint and tenant: used (as the provider reported them, since "
            "the tenant's first call there), and now reserved (held by its calls in flight), "
            "booked and tenant_booked (taken by its calls waiting for their turn).",
            ["endpoint", "tenant", "state"],
            registry=self.registry,
        )
        self.model_tenant_waits = Gauge(
            "turnstile_model_tenant_waits",
            "Reservations a tenant's own limit on an endpoint refused (each gave its run's slot "
            "back until its turn within the limit), since the tenant's first call there.",
            ["endpoint", "tenant"],
            registry=self.registry,
        )
        self.model_tenant_limit = Gauge(
            "turnstile_model_tenant_limit",
            "A tenant's own limit on an endpoint, a minute (unit: requests or tokens; its "
            "limit on every endpoint where it has none of its own there); absent: none.",
            ["endpoint", "tenant", "unit"],
            registry=self.registry,
        )
        self.model_capacity_waits = Gauge(
            "turnstile_model_capacity_waits",
            "Reservations an endpoint's budget refused (each gave its run's slot back until the "
            "budget had room), since the endpoint's first use.",
            ["endpoint"],
            registry=self.registry,
        )
        self.model_pauses = Gauge(
            "turnstile_model_pauses",
            "429s from the provider that paused an endpoint for every process, since its first "
            "use.",
            ["endpoint"],
            registry=self.registry,
        )
        self.model_paused = Gauge(
            "turnstile_model_paused",
            "1 while a provider's 429 has an endpoint paused.",
            ["endpoint"],
            registry=self.registry,
        )
        self.open_streams = Gauge(
            "turnstile_api_open_streams",
            "Event streams and long polls this API process is serving now (each holds a place "
            "under TURNSTILE_MAX_STREAMS_PER_PROCESS; over it, new ones get 429).",
            registry=self.registry,
        )
        self.stuck = Gauge(
            "turnstile_stuck_runs",
            "Runs stuck per reason: lease_expired, queued_too_long, waiting_too_long.",
            ["reason"],
            registry=self.registry,
        )
        self.notification_queue_usage = Gauge(
            "turnstile_notification_queue_usage_ratio",
            "PostgreSQL's pg_notification_queue_usage(): the share of the cluster's NOTIFY queue "
            "in use. At 1.0, every notifying transition fails; a listener that stopped reading "
            "(a stuck LISTEN session) is what fills it.",
            registry=self.registry,
        )

        # Live output (docs/adr/0007-live-output-deltas.md): each worker process's publisher.
        self.delta_notifications = Counter(
            "turnstile_delta_notifications",
            "Notifications sent on the turnstile_deltas channel by this process (at most 10 a "
            "second, each at most 4,000 bytes).",
            registry=self.registry,
        )
        self.delta_chars_sent = Counter(
            "turnstile_delta_chars_sent",
            "Characters of live output sent as deltas by this process.",
            registry=self.registry,
        )
        self.delta_drops = Counter(
            "turnstile_deltas_dropped",
            "Deltas dropped by this process's publisher: full (its buffer was full: it fell "
            "behind), paused (the notification queue was above 1 %), disconnected.",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("full", "paused", "disconnected"):
            self.delta_drops.labels(reason)

        self.schedules = Gauge(
            "turnstile_schedules",
            "Schedules per state (active, paused), from the database, by the process holding "
            "the scheduler lease.",
            ["state"],
            registry=self.registry,
        )
        self.schedules_without_tick = Gauge(
            "turnstile_schedules_without_tick",
            "Active schedules with no tick queued ahead. Normally 0: a tick's successor is "
            "created as it starts.",
            registry=self.registry,
        )
        self.schedule_overdue = Gauge(
            "turnstile_schedule_most_overdue_seconds",
            "How long past its fire time the most overdue tick ahead still waits to start "
            "(0 when every due tick has started).",
            registry=self.registry,
        )
        self.schedule_ticks_repaired = Counter(
            "turnstile_schedule_ticks_repaired",
            "Schedule ticks the scheduler had to create because the worker pool had not "
            "(a process died between a tick's start and its successor's creation).",
            registry=self.registry,
        )
        self.webhook_attempts = Counter(
            "turnstile_webhook_delivery_attempts",
            "Webhook delivery attempts by outcome: delivered (2xx), retry (timeout, 429, 5xx, "
            "unreachable: the run is retried with the delivery backoff), refused (another "
            "status, a refused destination, a deleted or disabled endpoint: permanent).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("delivered", "retry", "refused"):
            self.webhook_attempts.labels(outcome)
        self.webhook_endpoints_disabled = Counter(
            "turnstile_webhook_endpoints_disabled",
            "Webhook endpoints this process disabled after TURNSTILE_WEBHOOK_DISABLE_AFTER "
            "failed deliveries in a row (each delivery that did so has a "
            "webhook.endpoint_disabled event).",
            registry=self.registry,
        )

        # The worker pool's own load (app/worker/backpressure.py, app/worker/heartbeat.py).
        self.worker_holding_back = Gauge(
            "turnstile_worker_holding_back",
            "1 while this process's worker pool claims nothing because its event loop lags or "
            "its CPU is saturated (TURNSTILE_BACKPRESSURE_MAX_LAG_MS, _MAX_CPU), else 0.",
            registry=self.registry,
        )
        self.worker_held_back_rounds = Counter(
            "turnstile_worker_held_back_rounds",
            "Claim rounds a slot group skipped because the pool was holding back.",
            registry=self.registry,
        )
        self.worker_loop_lag = Gauge(
            "turnstile_worker_loop_lag_seconds",
            "How late the worker's event loop ran its last tick.",
            registry=self.registry,
        )
        self.worker_heartbeat_lag = Gauge(
            "turnstile_worker_heartbeat_lag_seconds",
            "How late the last heartbeat of held leases started (its own thread and "
            "connection), plus how long its statement took.",
            registry=self.registry,
        )

    def webhook_attempt(self, outcome: str) -> None:
        self.webhook_attempts.labels(outcome).inc()

    def webhook_endpoint_disabled(self) -> None:
        self.webhook_endpoints_disabled.inc()

    # --- the queue core's observer ------------------------------------------------------------
    def transition(self, name: str, priority: int, count: int = 1) -> None:
        if count:
            self.transitions[name].labels(class_of(priority)).inc(count)

    def claimed(self, priority: int, waited_seconds: float) -> None:
        klass = class_of(priority)
        self.transitions["claimed"].labels(klass).inc()
        self.claim_wait.labels(klass).observe(max(waited_seconds, 0.0))

    def watch_slots(self, occupancy: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.registry.register(_SlotCollector(occupancy))


class _SlotCollector(Collector):
    def __init__(self, occupancy: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.occupancy = occupancy

    def collect(self) -> Iterable[GaugeMetricFamily]:
        busy = GaugeMetricFamily(
            "turnstile_slots_busy", "Slots holding a run, per slot group.", labels=["group"]
        )
        size = GaugeMetricFamily("turnstile_slots", "Slots per slot group.", labels=["group"])
        for group, state in self.occupancy().items():
            busy.add_metric([group], state["busy"])
            size.add_metric([group], state["size"])
        yield busy
        yield size


def method_label(method: str) -> str:
    """The request's method when it is a standard one, else `other`."""
    return method if method in HTTP_METHODS else "other"


def route_label(scope: Scope) -> str:
    """The matched route's template (fixed by the app's code), else `unmatched`."""
    route: Any = scope.get("route")
    template = getattr(route, "path", None)
    return template if isinstance(template, str) and template else "unmatched"


class HttpMetrics:
    """Counts every request by its route template (not its raw path, so ids do not explode the
    label space), its method (standard ones only) and status, with its latency."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            template = route_label(scope)
            method = method_label(str(scope.get("method", "")))
            self.metrics.http_requests.labels(template, method, str(status)).inc()
            self.metrics.http_latency.labels(template, method).observe(
                time.perf_counter() - started
            )
