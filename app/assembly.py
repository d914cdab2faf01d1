"""The queue core's services built from the settings: the one place that turns `Settings`
into the plain values the core takes (the core knows no settings, tests/test_architecture.py),
shared by the app factory (app/main.py) and the CLI (app/cli.py), which opens the same services
without loading the HTTP layer, the runtime or the worker pool."""

from __future__ import annotations

from app.config import Settings
from app.queue.core import Queue, QueueConfig
from app.queue.model_budgets import BudgetDefaults
from app.queue.submit import Submissions
from app.queue.tenant_limits import LimitDefaults
from app.vocabulary.classes import PriorityClass


def queue_config(settings: Settings) -> QueueConfig:
    """The queue core's settings, taken from the service's (the core knows no Settings)."""
    return QueueConfig(
        lease_seconds=settings.lease_seconds,
        max_attempts=settings.max_attempts,
        backoff_base_seconds=settings.retry_backoff_base_seconds,
        backoff_max_seconds=settings.retry_backoff_max_seconds,
        webhook_max_attempts=settings.webhook_max_attempts,
        webhook_backoff_base_seconds=settings.webhook_backoff_base_seconds,
        webhook_backoff_max_seconds=settings.webhook_backoff_max_seconds,
        direct_calls=not settings.pgbouncer,
        tenant_max_running=settings.tenant_running_limits,
        tenant_max_queued=settings.tenant_max_queued,
        fair_claim=settings.fair_claim,
    )


def submissions_for(queue: Queue, settings: Settings) -> Submissions:
    return Submissions(
        queue,
        default_agent=settings.default_agent,
        idempotency_ttl_seconds=settings.idempotency_ttl_seconds,
        idempotency_wait_seconds=settings.idempotency_wait_seconds,
        lock_timeout_ms=settings.lock_timeout_ms,
        submit_rate_per_second=settings.submit_rate_per_second,
        submit_burst=settings.submit_burst,
        start_within=settings.start_within_defaults,
        max_pending_turns=settings.max_pending_turns,
        interrupt_grace_seconds=settings.interrupt_grace_seconds,
        group_commit=settings.submit_group_commit,
    )


def budget_defaults(settings: Settings) -> BudgetDefaults:
    """Every model endpoint's budget where an admin set none (TURNSTILE_MODEL_RPM,
    TURNSTILE_MODEL_TPM; unset: unlimited), the longest a reservation is held
    (TURNSTILE_MODEL_RESERVATION_SECONDS), and the share held for interactive calls
    (TURNSTILE_MODEL_INTERACTIVE_SHARE)."""
    return BudgetDefaults(
        requests_per_minute=settings.model_rpm,
        tokens_per_minute=settings.model_tpm,
        reservation_seconds=settings.model_reservation_seconds,
        interactive_share=settings.model_interactive_share,
    )


def limit_defaults(settings: Settings) -> LimitDefaults:
    """Every tenant's limits where it has no override of its own (TURNSTILE_TENANT_MAX_RUNNING,
    TURNSTILE_TENANT_MAX_QUEUED, TURNSTILE_SUBMIT_RATE_PER_SECOND, TURNSTILE_SUBMIT_BURST,
    TURNSTILE_TENANT_MAX_SCHEDULES, TURNSTILE_TENANT_MAX_WEBHOOK_ENDPOINTS,
    TURNSTILE_SCHEDULE_MIN_INTERVAL_SECONDS)."""
    running = settings.tenant_running_limits  # by class band: interactive, async, maintenance
    return LimitDefaults(
        max_running={
            klass: limit
            for klass, limit in zip(PriorityClass, running, strict=True)
            if limit is not None
        },
        max_queued=settings.tenant_max_queued,
        submit_rate_per_second=settings.submit_rate_per_second,
        submit_burst=settings.submit_burst,
        max_schedules=settings.tenant_max_schedules,
        max_webhook_endpoints=settings.tenant_max_webhook_endpoints,
        min_schedule_interval_seconds=settings.schedule_min_interval_seconds,
    )
