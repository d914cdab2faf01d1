"""Settings: every knob Turnstile reads from the environment, validated in one place.

Nothing here runs at import time. `get_settings()` builds the settings once per process (cached)
and tests build their own `Settings(...)` objects directly. Variables carry the `TURNSTILE_`
prefix, except `DATABASE_URL`, which keeps the name every PostgreSQL tool already uses.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.vocabulary.allowed_hosts import parse_allowed
from app.vocabulary.approval_policy import parse_default
from app.vocabulary.deadlines import MAX_START_WITHIN_SECONDS

if TYPE_CHECKING:
    from app.vocabulary.classes import ClassLimits, PriorityClass
    from app.vocabulary.layout import SlotGroup


RUN_WRITE_CONNECTIONS = 10
"""At most this many pooled connections serve the runs' own writes (see `Settings.pool_size`)."""

MIN_SUBMIT_RATE = 1 / 86_400
MAX_SUBMIT_RATE = 1_000_000.0
"""As app/queue/tenant_limits.py's MIN_RATE and MAX_RATE: the same bounds for the default and the
overrides (one a day at least)."""


_DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_origins(value: str) -> tuple[str, ...]:
    """Origins as browsers write them in `Origin` (lower case, no default port, no path), from
    a comma-separated list; a ValueError naming the first one that is not an origin."""
    origins: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        if part == "*":
            origins.append(part)
            continue
        url = urlsplit(part)
        try:
            port = url.port
        except ValueError:
            port = -1
        if (
            url.scheme.lower() not in _DEFAULT_PORTS
            or not url.hostname
            or url.username is not None
            or url.path not in ("", "/")
            or url.query
            or url.fragment
            or port == -1
        ):
            raise ValueError(
                f"{part!r} is not an origin: write scheme://host[:port], such as "
                "https://chat.example.com or http://127.0.0.1:5173 (TURNSTILE_CORS_ORIGINS)"
            )
        scheme, host = url.scheme.lower(), url.hostname.lower()
        if ":" in host:
            host = f"[{host}]"  # an IPv6 address, as an origin writes it
        shown = "" if port is None or port == _DEFAULT_PORTS[scheme] else f":{port}"
        origins.append(f"{scheme}://{host}{shown}")
    if "*" in origins and len(origins) > 1:
        raise ValueError("'*' allows every origin: give it alone (TURNSTILE_CORS_ORIGINS)")
    return tuple(dict.fromkeys(origins))


class Settings(BaseSettings):
    """Validated service settings; see the README's configuration table for each default."""

    model_config = SettingsConfigDict(env_prefix="TURNSTILE_", extra="ignore", frozen=True)

    # --- database ---------------------------------------------------------------------------
    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("DATABASE_URL", "TURNSTILE_DATABASE_URL"),
        description="PostgreSQL URL; unset means the embedded PostgreSQL in data_dir.",
    )
    data_dir: Path = Field(
        default=Path(".turnstile"), description="Folder of the embedded PostgreSQL's data."
    )
    statement_timeout_ms: int = Field(default=30_000, ge=0)
    lock_timeout_ms: int = Field(default=5_000, ge=0)
    idle_in_transaction_timeout_ms: int = Field(default=60_000, ge=0)
    pgbouncer: bool = Field(
        default=False,
        description="DATABASE_URL goes through PgBouncer in transaction pooling mode: no "
        "prepared-statement caches, unique statement names; LISTEN needs LISTEN_DATABASE_URL.",
    )
    db_pool_size: int | None = Field(
        default=None, ge=1, description="Connections per process; derived from slots if unset."
    )

    # --- HTTP server ------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "text"] = Field(
        default="auto",
        description="Log lines as JSON (for a collector) or readable text (for a person); "
        "auto: text when stderr is a terminal, JSON otherwise.",
    )
    http_keep_alive_seconds: int = Field(
        default=75,
        ge=1,
        le=3600,
        description="How long an idle HTTP keep-alive connection stays open. Above common "
        "client and load-balancer idle timeouts (httpx 5 s, AWS ALB 60 s), so the server is "
        "never the side that closes a connection just as a client sends on it.",
    )

    http_header_timeout_seconds: float = Field(
        default=20.0,
        gt=0,
        le=3600,
        description="A request's line and headers must arrive within this, from the "
        "connection's opening or the request's first byte; else the connection is closed "
        "(slow-header clients, app/api/connections.py).",
    )
    http_body_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="A request's whole body must arrive within this, from the service's first "
        "read of it; else 408 request-timeout and the connection is closed.",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="Concurrent HTTP connections (idle keep-alive ones and open streams "
        "included) one API process takes; beyond, new requests answer 503 (uvicorn's "
        "limit_concurrency). Unset: max_streams_per_process + 1,000. Keep it below the "
        "process's open-file limit (ulimit -n) less its database connections.",
    )

    # --- queue ------------------------------------------------------------------------------
    lease_seconds: float = Field(default=30.0, gt=0)
    heartbeat_seconds: float = Field(default=10.0, gt=0)
    max_attempts: int = Field(default=3, ge=1, le=100)
    retry_backoff_base_seconds: float = Field(default=5.0, ge=0)
    retry_backoff_max_seconds: float = Field(default=300.0, ge=0)
    sweep_interval_seconds: float = Field(default=5.0, gt=0)
    # --- start deadlines (docs/start-deadlines.md) ---------------------------------------------
    start_within_interactive: float | None = Field(
        default=None,
        gt=0,
        le=MAX_START_WITHIN_SECONDS,
        allow_inf_nan=False,
        description="The deadline to start of a new interactive run that names none, in "
        "seconds after it becomes eligible: still queued then, it ends cancelled ('expired'). "
        "Unset: none.",
    )
    start_within_async: float | None = Field(
        default=None,
        gt=0,
        le=MAX_START_WITHIN_SECONDS,
        allow_inf_nan=False,
        description="As TURNSTILE_START_WITHIN_INTERACTIVE, for async runs.",
    )
    start_within_maintenance: float | None = Field(
        default=None,
        gt=0,
        le=MAX_START_WITHIN_SECONDS,
        allow_inf_nan=False,
        description="As TURNSTILE_START_WITHIN_INTERACTIVE, for maintenance runs.",
    )
    idempotency_ttl_seconds: float = Field(default=86_400.0, gt=0)
    retention_seconds: float = Field(
        default=7 * 86_400.0,
        gt=0,
        description="Finished sessionless runs older than this are deleted with their events; "
        "failed runs only once dismissed. Runs of a session go with their session.",
    )
    session_retention_seconds: float = Field(
        default=30 * 86_400.0,
        gt=0,
        description="A session idle this long (no turn, no run finishing, no active run, no "
        "undismissed failed run) is deleted whole: its runs, events, inputs, checkpoints and "
        "journal.",
    )
    prune_interval_seconds: float = Field(default=60.0, gt=0)
    queue_metrics_interval_seconds: float = Field(default=15.0, gt=0)
    retention_interval_seconds: float = Field(default=300.0, gt=0)
    schedule_interval_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often the scheduler creates any schedule tick the worker pool did not "
        "(a process died between a tick's claim and its successor's creation).",
    )
    idempotency_wait_seconds: float = Field(
        default=5.0, gt=0, description="How long a request waits for its in-flight twin."
    )
    submit_group_commit: bool = Field(
        default=True,
        description="Turns and sessionless runs that arrive while earlier ones are being "
        "committed go together in one statement, one commit and one notification, each with "
        "its own answer (docs/adr/0012-group-committed-submissions.md). Off: one commit each.",
    )
    # --- turn control (docs/turn-control.md) ---------------------------------------------------
    max_pending_turns: int = Field(
        default=20,
        ge=1,
        le=10_000,
        description="Pending turns (enqueued, interrupting or steering) a session may hold "
        "while its run is active; one more is 429 too-many-pending-turns.",
    )
    interrupt_grace_seconds: float = Field(
        default=10.0,
        gt=0,
        description="How long an interrupted run may take to reach its next boundary (before "
        "its next model or tool call) before it is cancelled as a cancel would (open calls "
        "settled by their idempotency class). Enforced by the sweep, so a dead worker does "
        "not hold an interrupt up longer than this plus a sweep interval.",
    )
    # --- approval before a tool call (docs/approvals.md) ---------------------------------------
    approval_required: str = Field(
        default="",
        description="Which tool calls wait for a user's approval when neither the turn nor its "
        "session says: comma-separated tool names and `class:<safe|keyed|unsafe>` items, e.g. "
        "`http_request,class:unsafe`. Empty (the default): none.",
    )
    # --- tenants (README "Limits and rate limits") ---------------------------------------------
    submit_rate_per_second: float | None = Field(
        default=None,
        description="Submissions (POST /runs, POST /sessions/{id}/turns) each tenant may make a "
        "second, on average: a token bucket per tenant in PostgreSQL, exact across API "
        "processes. Unset: no limit (tenants' own limits may still set one). Over it: 429.",
    )
    submit_burst: int | None = Field(
        default=None,
        description="The bucket's size: submissions a tenant may make at once after a pause. "
        "Unset: one second's worth of the rate (at least 1).",
    )
    # --- fair shares between tenants (docs/adr/0006) -----------------------------------------
    tenant_max_running: str | None = Field(
        default=None,
        description="At most this many running runs per tenant per class, unless the tenant's "
        "own limit says otherwise: one number for every class ('4') or 'class:N,...' "
        "('interactive:2,async:8'; a class left out has no limit). Unset: no limit.",
    )
    tenant_max_queued: int | None = Field(
        default=None,
        ge=0,
        description="At most this many queued runs per tenant, unless its own quota says "
        "otherwise; new runs over it answer 429 queue-quota. Unset: no quota.",
    )
    tenant_max_schedules: int = Field(
        default=100,
        ge=0,
        le=2**31 - 1,
        description="At most this many schedules per tenant (paused ones included), unless its "
        "own limit says otherwise; one more answers 409 limit-reached.",
    )
    tenant_max_webhook_endpoints: int = Field(
        default=20,
        ge=0,
        le=2**31 - 1,
        description="At most this many webhook endpoints per tenant, unless its own limit says "
        "otherwise; one more answers 409 limit-reached.",
    )
    schedule_min_interval_seconds: int = Field(
        default=60,
        ge=1,
        le=2**31 - 1,
        description="The shortest time between two fire times of one schedule, unless its "
        "tenant's own minimum says otherwise; a cron expression firing more often is refused "
        "(422). 1: any cron expression, every second included.",
    )
    fair_claim: bool = Field(
        default=True,
        description="Test-only: off, claims ignore tenants (priority, then eligibility, across "
        "all of them) and apply no concurrency limits. Leave on.",
    )

    # --- runtime -----------------------------------------------------------------------------
    http_allowed_hosts: str = Field(
        default="*",
        description="Hosts http_request and webhooks may reach, comma-separated: names, "
        "'*.suffix', '*' or literal addresses, each optionally with ':port' (that port only; "
        "without one, every port). Internal addresses only when the host is listed by its "
        "exact name or address; link-local and cloud-metadata addresses only when the address "
        "itself is listed.",
    )
    http_timeout_seconds: float = Field(default=10.0, gt=0)
    agent_time_limit_seconds: float = Field(default=600.0, gt=0)
    transient_retries: int = Field(default=3, ge=0, le=20)
    # --- webhooks (README "Webhooks") ---------------------------------------------------------
    secret_key: SecretStr | None = Field(
        default=None,
        description="At least 32 characters; the key webhook signing secrets are encrypted "
        "under (HKDF to AES-GCM). Unset: creating a webhook is refused.",
    )
    webhook_max_attempts: int = Field(default=12, ge=1, le=100)
    webhook_backoff_base_seconds: float = Field(default=30.0, ge=0)
    webhook_backoff_max_seconds: float = Field(default=3600.0, ge=0)
    webhook_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="A webhook delivery's total deadline: connecting, sending and reading the "
        "receiver's whole answer (a receiver trickling its answer byte by byte is cut off at "
        "it, and the delivery retried like a timeout).",
    )
    webhook_disable_after: int = Field(
        default=20,
        ge=1,
        description="Failed deliveries in a row (each after all its attempts) that disable an "
        "endpoint.",
    )
    openai_base_url: str | None = Field(
        default=None,
        description="An OpenAI-compatible endpoint (e.g. https://api.openai.com/v1, or a vLLM or "
        "Ollama server's /v1); set to enable the 'openai' agent.",
    )
    openai_model: str = "gpt-4o-mini"
    openai_api_key: SecretStr | None = None
    openai_timeout_seconds: float = Field(default=60.0, gt=0)
    openai_system_prompt: str | None = None
    openai_max_response_bytes: int = Field(
        default=8_388_608,
        ge=1024,
        description="The largest answer body the 'openai' agent reads from its endpoint (a "
        "streamed answer's bytes in all); beyond it the run fails, nothing more is read.",
    )
    openai_max_line_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        description="The longest line of a streamed answer the 'openai' agent reads (one SSE "
        "event); beyond it the run fails, nothing more is read.",
    )
    openai_stream: bool = Field(
        default=True,
        description="Ask the endpoint to stream (`stream: true`) and show the text live as "
        "`message.delta` events; false for endpoints that cannot stream.",
    )
    openai_max_output_tokens: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="The bound on each answer the 'openai' agent asks for (`max_tokens`); unset: "
        "the endpoint's own. What a model call reserves of its budget beyond its prompt "
        "(unset: 1024 tokens).",
    )
    openai_budget_endpoint: str | None = Field(
        default=None,
        min_length=1,
        max_length=300,
        description="The key of the 'openai' agent's model budget; unset: its model at its base "
        "URL (`gpt-4o-mini@https://api.openai.com/v1`). Processes naming one key share one "
        "budget.",
    )
    model_budgets: bool = Field(
        default=True,
        description="Model calls reserve requests and tokens on their endpoint's budget before "
        "they are sent (docs/model-budgets.md); false: no reservation, no pause, as before.",
    )
    model_rpm: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="Every model endpoint's requests a minute where an admin set none; unset: "
        "unlimited.",
    )
    model_tpm: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="Every model endpoint's tokens a minute (input and output) where an admin "
        "set none; unset: unlimited.",
    )
    model_reservation_seconds: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="The longest a model call's reservation is held: past it (or once its run "
        "lost its lease) its tokens go back to the budget.",
    )
    model_interactive_share: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="The share of a model endpoint's minute an async or maintenance call must "
        "leave for interactive calls while any are in flight or waiting there: a burst of "
        "back-end work cannot spend the whole budget under a user's turns (0: none held).",
    )
    history_max_messages: int = Field(
        default=50,
        ge=0,
        description="At most this many messages of a session's earlier turns go ahead of a "
        "run's own in the 'openai' agent's request; oldest whole exchanges dropped first.",
    )
    history_max_chars: int = Field(
        default=32_000,
        ge=0,
        description="The character budget of that history (contents and tool calls).",
    )
    plugins: str = Field(
        default="", description="'package.module:function,...' adding agents and tools."
    )

    # --- API ---------------------------------------------------------------------------------
    default_agent: str = Field(default="scripted", min_length=1)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    metrics_require_key: bool = Field(
        default=False,
        description="Serve GET /metrics only to admin keys: its figures are queue-wide, across "
        "tenants. Off, anyone who can reach the port may scrape it.",
    )
    max_streams_per_key: int = Field(
        default=100,
        ge=1,
        description="Concurrent event streams and long polls one API key may hold open in one "
        "API process; more answer 429.",
    )
    max_streams_per_tenant: int | None = Field(
        default=None,
        ge=1,
        description="Concurrent event streams and long polls the keys of one tenant may hold "
        "open in one API process, all together; more answer 429. Unset: a quarter of "
        "max_streams_per_process, so one tenant (with however many keys) cannot take a "
        "process's every place.",
    )
    max_streams_per_process: int = Field(
        default=1_000,
        ge=1,
        description="Concurrent event streams and long polls one API process serves; more "
        "answer 429.",
    )
    stream_key_recheck_seconds: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="How often an API process checks that the keys holding event streams and "
        "long polls open are still unrevoked (one statement for all of them); a revoked key's "
        "streams end with a stream.ended event, its long polls with 401.",
    )
    cors_origins: str = Field(
        default="",
        description="Origins whose web pages may call the API from a browser (CORS): "
        "'scheme://host[:port]', comma-separated, or '*' for any. Unset: none, and no CORS "
        "header is sent. Browsers send no cookies along: the API takes bearer keys only.",
    )
    trust_forwarded_headers: bool = Field(
        default=False,
        description="Behind a TLS-terminating proxy you control: honour its X-Forwarded-Proto "
        "(https marks the dashboard's cookie Secure). Leave off when clients reach the service "
        "directly, or anyone could claim https.",
    )

    # --- dashboard -----------------------------------------------------------------------------
    ui_session_seconds: float = Field(
        default=43_200.0,
        gt=0,
        le=30 * 86_400,
        description="How long a dashboard sign-in lasts (12 h), however active.",
    )

    # --- worker pool ------------------------------------------------------------------------
    # Agent runs spend their time waiting on models, not on this process's CPU: the default
    # serves 64 async runs at once (a backlog drains at about a third of the commit ceiling,
    # docs/performance.md) and 8 chat turns, for the same connections as fewer slots
    # (pool_size below). Model budgets keep a provider's limits, not the slot count.
    slots: str = Field(
        default="interactive:8,async:64,maintenance:1",
        description="Slot groups, e.g. 'interactive:4,async+interactive:2,maintenance:1'.",
    )
    partial_layout: bool = Field(
        default=False,
        description="Let `slots` leave classes out, for a process dedicated to some classes "
        "(docs/adr/0005); the fleet must then cover every class.",
    )
    run_workers: bool = Field(default=True, description="Run the worker pool inside serve.")
    poll_interval_seconds: float = Field(default=2.0, gt=0)
    claim_batch_max: int = Field(
        default=128,
        ge=1,
        description="At most this many runs in one claim of a slot group, however many slots "
        "are free: a 5,000-slot pool fills in steps it can start, not in one batch it cannot.",
    )
    backpressure_max_lag_ms: float = Field(
        default=200.0,
        gt=0,
        description="The pool stops claiming while its event loop runs this late (a ticker "
        "measures it) and starts again once it catches up (turnstile_worker_holding_back).",
    )
    backpressure_max_cpu: float = Field(
        default=0.95,
        gt=0,
        le=1,
        description="The pool stops claiming while its event loop's thread uses more than this "
        "share of one core (over the last second); 1: CPU alone never holds claims back.",
    )
    drain_grace_seconds: float = Field(default=10.0, ge=0)
    worker_start_timeout_seconds: float = Field(
        default=300.0,
        ge=0,
        description="How long `turnstile worker` keeps retrying, with backoff, a database it "
        "cannot reach at start (a fleet may start before its database); 0: fail at once.",
    )
    listen_database_url: str | None = Field(
        default=None,
        description="Direct PostgreSQL URL for LISTEN when DATABASE_URL goes through PgBouncer.",
    )

    @field_validator("database_url", "listen_database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        # Checked here, so a MySQL URL or a typo is one line at start, not a traceback from
        # the first connection.
        if value is None or not value.strip():
            return None
        from urllib.parse import urlsplit

        # The scheme only (`postgresql`, `postgresql+asyncpg`...): the rest, a libpq multi-host
        # list of hosts included, is app/store/engine.py's to read, with its own one-line errors.
        try:
            backend = urlsplit(value).scheme.partition("+")[0].lower() or None
        except ValueError:
            backend = None
        if backend not in ("postgresql", "postgres"):
            raise ValueError(
                "must be a PostgreSQL URL such as postgresql://user:password@host:5432/dbname"
                + (f", not {backend}://" if backend else "")
            )
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        # People write INFO as often as info.
        return value.lower() if isinstance(value, str) else value

    @field_validator("approval_required")
    @classmethod
    def _check_approval_required(cls, value: str) -> str:
        parse_default(value)  # a ValueError names the bad item
        return value

    @field_validator("http_allowed_hosts")
    @classmethod
    def _check_allowed_hosts(cls, value: str) -> str:
        for entry in value.split(","):
            if entry.strip():
                parse_allowed(entry)  # its ValueError names the entry and what is wrong
        return value

    @field_validator("submit_rate_per_second")
    @classmethod
    def _check_submit_rate(cls, value: float | None) -> float | None:
        # One message for 0, negatives, inf and nan alike: what to write instead.
        if value is not None and not (
            math.isfinite(value) and MIN_SUBMIT_RATE <= value <= MAX_SUBMIT_RATE
        ):
            raise ValueError(
                f"must be a number of submissions a second from {MIN_SUBMIT_RATE:.9g} (one a "
                f"day) to {MAX_SUBMIT_RATE:g} (TURNSTILE_SUBMIT_RATE_PER_SECOND; unset it for "
                "no limit)"
            )
        return value

    @field_validator("submit_burst")
    @classmethod
    def _check_submit_burst(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= 2**31 - 1:
            raise ValueError(
                "must be a whole number of submissions of at least 1 (TURNSTILE_SUBMIT_BURST; "
                "unset it for one second's worth of the rate)"
            )
        return value

    @field_validator("cors_origins")
    @classmethod
    def _check_cors_origins(cls, value: str) -> str:
        return ",".join(parse_origins(value))

    @property
    def cors_origin_list(self) -> tuple[str, ...]:
        """TURNSTILE_CORS_ORIGINS as the origins a browser sends (empty: CORS off)."""
        return tuple(origin for origin in self.cors_origins.split(",") if origin)

    @field_validator("slots")
    @classmethod
    def _check_slots(cls, value: str) -> str:
        from app.vocabulary.layout import parse_slots

        # The syntax here; whether every class is covered depends on partial_layout, checked
        # with the other fields in _check_cross_field.
        parse_slots(value, partial=True)
        return value

    @field_validator("tenant_max_running")
    @classmethod
    def _check_tenant_max_running(cls, value: str | None) -> str | None:
        from app.vocabulary.classes import parse_class_limits

        if value is None or not value.strip():
            return None
        parse_class_limits(value)  # its ValueError names the part that is wrong
        return value

    @property
    def start_within_defaults(self) -> dict[PriorityClass, float]:
        """TURNSTILE_START_WITHIN_<CLASS> by class, the classes without one left out."""
        from app.vocabulary.classes import PriorityClass

        given = {
            PriorityClass.INTERACTIVE: self.start_within_interactive,
            PriorityClass.ASYNC: self.start_within_async,
            PriorityClass.MAINTENANCE: self.start_within_maintenance,
        }
        return {klass: seconds for klass, seconds in given.items() if seconds is not None}

    @property
    def tenant_running_limits(self) -> ClassLimits:
        """TURNSTILE_TENANT_MAX_RUNNING by class band (None: no limit)."""
        from app.vocabulary.classes import parse_class_limits

        if self.tenant_max_running is None:
            return (None, None, None)
        return parse_class_limits(self.tenant_max_running)

    @property
    def connection_limit(self) -> int:
        """TURNSTILE_MAX_CONNECTIONS, or the stream places plus 1,000 for plain requests."""
        if self.max_connections is not None:
            return self.max_connections
        return self.max_streams_per_process + 1_000

    @property
    def stream_tenant_limit(self) -> int:
        """TURNSTILE_MAX_STREAMS_PER_TENANT, or a quarter of the process's places."""
        if self.max_streams_per_tenant is not None:
            return self.max_streams_per_tenant
        return max(1, self.max_streams_per_process // 4)

    @property
    def slot_groups(self) -> tuple[SlotGroup, ...]:
        from app.vocabulary.layout import parse_slots

        return parse_slots(self.slots, partial=self.partial_layout)

    @property
    def total_slots(self) -> int:
        return sum(group.size for group in self.slot_groups)

    @property
    def pool_size(self) -> int:
        """Connections per process, sized for the statements in flight, not for the slots: a
        run awaiting a model or a tool holds no connection, and a run's writes are short. Per
        slot group a completion batch, and its claim loop unless claims have their own
        connections (`claim_pool_size`; not behind PgBouncer); for the runs' own writes (tool
        journal, checkpoints, waits, failures) up to ten at once, fewer with fewer slots; and
        two for the registry, maintenance and the API's requests (the heartbeats have their
        own thread's connection). A 2,000-slot worker needs 19 in all (plus the share for
        bursts: app/store/engine.py, pool_limit), not 2,000."""
        if self.db_pool_size is not None:
            return self.db_pool_size
        per_group = 2 if self.pgbouncer else 1
        return min(self.total_slots, RUN_WRITE_CONNECTIONS) + per_group * len(self.slot_groups) + 2

    @property
    def claim_pool_size(self) -> int:
        """The claim engine's connections (app/store/engine.py, create_claim_engine): one per
        slot group, whose claim loop makes one claim at a time."""
        return len(self.slot_groups)

    @model_validator(mode="after")
    def _check_cross_field(self) -> Settings:
        from app.vocabulary.layout import SlotLayoutError

        try:
            self.slot_groups  # noqa: B018 (validated for its error)
        except SlotLayoutError as exc:
            hint = "" if self.partial_layout else "; see TURNSTILE_PARTIAL_LAYOUT"
            raise ValueError(f"TURNSTILE_SLOTS: {exc}{hint}") from None
        # A heartbeat must land well inside the lease, or a healthy but briefly delayed worker
        # loses its run to the sweeper; three heartbeats per lease leaves room for two misses.
        if self.heartbeat_seconds * 3 > self.lease_seconds:
            raise ValueError(
                f"TURNSTILE_HEARTBEAT_SECONDS ({self.heartbeat_seconds:g}) must be at most a "
                f"third of TURNSTILE_LEASE_SECONDS ({self.lease_seconds:g})"
            )
        if self.pgbouncer and not self.listen_database_url:
            raise ValueError(
                "TURNSTILE_PGBOUNCER needs TURNSTILE_LISTEN_DATABASE_URL: LISTEN cannot work "
                "through transaction pooling, so give a direct PostgreSQL URL for it"
            )
        if (
            self.max_streams_per_tenant is not None
            and self.max_streams_per_tenant > self.max_streams_per_process
        ):
            raise ValueError(
                f"TURNSTILE_MAX_STREAMS_PER_TENANT ({self.max_streams_per_tenant}) must not "
                f"exceed TURNSTILE_MAX_STREAMS_PER_PROCESS ({self.max_streams_per_process}); it "
                "could never apply"
            )
        if self.secret_key is not None and len(self.secret_key.get_secret_value()) < 32:
            raise ValueError("TURNSTILE_SECRET_KEY must be at least 32 characters")
        if self.webhook_backoff_max_seconds < self.webhook_backoff_base_seconds:
            raise ValueError(
                "TURNSTILE_WEBHOOK_BACKOFF_MAX_SECONDS must be at least "
                "TURNSTILE_WEBHOOK_BACKOFF_BASE_SECONDS"
            )
        if self.retry_backoff_max_seconds < self.retry_backoff_base_seconds:
            raise ValueError(
                "TURNSTILE_RETRY_BACKOFF_MAX_SECONDS must be at least "
                "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS"
            )
        if (
            self.statement_timeout_ms
            and self.lock_timeout_ms
            and self.lock_timeout_ms > self.statement_timeout_ms
        ):
            raise ValueError(
                "TURNSTILE_LOCK_TIMEOUT_MS must not exceed TURNSTILE_STATEMENT_TIMEOUT_MS"
            )
        return self


def environment_name(field: str) -> str:
    """The environment variable that sets a field: TURNSTILE_<FIELD>, or DATABASE_URL."""
    return "DATABASE_URL" if field == "database_url" else f"TURNSTILE_{field.upper()}"


def setting_error(exc: ValidationError) -> str:
    """The first problem of invalid settings as one line a person can act on: the environment
    variable to change (never the field's Python name), what is wrong, and the value given."""
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    message = str(first["msg"]).removeprefix("Value error, ")
    if field.isupper():  # an alias (DATABASE_URL) is its own variable's name
        return f"{field}: {message}"
    if field not in Settings.model_fields:
        return message  # a check across fields: its message names the variables itself
    given = first.get("input")
    # Never a key's or a URL's value (a password may be inside): logs and terminals are shared.
    private = "key" in field or "url" in field
    shown = f" (got {given!r})" if isinstance(given, str) and not private else ""
    return f"{environment_name(field)}: {message}{shown}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    return Settings()
