"""Per-tenant limits on a model endpoint's budget (issue 39; docs/model-budgets.md).

* `model_tenant_budgets`: one row per (endpoint, tenant). An admin's limits of what the
  tenant may use of the endpoint, requests and tokens a minute (NULL: the tenant's row of
  endpoint `''`, which holds its limits on every endpoint; NULL there too: no limit of the
  tenant's own, the endpoint's budget only), the tenant's two token buckets on the endpoint
  (`request_level`, `token_level`, refilled for the time since `refilled_at`, at most a
  minute's worth, as the endpoint's are), and its running totals (requests and tokens used,
  waits) for the metrics. A model call's reservation locks its tenant's row under the
  endpoint's row lock, so the limit is exact across every process. Every reservation and
  settlement rewrites the row: fillfactor 50 for HOT updates.
* `model_tenant_bookings`: a call its tenant's limit cannot take now is booked on the
  tenant's buckets (its request and tokens taken, the buckets going below zero): its run
  gives its slot back until `ready_at`, when it passes its tenant's limit and asks the
  endpoint's budget as any call does. It takes nothing of the endpoint's meanwhile, so a
  tenant over its own limit never holds another tenant's turn. Past `expires_at` it gives
  its request and tokens back.
* `model_reservations.tenant_tokens`: what a reservation or an endpoint's booking took of its
  tenant's token bucket (with one request); NULL when it took nothing of it (no limit, or a
  reservation of the release before this one). Its settlement gives the difference back.

Safe for the release before it (an expand step): two new tables it never reads, and one
nullable column it never writes (its inserts leave it NULL). That release enforces no tenant's
model limit and counts no tenant's use: while both run, its processes' calls go by the
endpoint's budget alone (which both releases keep exactly as before), and a reservation it
reclaims gives its tenant's tokens back only to the endpoint (the tenant's bucket refills
within a minute). Downgrade drops the two tables and the column.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_tenant_budgets",
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("request_level", sa.Float(), nullable=True),
        sa.Column("token_level", sa.Float(), nullable=True),
        sa.Column("refilled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("requests_used", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("tokens_used", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("waits", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "requests_per_minute IS NULL OR requests_per_minute >= 1",
            name=op.f("ck_model_tenant_budgets_requests_per_minute"),
        ),
        sa.CheckConstraint(
            "tokens_per_minute IS NULL OR tokens_per_minute >= 1",
            name=op.f("ck_model_tenant_budgets_tokens_per_minute"),
        ),
        sa.PrimaryKeyConstraint("endpoint", "tenant_id", name=op.f("pk_model_tenant_budgets")),
    )
    op.execute("ALTER TABLE model_tenant_budgets SET (fillfactor = 50)")
    op.create_table(
        "model_tenant_bookings",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            server_default=sa.text("gen_random_uuid()"),
            nullable=False,
        ),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_tenant_bookings")),
    )
    op.create_index(
        "ix_model_tenant_bookings_endpoint",
        "model_tenant_bookings",
        ["endpoint", "run_id"],
    )
    op.add_column("model_reservations", sa.Column("tenant_tokens", sa.Integer()))


def downgrade() -> None:
    op.drop_column("model_reservations", "tenant_tokens")
    op.drop_index("ix_model_tenant_bookings_endpoint", table_name="model_tenant_bookings")
    op.drop_table("model_tenant_bookings")
    op.drop_table("model_tenant_budgets")
