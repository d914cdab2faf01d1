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
A resubmission into a session (`enqueue` in app/queue/runs.sql) names it the same way.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

NOTIFY_CREATED = (
    "        PERFORM pg_notify('turnstile',\n"
    "                          jsonb_build_object('work', "
    "jsonb_build_array(the_run.priority))::text);\n"
)
NOTIFY_CREATED_WITH_SESSION = (
    "        -- [0013] The session too, so its streams in every API process look again now.\n"
    "        PERFORM pg_notify('turnstile', jsonb_strip_nulls(jsonb_build_object(\n"
    "            'work', jsonb_build_array(the_run.priority),\n"
    "            'sessions', CASE WHEN p_session IS NOT NULL\n"
    "                             THEN jsonb_build_array(left(p_session::text, 8)) END))::text);\n"
)


def _submit_0012() -> str:
    """Migration 0012's `turnstile_submit`, as CREATE OR REPLACE."""
    path = Path(__file__).with_name("0012_submit_rate_limits.py")
    spec = importlib.util.spec_from_file_location("turnstile_migration_0012", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module._patched())


def _patched() -> str:
    text = _submit_0012()
    if text.count(NOTIFY_CREATED) != 1:
        raise RuntimeError("turnstile_submit is not migration 0012's: update migration 0013")
    return text.replace(NOTIFY_CREATED, NOTIFY_CREATED_WITH_SESSION)


def upgrade() -> None:
    # Same signature and results: CREATE OR REPLACE keeps every grant and caller.
    op.execute(_patched())


def downgrade() -> None:
    op.execute(_submit_0012())
