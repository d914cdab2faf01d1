"""Storage parameters for the tables every run churns through: runs, run_events, run_inputs.

A run's row is inserted, updated a few times (claim, heartbeats, one bump of last_event_seq per
event it appends, completion) and deleted by retention with its events and inputs. The churn
benchmark (bench/churn.py; docs/performance.md, "Churn") measured that with the defaults:
with autovacuum running the tables reach a steady size and the claim stays within about 1.5x
of a fresh table; with pages filled to the brim on insert, fewer of the updates that could be
HOT were (56 % of them with vacuum behind, 96 % with it keeping up).

* runs, fillfactor 80: the updates that change no indexed column (append_event, tool_started,
  tool_finished, tool_not_sent, save_checkpoint: last_event_seq, and updated_at alone) can be
  HOT only when the new version fits on the same page. 20 % free leaves room for a few versions
  of a row of a few hundred bytes; claims, heartbeats (lease_expires_at is indexed) and
  transitions change indexed columns and are never HOT, but they too stay on their page when it
  has room, so the table keeps its order and its index entries their locality.
  Measured: 0.137 to 0.141 of the updates HOT with vacuum keeping up (0.143 possible in that
  workload), 0.080 to 0.104 with it behind, for about a fifth more heap.
* runs, run_events, run_inputs: vacuum after 2 % (runs, plus 1,000 rows) or 5 % (events,
  inputs: inserted and deleted, never updated, so fillfactor stays 100) of the rows changed
  rather than 20 %, at ten times the default cost limit so each vacuum finishes promptly;
  analyze as often, so the planner's estimates of the claim's partial index follow a queue
  whose size changes by orders of magnitude. These are for the production shape (days of
  retention, millions of live rows, where 20 % is hundreds of thousands of dead rows between
  vacuums); the benchmark's 60 s retention crossed the default trigger within seconds, so
  there the server's autovacuum_naptime was the bound and these made no difference.

A new fillfactor applies to pages written from now on; existing pages keep their fill until
rewritten (VACUUM FULL or pg_repack, never needed for this).

Revision ID: 0008
Revises: 0009
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0009"
branch_labels = None
depends_on = None

STORAGE: dict[str, dict[str, str]] = {
    "runs": {
        "fillfactor": "80",
        "autovacuum_vacuum_scale_factor": "0.02",
        "autovacuum_vacuum_threshold": "1000",
        "autovacuum_vacuum_cost_limit": "2000",
        "autovacuum_analyze_scale_factor": "0.02",
    },
    "run_events": {
        "autovacuum_vacuum_scale_factor": "0.05",
        "autovacuum_vacuum_cost_limit": "2000",
        "autovacuum_analyze_scale_factor": "0.05",
    },
    "run_inputs": {
        "autovacuum_vacuum_scale_factor": "0.05",
        "autovacuum_vacuum_cost_limit": "2000",
        "autovacuum_analyze_scale_factor": "0.05",
    },
}


def upgrade() -> None:
    for table, options in STORAGE.items():
        settings = ", ".join(f"{name} = {value}" for name, value in options.items())
        # Catalog-only: takes a SHARE UPDATE EXCLUSIVE lock briefly, rewrites nothing.
        op.execute(f"ALTER TABLE {table} SET ({settings})")


def downgrade() -> None:
    for table, options in STORAGE.items():
        op.execute(f"ALTER TABLE {table} RESET ({', '.join(options)})")
