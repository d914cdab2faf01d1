"""Table definitions: the schema Turnstile's migrations create, as SQLAlchemy Core tables.

These definitions are the reference the migration test compares against (no drift allowed).
Queue statements do not go through them: the queue's SQL lives in `app/store/sql/*.sql`.
Partial-index predicates and CHECK constraints are spelled here exactly as in the migration,
because autogenerate compares neither; the migration tests read them back from the catalog.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from app.vocabulary import statuses

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

RUN_STATUSES = tuple(status.value for status in statuses.ALL)
# SQL spelling of the non-terminal statuses, shared by the partial unique index and the checks.
ACTIVE_STATUS_SQL = f"status IN ({statuses.sql_list(statuses.ACTIVE)})"

now = text("now()")

MULTITASK_POLICIES = ("reject", "enqueue", "interrupt", "steer")
MULTITASK_SQL = "(" + ", ".join(f"'{policy}'" for policy in MULTITASK_POLICIES) + ")"


def _ts(name: str, *, nullable: bool = True, default_now: bool = False) -> Column[object]:
    return Column(
        name,
        DateTime(timezone=True),
        nullable=nullable,
        server_default=now if default_now else None,
    )


sessions = Table(
    "sessions",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("tenant_id", Text, nullable=False),
    Column("principal", Text, nullable=False),
    _ts("created_at", nullable=False, default_now=True),
    # When a turn last reached the session (every submission that locks it sets it): session
    # retention deletes a session idle past its own period whole, scanning this index.
    _ts("last_activity_at", nullable=False, default_now=True),
    # A conversation's metadata (the OpenAI Conversations API, migration 0020): 16 string
    # pairs at most, checked by the API; the CHECK bounds its size whoever writes it.
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    CheckConstraint(
        "jsonb_typeof(metadata) = 'object' AND octet_length(CAST(metadata AS text)) <= 65536",
        name="metadata",
    ),
    # What a turn does when the session's run is queued or running (docs/turn-control.md);
    # a turn's own `multitask` overrides it.
    Column("multitask", Text, nullable=False, server_default=text("'reject'")),
    CheckConstraint(f"multitask IN {MULTITASK_SQL}", name="multitask"),
    # Which tool calls of the session's runs wait for a user's approval (docs/approvals.md):
    # {"tools": [...], "classes": [...]}; NULL: the process default. A turn's own overrides it.
    Column("approval", JSONB, nullable=True),
    Index("ix_sessions_tenant_id_created_at", "tenant_id", "created_at"),
    Index("ix_sessions_last_activity_at", "last_activity_at"),
)

# runs, run_events and run_inputs carry storage parameters (fillfactor, per-table autovacuum)
# set by migration 0008; Table has no option for them and autogenerate does not compare them,
# so tests/store/test_migrations.py reads them back from pg_class.
runs = Table(
    "runs",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("tenant_id", Text, nullable=False),
    Column("principal", Text, nullable=False),
    Column("session_id", UUID(as_uuid=True), ForeignKey("sessions.id"), nullable=True),
    # The run's number within its session (1, 2, ...), assigned by enqueue under the session
    # lock; with an event's seq it orders the session's transcript (and its stream ids).
    Column("session_run_no", Integer, nullable=True),
    Column("status", Text, nullable=False, server_default=text("'queued'")),
    Column("priority", SmallInteger, nullable=False, server_default=text("0")),
    Column("agent", Text, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("question", JSONB, nullable=True),
    Column("result", JSONB, nullable=True),
    Column("failure", JSONB, nullable=True),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False, server_default=text("3")),
    _ts("scheduled_for"),
    Column("lease_epoch", BigInteger, nullable=False, server_default=text("0")),
    Column("lease_owner", Text, nullable=True),
    _ts("lease_expires_at"),
    Column("last_event_seq", BigInteger, nullable=False, server_default=text("0")),
    Column("inputs_count", Integer, nullable=False, server_default=text("1")),
    Column("resubmitted_from", UUID(as_uuid=True), nullable=True),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    _ts("started_at"),
    _ts("finished_at"),
    _ts("dismissed_at"),
    # The W3C trace context the run's work joins (docs/operations.md, "Tracing"): the
    # submission's, or the answer's that resumed the run; NULL when the caller sent none.
    Column("traceparent", String(55), nullable=True),
    # A schedule's tick (app/queue/scheduling.py): the schedule and the fire time it is for.
    # No foreign key: a deleted schedule's runs keep its id, so an operator can still find them.
    Column("schedule_id", UUID(as_uuid=True), nullable=True),
    _ts("fire_at"),
    # The run's deadline to start (docs/start-deadlines.md): still queued and never claimed at
    # this time, it ends cancelled ('expired'). NULL: none.
    _ts("start_before"),
    # The approval policy its turn gave (docs/approvals.md); NULL: its session's, else the
    # process default, read when the run reaches a tool call.
    Column("approval", JSONB, nullable=True),
    CheckConstraint(
        "status IN ('queued', 'running', 'waiting_for_user', 'succeeded', 'failed', 'cancelled')",
        name="status",
    ),
    # A class owns a band (interactive 0-9, async 10-19, maintenance 20-29), so a class can be
    # subdivided later without a migration: the constraint is a range, not a list.
    CheckConstraint("priority BETWEEN 0 AND 29", name="priority_band"),
    CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="attempts"),
    # A lease exists exactly while a worker holds the run.
    CheckConstraint(
        "(status = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="lease_only_when_running",
    ),
    CheckConstraint(
        "(status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)",
        name="finished_when_terminal",
    ),
    CheckConstraint("status <> 'failed' OR failure IS NOT NULL", name="failed_has_failure"),
    CheckConstraint("(session_id IS NULL) = (session_run_no IS NULL)", name="session_run_no"),
    CheckConstraint(
        "status = 'waiting_for_user' OR question IS NULL", name="question_only_when_waiting"
    ),
    # The driver reads PostgreSQL's infinities back as naive datetime.max/min: no run may hold
    # one (migration 0015, NOT VALID there: rows from before it are normalised or terminal).
    CheckConstraint("isfinite(scheduled_for)", name="finite_times"),
    CheckConstraint("isfinite(start_before)", name="start_before_finite"),
    # ADR-0004 decision 10: one non-terminal run per session, enforced by the schema.
    Index(
        "uq_runs_session_id_active",
        "session_id",
        unique=True,
        postgresql_where=text(ACTIVE_STATUS_SQL),
    ),
    # The claim index: queued runs by class, then by the time they became eligible. Ordering by
    # created_at alone made the claim walk every backed-off run at the head of the queue; see
    # docs/adr/0001-claim-order-by-eligibility.md for the measurement.
    Index(
        "ix_runs_claim",
        "priority",
        text("coalesce(scheduled_for, created_at)"),
        postgresql_where=text("status = 'queued'"),
    ),
    # The fair claim's probe of one tenant's queue (docs/adr/0006): the head of its queued runs
    # at one priority, by eligibility; and the same for its webhook deliveries and schedule
    # ticks alone, which a tenant at its concurrency limit still gets (migration 0011).
    Index(
        "ix_runs_tenant_claim",
        "tenant_id",
        "priority",
        text("coalesce(scheduled_for, created_at)"),
        postgresql_where=text("status = 'queued'"),
    ),
    Index(
        "ix_runs_tenant_exempt",
        "tenant_id",
        "priority",
        text("coalesce(scheduled_for, created_at)"),
        postgresql_where=text(
            "status = 'queued' AND (agent = 'webhook' OR schedule_id IS NOT NULL)"
        ),
    ),
    # The sweeper's scan: running runs by lease deadline.
    Index(
        "ix_runs_lease_expires_at",
        "lease_expires_at",
        postgresql_where=text("status = 'running'"),
    ),
    # The expirer's: queued runs never claimed that have a deadline to start, by deadline.
    Index(
        "ix_runs_start_before",
        "start_before",
        postgresql_where=text(
            "status = 'queued' AND start_before IS NOT NULL AND started_at IS NULL"
        ),
    ),
    # The runs waiting for their users, counted by the depth reads (migration 0016).
    Index(
        "ix_runs_waiting",
        "tenant_id",
        "priority",
        postgresql_where=text("status = 'waiting_for_user'"),
    ),
    Index("ix_runs_session_id_created_at", "session_id", "created_at"),
    # One number per run of a session: the backstop for the session lock enqueue runs under,
    # and the transcript's and the next number's index.
    Index(
        "uq_runs_session_id_session_run_no",
        "session_id",
        "session_run_no",
        unique=True,
        postgresql_where=text("session_id IS NOT NULL"),
    ),
    # One resubmission per failed run: concurrent resubmits answer with the same new run.
    Index(
        "uq_runs_resubmitted_from",
        "resubmitted_from",
        unique=True,
        postgresql_where=text("resubmitted_from IS NOT NULL"),
    ),
    Index("ix_runs_tenant_id_status_created_at", "tenant_id", "status", "created_at"),
    # Retention and the dead letter read finished runs by age.
    CheckConstraint("(schedule_id IS NULL) = (fire_at IS NULL)", name="schedule_tick"),
    # Exactly one run per tick, whatever the number of processes creating ticks. Its index
    # also serves "the latest tick of a schedule" (backwards, LIMIT 1) and a schedule's runs.
    UniqueConstraint("schedule_id", "fire_at"),
    Index(
        "ix_runs_finished_at",
        "finished_at",
        postgresql_where=text("finished_at IS NOT NULL"),
    ),
)

schedules = Table(
    "schedules",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("tenant_id", Text, nullable=False),
    # Who created it: its runs are this principal's.
    Column("principal", Text, nullable=False),
    Column("cron", Text, nullable=False),
    Column("timezone", Text, nullable=False, server_default=text("'UTC'")),
    Column("agent", Text, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    # Creation or last resume: no tick at or before it fires (a resumed schedule does not
    # catch up on what it skipped while paused).
    _ts("anchor_at", nullable=False),
    _ts("paused_at"),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    CheckConstraint("priority BETWEEN 0 AND 29", name="priority_band"),
    Index("ix_schedules_tenant_id_created_at", "tenant_id", "created_at"),
)

run_events = Table(
    "run_events",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE")),
    # Gap-free per run: allocated by bumping runs.last_event_seq in the statement that
    # takes the run row.
    Column("seq", BigInteger, nullable=False),
    Column("type", Text, nullable=False),
    # The lease epoch of the writer; 0 for writes made by no worker (enqueue, API actions).
    Column("epoch", BigInteger, nullable=False),
    Column("data", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _ts("created_at", nullable=False, default_now=True),
    PrimaryKeyConstraint("run_id", "seq"),
)

run_inputs = Table(
    "run_inputs",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE")),
    # 1 for the turn that created the run, then one per answer delivered to it.
    Column("idx", Integer, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("principal", Text, nullable=False),
    Column("event_seq", BigInteger, nullable=False),
    _ts("created_at", nullable=False, default_now=True),
    PrimaryKeyConstraint("run_id", "idx"),
)

# Turns that arrived while their session's run was queued or running, under the `enqueue`,
# `interrupt` or `steer` policy (docs/turn-control.md). Not runs: the partial unique index
# still allows one active run per session. A pending turn becomes the session's next run in
# the transaction that ends the run before it (turnstile_promote_turns), or, steered, an input
# of the active run (`take_steered`); `seq` is the order they were accepted in.
pending_turns = Table(
    "pending_turns",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("seq", BigInteger, Identity(always=True), nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column(
        "session_id",
        UUID(as_uuid=True),
        ForeignKey("sessions.id", ondelete="CASCADE"),
        nullable=False,
    ),
    # The session's owner (the run's principal, as for every run of a session), and who posted.
    Column("principal", Text, nullable=False),
    Column("submitted_by", Text, nullable=False),
    Column("actor", Text, nullable=True),
    Column("policy", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("agent", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("traceparent", Text, nullable=True),
    # The run that was active when the turn arrived, and the run it became or reached.
    Column("active_run_id", UUID(as_uuid=True), nullable=True),
    Column("run_id", UUID(as_uuid=True), nullable=True),
    # A steered turn, once delivered: its index among the run's inputs, and the step the run
    # was at when it took it (where the agent's conversation places it).
    Column("input_idx", Integer, nullable=True),
    Column("at_step", Integer, nullable=True),
    # Its deadline to start (migration 0027), which the run it becomes takes.
    _ts("start_before"),
    # An interrupt's bound: past it, a run that has not stopped at a boundary is cancelled.
    _ts("interrupt_by"),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    CheckConstraint("policy IN ('enqueue', 'interrupt', 'steer')", name="policy"),
    CheckConstraint("status IN ('pending', 'started', 'delivered', 'cancelled')", name="status"),
    Index(
        "ix_pending_turns_session_id_seq",
        "session_id",
        "seq",
        postgresql_where=text("status = 'pending'"),
    ),
    Index(
        "ix_pending_turns_interrupt_by",
        "interrupt_by",
        postgresql_where=text("status = 'pending' AND policy = 'interrupt'"),
    ),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE")),
    # The sequence number of the event written in the same fenced transaction.
    Column("event_seq", BigInteger, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("step", Integer, nullable=False),
    Column("state", JSONB, nullable=False),
    _ts("created_at", nullable=False, default_now=True),
    PrimaryKeyConstraint("run_id", "event_seq"),
)

tool_journal = Table(
    "tool_journal",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE")),
    Column("event_seq", BigInteger, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("step", Integer, nullable=False),
    # 'started' before the tool runs; 'finished' with its outcome after; 'not_sent' when the
    # call provably never left and its retries ran out (the next attempt plans it again). A
    # call the user refused (docs/approvals.md) has only a 'finished' entry, status
    # 'rejected', which keeps its args.
    Column("entry", Text, nullable=False),
    Column("tool", Text, nullable=False),
    Column("idempotency_class", Text, nullable=False),
    Column("idempotency_key", Text, nullable=True),
    Column("args", JSONB, nullable=True),
    Column("outcome_status", Text, nullable=True),
    Column("outcome", JSONB, nullable=True),
    _ts("created_at", nullable=False, default_now=True),
    PrimaryKeyConstraint("run_id", "event_seq"),
    CheckConstraint("entry IN ('started', 'finished', 'not_sent')", name="entry"),
    CheckConstraint("idempotency_class IN ('safe', 'keyed', 'unsafe')", name="idempotency_class"),
    CheckConstraint(
        "outcome_status IS NULL OR outcome_status IN ('succeeded', 'failed', 'uncertain', "
        "'abandoned', 'rejected')",
        name="outcome_status",
    ),
    CheckConstraint(
        "(entry = 'finished') = (outcome_status IS NOT NULL)", name="outcome_when_finished"
    ),
    Index("ix_tool_journal_run_id_step", "run_id", "step"),
)

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("tenant_id", Text, nullable=False),
    Column("principal", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("request_hash", Text, nullable=False),
    Column("run_id", UUID(as_uuid=True), nullable=True),
    Column("response_status", SmallInteger, nullable=False),
    Column("response_body", JSONB, nullable=False),
    _ts("created_at", nullable=False, default_now=True),
    _ts("expires_at", nullable=False),
    PrimaryKeyConstraint("tenant_id", "principal", "key"),
    CheckConstraint("char_length(key) BETWEEN 1 AND 255", name="key_length"),
    Index("ix_idempotency_keys_expires_at", "expires_at"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    # SHA-256 of the secret: keys are long random strings, so a fast hash is enough and keeps
    # authentication off the request's critical path.
    Column("key_hash", LargeBinary, nullable=False),
    Column("prefix", Text, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("principal", Text, nullable=False),
    Column("scopes", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    Column("name", Text, nullable=True),
    _ts("created_at", nullable=False, default_now=True),
    _ts("revoked_at"),
    UniqueConstraint("key_hash"),
    CheckConstraint("scopes <@ ARRAY['operator', 'admin']::text[]", name="scopes"),
)

dashboard_sessions = Table(
    "dashboard_sessions",
    metadata,
    # SHA-256 of the session token in the dashboard's cookie: the token itself is never stored,
    # so a read of this table opens no browser session.
    Column("token_hash", LargeBinary, primary_key=True),
    # Deleting a key deletes its sessions; revoking one deletes them too (app/security/api_keys).
    Column(
        "key_id", UUID(as_uuid=True), ForeignKey("api_keys.id", ondelete="CASCADE"), nullable=False
    ),
    _ts("created_at", nullable=False, default_now=True),
    _ts("expires_at", nullable=False),
    Index("ix_dashboard_sessions_key_id", "key_id"),
    Index("ix_dashboard_sessions_expires_at", "expires_at"),
)

workers = Table(
    "workers",
    metadata,
    Column("id", Text, primary_key=True),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("role", Text, nullable=False),
    Column("slot_groups", JSONB, nullable=False),
    _ts("started_at", nullable=False, default_now=True),
    _ts("last_seen_at", nullable=False, default_now=True),
    _ts("stopped_at"),
)

maintenance_leases = Table(
    "maintenance_leases",
    metadata,
    # One row per maintenance service (sweeper, pruner, ...): whoever holds an unexpired lease
    # runs it; a crashed holder loses it when the lease expires.
    Column("name", Text, primary_key=True),
    Column("holder", Text, nullable=False),
    _ts("expires_at", nullable=False),
    _ts("last_success_at"),
)

webhook_endpoints = Table(
    "webhook_endpoints",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("tenant_id", Text, nullable=False),
    # Who created it: its deliveries are runs of this principal.
    Column("principal", Text, nullable=False),
    Column("url", Text, nullable=False),
    # Empty: every event.
    Column("events", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    # AES-GCM under a key derived from TURNSTILE_SECRET_KEY (app/security/secret_box.py).
    Column("secret_ciphertext", LargeBinary, nullable=False),
    Column("consecutive_failures", Integer, nullable=False, server_default=text("0")),
    _ts("disabled_at"),
    _ts("deleted_at"),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    # An A2A task's push configuration reports this run only (migration 0021); NULL: every
    # run of the tenant. No foreign key: its deliveries outlive a pruned run, as theirs do.
    Column("run_id", UUID(as_uuid=True)),
    # What a delivery sends: 'standard' (our body) or 'a2a' (an A2A StreamResponse, with the
    # configuration's token and authentication, which the ciphertext then holds).
    Column("format", Text, nullable=False, server_default=text("'standard'")),
    CheckConstraint("format IN ('standard', 'a2a')", name="format"),
    # The transitions' probe (app/store/sql/runs.sql): a tenant's live webhook endpoints only
    # (its tasks' A2A push configurations are found by their run: migration 0021).
    Index(
        "ix_webhook_endpoints_tenant_id",
        "tenant_id",
        postgresql_where=text("deleted_at IS NULL AND disabled_at IS NULL AND run_id IS NULL"),
    ),
    # A task's live push configurations (the A2A list and its cap).
    Index(
        "ix_webhook_endpoints_run_id",
        "run_id",
        postgresql_where=text("run_id IS NOT NULL AND deleted_at IS NULL"),
    ),
)

webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    # The delivery is this run (agent `webhook`); its id is the `webhook-id` header.
    Column(
        "run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    ),
    Column(
        "endpoint_id",
        UUID(as_uuid=True),
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"),
        nullable=False,
    ),
    # No foreign key: retention may prune the reported run before its delivery.
    Column("source_run_id", UUID(as_uuid=True), nullable=False),
    Column("event", Text, nullable=False),
    _ts("created_at", nullable=False, default_now=True),
    Index("ix_webhook_deliveries_endpoint_id", "endpoint_id"),
)


tenant_limits = Table(
    "tenant_limits",
    metadata,
    # An admin's overrides of a tenant's limits (migration 0010). NULL, or a class missing from
    # max_running, means the process default from the environment.
    Column("tenant_id", Text, primary_key=True),
    # {"interactive": 4, "async": 20}: at most that many running runs of the class.
    Column("max_running", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("max_queued", Integer),
    Column("submit_rate_per_second", Float),
    Column("submit_burst", Integer),
    # How many schedules and webhook endpoints the tenant may hold, and the shortest gap
    # between two fire times of one of its schedules (migration 0016).
    Column("max_schedules", Integer),
    Column("max_webhook_endpoints", Integer),
    Column("min_schedule_interval_seconds", Integer),
    _ts("updated_at", nullable=False, default_now=True),
    CheckConstraint("max_queued IS NULL OR max_queued >= 0", name="max_queued"),
    CheckConstraint(
        "submit_rate_per_second IS NULL OR submit_rate_per_second > 0", name="submit_rate"
    ),
    CheckConstraint("submit_burst IS NULL OR submit_burst >= 1", name="submit_burst"),
    CheckConstraint("max_schedules IS NULL OR max_schedules >= 0", name="max_schedules"),
    CheckConstraint(
        "max_webhook_endpoints IS NULL OR max_webhook_endpoints >= 0", name="max_webhook_endpoints"
    ),
    CheckConstraint(
        "min_schedule_interval_seconds IS NULL OR min_schedule_interval_seconds >= 1",
        name="min_schedule_interval_seconds",
    ),
)

tenant_class_counts = Table(
    "tenant_class_counts",
    metadata,
    # A tenant's running runs of one class band (priority / 10), kept exact by the statements
    # that move runs into and out of running, and the fair walk's marks (docs/adr/0009).
    Column("tenant_id", Text, primary_key=True),
    Column("band", SmallInteger, primary_key=True),
    Column("running", Integer, nullable=False, server_default=text("0")),
    # Read by the release before migration 0016 only (its queued counts); dropped by the
    # migration that contracts 0016.
    Column("queued", BigInteger, nullable=False, server_default=text("0")),
    # Ties between tenants with as many running runs go to the least recently served.
    _ts("last_claimed_at"),
    # "Has a queued run to claim now": the fair walk's filter. Set by turnstile_mark_work and
    # by transitions that requeue; cleared only by turnstile_settle_work.
    Column("has_work", Boolean, nullable=False, server_default=text("false")),
    # Out of the walk: when its earliest queued run becomes eligible (NULL: none known);
    # turnstile_promote_due puts it back then.
    _ts("due_at"),
    CheckConstraint("band BETWEEN 0 AND 2", name="band"),
    CheckConstraint("running >= 0", name="non_negative"),
    # The fair claim's walk (docs/adr/0006): tenants with work to claim now, fewest running
    # first, then least recently served.
    Index(
        "ix_tenant_class_counts_fair",
        "band",
        "running",
        text("last_claimed_at NULLS FIRST"),
        "tenant_id",
        postgresql_where=text("has_work"),
    ),
    # The pairs whose work comes due next (turnstile_promote_due).
    Index(
        "ix_tenant_class_counts_due",
        "band",
        "due_at",
        postgresql_where=text("NOT has_work AND due_at IS NOT NULL"),
    ),
)

tenant_queued_stripes = Table(
    "tenant_queued_stripes",
    metadata,
    # The striped queued counts of the release before migration 0016 (migration 0014), read
    # and written by that release only; dropped by the migration that contracts 0016.
    Column("tenant_id", Text, primary_key=True),
    Column("band", SmallInteger, primary_key=True),
    Column("stripe", SmallInteger, primary_key=True),
    Column("queued", BigInteger, nullable=False, server_default=text("0")),
    CheckConstraint("band BETWEEN 0 AND 2", name="band"),
    CheckConstraint("stripe >= 0 AND stripe < 8", name="stripe"),
    CheckConstraint("queued >= 0", name="non_negative"),
)

schema_compatibility = Table(
    "schema_compatibility",
    metadata,
    # One row: the oldest release whose code still works on this schema (migration 0016 on;
    # every migration sets it). Read by readiness and the worker's start (app/store/resolve.py).
    Column("id", SmallInteger, primary_key=True, server_default=text("1")),
    Column("oldest_release", Text, nullable=False),
    CheckConstraint("id = 1", name="one_row"),
)

submit_buckets = Table(
    "submit_buckets",
    metadata,
    # A tenant's submission token bucket (migration 0012; fillfactor 50 there, for the HOT
    # update every limited submission makes): turnstile_submit refills it for the time since
    # `refilled_at` and takes a token, holding the row to its commit.
    Column("tenant_id", Text, primary_key=True),
    Column("tokens", Float, nullable=False),
    _ts("refilled_at", nullable=False),
)

model_budgets = Table(
    "model_budgets",
    metadata,
    # One model endpoint's budget (migration 0022; fillfactor 50 there: every reservation
    # rewrites the row). The overrides (NULL: the process default), the request and token
    # buckets (NULL until first used under a limit), the pause a provider's 429 asked for, and
    # running totals for the metrics. docs/model-budgets.md.
    Column("endpoint", Text, primary_key=True),
    Column("requests_per_minute", Integer),
    Column("tokens_per_minute", Integer),
    Column("request_level", Float),
    Column("token_level", Float),
    _ts("refilled_at"),
    _ts("paused_until"),
    Column("requests_used", BigInteger, nullable=False, server_default=text("0")),
    Column("tokens_used", BigInteger, nullable=False, server_default=text("0")),
    Column("waits", BigInteger, nullable=False, server_default=text("0")),
    Column("pauses", BigInteger, nullable=False, server_default=text("0")),
    _ts("updated_at", nullable=False, default_now=True),
    # The bookings' clock (migration 0028): seconds of tokens settlements gave back, which
    # bring every booking forward; and the share of their reservations calls used.
    Column("token_advance", Float, nullable=False, server_default=text("0")),
    Column("used_share", Float, nullable=False, server_default=text("1")),
    # What the provider's rate-limit headers last said its limits are (migration 0028): the
    # effective budget is never above them.
    Column("provider_rpm", Integer),
    Column("provider_tpm", Integer),
    _ts("observed_at"),
    CheckConstraint(
        "requests_per_minute IS NULL OR requests_per_minute >= 1", name="requests_per_minute"
    ),
    CheckConstraint(
        "tokens_per_minute IS NULL OR tokens_per_minute >= 1", name="tokens_per_minute"
    ),
)

model_reservations = Table(
    "model_reservations",
    metadata,
    # What a model call took before it was sent, held by its run under its lease epoch until
    # settled (migration 0022). One whose run lost the lease, or past expires_at, gives its
    # tokens back at the endpoint's next reservation.
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("endpoint", Text, nullable=False),
    Column("run_id", UUID(as_uuid=True), nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("tokens", Integer, nullable=False),
    _ts("created_at", nullable=False),
    _ts("expires_at", nullable=False),
    # A booking (migration 0028; NULL for a call in flight): when the request bucket covers
    # it, when the token bucket does (on the budget's token_advance clock), when its run was
    # told to come back, and its run's class; every reservation's tenant (the fair share).
    _ts("ready_requests_at"),
    _ts("ready_tokens_at"),
    _ts("wake_at"),
    Column("band", SmallInteger),
    Column("tenant_id", Text),
    # What it took of its tenant's token bucket on the endpoint, with one request (migration
    # 0030); NULL: nothing (no limit of the tenant's, or the release before 0030 took it).
    Column("tenant_tokens", Integer),
    Index("ix_model_reservations_endpoint", "endpoint", "expires_at"),
)

model_tenant_budgets = Table(
    "model_tenant_budgets",
    metadata,
    # What one tenant may use of one model endpoint (migration 0030; fillfactor 50 there):
    # an admin's limits (NULL: the tenant's row of endpoint '', its limits on every endpoint;
    # NULL there too: none), the tenant's buckets on the endpoint (NULL until used under a
    # limit), and its running totals. docs/model-budgets.md.
    Column("endpoint", Text, primary_key=True),
    Column("tenant_id", Text, primary_key=True),
    Column("requests_per_minute", Integer),
    Column("tokens_per_minute", Integer),
    Column("request_level", Float),
    Column("token_level", Float),
    _ts("refilled_at"),
    Column("requests_used", BigInteger, nullable=False, server_default=text("0")),
    Column("tokens_used", BigInteger, nullable=False, server_default=text("0")),
    Column("waits", BigInteger, nullable=False, server_default=text("0")),
    _ts("updated_at", nullable=False, default_now=True),
    CheckConstraint(
        "requests_per_minute IS NULL OR requests_per_minute >= 1", name="requests_per_minute"
    ),
    CheckConstraint(
        "tokens_per_minute IS NULL OR tokens_per_minute >= 1", name="tokens_per_minute"
    ),
)

model_tenant_bookings = Table(
    "model_tenant_bookings",
    metadata,
    # A call its tenant's limit could not take, booked on the tenant's buckets (migration
    # 0030): its run comes back at ready_at; past expires_at it gives its request and tokens
    # back to the tenant's buckets.
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("endpoint", Text, nullable=False),
    Column("tenant_id", Text, nullable=False),
    Column("run_id", UUID(as_uuid=True), nullable=False),
    Column("tokens", Integer, nullable=False),
    _ts("created_at", nullable=False),
    _ts("ready_at", nullable=False),
    _ts("expires_at", nullable=False),
    Index("ix_model_tenant_bookings_endpoint", "endpoint", "run_id"),
)
