"""Model capacity as a scheduled resource (issue 39, first steps): a request and token budget
per model endpoint, kept in PostgreSQL so it is exact across every worker process.

* `model_budgets`: one row per model endpoint (its key: the base URL and the model, or a name
  an admin gives). An admin's overrides of the requests and tokens a minute (NULL: the process
  default, TURNSTILE_MODEL_RPM / TURNSTILE_MODEL_TPM; unset there too: unlimited), and the two
  token buckets (`request_level`, `token_level`, refilled for the time since `refilled_at` at
  a minute's budget a minute, holding at most a minute's budget), `paused_until` (a provider's
  429 with Retry-After pauses the endpoint for every process), and running totals for the
  metrics. Every reservation rewrites the row: fillfactor 50 for HOT updates.
* `model_reservations`: what a model call took before it was sent (one request, its estimated
  tokens), held by the run under its lease epoch until the call is settled with the usage the
  provider reports. A reservation whose run lost its lease (a crash), or that outlived
  `expires_at`, gives its tokens back at the endpoint's next reservation.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_budgets",
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("request_level", sa.Float(), nullable=True),
        sa.Column("token_level", sa.Float(), nullable=True),
        sa.Column("refilled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("paused_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("requests_used", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("tokens_used", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("waits", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("pauses", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "requests_per_minute IS NULL OR requests_per_minute >= 1",
            name=op.f("ck_model_budgets_requests_per_minute"),
        ),
        sa.CheckConstraint(
            "tokens_per_minute IS NULL OR tokens_per_minute >= 1",
            name=op.f("ck_model_budgets_tokens_per_minute"),
        ),
        sa.PrimaryKeyConstraint("endpoint", name=op.f("pk_model_budgets")),
    )
    op.execute("ALTER TABLE model_budgets SET (fillfactor = 50)")
    op.create_table(
        "model_reservations",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            server_default=sa.text("gen_random_uuid()"),
            nullable=False,
        ),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_reservations")),
    )
    op.create_index(
        "ix_model_reservations_endpoint", "model_reservations", ["endpoint", "expires_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_model_reservations_endpoint", table_name="model_reservations")
    op.drop_table("model_reservations")
    op.drop_table("model_budgets")
