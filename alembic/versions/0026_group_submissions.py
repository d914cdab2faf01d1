"""Group-committed submissions (issue 41 item 4; docs/adr/0012-group-committed-submissions.md).

* `turnstile_submit` (signature changed: a trailing `p_notify boolean DEFAULT true`; the text
  of app/store/functions/ at this revision, alembic/frozen/0026-*): false sends no
  notification, for a caller that sends one for its whole batch.
* `turnstile_submit_many` (new): the submissions one API process received together, each
  `turnstile_submit` in a block of its own (a refusal rolls back that block only), one
  notification for all of them.

Safe for the release before it (an expand step): its calls of `turnstile_submit` name 26
arguments, which the new signature takes (the 27th has a default, true: it notifies as
before), and it never calls the new function. No table changes.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op
from app.store.migrate import frozen

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(frozen("0026", "turnstile_submit"))
    op.execute(frozen("0026", "turnstile_submit_many"))


def downgrade() -> None:
    op.execute("DROP FUNCTION turnstile_submit_many")
    op.execute("DROP FUNCTION turnstile_submit")
    op.execute(frozen("0025", "turnstile_submit"))
