"""Runs never carry an infinite time.

PostgreSQL takes `infinity` and `-infinity` for a timestamp, and the driver hands them back as
Python's naive `datetime.max` and `datetime.min`; a client that sent `0001-01-01T00:00:00Z` or
`9999-12-31T23:59:59.999999Z` as `scheduled_for` stored one of them, and the run could not be
decoded once claimed (issue 40, item 1). The API now refuses such times; this is the
database's half:

* live runs that already carry one are normalised: `-infinity` (eligible since ever) becomes
  NULL (eligible from its creation, which is the same thing), `infinity` (never eligible)
  becomes 9999-01-01, which still never comes and can be read;
* `ck_runs_finite_times` refuses infinite values from now on. It is added NOT VALID: it holds
  for every row written from now on without a scan of the whole table under the migration's
  lock; terminal runs written before keep what they had (nothing claims or ages them).

Safe for the release before it: that release never relied on an infinite time; a client
sending one to it is refused by this constraint (an error, with nothing written) instead of
storing a run nobody can decode.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "UPDATE runs SET scheduled_for = CASE WHEN scheduled_for = '-infinity' THEN NULL "
        "ELSE TIMESTAMPTZ '9999-01-01 00:00:00+00' END "
        "WHERE NOT isfinite(scheduled_for) "
        "AND status IN ('queued', 'running', 'waiting_for_user')"
    )
    op.execute(
        "ALTER TABLE runs ADD CONSTRAINT ck_runs_finite_times "
        "CHECK (isfinite(scheduled_for)) NOT VALID"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_finite_times")
