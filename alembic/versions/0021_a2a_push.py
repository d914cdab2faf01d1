"""A2A push notifications (issue 34): a task's push configuration is a webhook endpoint
restricted to one run.

* `webhook_endpoints.run_id` (new, nullable): the run (A2A task) the endpoint reports, and
  only that run; NULL for a tenant's webhook endpoint as before. No foreign key: a delivery
  row keeps its endpoint after retention prunes the run, as `source_run_id` does.
* `webhook_endpoints.format` (new, 'standard' or 'a2a'): what a delivery sends. 'a2a': an A2A
  StreamResponse with the task's status update, the config's token in
  `X-A2A-Notification-Token` and its `authentication` as `Authorization`, beside our Standard
  Webhooks signature; the stored ciphertext holds the token and authentication.
* `ix_webhook_endpoints_run_id` (new): a run's live configurations (the transitions' fan-out,
  the A2A list and cap); `ix_webhook_endpoints_tenant_id` now leaves them out, so a tenant's
  webhooks' probe never grows with its tasks' configurations.

Safe for the release before it: a per-task row's `events` is `{a2a.task}`, an event no
transition has, so that release's fan-out (which knows no `run_id`) never delivers to it (that
fan-out's predicate no longer implies the tenant index's: it reads the table, small while no
release of this one has made configurations, for as long as the rollout lasts).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "webhook_endpoints", sa.Column("run_id", postgresql.UUID(as_uuid=True), nullable=True)
    )
    op.add_column(
        "webhook_endpoints",
        sa.Column("format", sa.Text(), server_default=sa.text("'standard'"), nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_webhook_endpoints_format"),
        "webhook_endpoints",
        "format IN ('standard', 'a2a')",
    )
    op.drop_index("ix_webhook_endpoints_tenant_id", table_name="webhook_endpoints")
    op.create_index(
        "ix_webhook_endpoints_tenant_id",
        "webhook_endpoints",
        ["tenant_id"],
        postgresql_where=sa.text("deleted_at IS NULL AND disabled_at IS NULL AND run_id IS NULL"),
    )
    op.create_index(
        "ix_webhook_endpoints_run_id",
        "webhook_endpoints",
        ["run_id"],
        postgresql_where=sa.text("run_id IS NOT NULL AND deleted_at IS NULL"),
    )


def downgrade() -> None:
    # Per-task configurations mean nothing to the release before: they go.
    op.execute("DELETE FROM webhook_endpoints WHERE run_id IS NOT NULL")
    op.drop_index("ix_webhook_endpoints_run_id", table_name="webhook_endpoints")
    op.drop_index("ix_webhook_endpoints_tenant_id", table_name="webhook_endpoints")
    op.create_index(
        "ix_webhook_endpoints_tenant_id",
        "webhook_endpoints",
        ["tenant_id"],
        postgresql_where=sa.text("deleted_at IS NULL AND disabled_at IS NULL"),
    )
    op.drop_constraint(op.f("ck_webhook_endpoints_format"), "webhook_endpoints", type_="check")
    op.drop_column("webhook_endpoints", "format")
    op.drop_column("webhook_endpoints", "run_id")
