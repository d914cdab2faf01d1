"""Queue defects: a journal entry for a tool call that provably never left, and one
resubmission per failed run.

- `tool_journal.entry` gains `not_sent`: an unsafe call whose transient errors prove the request
  never reached its target, and whose retries ran out, is closed as not sent. Recovery neither
  skips it (as it would a `finished` entry) nor reports it `uncertain`: the next attempt plans
  the call again.
- `runs.resubmitted_from` becomes unique: two operators (or one retrying) resubmitting the same
  failed run get the same new run, never two. A database where one failed run was resubmitted
  more than once (allowed before) keeps the link on the earliest resubmission; the later ones
  lose the column's value, and keep it in their own `run.created` event, so no provenance is
  lost and the index can be built.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_constraint("entry", "tool_journal", type_="check")
    op.create_check_constraint(
        "entry", "tool_journal", "entry IN ('started', 'finished', 'not_sent')"
    )
    op.execute(
        """
        UPDATE runs SET resubmitted_from = NULL
        WHERE id IN (
            SELECT id FROM (
                SELECT id, row_number() OVER (PARTITION BY resubmitted_from
                                              ORDER BY created_at, id) AS n
                FROM runs WHERE resubmitted_from IS NOT NULL
            ) AS ranked
            WHERE n > 1
        )
        """
    )
    op.create_index(
        "uq_runs_resubmitted_from",
        "runs",
        ["resubmitted_from"],
        unique=True,
        postgresql_where=sa.text("resubmitted_from IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("uq_runs_resubmitted_from", table_name="runs")
    op.execute("DELETE FROM tool_journal WHERE entry = 'not_sent'")
    op.drop_constraint("entry", "tool_journal", type_="check")
    op.create_check_constraint("entry", "tool_journal", "entry IN ('started', 'finished')")
