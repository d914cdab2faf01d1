"""What a lost connection proves about the statement that was on it (docs/reliability.md, "Lost
connections and replays").

A statement that fails because its connection is gone either provably did not commit, and may
be sent again on a fresh connection whatever it is, or may have committed, and may be sent
again only if it recognises its own earlier commit (the fenced writes' replays, the keyed
submission). The two are told apart by where the failure happened, never by guessing:

* `NotCommitted`: the connection could not be had (connect or checkout failed), or the driver
  found it closed before sending anything (asyncpg's `InterfaceError` "connection is closed",
  raised by its own check before a write), or, in an explicit transaction, it died before the
  COMMIT was sent (PostgreSQL rolls back a transaction whose client is gone).
* `OutcomeUnknown`: the connection died after the statement, or its COMMIT, was sent. In the
  implicit transaction of the direct path the commit happens at the protocol's Sync, after the
  server produced the statement's CommandComplete and before its ReadyForQuery, so a loss at
  any point after the send may follow the commit. asyncpg reports it as
  `ConnectionDoesNotExistError` (SQLSTATE 08003, "connection was closed in the middle of
  operation"), with the server's FATAL as its cause when one came first (57P01 admin shutdown:
  a terminated backend or a fast shutdown; 57P02 crash shutdown), or as a server error of
  class 08 or 57P0x itself.

Both are OperationalErrors, so every handler that treats a lost database as unavailable (the
API's 503) still does.
"""

from __future__ import annotations

import asyncpg
from sqlalchemy.exc import DBAPIError, OperationalError

SERVER_GOING = ("57P01", "57P02", "57P03")
"""Admin shutdown, crash shutdown, cannot connect now: the connection is gone or going."""


class NotCommitted(OperationalError):
    """The connection was lost and nothing of the statement committed: it may be sent again."""


class OutcomeUnknown(OperationalError):
    """The connection was lost after the statement (or its COMMIT) was sent: it may have
    committed. Only a statement that recognises its own earlier commit may be sent again."""


def driver_error(exc: BaseException) -> BaseException | None:
    """The driver's own error behind `exc` (asyncpg's, or an OSError), through SQLAlchemy's
    wrapper (`orig`) and its dialect's adapted error (`__cause__`)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return None
        if isinstance(seen, asyncpg.PostgresError | asyncpg.InterfaceError | OSError):
            return seen
        nested = seen.orig if isinstance(seen, DBAPIError) else None
        seen = nested if isinstance(nested, BaseException) else seen.__cause__
    return None


def closed_before_send(error: BaseException | None) -> bool:
    """asyncpg found its connection closed before writing anything (`Connection._check_open`,
    `Protocol._check_state`): nothing of the statement reached the server."""
    return isinstance(error, asyncpg.InterfaceError) and "connection is closed" in str(error)


def lost_connection(error: BaseException | None) -> bool:
    """The driver's error says the connection is gone (as opposed to the server refusing the
    statement, which rolled it back and kept the connection)."""
    if isinstance(error, asyncpg.PostgresError):
        sqlstate = error.sqlstate or ""
        return sqlstate.startswith("08") or sqlstate in SERVER_GOING
    return isinstance(error, OSError) or closed_before_send(error)
