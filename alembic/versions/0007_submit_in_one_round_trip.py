"""A submission in one round trip: the PL/pgSQL function `turnstile_submit`.

A turn used to be six statements and two transaction-control round trips from Python (take the
key, set and reset its lock timeout, lock the session, read the active run, enqueue or deliver,
store the answer). It cannot become one SQL statement: every part of a statement shares the
snapshot taken when it starts, so after waiting for the session lock its routing read would
still miss a run a rival committed meanwhile. A PL/pgSQL function runs each of its statements
with a fresh snapshot (READ COMMITTED), so it keeps the old transaction's rules exactly, in one
call:

1. the key (if any) under its own lock timeout: a twin in flight is waited for, then replayed;
   past the wait, `idempotency-key-in-flight`; same key, other request: `idempotency-key-reused`;
2. the session row locked, with the tenant and (for keys without a scope) the principal checked
   in the same statement;
3. routing on a fresh read of the session's active run: none, a new run (`run.created` and the
   first input in the same statement); waiting for the user, the answer delivered (a cancel
   that got there first routes again, once); queued or running, `session-busy`;
4. the 2xx outcome stored under the key, as the run row it answered with (the API renders the
   same document from it on a replay).

Refusals raise SQLSTATE `TS404` or `TS409` with the problem's name as the message and its
fields as JSON in the detail, so the whole call rolls back (only successful outcomes are
remembered) and the caller maps it to the same errors as before (`app/queue/submit.py`).
Sessionless runs (`POST /runs`) take steps 1, 3 (create) and 4.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from app.store.migrate import frozen

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(frozen("0007", "turnstile_submit"))


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_submit")
