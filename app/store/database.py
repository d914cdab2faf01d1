"""How a statement reaches PostgreSQL, and what a lost connection proves.

`Database` is the store's one door: every named statement goes out through one of its three
paths. `rows` runs a statement on the caller's connection (inside its transaction) or in a
transaction of its own: one round trip on the driver's own connection (its implicit
transaction, `direct_calls`), or BEGIN ... COMMIT through SQLAlchemy behind PgBouncer. `call`
is the positional one-round-trip path of the hot submission. `batch_rows` retries a multi-row
fenced statement a deadlock chose as its victim. A lost connection is sent again only where
that is provably safe (app/store/outcomes.py): any statement nothing of which committed, and a
fenced write of unknown outcome through `replay`, which recognises its own earlier commit.
Time is the database's unless a `clock` (tests) or an explicit `now` says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

import asyncpg
from sqlalchemy import RowMapping
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.store.outcomes import (
    NotCommitted,
    OutcomeUnknown,
    closed_before_send,
    driver_error,
    lost_connection,
)
from app.store.primary import no_primary, on_standby
from app.store.statements import q, statements
from app.vocabulary.records import JSON

Clock = Callable[[], datetime | None]

log = logging.getLogger("turnstile.store")

DEADLOCK_RETRIES = 3
"""How often a multi-row fenced statement is retried after PostgreSQL chose it as a deadlock
victim. Its transaction rolled back whole, so a retry cannot write twice; the id-ordered lock
step makes deadlocks between our own batches impossible, and this covers any other session."""


@cache
def positional(name: str) -> tuple[str, tuple[str, ...]]:
    """A named statement as the driver takes it: `$n` placeholders, and the parameter names
    in their order (compiled once, by SQLAlchemy's own asyncpg dialect)."""
    compiled = statements()[name].clause.compile(dialect=asyncpg_dialect())  # type: ignore[no-untyped-call]
    return compiled.string, tuple(compiled.positiontup or ())


END_ARRAYS = ("run_ids", "epochs", "outcomes", "values", "steps", "states")
"""end_holds' parallel arrays, one entry per hold to end."""

END_RESULTS = ("ids", "epochs", "seqs", "statuses", "priorities")
"""end_holds' result: the ends written, as parallel arrays in one row."""

_REFUSALS = ("TS404", "TS409", "TS422", "TS429")
"""SQLSTATEs our own functions raise for a refusal (migration 0007; TS429, a tenant's queued
quota (migration 0011) or its submission rate limit (migration 0012): the message names which;
TS422, a deadline to start long past (migration 0018))."""

REPLAY_ATTEMPTS = 5
"""How often a fenced write of unknown outcome is replayed before its error is raised: each
replay is exact, so the only limit is how long a worker should wait for its database."""

REPLAY_PAUSE_SECONDS = 0.05
"""The pause before the second replay, doubled before each next (0.05 s to 0.4 s: about a
fast restart of the database in all)."""


def _lost(exc: BaseException) -> bool:
    """The connection was lost (or could not be had), as opposed to a refusal by the server."""
    if isinstance(exc, NotCommitted | OutcomeUnknown):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, OSError) or lost_connection(driver_error(exc))


def refusal(exc: DBAPIError) -> tuple[str, dict[str, Any]] | None:
    """A refusal one of our functions raised (SQLSTATE TS404/TS409/TS422/TS429, the problem's name
    as the message, its fields as JSON in the detail), whichever path sent the statement:
    directly, the driver's error is the wrapper's `orig`; through SQLAlchemy's dialect, the
    cause of its own adapted error."""
    cause = exc.orig if isinstance(exc.orig, asyncpg.PostgresError) else None
    cause = cause or (exc.orig.__cause__ if exc.orig is not None else None)
    if isinstance(cause, asyncpg.PostgresError) and cause.sqlstate in _REFUSALS:
        return str(cause.message), json.loads(cause.detail or "{}")
    return None


def failed_with(exc: DBAPIError, sqlstate: str, message: str) -> bool:
    """Whether PostgreSQL refused the statement with `sqlstate` (the driver's code, or its
    message where a driver does not pass the code on)."""
    return getattr(exc.orig, "sqlstate", None) == sqlstate or message in str(exc.orig)


def database_clock() -> datetime | None:
    """No override: statements use the database's now()."""
    return None


def dump_json(value: JSON) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Database:
    """The engines a store's statements run on, and the ways they are sent."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        clock: Clock | None = None,
        direct_calls: bool = True,
        claim_engine: AsyncEngine | None = None,
    ) -> None:
        self.engine = engine
        # Claims run here when given: connections that keep one generic plan per claim
        # statement (app/store/engine.py, create_claim_engine); everything else on `engine`.
        self.claim_engine = claim_engine
        self.clock: Clock = clock or database_clock
        # The hot statements run on the driver's own connection, outside SQLAlchemy's
        # transaction handling. Behind PgBouncer in transaction mode, where a transaction must
        # set its own timeouts, they go through an ordinary transaction.
        self.direct_calls = direct_calls

    async def rows(
        self,
        name: str,
        params: dict[str, Any],
        conn: AsyncConnection | None = None,
        *,
        engine: AsyncEngine | None = None,
    ) -> list[RowMapping]:
        """The named statement's rows: on `conn` (the caller's transaction), or in a
        transaction of its own, sent once more on a fresh connection when the first connection
        was lost before anything of it committed (`NotCommitted`; app/store/outcomes.py). A
        loss after it may have committed is raised as `OutcomeUnknown`."""
        params.setdefault("now", self.clock())
        if conn is not None:
            result = await conn.execute(q(name), params)
            return list(result.mappings().all())
        for attempt in range(2):
            try:
                return await self._own_rows(name, params, engine or self.engine)
            except NotCommitted:
                if attempt == 1:
                    raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _own_rows(
        self, name: str, params: dict[str, Any], engine: AsyncEngine
    ) -> list[RowMapping]:
        if self.direct_calls:
            # A statement that is its own transaction: one round trip on the driver's
            # connection (its implicit transaction), no BEGIN and COMMIT around it.
            sql, names = positional(name)
            return await self._direct(sql, [params[n] for n in names], engine)
        return await self._transaction(name, params, engine)

    async def _transaction(
        self, name: str, params: dict[str, Any], engine: AsyncEngine
    ) -> list[RowMapping]:
        """The statement in BEGIN ... COMMIT through SQLAlchemy (behind PgBouncer). A lost
        connection before the COMMIT was sent rolled it back (`NotCommitted`); during the
        COMMIT, its outcome is unknown."""
        stage = "connect"
        try:
            async with engine.connect() as conn:
                stage = "execute"
                async with conn.begin():
                    result = await conn.execute(q(name), params)
                    rows = list(result.mappings().all())
                    stage = "commit"
                return rows
        except (DBAPIError, OSError) as exc:
            error = driver_error(exc)
            lost = lost_connection(error) or (
                isinstance(exc, DBAPIError) and exc.connection_invalidated
            )
            if stage == "connect" or (lost and stage == "execute"):
                raise NotCommitted(name, None, exc, connection_invalidated=True) from exc
            if lost:
                unknown = NotCommitted if closed_before_send(error) else OutcomeUnknown
                raise unknown(name, None, exc, connection_invalidated=True) from exc
            raise

    async def call(
        self,
        name: str,
        args: Sequence[Any],
        *,
        retry_on_disconnect: bool,
        refusals: Callable[[str, dict[str, Any]], Exception],
    ) -> Mapping[str, Any]:
        """One round trip: the named statement (positional `$n` parameters, one row back) on
        the driver's own connection, where asyncpg prepares it once per connection and runs it
        in its implicit transaction: no BEGIN and COMMIT round trips, no SQLAlchemy compilation.
        A refusal raised by the statement (SQLSTATE TS404/TS409/TS429, the problem's name as the
        message, its fields as JSON in the detail) becomes `refusals(name, fields)`. A lost
        connection is dropped from the pool; the statement is sent once more on a fresh
        connection when nothing of it committed (`NotCommitted`), and, with
        `retry_on_disconnect` (it recognises its own earlier commit), also when it may have
        (`OutcomeUnknown`); otherwise the OperationalError is raised."""
        sql = statements()[name].sql
        for attempt in range(2):
            try:
                if self.direct_calls:
                    return await self._call_direct(sql, args)
                async with self.engine.begin() as conn:
                    result = await conn.exec_driver_sql(sql, tuple(args))
                    return dict(result.mappings().one())
            except NotCommitted:
                if attempt == 1:
                    raise
            except OperationalError:
                if not retry_on_disconnect or attempt == 1:
                    raise
            except DBAPIError as exc:
                refused = refusal(exc)
                if refused is not None:
                    raise refusals(*refused) from None
                if retry_on_disconnect and attempt == 0 and exc.connection_invalidated:
                    continue
                raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _call_direct(self, sql: str, args: Sequence[Any]) -> Mapping[str, Any]:
        rows = await self._direct(sql, args)
        if len(rows) != 1:
            raise AssertionError(f"{sql[:40]!r} returned {len(rows)} rows, not one")
        found: Mapping[str, Any] = rows[0]
        return found

    async def _direct(
        self, sql: str, args: Sequence[Any], engine: AsyncEngine | None = None
    ) -> list[Any]:
        """The statement on the driver's own connection, prepared once per connection (the
        driver's statement cache), its errors raised as SQLAlchemy's would be: callers and the
        API's handlers see one kind of error whichever path ran. A lost connection is told
        apart by what it proves (app/store/outcomes.py): `NotCommitted` when no connection
        could be had or the driver found it closed before sending, `OutcomeUnknown` once the
        statement was sent (its implicit transaction commits at the protocol's Sync, before
        the answer that was lost)."""
        had_connection = False
        try:
            async with (engine or self.engine).connect() as conn:
                had_connection = True
                raw = await conn.get_raw_connection()
                driver: asyncpg.Connection = raw.driver_connection
                try:
                    rows: list[Any] = await driver.fetch(sql, *args)
                    return rows
                except (
                    asyncpg.PostgresError,
                    asyncpg.InterfaceError,
                    asyncpg.InternalClientError,
                    OSError,
                ) as exc:
                    if on_standby(exc):
                        # A session left on an old primary that came back as a standby (a
                        # failover): refused, nothing written; the fresh connection the retry
                        # draws goes to whichever host takes writes now.
                        await conn.invalidate()
                        raise NotCommitted(sql, None, exc, connection_invalidated=True) from exc
                    if no_primary(exc) or (
                        isinstance(exc, asyncpg.InterfaceError) and not closed_before_send(exc)
                    ):
                        # The driver's state is not to be trusted (an operation left running).
                        await conn.invalidate()
                        raise OperationalError(sql, None, exc, connection_invalidated=True) from exc
                    if not lost_connection(exc):
                        raise DBAPIError(sql, None, exc) from exc
                    await conn.invalidate()
                    unknown = NotCommitted if closed_before_send(exc) else OutcomeUnknown
                    raise unknown(sql, None, exc, connection_invalidated=True) from exc
        except Exception as exc:
            # Raised before a connection was had (refused, the server starting or stopping,
            # checkout failed): nothing was sent. A pool timeout is not sent again: every
            # connection is busy, and a second try would only wait as long again.
            if had_connection or isinstance(exc, PoolTimeout):
                raise
            raise NotCommitted(sql, None, exc, connection_invalidated=True) from exc

    async def replay(self, name: str, params: dict[str, Any]) -> list[RowMapping]:
        """The fenced write `name` once more, after its first sending's outcome was unknown
        (runs.sql, "Replays"): in one transaction, the run row locked, then the write's
        recognising read, whose row is the earlier commit's result; else the write itself.
        A replay is exact whatever became of the ones before it, so one lost in turn is
        replayed again, a few times, a little later each (a database restarting)."""
        for attempt in range(REPLAY_ATTEMPTS):
            try:
                async with self.engine.begin() as tx:
                    await tx.execute(q("lock_for_replay"), params)
                    found = await tx.execute(q(f"recognise_{name}"), params)
                    rows = list(found.mappings().all())
                    recognised = bool(rows)
                    if not recognised:
                        rows = list((await tx.execute(q(name), params)).mappings().all())
                # Rare (a connection lost mid-write) and worth knowing: what the replay found.
                log.warning(
                    "fenced write of unknown outcome replayed",
                    extra={
                        "write": name,
                        "run_id": str(params["run_id"]),
                        "epoch": params["epoch"],
                        "earlier_commit_found": recognised,
                        "replays": attempt + 1,
                    },
                )
                return rows
            except (DBAPIError, OSError) as exc:
                if not _lost(exc) or attempt == REPLAY_ATTEMPTS - 1:
                    raise
            await asyncio.sleep(REPLAY_PAUSE_SECONDS * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def recognise(self, name: str, params: dict[str, Any]) -> list[RowMapping]:
        """A recognising read (`recognise_*`) after a statement of unknown outcome, tried a few
        times, a little later each (the database may be restarting)."""
        for attempt in range(REPLAY_ATTEMPTS):
            try:
                return await self.rows(name, dict(params))
            except (DBAPIError, OSError) as exc:
                if not _lost(exc) or attempt == REPLAY_ATTEMPTS - 1:
                    raise
            await asyncio.sleep(REPLAY_PAUSE_SECONDS * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def replay_ends(self, params: dict[str, Any]) -> list[Mapping[Any, Any]]:
        """end_holds' replay: as `replay`, for each (run, epoch, outcome) of the batch; the
        ends found written by the earlier sending and those written now, in one result row.
        The sweeper's own ends are not replayed (its next pass finds what this one left)."""
        for attempt in range(REPLAY_ATTEMPTS):
            try:
                async with self.engine.begin() as tx:
                    await tx.execute(q("lock_many_for_replay"), params)
                    found = (await tx.execute(q("recognise_end_holds"), params)).mappings()
                    earlier = dict(found.one())
                    done = set(zip(earlier["ids"], earlier["epochs"], strict=True))
                    left = [
                        i
                        for i, key in enumerate(
                            zip(params["run_ids"], params["epochs"], strict=True)
                        )
                        if key not in done
                    ]
                    merged = earlier
                    if left:
                        rest = {
                            **params,
                            **{k: [params[k][i] for i in left] for k in END_ARRAYS},
                        }
                        now = dict((await tx.execute(q("end_holds"), rest)).mappings().one())
                        merged = {k: [*earlier[k], *now[k]] for k in END_RESULTS}
                log.warning(
                    "ends of unknown outcome replayed",
                    extra={"runs": len(params["run_ids"]), "earlier_commits_found": len(done)},
                )
                return [merged]
            except (DBAPIError, OSError) as exc:
                if not _lost(exc) or attempt == REPLAY_ATTEMPTS - 1:
                    raise
            await asyncio.sleep(REPLAY_PAUSE_SECONDS * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def batch_rows(self, name: str, params: dict[str, Any]) -> Sequence[Mapping[Any, Any]]:
        """A multi-row fenced statement in a transaction of its own, retried when it was a
        deadlock victim (nothing of it committed). One whose outcome is unknown is sent again:
        heartbeat_many as it is (setting a deadline again changes nothing), end_holds through
        its replay."""
        for attempt in range(DEADLOCK_RETRIES + 1):
            try:
                return await self.rows(name, dict(params))
            except OutcomeUnknown:
                if name == "end_holds":
                    return await self.replay_ends(dict(params, now=self.clock()))
                if name != "heartbeat_many" or attempt == DEADLOCK_RETRIES:
                    raise
            except DBAPIError as exc:
                deadlock = failed_with(exc, "40P01", "deadlock detected")
                if not deadlock or attempt == DEADLOCK_RETRIES:
                    raise
        raise AssertionError("unreachable")
