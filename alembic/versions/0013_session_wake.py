"""A new run of a session wakes that session's streams in every API process.

`GET /sessions/{id}/events` (one stream per conversation) is held by one API process while the
client's next turn may go through another. The enqueue's notification named only the run's
priority, so the holding process learned of the new run when its idle stream looked again (up
to 30 s later) or from the run's first live delta. `turnstile_submit` (migration 0012's text)
now names the session in the notification it already sends when it creates a run:
`{"work": [priority], "sessions": ["<first 8 characters of the session id>"]}`: one more short
string in the same payload, no additional notification, so the commit throughput NOTIFY costs
is unchanged. API processes' notifiers wake the streams of sessions with that prefix
(app/api/watch.py: LiveWatch.sessions_notified); a rare false match of a prefix costs one read.
A resubmission into a session (`enqueue` in app/store/sql/runs.sql) names it the same way.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op
from app.store.migrate import frozen

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Same signature and results: CREATE OR REPLACE keeps every grant and caller.
    op.execute(frozen("0013", "turnstile_submit"))


def downgrade() -> None:
    op.execute(frozen("0012", "turnstile_submit"))
