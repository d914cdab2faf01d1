"""The database engine: URL normalisation, pool sizing and safety timeouts on every connection.

A DATABASE_URL may name several hosts, as libpq spells it (`postgresql://u@h1:5432,h2:5432/db
?target_session_attrs=read-write`): the pool, the migrations and the LISTEN connections then
try the hosts in turn and keep the first that takes writes, so every process finds a new
primary by itself after a failover (docs/deployment.md, "Failover"). SQLAlchemy's URL parser
refuses that spelling (a port list is no integer), so it is translated here into the one
SQLAlchemy's asyncpg dialect takes (`?host=h1:5432&host=h2:5432`), and back into libpq's for
the plain asyncpg connections (asyncpg keeps only the last of repeated `host` parameters).

Every transaction Turnstile runs has a statement, a lock and an idle-in-transaction timeout, so
a stuck query or a forgotten transaction cannot hold a run's row forever. Connected directly,
they are startup parameters of each connection: free, with no round trip per transaction.
Behind PgBouncer in transaction mode, which neither forwards startup parameters nor keeps
session state, every transaction sets them for itself instead (`set_config(..., true)`), at the
cost of one statement per transaction.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, ExceptionContext, make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.util import await_

from app.config import Settings
from app.store.primary import no_primary, waiting_for_primary


class DatabaseUrlError(ValueError):
    """DATABASE_URL cannot be used; the message says why (the CLI prints it in one line)."""


DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0
"""How long one connection attempt may take when the URL gives no `connect_timeout` (asyncpg's
own default is 60 s): a host that is down but does not refuse (a dead machine, a dropped route)
costs this much before the next host of a multi-host URL is tried."""


def _multi_host(url: str) -> URL | None:
    """A libpq multi-host URL (`scheme://user@h1:p1,h2:p2/db?...`) as SQLAlchemy spells it
    (`scheme://user@/db?host=h1:p1&host=h2:p2&...`); None for a URL with one host."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    if "," not in hostlist:
        return None
    entries = [h for h in hostlist.split(",") if h]
    for entry in entries:
        port = entry.rpartition(":")[2] if ":" in entry and not entry.endswith("]") else ""
        if port and not (port.isascii() and port.isdigit()):
            raise DatabaseUrlError(f"DATABASE_URL's host {entry!r} has a port that is no number")
    hosts = "&".join(f"host={quote(h, safe='')}" for h in entries)
    at = f"{userinfo}@" if userinfo else ""
    query = f"{hosts}&{parts.query}" if parts.query else hosts
    return make_url(f"{parts.scheme}://{at}{parts.path}?{query}")


def parse_url(url: str | URL) -> URL:
    """`url` as a SQLAlchemy URL, a libpq multi-host one included (see `_multi_host`). A URL of
    several hosts, in either spelling, asks for `target_session_attrs=read-write` unless it
    says otherwise: every process writes, and a standby is of no use to it."""
    try:
        parsed = url if isinstance(url, URL) else (_multi_host(url) or make_url(url))
    except (ArgumentError, ValueError) as exc:
        raise DatabaseUrlError(f"DATABASE_URL cannot be read: {exc}") from None
    hosts = parsed.query.get("host")
    if isinstance(hosts, tuple) and len(hosts) > 1 and "target_session_attrs" not in parsed.query:
        parsed = parsed.update_query_dict({"target_session_attrs": "read-write"})
    return parsed


def async_url(url: str | URL) -> URL:
    """The URL with the asyncpg driver, whatever PostgreSQL spelling it was given in (without
    `connect_timeout`: pass `connect_timeout(url)` as the driver's `timeout`)."""
    parsed = _driver_url(url)
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise DatabaseUrlError(f"DATABASE_URL must be a PostgreSQL URL, got {parsed.drivername!r}")
    return parsed.set(drivername="postgresql+asyncpg")


def hosts_of(url: str | URL) -> list[str]:
    """The `host:port` entries of a multi-host URL, in the order they are tried; [] for one host."""
    found = parse_url(url).query.get("host")
    if isinstance(found, tuple) and len(found) > 1:
        return list(found)
    return []


def database_place(url: str | None) -> str:
    """Where a database URL points, for an error line: DATABASE_URL and its host(s), port and
    database, never its password."""
    if not url:
        return "the embedded PostgreSQL (TURNSTILE_DATA_DIR; set DATABASE_URL for another)"
    try:
        parsed = parse_url(url)
    except DatabaseUrlError:
        return "DATABASE_URL"
    hosts = ",".join(hosts_of(parsed)) or f"{parsed.host or 'local socket'}:{parsed.port or 5432}"
    return f"DATABASE_URL ({hosts}/{parsed.database})"


def connect_timeout(url: str | URL) -> float:
    """Seconds one connection attempt may take: the URL's libpq `connect_timeout`, else
    `DEFAULT_CONNECT_TIMEOUT_SECONDS`."""
    given = parse_url(url).query.get("connect_timeout")
    if not isinstance(given, str) or not given.strip():
        return DEFAULT_CONNECT_TIMEOUT_SECONDS
    try:
        return max(float(given), 0.5)
    except ValueError:
        raise DatabaseUrlError(
            f"DATABASE_URL's connect_timeout must be a number of seconds, got {given!r}"
        ) from None


def _driver_url(url: str | URL) -> URL:
    """The URL without `connect_timeout`, which asyncpg does not know as a URL parameter (it
    would send it to the server as a setting): it becomes the driver's `timeout` instead."""
    parsed = parse_url(url)
    if "connect_timeout" not in parsed.query:
        return parsed
    return parsed.difference_update_query(["connect_timeout"])


def plain_url(url: str | URL) -> str:
    """The URL as libpq and asyncpg spell it (no SQLAlchemy driver suffix; several hosts in the
    authority, where asyncpg reads them all, rather than as repeated `host` parameters, of
    which it keeps the last), without `connect_timeout` (see `connect_timeout`)."""
    parsed = _driver_url(url).set(drivername="postgresql")
    hosts = hosts_of(parsed)
    if not hosts:
        return parsed.render_as_string(hide_password=False)
    rest = parsed.difference_update_query(["host"]).set(host=None, port=None)
    # `postgresql://user@/db?...`: the hosts go where the empty authority's host is.
    scheme, _, tail = rest.render_as_string(hide_password=False).partition("://")
    authority, slash, path = tail.partition("/")
    return f"{scheme}://{authority}{','.join(unquote(h) for h in hosts)}{slash}{path}"


def timeout_parameters(settings: Settings) -> dict[str, str]:
    """The three timeouts as connection startup parameters (milliseconds)."""
    return {
        "statement_timeout": str(int(settings.statement_timeout_ms)),
        "lock_timeout": str(int(settings.lock_timeout_ms)),
        "idle_in_transaction_session_timeout": str(int(settings.idle_in_transaction_timeout_ms)),
    }


def timeout_statement(settings: Settings) -> str:
    """One statement that sets the three timeouts for the current transaction only."""
    statement_ms = int(settings.statement_timeout_ms)
    lock_ms = int(settings.lock_timeout_ms)
    idle_ms = int(settings.idle_in_transaction_timeout_ms)
    return (
        f"SELECT set_config('statement_timeout', '{statement_ms}', true),"
        f" set_config('lock_timeout', '{lock_ms}', true),"
        f" set_config('idle_in_transaction_session_timeout', '{idle_ms}', true)"
    )


STATEMENT_CACHE_MAX_BYTES = 256 * 1024
"""The longest statement text the driver keeps prepared per connection. asyncpg's default
(15 KiB) is shorter than `end_holds` (about 20 KiB), which it would then parse and plan again
on every completion batch; every named statement must fit (tests/store/test_statement_cache.py)."""


def pgbouncer_options(url: URL) -> tuple[URL, dict[str, Any]]:
    """What PgBouncer in transaction mode needs (Debian's 1.18 has no prepared-statement
    support): no statement caches in asyncpg or SQLAlchemy, and a unique name for every
    prepared statement, since the next transaction may run on another server connection where
    a cached name means something else (asyncpg issues 837 and 1058)."""
    return (
        url.update_query_dict({"prepared_statement_cache_size": "0"}),
        {
            "statement_cache_size": 0,
            "prepared_statement_name_func": lambda: f"__turnstile_{uuid.uuid4().hex}__",
        },
    )


def pool_limit(pool_size: int) -> int:
    """The most connections an engine of `pool_size` holds at once: its size and half as much
    again (at least two), for bursts past what the size was chosen for. A statement that finds
    them all taken waits for one (up to 30 s, the pool's timeout)."""
    return pool_size + max(2, pool_size // 2)


def create_engine(
    settings: Settings,
    url: str,
    *,
    pool_size: int = 5,
    application_name: str = "turnstile",
    planner_settings: dict[str, str] | None = None,
    connect_patience_seconds: float = 0.0,
    **engine_options: Any,
) -> AsyncEngine:
    """An asyncpg engine whose every transaction runs under the configured timeouts. Direct
    connections carry `application_name` (the process's role) into pg_stat_activity, and
    `planner_settings` (see `create_claim_engine`). With `connect_patience_seconds`, a new
    connection that finds no primary (refused, none of the hosts taking writes, the server
    starting) is tried again for that long before its error is raised (see `_patient`)."""
    if not url:
        # Embedding code passes settings.database_url, which is None when DATABASE_URL is unset:
        # SQLAlchemy's own answer to that names no setting at all.
        raise ValueError(
            "no database URL: set DATABASE_URL, or pass resolve_database(settings).url "
            "(app.store.resolve), which is the embedded PostgreSQL's when it is unset"
        )
    target = async_url(url)
    if settings.pgbouncer:
        target, connect_args = pgbouncer_options(target)
    else:
        connect_args = {
            "server_settings": {
                **timeout_parameters(settings),
                "application_name": application_name,
                **(planner_settings or {}),
            }
        }
    connect_args["timeout"] = connect_timeout(url)
    if not settings.pgbouncer:
        connect_args["max_cacheable_statement_size"] = STATEMENT_CACHE_MAX_BYTES
    engine_options["connect_args"] = {**engine_options.get("connect_args", {}), **connect_args}
    engine = create_async_engine(
        target,
        # Every connection the pool may hold is kept once opened, none as overflow: the pool
        # closes an overflow connection each time one is returned to it full, so demand that
        # swings above its size (an API process's does, request by request) opened and closed
        # connections all the time (tests/store/test_connection_reuse.py).
        pool_size=pool_limit(pool_size),
        max_overflow=0,
        **engine_options,
    )

    # A connection that died with a database restart or a terminated backend is replaced on
    # checkout instead of failing the first request that draws it. The driver learns of the
    # server closing the socket as soon as its event loop reads the close, so asking it costs
    # nothing; a ping (`pool_pre_ping`) cost a BEGIN, a `;` and a ROLLBACK, three round trips
    # before every transaction. A connection that dies between this check and its statement
    # fails that statement, as it could after a ping too.
    @event.listens_for(engine.sync_engine, "checkout")
    def _replace_if_closed(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if dbapi_connection.driver_connection.is_closed():
            raise DisconnectionError("the server closed this connection")

    # A failover's errors that are not the driver's connection errors (app/store/primary.py):
    # a session on a standby refusing a write, no host taking writes yet, the driver's state
    # broken by its server's death. The connection is dropped from the pool (on a standby it
    # would refuse every write after), and the error is an OperationalError with its
    # connection invalidated, as a lost connection's is: the API's 503, the replays' retry.
    @event.listens_for(engine.sync_engine, "handle_error")
    def _primary_lost(context: ExceptionContext) -> None:
        original = context.original_exception
        cause = getattr(original, "__cause__", None)
        if not (no_primary(original) or no_primary(cause)):
            return
        context.is_disconnect = True
        raise OperationalError(
            context.statement, context.parameters, original, connection_invalidated=True
        ) from original

    if connect_patience_seconds > 0:
        _patient(engine, connect_patience_seconds)

    if settings.pgbouncer:
        statement = timeout_statement(settings)

        @event.listens_for(engine.sync_engine, "begin")
        def _set_transaction_timeouts(conn: Connection) -> None:
            conn.exec_driver_sql(statement)

    return engine


def _patient(engine: AsyncEngine, patience: float) -> None:
    """Connections of `engine` wait up to `patience` seconds for a primary: a failover's few
    seconds without one cost a worker's writes that long instead of failing them (a run whose
    journal entry or completion failed is given up, and requeued only when its lease expires).
    Only the connection is retried, never a statement: nothing was sent on a connection that
    could not be had. Statements on a connection lost under them fail as before, and their
    retries (a statement nothing of which committed; a fenced write's replay) draw a new
    connection, which waits here for the new primary."""

    @event.listens_for(engine.sync_engine, "do_connect")
    def _connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        deadline = time.monotonic() + patience
        pause = 0.1
        while True:
            try:
                return dialect.connect(*cargs, **cparams)
            except Exception as exc:
                if not waiting_for_primary(exc) or time.monotonic() + pause > deadline:
                    raise
            # Inside the pool's greenlet: the event loop runs on while this one waits.
            await_(asyncio.sleep(pause))
            pause = min(pause * 2, 1.0)


CLAIM_PLANNER_SETTINGS = {
    # One plan per claim statement and connection, made once (see create_claim_engine).
    "plan_cache_mode": "force_generic_plan",
    # The claim reads hot rows by key (count rows, run heads), in shared buffers: priced at the
    # default 4.0 a page, eight key lookups of count rows cost more than a scan of a 1,000-row
    # count table, and the plan then kept scanning it for the life of the connection.
    "random_page_cost": "1.1",
}


def create_claim_engine(
    settings: Settings,
    url: str,
    *,
    pool_size: int | None = None,
    application_name: str = "turnstile",
    connect_patience_seconds: float = 0.0,
) -> AsyncEngine | None:
    """The small engine the queue claims on (`Queue(claim_engine=...)`), whose connections reuse
    one generic plan per claim statement (docs/adr/0006). The fair claim is a large statement:
    planning the batch claim for its parameters cost about as much as running it (1.3 ms at
    1,000 tenants), and PostgreSQL kept planning it on every call. Its plan does not depend on
    the parameters' values (a worker's classes, a lease, a batch size), so one plan per
    connection serves every call. Other statements keep their per-call plans: some depend on
    their values. None behind PgBouncer, where nothing is prepared and startup parameters do
    not reach the server: claims then share the main engine. One connection per slot group by
    default (`Settings.claim_pool_size`)."""
    if settings.pgbouncer:
        return None
    return create_engine(
        settings,
        url,
        connect_patience_seconds=connect_patience_seconds,
        pool_size=pool_size or settings.claim_pool_size,
        application_name=application_name,
        planner_settings=CLAIM_PLANNER_SETTINGS,
        # A kept plan is made with the tables as they are at the connection's first claim
        # (often an empty queue) and replaced when their statistics change; a connection
        # replaced every ten minutes also re-plans a queue that grew faster than autovacuum
        # analysed it. The statements are written so that such a plan stays bounded anyway
        # (tests/store/test_claim_plans.py).
        pool_recycle=600,
    )
