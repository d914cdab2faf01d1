"""The database engine: URL normalisation, pool sizing and safety timeouts on every connection.

Every transaction Turnstile runs has a statement, a lock and an idle-in-transaction timeout, so
a stuck query or a forgotten transaction cannot hold a run's row forever. Connected directly,
they are startup parameters of each connection: free, with no round trip per transaction.
Behind PgBouncer in transaction mode, which neither forwards startup parameters nor keeps
session state, every transaction sets them for itself instead (`set_config(..., true)`), at the
cost of one statement per transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.config import Settings


def async_url(url: str) -> URL:
    """The URL with the asyncpg driver, whatever PostgreSQL spelling it was given in."""
    parsed = make_url(url)
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise ValueError(f"DATABASE_URL must be a PostgreSQL URL, got {parsed.drivername!r}")
    return parsed.set(drivername="postgresql+asyncpg")


def plain_url(url: str | URL) -> str:
    """The URL as libpq and asyncpg spell it (no SQLAlchemy driver suffix)."""
    parsed = make_url(url) if isinstance(url, str) else url
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


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


def create_engine(
    settings: Settings,
    url: str,
    *,
    pool_size: int = 5,
    application_name: str = "turnstile",
    planner_settings: dict[str, str] | None = None,
    **engine_options: Any,
) -> AsyncEngine:
    """An asyncpg engine whose every transaction runs under the configured timeouts. Direct
    connections carry `application_name` (the process's role) into pg_stat_activity, and
    `planner_settings` (see `create_claim_engine`)."""
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
    engine_options["connect_args"] = {**engine_options.get("connect_args", {}), **connect_args}
    engine = create_async_engine(
        target,
        pool_size=pool_size,
        max_overflow=max(2, pool_size // 2),
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

    if settings.pgbouncer:
        statement = timeout_statement(settings)

        @event.listens_for(engine.sync_engine, "begin")
        def _set_transaction_timeouts(conn: Connection) -> None:
            conn.exec_driver_sql(statement)

    return engine


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
