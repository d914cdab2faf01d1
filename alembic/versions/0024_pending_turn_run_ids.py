"""A pending turn becomes the run with its own id (issue 34, a busy context's message as an A2A
task; docs/turn-control.md): `turnstile_promote_turns` creates the run with `id` = the
pending turn's id instead of a fresh random one (the text of app/store/functions/ at this
revision, alembic/frozen/0024-*). A caller that was given the pending turn's id follows the
run under that same id, before and after it starts. `pending_turns.run_id` is still set.

Safe beside the release before it: the function's signature and what it returns are as they
were (a run), and no code of that release reads meaning into a run's id; it only reads
`pending_turns.run_id`, which still names the run. Turns promoted before this migration keep
the run ids they were given.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op
from app.store.migrate import frozen

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # CREATE OR REPLACE of a plpgsql function: no table lock; a statement already running the
    # old text finishes with it.
    op.execute(frozen("0024", "turnstile_promote_turns"))


def downgrade() -> None:
    op.execute(frozen("0023", "turnstile_promote_turns"))
