"""A pending turn keeps its deadline to start (issue 33 item 3; docs/start-deadlines.md).

* `pending_turns.start_before` (new, nullable, no default: a catalog change, no rewrite): the
  deadline a turn that waits behind its session's active run was given (its `start_within`
  counted from its acceptance, or its `start_before`, or its class's default).
* `turnstile_promote_turns` (the text of app/store/functions/ at this revision,
  alembic/frozen/0027-*): the run a pending turn becomes takes that deadline, and the
  notification names it so the expirer wakes for it. A run whose deadline passed while it
  waited is created all the same and ends `cancelled` (`expired`) unclaimed.

Safe for the release before it (an expand step): it never writes the column (its pending
turns have none, so their runs have none, as before), and the function's signature and
result are unchanged.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from app.store.migrate import frozen, lock_up_front

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    lock_up_front(op.get_bind(), "LOCK TABLE pending_turns IN ACCESS EXCLUSIVE MODE")
    op.add_column(
        "pending_turns", sa.Column("start_before", sa.DateTime(timezone=True), nullable=True)
    )
    op.execute(frozen("0027", "turnstile_promote_turns"))


def downgrade() -> None:
    lock_up_front(op.get_bind(), "LOCK TABLE pending_turns IN ACCESS EXCLUSIVE MODE")
    op.execute(frozen("0024", "turnstile_promote_turns"))
    op.drop_column("pending_turns", "start_before")
