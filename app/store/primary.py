"""Which errors mean "no primary answers right now", and whether one does.

Under a failover (docs/deployment.md, "Failover") the database is unavailable for a few
seconds in several ways, none of which is a defect of the statement that met it: the old
primary's connections die (asyncpg's connection errors, `OSError`); a connection attempt finds
only the standby, not yet promoted (`TargetServerAttributeNotMatched`, from a multi-host URL's
`target_session_attrs=read-write`); a session still open on an old primary that came back as a
standby refuses the write (SQLSTATE 25006, `ReadOnlySQLTransactionError`); and a connection
whose socket died under a running operation is left by the driver in a state it cannot leave
(`InternalClientError`, "cannot switch to state ..."). A failed connection attempt and a
standby's refusal prove nothing was written; a connection lost under a statement may have
committed it, which app/store/outcomes.py tells apart, and a broken driver state is taken as
unknown (never sent again unless the write recognises its own commit). The API answers them
503 `database-unavailable` with `Retry-After` (app/api/problems.py); a worker's new
connections wait up to half a lease for a primary (`waiting_for_primary`, app/store/engine.py);
the readiness probe says not-ready while no primary answers (`primary_answers`).
"""

from __future__ import annotations

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

DriverStateError = asyncpg.InternalClientError
"""The driver's own error for a connection it cannot use (its server gone mid-operation) or
could not get as asked (`TargetServerAttributeNotMatched`: no host takes writes)."""

READ_ONLY = "25006"
"""read_only_sql_transaction: the session is on a standby (or a server set read-only)."""

LOST_PRIMARY: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    TimeoutError,
)
"""What a plain asyncpg connection (LISTEN, the deltas' NOTIFY) may raise while the primary is
lost (a connection attempt or a keepalive query timing out included); such a connection is
closed and made again, to whichever host takes writes then."""


def on_standby(error: BaseException | None) -> bool:
    """The server refused a write because it is (now) a standby: nothing was written."""
    return isinstance(error, asyncpg.PostgresError) and error.sqlstate == READ_ONLY


def no_primary(error: BaseException | None) -> bool:
    """No connection to a primary could be had or kept: none of the hosts takes writes yet, or
    the driver's connection was left unusable by the loss of its server."""
    return isinstance(error, asyncpg.InternalClientError) or on_standby(error)


CONNECT_REFUSALS = ("57P03", "08001", "08006")
"""The server is starting or shutting down (cannot_connect_now), or the connection could not be
made: a connection attempt worth repeating while a standby is promoted."""


def waiting_for_primary(exc: BaseException) -> bool:
    """A connection attempt failed for want of a primary (refused, timed out, only standbys
    answering, the server starting), as opposed to a refusal a retry cannot change (a wrong
    password, a missing database)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, OSError | TimeoutError | asyncpg.InternalClientError):
            return True
        if isinstance(seen, asyncpg.PostgresError):
            return (seen.sqlstate or "") in CONNECT_REFUSALS
        seen = seen.__cause__
    return False


async def primary_answers(engine: AsyncEngine) -> bool:
    """Whether the engine's database answers as a primary (not in recovery): a multi-host URL
    connects to a primary only, but a single-host URL may name a standby."""
    async with engine.connect() as conn:
        return not bool(await conn.scalar(text("SELECT pg_is_in_recovery()")))
