"""The `turnstile` command line: serve, worker, migrate, keys, and the operator commands.

The operator commands (runs, sessions, pending-turns, queue, schedules, webhooks, tenants,
model-budgets) act on the configured database through the queue's services.

Thin by design: each command parses its flags, calls into the app, and prints one line on
error (exit status 2) rather than a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, OperationalError

from app.config import Settings, setting_error
from app.observability.logs import configure_logging
from app.runtime.plugins import PluginError
from app.store.embedded import EmbeddedDatabase, EmbeddedUnavailableError
from app.store.engine import DatabaseUrlError, database_place

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from app.queue.core import Queue
    from app.queue.model_budgets import ModelBudgets
    from app.queue.reads import Reads
    from app.queue.scheduling import Schedules
    from app.queue.submit import Submissions, Submitter
    from app.queue.tenant_limits import Tenants
    from app.security.api_keys import KeyInfo


# The development key's file in the embedded data folder (mode 0600).
DEV_KEY_FILE = "dev-key"


class CommandError(Exception):
    """A failure to report as one line on stderr."""


def _settings(**overrides: object) -> Settings:
    try:
        settings = Settings()
    except ValidationError as exc:
        raise CommandError(f"invalid setting {setting_error(exc)}") from None
    updates = {k: v for k, v in overrides.items() if v is not None}
    return settings.model_copy(update=updates) if updates else settings


def _migrated_settings(settings: Settings) -> Settings:
    """Resolve the database (starting the embedded one if needed) and migrate it to head."""
    return _migrated(settings)[0]


def _migrated(settings: Settings) -> tuple[Settings, EmbeddedDatabase | None]:
    """`_migrated_settings`, also saying whether the database is the embedded one."""
    from app.store.migrate import head_revision, upgrade
    from app.store.resolve import resolve_database

    database = resolve_database(settings)
    upgrade(database.url, pgbouncer=settings.pgbouncer)
    where = (
        f"embedded PostgreSQL ({database.embedded.kind}) in {database.embedded.data_dir}"
        if database.embedded
        else "DATABASE_URL"
    )
    print(f"turnstile: schema at revision {head_revision()} on {where}", file=sys.stderr)
    return settings.model_copy(update={"database_url": database.url}), database.embedded


def cmd_serve(args: argparse.Namespace) -> None:
    from app.roles import collect_less, serve

    overrides: dict[str, object] = {"host": args.host, "port": args.port}
    if args.no_workers:
        overrides["run_workers"] = False
    settings = _settings(**overrides)
    configure_logging(settings.log_level, log_format=settings.log_format)
    _check_port(settings.host, settings.port)
    _check_plugins(settings)
    settings, embedded = _migrated(settings)
    asyncio.run(first_start_key(settings, embedded))
    print(f"turnstile: serving on http://{settings.host}:{settings.port}/docs", file=sys.stderr)
    collect_less()  # everything imported by now lives as long as the process
    try:
        serve(settings)  # returns once the lifespan has drained the pool and disposed the engine
    finally:
        if embedded is not None:
            embedded.release()


def _check_port(host: str, port: int) -> None:
    """Bind the service's address once before anything starts (the database, the worker
    pool), so a port in use is a one-line error naming it, not a failure after the pool has
    started. uvicorn binds with SO_REUSEADDR as this does, so a port this finds free it can
    take."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise CommandError(
            f"cannot serve on host {host!r} ({exc.strerror}): set TURNSTILE_HOST or --host"
        ) from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise CommandError(
                f"cannot serve on {host}:{port}: {exc.strerror or exc}; stop what holds port "
                f"{port}, or choose another with --port or TURNSTILE_PORT"
            ) from None


def _check_plugins(settings: Settings) -> None:
    """Load the plugins once before serving, so a bad one is a one-line error, not a traceback
    from inside the server's startup."""
    from app.runtime.executor import default_registry
    from app.runtime.plugins import load_plugins

    load_plugins(settings.plugins, default_registry([]))


async def _engine_for(settings: Settings) -> AsyncEngine:
    from app.store.engine import create_engine
    from app.store.resolve import resolve_database

    database = await asyncio.to_thread(resolve_database, settings)
    return create_engine(settings, database.url, pool_size=2)


async def first_start_key(settings: Settings, embedded: EmbeddedDatabase | None) -> None:
    """On the first start of the embedded database (local development: no DATABASE_URL), make
    a development key so the quick start works in one command. It goes to a file only its owner
    can read, in the embedded data folder, and only that file's path is printed: logs are
    collected and shared, so a live key must never reach them. Against a configured database
    (a deployment) no key is made; the log says how to make one."""
    from app.security.api_keys import create_key, has_any_key

    engine = await _engine_for(settings)
    try:
        if await has_any_key(engine):
            return
        if embedded is None:
            print(
                "turnstile: no API keys exist yet; create one with: turnstile keys create "
                "--tenant TENANT --principal NAME [--operator|--admin]",
                file=sys.stderr,
            )
            return
        new = await create_key(
            engine, tenant_id="dev", principal="dev", scopes=("operator",), name="first start"
        )
    finally:
        await engine.dispose()
    path = embedded.data_dir / DEV_KEY_FILE
    # O_CREAT's mode applies only to a new file, so a leftover file is narrowed with fchmod
    # before the key is written into it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)
        file.write(new.secret + "\n")
    print(
        "turnstile: no API keys existed, so a development key was created (tenant 'dev', "
        f"operator scope) and written to {path} (readable by you only);\n"
        f"  revoke it with: turnstile keys revoke {new.info.id}",
        file=sys.stderr,
    )


def cmd_keys_create(args: argparse.Namespace) -> None:
    from app.security.api_keys import create_key

    scopes = tuple(s for s, on in (("operator", args.operator), ("admin", args.admin)) if on)

    async def run() -> None:
        engine = await _engine_for(_settings())
        try:
            new = await create_key(
                engine,
                tenant_id=args.tenant,
                principal=args.principal,
                scopes=scopes,
                name=args.name,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        finally:
            await engine.dispose()
        if args.json:
            print(json.dumps({"key": new.secret, **_key_json(new.info)}))
        else:
            print(new.secret)
            print(
                f"key {new.info.id} for tenant {new.info.tenant_id}, principal "
                f"{new.info.principal}, scopes {list(new.info.scopes) or 'none'}; it is shown "
                "only now",
                file=sys.stderr,
            )

    asyncio.run(run())


def cmd_keys_list(args: argparse.Namespace) -> None:
    from app.security.api_keys import list_keys

    async def run() -> None:
        engine = await _engine_for(_settings())
        try:
            keys = await list_keys(engine, args.tenant)
        finally:
            await engine.dispose()
        if args.json:
            print(json.dumps([_key_json(k) for k in keys]))
            return
        for k in keys:
            state = f"revoked {k.revoked_at:%Y-%m-%d}" if k.revoked_at else "active"
            print(
                f"{k.id}  {k.prefix}...  {k.tenant_id}/{k.principal}  "
                f"{','.join(k.scopes) or '-'}  {state}"
            )

    asyncio.run(run())


def cmd_keys_revoke(args: argparse.Namespace) -> None:
    from app.security.api_keys import revoke_key

    try:
        key_id = uuid.UUID(args.key_id)
    except ValueError:
        raise CommandError(f"not a key id: {args.key_id!r}") from None

    async def run() -> None:
        engine = await _engine_for(_settings())
        try:
            revoked = await revoke_key(engine, key_id)
        finally:
            await engine.dispose()
        if not revoked:
            raise CommandError(f"no active key {key_id}")
        print(json.dumps({"revoked": str(key_id)}) if args.json else f"revoked {key_id}")

    asyncio.run(run())


def _key_json(info: KeyInfo) -> dict[str, object]:
    return {
        "id": str(info.id),
        "prefix": info.prefix,
        "tenant": info.tenant_id,
        "principal": info.principal,
        "scopes": list(info.scopes),
        "name": info.name,
        "created_at": info.created_at.isoformat(),
        "revoked_at": info.revoked_at.isoformat() if info.revoked_at else None,
    }


def cmd_worker(args: argparse.Namespace) -> None:
    """The worker pool and the sweeper with no HTTP server, for more machines. SIGTERM or SIGINT
    drains it: no new claims, running steps get the grace period, the rest are released."""
    from app.roles import WorkerStartError, collect_less, event_loop_run, run_worker

    settings = _settings(run_workers=True)
    configure_logging(settings.log_level, log_format=settings.log_format)
    _check_plugins(settings)

    def ready(worker_id: str) -> None:
        print(
            f"turnstile: worker {worker_id} running slots {settings.slots}",
            file=sys.stderr,
            flush=True,
        )

    def say(line: str) -> None:
        print(f"turnstile: {line}", file=sys.stderr, flush=True)

    embedded = None
    if not settings.database_url:
        from app.store.resolve import resolve_database

        # The embedded server is started here, so that it is released (below) only after the
        # pool has drained and its engine is disposed, as `serve` does.
        database = resolve_database(settings)
        embedded = database.embedded
        settings = settings.model_copy(update={"database_url": database.url})
    collect_less()  # everything imported by now lives as long as the process
    try:
        # uvloop's event loop: the worker's loops, its sockets and its timers cost less CPU.
        ran = event_loop_run(
            run_worker(
                settings,
                metrics_port=args.metrics_port,
                metrics_host=args.metrics_host,
                on_ready=ready,
                on_unreachable=lambda reason, delay: say(
                    f"database unreachable at {database_place(settings.database_url)} "
                    f"({reason}); retrying in {delay:g}s"
                ),
                on_drain=lambda running, grace: say(
                    f"draining: {running} runs, up to {grace:g} s (Ctrl-C again to release "
                    "them now)"
                ),
            )
        )
    except WorkerStartError as exc:
        raise CommandError(str(exc)) from None
    finally:
        if embedded is not None:
            embedded.release()
    say("worker stopped" if ran else "worker stopped before the database was reachable")


@dataclass
class Runbook:
    """What the runbook commands act through: the queue's services on the configured database,
    with the platform's view (every tenant unless --tenant narrows it)."""

    queue: Queue
    reads: Reads
    submissions: Submissions
    actor: Submitter
    stale_seconds: float  # a worker process not seen for this long is not live (a lease)
    schedules: Schedules
    settings: Settings
    tenants: Tenants
    budgets: ModelBudgets


RunbookCommand = Callable[[Runbook, argparse.Namespace], Awaitable[object]]


def _runbook(command: RunbookCommand) -> Callable[[argparse.Namespace], None]:
    """A runbook command as a CLI entry: open the services, run it, print its result (a table,
    a document or JSON), and turn the core's refusals into one-line errors."""

    def entry(args: argparse.Namespace) -> None:
        from app.assembly import budget_defaults, limit_defaults, queue_config, submissions_for
        from app.queue.core import Queue
        from app.queue.errors import TurnstileError
        from app.queue.holdings import Holdings
        from app.queue.model_budgets import ModelBudgets
        from app.queue.reads import Reads
        from app.queue.scheduling import Schedules
        from app.queue.submit import Submitter
        from app.queue.tenant_limits import Tenants

        settings = _settings()

        async def run() -> object:
            engine = await _engine_for(settings)
            # The service's own queue settings: a cancel here enqueues its webhook deliveries
            # with the configured attempts.
            queue = Queue(engine, queue_config(settings))
            runbook = Runbook(
                queue=queue,
                reads=Reads(queue),
                submissions=submissions_for(queue, settings),
                actor=Submitter("cli", "cli", actor=f"cli:{os.environ.get('USER', 'operator')}"),
                stale_seconds=settings.lease_seconds,
                schedules=Schedules(queue, holdings=Holdings(limit_defaults(settings))),
                settings=settings,
                tenants=Tenants(queue, limit_defaults(settings)),
                budgets=ModelBudgets(queue, budget_defaults(settings)),
            )
            try:
                return await command(runbook, args)
            except TurnstileError as exc:
                raise CommandError(str(exc)) from None
            finally:
                await engine.dispose()

        _print_result(asyncio.run(run()), as_json=args.json)

    return entry


def _print_result(result: object, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str))
    elif isinstance(result, list):
        for row in result:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
        if not result:
            print("nothing")
    else:
        assert isinstance(result, dict)
        for key, value in result.items():
            if value is not None:
                shown = json.dumps(value, default=str) if isinstance(value, dict | list) else value
                print(f"{key}: {shown}")


async def queue_stats(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile queue stats`: every class and status, zeros included (an empty queue is a
    table of zeros, not nothing), with the slots of the live worker processes that can claim
    each class; a class with queued runs and no live slot anywhere is `unserved` (a fleet of
    partial layouts that leaves it out, docs/adr/0005), and said so on stderr too."""
    from app.queue.reads import coverage_of
    from app.vocabulary.statuses import ACTIVE

    if args.by_tenant:
        return await _tenant_depth(runbook, args)
    depth = await runbook.reads.depth(tenant_id=args.tenant)
    slots = await runbook.reads.live_slots(stale_seconds=runbook.stale_seconds)
    coverage = {klass: coverage_of(entry, slots[klass]) for klass, entry in depth.items()}
    for klass, seen in coverage.items():
        if seen.unserved:
            print(
                f"turnstile: {klass.value} has {seen.queued} queued runs and no live worker "
                f"slot serves it: start a worker whose TURNSTILE_SLOTS include {klass.value}",
                file=sys.stderr,
            )
    return [
        {
            "class": klass.value,
            "status": status,
            "runs": getattr(entry, status),
            "oldest_eligible_age_seconds": (
                entry.oldest_eligible_age_seconds if status == "queued" else None
            ),
            "live_slots": coverage[klass].live_slots,
            "unserved": coverage[klass].unserved,
        }
        for klass, entry in depth.items()
        for status in ACTIVE
    ]


async def _tenant_depth(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile queue stats --by-tenant`: running and queued runs per tenant and class, from
    the counts the transitions keep (no runs counted): one tenant with --tenant, else the
    busiest --top tenants by queued runs and a `tenant=other` row per class for the rest."""
    if args.top < 1:
        raise CommandError("--top must be at least 1")
    depth = await runbook.tenants.depth(tenant_id=args.tenant, top=args.top)
    return [
        {
            "tenant": entry.tenant_id if entry.tenant_id is not None else "other",
            "class": klass.value,
            "running": counts.running,
            "queued": counts.queued,
        }
        for entry in depth
        for klass, counts in entry.classes.items()
    ]


async def tenants_get(runbook: Runbook, args: argparse.Namespace) -> object:
    limits = await runbook.tenants.get_limits(args.tenant)
    return _limits_result(runbook, args.tenant, limits)


async def tenants_set(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile tenants set TENANT ...`: changes only the limits named; `default` returns one
    to the service's default (`--max-running async=default`, `--submit-rate default`)."""
    from app.queue.tenant_limits import KEEP

    changes: dict[str, Any] = {}
    if args.max_running:
        classes: dict[str, int | None] = {}
        for given in args.max_running:
            name, sep, value = given.partition("=")
            if not sep or not name.strip():
                raise CommandError(f"--max-running takes CLASS=N or CLASS=default, not {given!r}")
            count = _limit_value("--max-running", value, int)
            classes[name.strip()] = None if count is None else int(count)
        changes["max_running"] = classes
    for flag, key, kind in (
        ("--max-queued", "max_queued", int),
        ("--submit-rate", "submit_rate_per_second", float),
        ("--submit-burst", "submit_burst", int),
        ("--max-schedules", "max_schedules", int),
        ("--max-webhook-endpoints", "max_webhook_endpoints", int),
        ("--min-schedule-interval", "min_schedule_interval_seconds", int),
    ):
        given = getattr(args, key)
        changes[key] = KEEP if given is None else _limit_value(flag, given, kind)
    if not args.max_running and all(v is KEEP for v in changes.values()):
        raise CommandError(
            "nothing to set: give --max-running, --max-queued, --submit-rate, --submit-burst, "
            "--max-schedules, --max-webhook-endpoints or --min-schedule-interval"
        )
    limits = await runbook.tenants.set_limits(args.tenant, **changes)
    return _limits_result(runbook, args.tenant, limits)


async def budgets_list(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile model-budgets list`: every endpoint's budget and figures."""
    defaults = runbook.budgets.defaults
    return {
        "defaults": {
            "requests_per_minute": defaults.requests_per_minute,
            "tokens_per_minute": defaults.tokens_per_minute,
        },
        "budgets": [b.to_document(defaults) for b in await runbook.budgets.budgets()],
    }


async def budgets_set(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile model-budgets set ENDPOINT ...`: changes only the values named; `default`
    returns one to the service's default."""
    from app.queue.tenant_limits import KEEP

    changes: dict[str, Any] = {}
    for flag, key in (("--rpm", "requests_per_minute"), ("--tpm", "tokens_per_minute")):
        given = getattr(args, key)
        changes[key] = KEEP if given is None else _limit_value(flag, given, int)
    if all(v is KEEP for v in changes.values()):
        raise CommandError("nothing to set: give --rpm or --tpm")
    budget = await runbook.budgets.set_budget(args.endpoint, **changes)
    return budget.to_document(runbook.budgets.defaults)


async def budgets_tenant(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile model-budgets tenant TENANT`: its own limits on model endpoints (on every
    endpoint: endpoint null) and its use of each."""
    budgets = await runbook.budgets.tenant_budgets(args.tenant)
    return {"tenant": args.tenant, "budgets": [entry.to_document() for entry in budgets]}


async def budgets_set_tenant(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile model-budgets set-tenant TENANT [--endpoint KEY] ...`: a tenant's own limits
    on one endpoint, or without --endpoint on every endpoint; changes only the values named,
    `default` removes one (no limit of the tenant's own there)."""
    from app.queue.tenant_limits import KEEP

    changes: dict[str, Any] = {}
    for flag, key in (("--rpm", "requests_per_minute"), ("--tpm", "tokens_per_minute")):
        given = getattr(args, key)
        changes[key] = KEEP if given is None else _limit_value(flag, given, int)
    if all(v is KEEP for v in changes.values()):
        raise CommandError("nothing to set: give --rpm or --tpm")
    limits = await runbook.budgets.set_tenant_budget(args.tenant, args.endpoint, **changes)
    return limits.to_document()


def _limit_value(flag: str, value: str, kind: type[int] | type[float]) -> int | float | None:
    text = value.strip()
    if text == "default":
        return None
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise CommandError(f"{flag} takes {what} or 'default', not {value!r}") from None


def _limits_result(runbook: Runbook, tenant: str, limits: Any) -> dict[str, object]:
    return {
        "tenant": tenant,
        "overrides": limits.to_document(),
        "effective": runbook.tenants.effective(limits).to_document(),
        "updated_at": limits.updated_at.isoformat() if limits.updated_at else None,
    }


async def runs_stuck(runbook: Runbook, args: argparse.Namespace) -> object:
    stuck = await runbook.reads.stuck(
        tenant_id=args.tenant,
        queued_seconds=args.queued_seconds,
        waiting_seconds=args.waiting_seconds,
        limit=args.limit,
    )
    return [
        {
            "reason": item.reason,
            "id": str(item.run.id),
            "status": item.run.status,
            "tenant": item.run.tenant_id,
        }
        for item in stuck
    ]


async def runs_show(runbook: Runbook, args: argparse.Namespace) -> object:
    run_id = _uuid(args.run_id)
    found = await runbook.queue.get_run(run_id, tenant_id=args.tenant)
    if found is None:
        raise CommandError(f"run {run_id} not found")
    return found.to_document()


CANCEL_REASON = "cancelled from the CLI"
"""A CLI cancel's reason when --reason gives none (the run's `run.cancelled` event says it)."""
MAX_CANCEL_REASON = 500  # as the API's cancel body (app/api/schemas.py, CancelRequest)


async def runs_cancel(runbook: Runbook, args: argparse.Namespace) -> object:
    reason = (args.reason or "").strip() or CANCEL_REASON
    if len(reason) > MAX_CANCEL_REASON:
        raise CommandError(f"--reason is at most {MAX_CANCEL_REASON} characters")
    outcome = await runbook.queue.cancel(
        _uuid(args.run_id), actor=runbook.actor.actor, tenant_id=args.tenant, reason=reason
    )
    return outcome.run.to_document()


# --- sessions and pending turns (docs/turn-control.md) ---------------------------------------
async def _visible_session(runbook: Runbook, args: argparse.Namespace) -> Any:
    """The session named on the command line (within --tenant when given), else one line."""
    session_id = _uuid(args.session_id, "session")
    found = await runbook.reads.session(session_id, tenant_id=args.tenant, principal=None)
    if found is None:
        where = f" in tenant {args.tenant}" if args.tenant else ""
        raise CommandError(f"session {session_id} not found{where}")
    return found


def _operator_in(runbook: Runbook, tenant_id: str) -> Submitter:
    """Who the CLI acts as on a tenant's session or run: an operator of the tenant (any
    principal's session), recorded as the CLI's actor."""
    from app.queue.submit import Submitter

    actor = runbook.actor.actor
    return Submitter(tenant_id, actor, actor=actor, own_sessions_only=False)


def _session_result(session: Any) -> dict[str, object]:
    return {
        "id": str(session.id),
        "tenant": session.tenant_id,
        "principal": session.principal,
        "state": session.state,
        "multitask": session.multitask,
        # None: the process default (TURNSTILE_APPROVAL_REQUIRED), which `approval_from` names.
        "approval": session.approval,
        "approval_from": "session" if session.approval is not None else "process default",
        "active_run_id": None if session.active_run_id is None else str(session.active_run_id),
        "active_run_status": session.active_status,
        "approval_request": session.approval_request,
        "pending_turns": session.pending_turns,
    }


async def sessions_show(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile sessions show SESSION`: its policies, its active run, its pending turns."""
    return _session_result(await _visible_session(runbook, args))


async def sessions_set_policy(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile sessions set-policy SESSION`: the multitask policy, the approval policy, or
    both, through the core that PATCH /sessions/{id} calls; the session as it is then."""
    from app.vocabulary.approval_policy import CLASSES, ApprovalPolicy

    approval_given = args.approval_tools is not None or args.approval_classes is not None
    if args.multitask is None and not approval_given and not args.approval_default:
        raise CommandError(
            "nothing to set: give --multitask, --approval-tools/--approval-classes or "
            "--approval-default"
        )
    if approval_given and args.approval_default:
        raise CommandError("give --approval-tools/--approval-classes or --approval-default")
    policy: ApprovalPolicy | None = None
    if approval_given:
        tools = _names(args.approval_tools)
        for tool in tools:
            if not TOOL_NAME.fullmatch(tool):
                raise CommandError(f"--approval-tools: {tool!r} is not a tool name")
        classes = _names(args.approval_classes)
        for klass in classes:
            if klass not in CLASSES:
                raise CommandError(
                    f"--approval-classes: {klass!r} is not one of {', '.join(CLASSES)}"
                )
        policy = ApprovalPolicy(frozenset(tools), frozenset(classes))
    session = await _visible_session(runbook, args)
    who = _operator_in(runbook, session.tenant_id)
    if args.multitask is not None:
        await runbook.submissions.turns.set_session_policy(who, session.id, args.multitask)
    if approval_given or args.approval_default:
        await runbook.submissions.approvals.set_session_policy(
            who, session.id, None if policy is None else policy.to_json()
        )
    return _session_result(await _visible_session(runbook, args))


TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")  # as the API's ToolName


def _names(given: str | None) -> list[str]:
    """A comma-separated list (empty: none)."""
    return [name.strip() for name in (given or "").split(",") if name.strip()]


async def sessions_submit(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile sessions submit SESSION INPUT_JSON`: a turn, as POST /sessions/{id}/turns
    routes it (a new run, an answer, or under the multitask policy a pending turn or a steer);
    prints the run or the pending turn."""
    from app.queue.submit import RunSpec

    try:
        value = json.loads(args.input)
    except json.JSONDecodeError as exc:
        raise CommandError(f"INPUT_JSON is not JSON: {exc}") from None
    within = None
    if args.start_within is not None:
        try:
            within = float(args.start_within)
        except ValueError:
            raise CommandError(
                f"--start-within takes a number of seconds, not {args.start_within!r}"
            ) from None
    session = await _visible_session(runbook, args)
    submitted = await runbook.submissions.submit_turn(
        _operator_in(runbook, session.tenant_id),
        session.id,
        RunSpec(input=value, start_within=within),
        None,
        multitask=args.multitask,
    )
    return submitted.document


def _turn_row(turn: Any) -> dict[str, object]:
    return {
        "position": turn.position,
        "id": str(turn.id),
        "policy": turn.policy,
        "status": turn.status,
        "accepted_at": turn.created_at.isoformat(),
        "interrupt_by": None if turn.interrupt_by is None else turn.interrupt_by.isoformat(),
        "start_before": None if turn.start_before is None else turn.start_before.isoformat(),
    }


async def pending_turns_list(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile pending-turns list SESSION`: the turns waiting, in the order they start."""
    session = await _visible_session(runbook, args)
    return [_turn_row(turn) for turn in await runbook.submissions.turns.pending_turns(session.id)]


async def pending_turns_show(runbook: Runbook, args: argparse.Namespace) -> object:
    session = await _visible_session(runbook, args)
    turn = await runbook.submissions.turns.pending_turn(
        session.id, _uuid(args.turn_id, "pending turn")
    )
    return turn.to_document()


async def pending_turns_cancel(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile pending-turns cancel SESSION TURN`: withdraw it (again: as it is); one that
    has started is one line naming its run, which is what to cancel instead."""
    from app.queue.errors import PendingTurnStartedError

    session = await _visible_session(runbook, args)
    try:
        turn = await runbook.submissions.turns.cancel_pending(
            _operator_in(runbook, session.tenant_id),
            session.id,
            _uuid(args.turn_id, "pending turn"),
        )
    except PendingTurnStartedError as exc:
        if exc.run_id is None:
            raise CommandError(str(exc)) from None
        became = "it is run" if exc.status == "started" else "it reached run"
        raise CommandError(
            f"pending turn {exc.turn_id} is {exc.status}: {became} {exc.run_id}; cancel "
            f"that run instead (turnstile runs cancel {exc.run_id})"
        ) from None
    return turn.to_document()


async def runs_decide(runbook: Runbook, args: argparse.Namespace) -> object:
    """`turnstile runs approve|reject|edit RUN`: an operator's decision on the tool call a run
    waits for, as the run's owner would send it (app/queue/approvals.py)."""
    from app.queue.approvals import ApprovalAnswer

    run_id = _uuid(args.run_id)
    found = await runbook.queue.get_run(run_id, tenant_id=args.tenant)
    if found is None:
        raise CommandError(f"run {run_id} not found")
    request = found.approval_request
    call_id = args.call_id or (request.get("call_id") if isinstance(request, dict) else None)
    if call_id is None:
        raise CommandError(f"run {run_id} is {found.status}, waiting for no approval")
    edited = None
    if args.decision == "edit":
        try:
            edited = json.loads(args.args)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--args is not JSON: {exc}") from None
        if not isinstance(edited, dict):
            raise CommandError("--args must be a JSON object")
    who = _operator_in(runbook, found.tenant_id)
    answer = ApprovalAnswer(str(call_id), args.decision, edited, args.reason)
    decided = await runbook.submissions.approvals.answer_run(who, run_id, answer, None)
    return decided.document


async def runs_resubmit(runbook: Runbook, args: argparse.Namespace) -> object:
    submitted = await runbook.submissions.resubmit(
        runbook.actor, _uuid(args.run_id), tenant_id=args.tenant
    )
    return submitted.document


async def runs_dismiss(runbook: Runbook, args: argparse.Namespace) -> object:
    dismissed = await runbook.submissions.dismiss(
        runbook.actor, _uuid(args.run_id), tenant_id=args.tenant
    )
    return dismissed.to_document()


async def schedules_create(runbook: Runbook, args: argparse.Namespace) -> object:
    from app.queue.scheduling import NewSchedule
    from app.vocabulary.classes import PriorityClass

    try:
        value = json.loads(args.input)
    except json.JSONDecodeError as exc:
        raise CommandError(f"--input is not JSON: {exc}") from None
    agent = args.agent or runbook.settings.default_agent
    known = _agent_names(runbook.settings)
    if agent not in known:
        from app.runtime.agents import unknown_agent

        raise CommandError(unknown_agent(agent, known))
    schedule = await runbook.schedules.create(
        NewSchedule(
            tenant_id=args.tenant,
            principal=args.principal,
            cron=args.cron,
            timezone=args.timezone,
            agent=agent,
            input=value,
            priority=PriorityClass(args.klass).base,
        )
    )
    return schedule.to_document()


def _agent_names(settings: Settings) -> frozenset[str]:
    """The agents a process with these settings runs: built in, the plugins', and the
    OpenAI-compatible one when configured."""
    from app.runtime.executor import default_registry
    from app.runtime.plugins import load_plugins

    registry = default_registry([])
    load_plugins(settings.plugins, registry)
    names = set(registry.agent_names())
    if settings.openai_base_url:
        names.add("openai")
    return frozenset(names)


async def schedules_list(runbook: Runbook, args: argparse.Namespace) -> object:
    page = await runbook.schedules.page(tenant_id=args.tenant, cursor=None, limit=args.limit)
    return [
        {
            "id": str(s.id),
            "state": s.state,
            "cron": s.cron,
            "timezone": s.timezone,
            "class": s.priority_class.value,
            "tenant": s.tenant_id,
        }
        for s in page.schedules
    ]


async def schedules_show(runbook: Runbook, args: argparse.Namespace) -> object:
    detail = await runbook.schedules.detail(
        _uuid(args.schedule_id, "schedule"), tenant_id=args.tenant
    )
    return {
        **detail.schedule.to_document(),
        "tenant": detail.schedule.tenant_id,
        "next_fire_times": [t.isoformat() for t in detail.next_fire_times],
        "runs": [{"id": str(r.id), "fire_at": r.fire_at, "status": r.status} for r in detail.runs],
    }


async def schedules_pause(runbook: Runbook, args: argparse.Namespace) -> object:
    schedule = await runbook.schedules.pause(
        _uuid(args.schedule_id, "schedule"), tenant_id=args.tenant
    )
    return schedule.to_document()


async def schedules_resume(runbook: Runbook, args: argparse.Namespace) -> object:
    schedule = await runbook.schedules.resume(
        _uuid(args.schedule_id, "schedule"), tenant_id=args.tenant
    )
    return schedule.to_document()


async def schedules_delete(runbook: Runbook, args: argparse.Namespace) -> object:
    schedule_id = _uuid(args.schedule_id, "schedule")
    dropped = await runbook.schedules.delete(schedule_id, tenant_id=args.tenant)
    return {"id": str(schedule_id), "deleted": True, "dropped_runs": dropped}


async def webhooks_create(runbook: Runbook, args: argparse.Namespace) -> object:
    from app.assembly import limit_defaults
    from app.queue.holdings import Holdings
    from app.queue.webhook_endpoints import EVENTS, Webhooks
    from app.runtime.http_tool import HttpRequestTool
    from app.runtime.webhook_delivery import DestinationRefusedError, register_endpoint
    from app.security.secret_box import SecretBox, SecretKeyMissingError

    settings = runbook.settings
    events = [e.strip() for e in args.events.split(",") if e.strip()]
    unknown = sorted(set(events) - set(EVENTS))
    if unknown:
        raise CommandError(f"unknown event {unknown[0]!r} (known: {', '.join(EVENTS)})")
    allowed = [h for h in settings.http_allowed_hosts.split(",") if h.strip()]
    box = SecretBox(settings.secret_key.get_secret_value()) if settings.secret_key else None
    try:
        endpoint, secret = await register_endpoint(
            Webhooks(runbook.queue, holdings=Holdings(limit_defaults(settings))),
            HttpRequestTool(allowed, timeout_seconds=settings.http_timeout_seconds),
            box,
            tenant_id=args.tenant,
            principal=args.principal,
            url=args.url,
            events=events,
        )
    except (SecretKeyMissingError, DestinationRefusedError) as exc:
        raise CommandError(str(exc)) from None
    return {**_webhook_row(endpoint), "secret": secret}


def _webhook_row(endpoint: Any) -> dict[str, object]:
    return {
        "id": str(endpoint.id),
        "tenant": endpoint.tenant_id,
        "url": endpoint.url,
        "events": ",".join(endpoint.events) or "all",
        "enabled": endpoint.disabled_at is None,
        "consecutive_failures": endpoint.consecutive_failures,
    }


async def webhooks_list(runbook: Runbook, args: argparse.Namespace) -> object:
    from app.queue.webhook_endpoints import Webhooks

    return [_webhook_row(e) for e in await Webhooks(runbook.queue).list(args.tenant)]


async def webhooks_delete(runbook: Runbook, args: argparse.Namespace) -> object:
    from app.queue.webhook_endpoints import Webhooks

    endpoint_id = _uuid(args.webhook_id, "webhook")
    cancelled = await Webhooks(runbook.queue).delete(
        tenant_id=args.tenant, endpoint_id=endpoint_id, actor=runbook.actor.actor or "cli"
    )
    return {"id": str(endpoint_id), "deleted": True, "cancelled_deliveries": cancelled}


async def webhooks_enable(runbook: Runbook, args: argparse.Namespace) -> object:
    from app.queue.webhook_endpoints import Webhooks

    endpoint_id = _uuid(args.webhook_id, "webhook")
    endpoint = await Webhooks(runbook.queue).enable(tenant_id=args.tenant, endpoint_id=endpoint_id)
    return _webhook_row(endpoint)


def _uuid(value: str, what: str = "run") -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise CommandError(f"not a {what} id: {value!r}") from None


def cmd_migrate(args: argparse.Namespace) -> None:
    _migrated_settings(_settings())


def _rate_flags(parser: argparse.ArgumentParser) -> None:
    """A model budget's two rates (an endpoint's or a tenant's on it), and --json."""
    parser.add_argument(
        "--rpm", dest="requests_per_minute", metavar="N", help="requests a minute, or default"
    )
    parser.add_argument(
        "--tpm", dest="tokens_per_minute", metavar="N", help="tokens a minute, or default"
    )
    parser.add_argument("--json", action="store_true", help="print JSON rather than text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnstile",
        description=__doc__.splitlines()[0],
        epilog="The commands other than serve and worker talk to the database directly "
        "(DATABASE_URL, or the embedded PostgreSQL in TURNSTILE_DATA_DIR), not to a running "
        "server: they need no API key, and work while the service is down. "
        "`turnstile COMMAND --help` for each.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the API (and its worker pool)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 8000)")
    serve.add_argument(
        "--no-workers", action="store_true", help="API only: run no worker pool or sweeper"
    )
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (shown once)")
    create.add_argument("--tenant", required=True, help="the tenant whose runs the key acts on")
    create.add_argument(
        "--principal", required=True, help="who holds the key (a service or a person's name)"
    )
    scope = create.add_mutually_exclusive_group()
    scope.add_argument("--operator", action="store_true", help="runbook actions, own tenant")
    scope.add_argument("--admin", action="store_true", help="queue-wide views and any run")
    create.add_argument("--name", help="a note to remember the key by")
    create.add_argument("--json", action="store_true", help="print JSON rather than text")
    create.set_defaults(func=cmd_keys_create)
    listing = keys_sub.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--tenant", help="only this tenant's keys (default: every tenant's)")
    listing.add_argument("--json", action="store_true", help="print JSON rather than text")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id", help="the key's id (from keys list), not its secret")
    revoke.add_argument("--json", action="store_true", help="print JSON rather than text")
    revoke.set_defaults(func=cmd_keys_revoke)

    worker = sub.add_parser("worker", help="run a worker pool with no HTTP server")
    worker.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    worker.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address of the metrics port (default "
        "127.0.0.1; 0.0.0.0 to let a remote Prometheus scrape it)",
    )
    worker.set_defaults(func=cmd_worker)

    runs = sub.add_parser("runs", help="runbook actions on runs")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    for name, text, command in (
        ("show", "a run's details", runs_show),
        ("cancel", "cancel a run", runs_cancel),
        ("resubmit", "a new run with a failed run's input (once per failed run)", runs_resubmit),
        ("dismiss", "dismiss a failed run", runs_dismiss),
    ):
        action = runs_sub.add_parser(name, help=text)
        action.add_argument("run_id", help="the run's id")
        if name == "cancel":
            action.add_argument(
                "--reason",
                help=f"why, in its run.cancelled event and webhook (default {CANCEL_REASON!r})",
            )
        action.add_argument("--tenant", help="only if the run belongs to this tenant")
        action.add_argument("--json", action="store_true", help="print JSON rather than text")
        action.set_defaults(func=_runbook(command))
    for decision, text in (
        ("approve", "approve the tool call a run waits for (docs/approvals.md)"),
        ("reject", "refuse the tool call a run waits for; the agent is told --reason"),
        ("edit", "approve the tool call with other arguments (--args, checked)"),
    ):
        action = runs_sub.add_parser(decision, help=text)
        action.add_argument("run_id", help="the run's id")
        action.add_argument("--call-id", help="the call (default: the one the run waits for)")
        action.add_argument("--reason", help="why (a rejection's is what the agent is told)")
        if decision == "edit":
            action.add_argument("--args", required=True, help="the arguments, as a JSON object")
        action.add_argument("--tenant", help="only if the run belongs to this tenant")
        action.add_argument("--json", action="store_true", help="print JSON rather than text")
        action.set_defaults(func=_runbook(runs_decide), decision=decision)
    stuck = runs_sub.add_parser("stuck", help="expired leases, long queues, long waits")
    stuck.add_argument("--tenant", help="only this tenant's runs (default: every tenant's)")
    stuck.add_argument(
        "--queued-seconds", type=float, default=300, help="queued longer than this is stuck (300)"
    )
    stuck.add_argument(
        "--waiting-seconds",
        type=float,
        default=86_400,
        help="waiting for input longer than this is stuck (86400)",
    )
    stuck.add_argument("--limit", type=int, default=100, help="at most this many runs (100)")
    stuck.add_argument("--json", action="store_true", help="print JSON rather than text")
    stuck.set_defaults(func=_runbook(runs_stuck))
    _add_turn_commands(sub)
    queue = sub.add_parser("queue", help="queue-wide views")
    queue_sub = queue.add_subparsers(dest="queue_command", required=True)
    stats = queue_sub.add_parser("stats", help="depth per class and status, oldest age")
    stats.add_argument("--tenant", help="only this tenant's runs (default: every tenant's)")
    stats.add_argument(
        "--by-tenant",
        action="store_true",
        help="running and queued runs per tenant and class (the busiest --top, the rest as "
        "tenant=other)",
    )
    stats.add_argument("--top", type=int, default=20, help="tenants shown one by one (20)")
    stats.add_argument("--json", action="store_true", help="print JSON rather than text")
    stats.set_defaults(func=_runbook(queue_stats))

    tenants = sub.add_parser("tenants", help="a tenant's limits (its overrides of the defaults)")
    tenants_sub = tenants.add_subparsers(dest="tenants_command", required=True)
    get_limits = tenants_sub.add_parser("get", help="a tenant's overrides and effective limits")
    get_limits.add_argument("tenant", help="the tenant's name")
    get_limits.add_argument("--json", action="store_true", help="print JSON rather than text")
    get_limits.set_defaults(func=_runbook(tenants_get))
    set_limits = tenants_sub.add_parser(
        "set",
        help="change a tenant's limits; 'default' returns one to the service's default",
    )
    set_limits.add_argument("tenant", help="the tenant's name")
    set_limits.add_argument(
        "--max-running",
        action="append",
        metavar="CLASS=N",
        help="at most N running runs of the class (interactive, async, maintenance); "
        "CLASS=default clears it; repeatable",
    )
    set_limits.add_argument("--max-queued", metavar="N", help="at most N queued runs, or default")
    set_limits.add_argument(
        "--submit-rate",
        dest="submit_rate_per_second",
        metavar="R",
        help="submissions a second (POST /runs and turns), or default",
    )
    set_limits.add_argument(
        "--submit-burst", metavar="B", help="submissions at once after a pause, or default"
    )
    set_limits.add_argument(
        "--max-schedules", metavar="N", help="at most N schedules (paused included), or default"
    )
    set_limits.add_argument(
        "--max-webhook-endpoints", metavar="N", help="at most N webhook endpoints, or default"
    )
    set_limits.add_argument(
        "--min-schedule-interval",
        dest="min_schedule_interval_seconds",
        metavar="S",
        help="seconds at least between two fire times of one schedule, or default",
    )
    set_limits.add_argument("--json", action="store_true", help="print JSON rather than text")
    set_limits.set_defaults(func=_runbook(tenants_set))

    budgets = sub.add_parser(
        "model-budgets",
        help="model endpoints' budgets: requests and tokens a minute (docs/model-budgets.md)",
    )
    budgets_sub = budgets.add_subparsers(dest="budgets_command", required=True)
    list_budgets = budgets_sub.add_parser("list", help="every endpoint's budget and figures")
    list_budgets.add_argument("--json", action="store_true", help="print JSON rather than text")
    list_budgets.set_defaults(func=_runbook(budgets_list))
    set_budget = budgets_sub.add_parser(
        "set",
        help="change an endpoint's budget; 'default' returns a value to the service's default",
    )
    set_budget.add_argument("endpoint", help="the endpoint's key (model@base-url, or a name)")
    _rate_flags(set_budget)
    set_budget.set_defaults(func=_runbook(budgets_set))
    tenant_budgets = budgets_sub.add_parser(
        "tenant", help="a tenant's own limits on model endpoints and its use of each"
    )
    tenant_budgets.add_argument("tenant", help="the tenant's name")
    tenant_budgets.add_argument("--json", action="store_true", help="print JSON rather than text")
    tenant_budgets.set_defaults(func=_runbook(budgets_tenant))
    set_tenant = budgets_sub.add_parser(
        "set-tenant",
        help="change a tenant's own limits on an endpoint (or on every endpoint); 'default' "
        "removes one",
    )
    set_tenant.add_argument("tenant", help="the tenant's name")
    set_tenant.add_argument(
        "--endpoint",
        metavar="KEY",
        help="the endpoint's key (model@base-url, or a name); left out: every endpoint where "
        "the tenant has no limit of its own",
    )
    _rate_flags(set_tenant)
    set_tenant.set_defaults(func=_runbook(budgets_set_tenant))

    schedules = sub.add_parser("schedules", help="recurring runs: one run per cron tick")
    schedules_sub = schedules.add_subparsers(dest="schedules_command", required=True)
    create_schedule = schedules_sub.add_parser(
        "create", help="a schedule of sessionless runs, and its first tick"
    )
    create_schedule.add_argument("--tenant", required=True, help="whose schedule it is")
    create_schedule.add_argument(
        "--principal", default="cli", help="whose runs its ticks are (default cli)"
    )
    create_schedule.add_argument(
        "--cron",
        required=True,
        help="five fields, or six with seconds first ('0 3 * * *': 03:00 every day); "
        "at most one fire a minute by default",
    )
    create_schedule.add_argument("--timezone", default="UTC", help="IANA time zone (UTC)")
    create_schedule.add_argument("--agent", help="default: the service's default agent")
    create_schedule.add_argument("--input", default="{}", help="each run's input, JSON")
    create_schedule.add_argument(
        "--class",
        dest="klass",
        default="async",
        choices=["interactive", "async", "maintenance"],
        help="the runs' class (async)",
    )
    create_schedule.add_argument("--json", action="store_true", help="print JSON rather than text")
    create_schedule.set_defaults(func=_runbook(schedules_create))
    list_schedules = schedules_sub.add_parser("list", help="schedules, newest first")
    list_schedules.add_argument("--tenant", help="only this tenant's (default: every tenant's)")
    list_schedules.add_argument("--limit", type=int, default=100, help="at most this many (100)")
    list_schedules.add_argument("--json", action="store_true", help="print JSON rather than text")
    list_schedules.set_defaults(func=_runbook(schedules_list))
    for name, text, command in (
        ("show", "a schedule, its next fire times and latest runs", schedules_show),
        ("pause", "no more ticks; the tick queued ahead is removed", schedules_pause),
        ("resume", "tick again from now on (no catch-up for the pause)", schedules_resume),
        ("delete", "delete it and its ticks not started yet", schedules_delete),
    ):
        action = schedules_sub.add_parser(name, help=text)
        action.add_argument("schedule_id", help="the schedule's id")
        action.add_argument("--tenant", help="only if the schedule belongs to this tenant")
        action.add_argument("--json", action="store_true", help="print JSON rather than text")
        action.set_defaults(func=_runbook(command))

    webhooks = sub.add_parser("webhooks", help="signed deliveries of a tenant's run transitions")
    webhooks_sub = webhooks.add_subparsers(dest="webhooks_command", required=True)
    create_webhook = webhooks_sub.add_parser(
        "create", help="an endpoint, and its signing secret (shown once)"
    )
    create_webhook.add_argument("--tenant", required=True, help="whose runs it reports")
    create_webhook.add_argument("--principal", default="cli", help="whose its deliveries are")
    create_webhook.add_argument("--url", required=True, help="on TURNSTILE_HTTP_ALLOWED_HOSTS")
    create_webhook.add_argument(
        "--events", default="", help="comma-separated run.succeeded,run.failed,... (all)"
    )
    create_webhook.add_argument("--json", action="store_true", help="print JSON rather than text")
    create_webhook.set_defaults(func=_runbook(webhooks_create))
    list_webhooks = webhooks_sub.add_parser("list", help="endpoints, every tenant's by default")
    list_webhooks.add_argument("--tenant", help="only this tenant's")
    list_webhooks.add_argument("--json", action="store_true", help="print JSON rather than text")
    list_webhooks.set_defaults(func=_runbook(webhooks_list))
    delete_webhook = webhooks_sub.add_parser(
        "delete", help="delete an endpoint and cancel its pending deliveries"
    )
    delete_webhook.add_argument("webhook_id", help="the endpoint's id")
    delete_webhook.add_argument("--tenant", required=True, help="the endpoint's tenant")
    delete_webhook.add_argument("--json", action="store_true", help="print JSON rather than text")
    delete_webhook.set_defaults(func=_runbook(webhooks_delete))
    enable_webhook = webhooks_sub.add_parser(
        "enable", help="re-enable an endpoint that failed deliveries disabled"
    )
    enable_webhook.add_argument("webhook_id", help="the endpoint's id")
    enable_webhook.add_argument("--tenant", required=True, help="the endpoint's tenant")
    enable_webhook.add_argument("--json", action="store_true", help="print JSON rather than text")
    enable_webhook.set_defaults(func=_runbook(webhooks_enable))

    migrate = sub.add_parser(
        "migrate",
        help="upgrade the database schema to this version",
        description="Upgrade the database's schema (DATABASE_URL, or the embedded PostgreSQL "
        "in TURNSTILE_DATA_DIR) to this version's, creating it on an empty database. Safe to "
        "run again (nothing to do at this version), and while the release before serves "
        "(docs/deployment.md). `turnstile serve` migrates by itself; `turnstile worker` "
        "never does.",
    )
    migrate.set_defaults(func=cmd_migrate)
    _add_examples(parser)
    return parser


def _add_turn_commands(sub: Any) -> None:
    """`sessions` and `pending-turns`: turn control from the command line
    (docs/turn-control.md)."""
    from app.queue.turns import POLICIES

    sessions = sub.add_parser("sessions", help="a session's policies and turns")
    sessions_sub = sessions.add_subparsers(dest="sessions_command", required=True)

    def session_command(name: str, text: str, command: RunbookCommand) -> Any:
        action = sessions_sub.add_parser(name, help=text)
        action.add_argument("session_id", help="the session's id")
        action.add_argument("--tenant", help="only if the session belongs to this tenant")
        action.add_argument("--json", action="store_true", help="print JSON rather than text")
        action.set_defaults(func=_runbook(command))
        return action

    session_command(
        "show", "its multitask and approval policies, active run and pending turns", sessions_show
    )
    set_policy = session_command(
        "set-policy",
        "change its multitask policy or approval policy (later turns)",
        sessions_set_policy,
    )
    set_policy.add_argument(
        "--multitask", choices=POLICIES, help="what a turn does while the session's run works"
    )
    set_policy.add_argument(
        "--approval-tools",
        metavar="TOOL,...",
        help="tools whose calls wait for a user's approval ('' for none)",
    )
    set_policy.add_argument(
        "--approval-classes",
        metavar="CLASS,...",
        help="idempotency classes (safe, keyed, unsafe) whose calls wait for approval",
    )
    set_policy.add_argument(
        "--approval-default",
        action="store_true",
        help="back to the process default (TURNSTILE_APPROVAL_REQUIRED)",
    )
    submit = session_command(
        "submit", "submit a user's turn, as POST /sessions/{id}/turns does", sessions_submit
    )
    submit.add_argument("input", metavar="INPUT_JSON", help="the turn's input, JSON")
    submit.add_argument(
        "--multitask", choices=POLICIES, help="this turn's policy (default: the session's)"
    )
    submit.add_argument(
        "--start-within",
        metavar="S",
        help="seconds it may wait to start, else it expires (a new run or a pending turn)",
    )

    turns = sub.add_parser("pending-turns", help="turns waiting for their session's run")
    turns_sub = turns.add_subparsers(dest="pending_turns_command", required=True)
    for name, text, command in (
        ("list", "a session's pending turns, in the order they start", pending_turns_list),
        ("show", "a pending turn: its position, or the run it became", pending_turns_show),
        ("cancel", "withdraw a pending turn before it starts", pending_turns_cancel),
    ):
        action = turns_sub.add_parser(name, help=text)
        action.add_argument("session_id", help="the session's id")
        if name != "list":
            action.add_argument("turn_id", help="the pending turn's id")
        action.add_argument("--tenant", help="only if the session belongs to this tenant")
        action.add_argument("--json", action="store_true", help="print JSON rather than text")
        action.set_defaults(func=_runbook(command))


AN_ID = "0193c4d2-5b6e-7a8f-9012-3456789abcde"
EXAMPLES = {
    "serve": "turnstile serve --port 8000",
    "worker": "TURNSTILE_SLOTS=async:8 turnstile worker --metrics-port 9464",
    "migrate": "DATABASE_URL=postgresql://turnstile@db:5432/turnstile turnstile migrate",
    "keys create": "turnstile keys create --tenant acme --principal ops --operator",
    "keys list": "turnstile keys list --tenant acme",
    "keys revoke": f"turnstile keys revoke {AN_ID}",
    "runs show": f"turnstile runs show {AN_ID}",
    "runs cancel": f'turnstile runs cancel {AN_ID} --reason "duplicate of another run"',
    "sessions show": f"turnstile sessions show {AN_ID} --tenant acme",
    "sessions set-policy": (
        f"turnstile sessions set-policy {AN_ID} --multitask enqueue --approval-classes unsafe"
    ),
    "sessions submit": (
        f"""turnstile sessions submit {AN_ID} '{{"text": "and tomorrow?"}}' """
        "--multitask steer --start-within 30"
    ),
    "pending-turns list": f"turnstile pending-turns list {AN_ID}",
    "pending-turns show": f"turnstile pending-turns show {AN_ID} TURN_ID",
    "pending-turns cancel": f"turnstile pending-turns cancel {AN_ID} TURN_ID --tenant acme",
    "runs resubmit": f"turnstile runs resubmit {AN_ID}",
    "runs dismiss": f"turnstile runs dismiss {AN_ID}",
    "runs stuck": "turnstile runs stuck --queued-seconds 60 --json",
    "runs approve": "turnstile runs approve RUN_ID",
    "runs reject": 'turnstile runs reject RUN_ID --reason "not this recipient"',
    "runs edit": """turnstile runs edit RUN_ID --args '{"to": "ops@example.com"}'""",
    "queue stats": "turnstile queue stats --by-tenant --top 10",
    "tenants get": "turnstile tenants get acme",
    "tenants set": "turnstile tenants set acme --max-running interactive=4 --submit-rate 20",
    "model-budgets list": "turnstile model-budgets list --json",
    "model-budgets set": (
        "turnstile model-budgets set gpt-4o-mini@https://api.openai.com/v1 --rpm 500 --tpm 200000"
    ),
    "model-budgets tenant": "turnstile model-budgets tenant acme --json",
    "model-budgets set-tenant": (
        "turnstile model-budgets set-tenant acme "
        "--endpoint gpt-4o-mini@https://api.openai.com/v1 --tpm 50000"
    ),
    "schedules create": (
        "turnstile schedules create --tenant acme --cron '0 3 * * *' --input '{\"report\": 1}'"
    ),
    "schedules list": "turnstile schedules list --tenant acme",
    "schedules show": f"turnstile schedules show {AN_ID}",
    "schedules pause": f"turnstile schedules pause {AN_ID}",
    "schedules resume": f"turnstile schedules resume {AN_ID}",
    "schedules delete": f"turnstile schedules delete {AN_ID}",
    "webhooks create": (
        "TURNSTILE_SECRET_KEY=... turnstile webhooks create --tenant acme "
        "--url https://hooks.example.com/turnstile --events run.succeeded,run.failed"
    ),
    "webhooks list": "turnstile webhooks list --json",
    "webhooks delete": f"turnstile webhooks delete {AN_ID} --tenant acme",
    "webhooks enable": f"turnstile webhooks enable {AN_ID} --tenant acme",
}
"""One example a command's --help ends with (ids stand for ones from a list)."""


def _add_examples(parser: argparse.ArgumentParser, path: str = "") -> None:
    """Give each command's --help its example, kept on a line of its own."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                _add_examples(child, f"{path} {name}".strip())
    if path in EXAMPLES:
        parser.epilog = f"example:\n  {EXAMPLES[path]}"
        parser.formatter_class = _ExampleFormatter


class _ExampleFormatter(argparse.HelpFormatter):
    """argparse's help, but an example keeps its line (a description is still wrapped)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example:"):
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def _normalise_names(args: argparse.Namespace) -> None:
    """Every tenant and principal a command takes (`--tenant`, `--principal`, `tenants get
    TENANT`), as app/vocabulary/names.py normalises them: one spelling per tenant, whatever the
    shell sent; a name that cannot be one is a one-line error."""
    from app.vocabulary.names import principal_name, tenant_name

    for attribute, normalise in (("tenant", tenant_name), ("principal", principal_name)):
        value = getattr(args, attribute, None)
        if isinstance(value, str):
            setattr(args, attribute, normalise(value))


def main(argv: Sequence[str] | None = None) -> None:
    from app.installation import problem

    # Before anything imports more of `app`: files another distribution overwrote or deleted.
    if (broken := problem()) is not None:
        print(f"turnstile: {broken}", file=sys.stderr)
        sys.exit(2)

    from app.vocabulary.names import InvalidNameError

    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        _normalise_names(args)
        func(args)
        sys.stdout.flush()  # here, so a closed pipe is met inside this try, not at exit
    except BrokenPipeError:
        # The reader went away (`turnstile ... | head`): nothing to say, and nothing more
        # written, as any command-line tool whose output is no longer read. The interpreter's
        # own flush at exit must not meet the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a tool the signal ended
    except (
        CommandError,
        EmbeddedUnavailableError,
        PluginError,
        InvalidNameError,
        DatabaseUrlError,
    ) as exc:
        print(f"turnstile: {exc}", file=sys.stderr)
        sys.exit(2)
    except (OperationalError, DBAPIError, OSError) as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        where = database_place(
            os.environ.get("DATABASE_URL", os.environ.get("TURNSTILE_DATABASE_URL"))
        )
        print(f"turnstile: database error at {where}: {reason}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
