"""Bookings on model budgets (issue 39; docs/model-budgets.md, docs/adr/0013-model-budgets.md).

* `model_reservations`: a reservation may be a **booking**, taken by a call the budget cannot
  take now: its request and tokens are taken from the buckets at once (they may go below
  zero), and the run comes back for them at its turn. `ready_requests_at` is when the
  request bucket covers it; `ready_tokens_at` when the token bucket does, on the budget's
  advancing clock (`model_budgets.token_advance`: the seconds of tokens settlements gave back
  since, which bring every booking forward at once without rewriting them); `wake_at` the
  time its run was told to come back; `band` its run's class (an interactive call takes an
  async booking's turn); `tenant_id` its run's tenant (a tenant holding two or more fewer
  bookings of a class than another takes that one's next turn). A held reservation (a call
  in flight) has them NULL, but for its tenant.
* `model_budgets.token_advance` (seconds) and `used_share` (what calls used of what they
  reserved, a moving average: the bookings' wake times count on the tokens settlements will
  give back).
* `model_budgets.provider_rpm`, `provider_tpm`, `observed_at`: the limits the provider's
  rate-limit headers last said (x-ratelimit-limit-*, or inferred from -remaining-* and
  -reset-*); the budget's effective rate is never above them.

Safe for the release before it (an expand step): only nullable columns and columns with
defaults. That release never writes a booking; it reads `model_reservations` only by
endpoint, run and expiry, and gives back, at its next reservation, any row whose run does not
hold its lease under its epoch: a booking (its run queued) is such a row, so a booking left by
this release is given back by it, tokens to the bucket, and its run reserves afresh.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_reservations", sa.Column("ready_requests_at", sa.DateTime(timezone=True)))
    op.add_column("model_reservations", sa.Column("ready_tokens_at", sa.DateTime(timezone=True)))
    op.add_column("model_reservations", sa.Column("wake_at", sa.DateTime(timezone=True)))
    op.add_column("model_reservations", sa.Column("band", sa.SmallInteger()))
    op.add_column("model_reservations", sa.Column("tenant_id", sa.Text()))
    op.add_column(
        "model_budgets",
        sa.Column("token_advance", sa.Float(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column(
        "model_budgets",
        sa.Column("used_share", sa.Float(), server_default=sa.text("1"), nullable=False),
    )
    op.add_column("model_budgets", sa.Column("provider_rpm", sa.Integer()))
    op.add_column("model_budgets", sa.Column("provider_tpm", sa.Integer()))
    op.add_column("model_budgets", sa.Column("observed_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    for column in ("observed_at", "provider_tpm", "provider_rpm"):
        op.drop_column("model_budgets", column)
    op.drop_column("model_budgets", "used_share")
    op.drop_column("model_budgets", "token_advance")
    for column in ("tenant_id", "band", "wake_at", "ready_tokens_at", "ready_requests_at"):
        op.drop_column("model_reservations", column)
