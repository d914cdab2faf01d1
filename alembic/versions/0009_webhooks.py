"""Webhooks: `webhook_endpoints` (a tenant's signed receivers) and `webhook_deliveries` (which
run is a delivery of which transition to which endpoint).

A delivery is an ordinary async-class run of the built-in `webhook` agent, inserted by the same
statement as the transition it reports (app/store/sql/runs.sql), so it inherits the queue's
durability, retries, fencing and dead letter. `webhook_deliveries` links it to its endpoint:
deleting an endpoint cancels its pending deliveries through `ix_webhook_deliveries_endpoint_id`.

The signing secret is stored encrypted (AES-GCM under a key derived from TURNSTILE_SECRET_KEY,
app/security/secret_box.py): a dump of the database alone does not reveal it.

Revision ID: 0009
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "0009"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            server_default=sa.text("gen_random_uuid()"),
            nullable=False,
        ),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        # Who created it: its deliveries are runs of this principal.
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        # Empty: every event.
        sa.Column(
            "events",
            postgresql.ARRAY(sa.Text()),
            server_default=sa.text("'{}'::text[]"),
            nullable=False,
        ),
        sa.Column("secret_ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("consecutive_failures", sa.Integer(), server_default="0", nullable=False),
        sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_endpoints"),
    )
    # The transitions' probe: a tenant's live endpoints. Partial, so a tenant with none (or only
    # deleted or disabled ones) costs one empty index lookup per transition.
    op.create_index(
        "ix_webhook_endpoints_tenant_id",
        "webhook_endpoints",
        ["tenant_id"],
        postgresql_where=sa.text("deleted_at IS NULL AND disabled_at IS NULL"),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("endpoint_id", postgresql.UUID(as_uuid=True), nullable=False),
        # No foreign key: retention may prune the reported run before its delivery.
        sa.Column("source_run_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name="fk_webhook_deliveries_run_id_runs",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["webhook_endpoints.id"],
            name="fk_webhook_deliveries_endpoint_id_webhook_endpoints",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", name="pk_webhook_deliveries"),
    )
    op.create_index("ix_webhook_deliveries_endpoint_id", "webhook_deliveries", ["endpoint_id"])


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_endpoints")
