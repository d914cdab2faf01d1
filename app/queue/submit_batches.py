"""Group commit of submissions in one API process (docs/adr/0012-group-committed-submissions.md).

A turn or a sessionless run is one call of `turnstile_submit` and one commit, and commits are
what PostgreSQL's throughput is counted in (bench/ceiling.py); each commit also sends its own
notification, and notifications serialize commits. So the submissions that arrive while
earlier ones are being committed wait for a flusher, then go together in one `submit_many`
statement: one transaction, one WAL flush, one notification. A submission that arrives with a
flusher free is sent at once, alone, by the single statement: nothing waits on a timer, and
an idle service answers exactly as before. The bounded wait is the commit in flight.

Each submission keeps its own outcome: `turnstile_submit_many` runs each in a block of its
own, so a refusal (a busy session, a replay's reused key, a rate limit or a quota) writes
nothing and its neighbours' writes stand. Any other failure of the batch (a lock timeout, a
deadlock with another process's batch) rolled all of it back, and each submission is then
sent again alone, to get its own answer. A lost connection after the batch was sent may have
committed it: the keyed submissions are sent again alone (their keys replay what committed),
the others get the error, as a single unkeyed submission does.

Several flushers may be in flight at once (`max_in_flight`): a batch that waits on a row lock
(a session's turn routed by another process, a twin's idempotency key) holds up only its own
submissions. Each batch takes its sessions in their ids' order, so two in flight never wait
for each other's sessions in a cycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast
from uuid import UUID

from sqlalchemy.exc import DBAPIError

from app.queue.group_commit import GroupCommit, fail
from app.store.database import Database
from app.store.outcomes import OutcomeUnknown

MAX_BATCH = 24
"""The most submissions one statement carries. Each runs in a block of its own, a
subtransaction (two with an idempotency key, whose wait has a block of its own); a backend
caches 64 subtransaction ids before snapshots taken elsewhere must look them up in
pg_subtrans, which slows every reader of the database."""

MAX_IN_FLIGHT = 4
"""Batches one API process sends at once."""


@dataclass(frozen=True)
class Submission:
    """One submission's arguments: the single statement's 26, in its order, as
    `Submissions._submit` builds them."""

    args: tuple[Any, ...]
    keyed: bool


# The positions of the single statement's arguments (app/store/sql/submission.sql, `submit`).
_NOW, _TENANT, _PRINCIPAL, _OWN, _ACTOR, _SESSION, _KEY, _HASH = range(8)
_TTL, _WAIT_MS, _LOCK_MS, _RUN_ID, _AGENT, _DEFAULT_AGENT, _PRIORITY = range(8, 15)
_DEFAULT_PRIORITY, _SCHEDULED_FOR, _INPUT, _MAX_ATTEMPTS, _TRACEPARENT = range(15, 20)
_MAX_QUEUED, _RATE, _BURST, _START_WITHIN, _START_BEFORE, _APPROVAL = range(20, 26)

# Per submission (one array element each); the rest are the process's settings.
_ARRAYS = {
    "tenants": _TENANT,
    "principals": _PRINCIPAL,
    "own_sessions_only": _OWN,
    "actors": _ACTOR,
    "sessions": _SESSION,
    "keys": _KEY,
    "request_hashes": _HASH,
    "run_ids": _RUN_ID,
    "agents": _AGENT,
    "priorities": _PRIORITY,
    "default_priorities": _DEFAULT_PRIORITY,
    "scheduled_fors": _SCHEDULED_FOR,
    "inputs": _INPUT,
    "traceparents": _TRACEPARENT,
    "start_withins": _START_WITHIN,
    "start_befores": _START_BEFORE,
    "approvals": _APPROVAL,
}
_SETTINGS = {
    "ttl_seconds": _TTL,
    "wait_ms": _WAIT_MS,
    "lock_timeout_ms": _LOCK_MS,
    "default_agent": _DEFAULT_AGENT,
    "max_attempts": _MAX_ATTEMPTS,
    "max_queued": _MAX_QUEUED,
    "submit_rate": _RATE,
    "submit_burst": _BURST,
}

Refusals = Callable[[str, dict[str, Any]], Exception]
_Pending = tuple[Submission, "asyncio.Future[Mapping[str, Any]]"]


class SubmissionBatcher:
    """Sends each submission alone when a flusher is free, else with the ones that arrived
    while every flusher was busy. A submission's answer is its row: the single statement's
    columns, or, from a batch, `submit_many`'s, whose `refusal` names the refusal that a
    single statement raises as `refusals(name, fields)` (app/queue/submit.py turns either into
    its error)."""

    def __init__(
        self,
        db: Database,
        refusals: Refusals,
        *,
        max_batch: int = MAX_BATCH,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.db = db
        self.refusals = refusals
        self._group: GroupCommit[Submission, Mapping[str, Any]] = GroupCommit(
            self._send,
            max_batch=max_batch,
            max_in_flight=max_in_flight,
            name="turnstile-submissions",
        )
        # Statements sent (batches and submissions sent alone), the submissions they carried,
        # and those sent again alone after their batch was refused as a whole (tests and the
        # benchmark read them).
        self.statements = 0
        self.submissions = 0
        self.resent = 0

    async def submit(self, submission: Submission) -> Mapping[str, Any]:
        return await self._group.put(submission)

    async def _send(self, batch: list[_Pending]) -> None:
        self.submissions += len(batch)
        if len(batch) == 1:
            await self._alone(*batch[0])
            return
        self.statements += 1
        # Each turn takes its session's row to the commit: taken in the order received, two
        # batches in flight that name the same sessions in opposite orders deadlocked. In the
        # sessions' order (a stable sort: one session's turns keep theirs), every batch, every
        # single submission and the pending turns' promotion take them in one order.
        batch = sorted(batch, key=_lock_order)
        try:
            rows = await self.db.rows("submit_many", _batch_params(batch))
        except OutcomeUnknown as lost:
            # It may have committed: only a keyed submission can tell by being sent again.
            fail([future for submission, future in batch if not submission.keyed], lost)
            keyed = [(s, future) for s, future in batch if s.keyed]
            self.resent += len(keyed)
            await asyncio.gather(*(self._alone(s, future) for s, future in keyed))
            return
        except (DBAPIError, OSError):
            # Refused as a whole and rolled back (a lock timeout, a deadlock, a connection
            # lost before anything committed): each is sent alone for its own answer.
            self.resent += len(batch)
            await asyncio.gather(*(self._alone(submission, future) for submission, future in batch))
            return
        except Exception as exc:
            # Not sent at all (every connection of the pool busy past its timeout): each
            # caller gets the error a submission sent alone would have got.
            fail([future for _, future in batch], exc)
            return
        for (_, future), row in zip(batch, rows, strict=True):
            if not future.done():
                future.set_result(cast(Mapping[str, Any], row))

    async def _alone(
        self, submission: Submission, future: asyncio.Future[Mapping[str, Any]]
    ) -> None:
        self.statements += 1
        try:
            row = await self.db.call(
                "submit",
                submission.args,
                retry_on_disconnect=submission.keyed,
                refusals=self.refusals,
            )
        except Exception as exc:  # the caller's to handle, as if it had sent it itself
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(row)


def _lock_order(pending: _Pending) -> tuple[bool, UUID | None]:
    """Sessions by id, as PostgreSQL orders uuids (Python compares their 128-bit values, the
    same bytes in the same order); sessionless submissions, which lock no session, last."""
    session = pending[0].args[_SESSION]
    return (session is None, session)


def _batch_params(batch: Sequence[_Pending]) -> dict[str, Any]:
    first = batch[0][0].args
    params: dict[str, Any] = {"now": first[_NOW]}
    for name, index in _ARRAYS.items():
        params[name] = [submission.args[index] for submission, _ in batch]
    for name, index in _SETTINGS.items():
        params[name] = first[index]
    return params
